"""The manifest of a prepared token folder (what `python -m orchestrator prepare` writes), read and checked.

A prepared folder holds `manifest.json`, `train/` and `eval/` (`shard-00000.bin`, ...: raw tokens of
the manifest's dtype, no header, as `orchestrator.data.shards.TokenShards` reads them) and `tokenizer/`
(a folder `transformers.AutoTokenizer.from_pretrained` loads). Use:

    from orchestrator.data.manifest import read_manifest, verify

    m = read_manifest("/data/tokens")           # sizes checked; ValueError (one line, naming the file)
    TokenShards(str(m.train), seq_len, m.dtype, vocab=m.vocab_size)
    verify("/data/tokens")                       # also every shard's sha256 (reads them whole)

`Manifest`'s fields: `folder` (absolute), `version`, `vocab_size` (the tokenizer's full size, added
tokens included: every token id is below it), `dtype` ("uint16" or "uint32"), `eos_id` (the end-of-text
id that follows each document, or None), `tokenizer` (absolute folder, or None), `tokenizer_kind` (how it
was made: "trained-bpe", or the class of the tokenizer given), `train` and `eval` (absolute shard folders;
`eval` is None when no document was held out), `train_tokens`, `eval_tokens`, `train_documents`,
`eval_documents`, and `shards` (every shard: side, name, tokens, sha256).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

MANIFEST_FILE = "manifest.json"
FORMAT = "orchestrator-token-shards"
VERSION = 1
DTYPES = {"uint16": 2, "uint32": 4}
"""The token dtypes a prepared folder may hold, with their size in bytes."""
SIDES = ("train", "eval")


@dataclass(frozen=True)
class Shard:
    side: str
    name: str
    tokens: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    folder: Path
    version: int
    vocab_size: int
    dtype: str
    eos_id: int | None
    tokenizer: Path | None
    tokenizer_kind: str
    train: Path
    eval: Path | None
    train_tokens: int
    eval_tokens: int
    train_documents: int
    eval_documents: int
    shards: tuple[Shard, ...]

    def shard_path(self, shard: Shard) -> Path:
        return self.folder / shard.side / shard.name


def _field(data: dict, key: str, kind: type, where: Path):
    value = data.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{where}: {key!r} is {value!r}, not a {kind.__name__} (written by another program?)")
    return value


def _sides(data: dict, where: Path) -> dict[str, tuple[int, int, tuple[Shard, ...]]]:
    """Per side: (documents, tokens, shards)."""
    out = {}
    for side in SIDES:
        entry = _field(data, side, dict, where)
        shards = tuple(Shard(side, _field(s, "name", str, where), _field(s, "tokens", int, where),
                             _field(s, "sha256", str, where)) for s in _field(entry, "shards", list, where))
        tokens = _field(entry, "tokens", int, where)
        if tokens != sum(s.tokens for s in shards):
            raise ValueError(f"{where}: {side} says {tokens} tokens, its shards {sum(s.tokens for s in shards)}")
        if any("/" in s.name or s.name.startswith(".") for s in shards):
            raise ValueError(f"{where}: a {side} shard's name is a path; shards are plain names in {side}/")
        out[side] = (_field(entry, "documents", int, where), tokens, shards)
    return out


def read_manifest(folder: str | Path) -> Manifest:
    """The manifest of a prepared folder, with every shard present at the size its token count says.
    ValueError in one line naming the file otherwise (no manifest, another format or version, a shard
    missing or of another size)."""
    root = Path(folder).expanduser().resolve()
    where = root / MANIFEST_FILE
    try:
        data = json.loads(where.read_text())
    except OSError as err:
        raise ValueError(f"{where}: {err.strerror or err} (a folder `python -m orchestrator prepare` wrote "
                         f"holds it)") from None
    except ValueError as err:
        raise ValueError(f"{where}: not JSON ({err})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{where}: not a prepared token folder's manifest (format {FORMAT!r} expected)")
    if data.get("version") != VERSION:
        raise ValueError(f"{where}: manifest version {data.get('version')!r}; this orchestrator reads version "
                         f"{VERSION} (prepare the data again, or use the orchestrator that wrote it)")
    dtype = _field(data, "dtype", str, where)
    if dtype not in DTYPES:
        raise ValueError(f"{where}: dtype {dtype!r}; a prepared folder holds {' or '.join(DTYPES)} tokens")
    sides = _sides(data, where)
    tokenizer = data.get("tokenizer") or {}
    manifest = Manifest(
        folder=root, version=VERSION, vocab_size=_field(data, "vocab_size", int, where), dtype=dtype,
        eos_id=data.get("eos_id") if isinstance(data.get("eos_id"), int) else None,
        tokenizer=(root / tokenizer["path"]).resolve() if isinstance(tokenizer.get("path"), str) else None,
        tokenizer_kind=str(tokenizer.get("kind", "")), train=root / "train",
        eval=root / "eval" if sides["eval"][2] else None, train_tokens=sides["train"][1], eval_tokens=sides["eval"][1],
        train_documents=sides["train"][0], eval_documents=sides["eval"][0],
        shards=sides["train"][2] + sides["eval"][2])
    for shard in manifest.shards:
        _check_size(manifest, shard)
    return manifest


def _check_size(manifest: Manifest, shard: Shard) -> None:
    path = manifest.shard_path(shard)
    expected = shard.tokens * DTYPES[manifest.dtype]
    try:
        size = path.stat().st_size
    except OSError as err:
        raise ValueError(f"{path}: {err.strerror or err} (the manifest lists it with {shard.tokens} tokens)") from None
    if size != expected:
        raise ValueError(f"{path}: {size} bytes, the manifest says {shard.tokens} {manifest.dtype} tokens "
                         f"({expected} bytes): {'truncated' if size < expected else 'changed'} since it was prepared")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(folder: str | Path) -> Manifest:
    """`read_manifest`, then every shard's sha256 against the manifest's (each shard read whole):
    ValueError in one line naming the first shard that differs."""
    manifest = read_manifest(folder)
    for shard in manifest.shards:
        path = manifest.shard_path(shard)
        if sha256_of(path) != shard.sha256:
            raise ValueError(f"{path}: its sha256 is not the manifest's: changed since it was prepared")
    return manifest
