"""`python -m orchestrator prepare`: text into token shards with a manifest (docs/language-models.md).

The input is text files, folders (the files under them matching a glob, in sorted path order) or
Hugging Face datasets saved on disk (`datasets.load_from_disk`, one text column, in row order). Each
file or row is a document; a fixed hash of its key (its path under the folder given, or `row N`) puts
it on the held-out side (`eval/`) or the training side (`train/`), so no document is on both and the
split does not depend on the order or number of the others. The tokenizer is a local one (a
`transformers` tokenizer folder, or a bare `tokenizers` `tokenizer.json`) or a byte-level BPE trained
here on the training side; either way it is saved into `OUT/tokenizer/`, which
`transformers.AutoTokenizer.from_pretrained` loads, and the shards are encoded with that saved copy.
Each document's tokens (no special tokens added) are followed by the end-of-text id. Shards are raw
little-endian tokens (`uint16` when the vocabulary fits, else `uint32`), `shard_tokens` each (the last
one shorter), as `orchestrator.data.shards.TokenShards` reads them; the manifest
(`orchestrator/data/manifest.py`) records the tokenizer, vocabulary, dtype, counts and hashes.

Everything is written into `OUT.partial/` and renamed to OUT at the end. After each shard a progress
file there records (atomically) the shards done and, per side, the document and token its next shard
starts at, with the fingerprint of the inputs (paths, sizes, mtimes), the tokenizer and the options: a
re-run with the same ones keeps those shards and encodes from there; with other ones it starts over.
"""
from __future__ import annotations

import bisect
import fnmatch
import functools
import hashlib
import importlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

import numpy as np

from actors.runs.runfiles import write_bytes_atomic, write_json_atomic
from core.schema import ConfigError
from orchestrator.data.manifest import FORMAT, MANIFEST_FILE, SIDES, VERSION, Manifest, read_manifest

EOT = "<|endoftext|>"
"""The end-of-text token of a trained BPE (GPT-2's)."""
EOS_NAMES = (EOT, "</s>", "<|end_of_text|>", "<eos>")
"""End-of-text tokens looked for in a bare tokenizer.json when `--eos-token` is not given."""
DEFAULT_GLOB = "**/*.txt"
DEFAULT_SHARD_TOKENS = 10_000_000
MIN_BPE_VOCAB = 257
"""256 byte tokens and the end-of-text token."""
PROGRESS_FILE = "progress.json"
TOKENIZER_DIR = "tokenizer"
BATCH_DOCUMENTS = 64
"""Documents encoded at once (the tokenizer spreads a batch over its threads)."""


@dataclass(frozen=True)
class PrepareOptions:
    inputs: tuple[str, ...]
    out: str
    tokenizer: str | None = None
    """A tokenizer folder (transformers) or a tokenizer.json (tokenizers); or None with `train_bpe`."""
    train_bpe: int | None = None
    """The vocabulary of a byte-level BPE trained on the training side (end-of-text token included)."""
    glob: str = DEFAULT_GLOB
    exclude: tuple[str, ...] = ()
    """Patterns (fnmatch, `*` crossing folders) of paths under a folder that are not documents."""
    text_column: str = "text"
    split: str = "train"
    """The split of a saved DatasetDict."""
    eval_fraction: float = 0.05
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    eos_token: str | None = None
    overwrite: bool = False

    def check(self) -> None:
        if not self.inputs:
            raise ConfigError("prepare: name at least one INPUT (a text file, a folder or a saved dataset)")
        if (self.tokenizer is None) == (self.train_bpe is None):
            raise ConfigError("prepare: give either --tokenizer TOKDIR or --train-bpe VOCAB")
        if self.train_bpe is not None and self.train_bpe < MIN_BPE_VOCAB:
            raise ConfigError(f"prepare: --train-bpe {self.train_bpe}: a byte-level BPE needs at least "
                              f"{MIN_BPE_VOCAB} tokens (256 bytes and {EOT})")
        if self.train_bpe is not None and self.eos_token not in (None, EOT):
            raise ConfigError(f"prepare: --eos-token goes with --tokenizer; a trained BPE's is {EOT}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"prepare: --eval-fraction {self.eval_fraction}: must be in [0, 1)")
        if self.shard_tokens < 1:
            raise ConfigError(f"prepare: --shard-tokens {self.shard_tokens}: must be at least 1")

    def stamp(self) -> dict:
        """The options that change the output (part of the fingerprint)."""
        return {"glob": self.glob, "exclude": list(self.exclude), "text_column": self.text_column, "split": self.split,
                "eval_fraction": self.eval_fraction, "shard_tokens": self.shard_tokens, "eos_token": self.eos_token}


def _need(module: str, extra: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(f"prepare: needs the {module} package ({err}): pip install -e '.[{extra}]'") from None


def _file_stamps(paths: Sequence[Path], root: Path) -> list:
    stamps = []
    for path in paths:
        stat = path.stat()
        stamps.append([path.relative_to(root).as_posix(), stat.st_size, stat.st_mtime_ns])
    return stamps


# ----------------------------------------------------------------------------------------------- inputs
class TextFiles:
    """One file, or the files under a folder that match a glob and no exclusion, in sorted path order; a
    file is a document."""

    def __init__(self, given: Path, pattern: str, exclude: tuple[str, ...]) -> None:
        self.root, self.paths = (given.parent, [given]) if given.is_file() else \
            (given, sorted(p for p in given.glob(pattern) if p.is_file() and not _excluded(p.relative_to(given), exclude)))

    def __len__(self) -> int:
        return len(self.paths)

    def key(self, index: int) -> str:
        return self.paths[index].relative_to(self.root).as_posix()

    def texts(self, indices: list[int]) -> list[str]:
        out = []
        for i in indices:
            try:  # undecodable bytes become U+FFFD: a stray latin-1 file is still text
                out.append(self.paths[i].read_text(encoding="utf-8", errors="replace"))
            except OSError as err:
                raise ConfigError(f"prepare: {self.paths[i]}: {err.strerror or err}") from None
        return out

    def stamp(self) -> list:
        return [str(self.root.resolve()), _file_stamps(self.paths, self.root)]


class SavedDataset:
    """A Hugging Face dataset saved with `save_to_disk` (a DatasetDict: its `split`); a row is a document."""

    def __init__(self, folder: Path, column: str, split: str) -> None:
        datasets = _need("datasets", "datasets")
        self.folder, self.column = folder, column
        try:
            data = datasets.load_from_disk(str(folder))
        except (OSError, ValueError) as err:
            raise ConfigError(f"prepare: {folder}: not a dataset saved with save_to_disk ({err})") from None
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise ConfigError(f"prepare: {folder} has splits {sorted(data)}, not {split!r} (--split)")
            data = data[split]
        if column not in data.column_names:
            raise ConfigError(f"prepare: {folder} has columns {data.column_names}, not {column!r} (--text-column)")
        self.data = data.select_columns([column])

    def __len__(self) -> int:
        return len(self.data)

    def key(self, index: int) -> str:
        return f"row {index}"

    def texts(self, indices: list[int]) -> list[str]:
        values = self.data[indices][self.column]
        for i, value in zip(indices, values):
            if not isinstance(value, str):
                raise ConfigError(f"prepare: {self.folder} row {i}: {self.column!r} is a {type(value).__name__}, "
                                  f"not text")
        return values

    def stamp(self) -> list:
        files = sorted(p for p in self.folder.rglob("*") if p.is_file())
        return [str(self.folder.resolve()), self.column, _file_stamps(files, self.folder)]


Source = TextFiles | SavedDataset


def _excluded(relative: Path, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(relative.as_posix(), pattern) for pattern in patterns)


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in ("state.json", "dataset_dict.json"))


class Corpus:
    """The documents of every input, numbered in order, each on the side its key hashes to."""

    def __init__(self, options: PrepareOptions) -> None:
        self.sources: list[Source] = []
        for given in options.inputs:
            path = Path(given).expanduser()
            if not path.exists():
                raise ConfigError(f"prepare: {given}: no such file or folder")
            self.sources.append(SavedDataset(path, options.text_column, options.split) if is_saved_dataset(path)
                                else TextFiles(path, options.glob, options.exclude))
        self._starts = [0]
        for source in self.sources:
            self._starts.append(self._starts[-1] + len(source))
        if not len(self):
            raise ConfigError(f"prepare: no documents in {', '.join(options.inputs)} (files matching "
                              f"--glob {options.glob!r}, or rows of a saved dataset)")
        self.sides = [_side(self.key(i), options.eval_fraction) for i in range(len(self))]
        if "train" not in self.sides:
            raise ConfigError(f"prepare: all {len(self)} documents hash to the held-out side; lower --eval-fraction "
                              f"{options.eval_fraction} or give more documents")

    def __len__(self) -> int:
        return self._starts[-1]

    def key(self, index: int) -> str:
        at = bisect.bisect_right(self._starts, index) - 1
        return self.sources[at].key(index - self._starts[at])

    def texts(self, indices: list[int]) -> list[str]:
        """The documents `indices` (ascending), read source by source."""
        out: list[str] = []
        for at, source in enumerate(self.sources):
            mine = [i - self._starts[at] for i in indices if self._starts[at] <= i < self._starts[at + 1]]
            if mine:
                out.extend(source.texts(mine))
        return out

    def train_texts(self, batch: int = BATCH_DOCUMENTS):
        """Every training document's text, in order (what a BPE is trained on)."""
        train = [i for i, side in enumerate(self.sides) if side == "train"]
        for start in range(0, len(train), batch):
            yield from self.texts(train[start:start + batch])

    def stamp(self) -> list:
        return [source.stamp() for source in self.sources]


def _side(key: str, eval_fraction: float) -> str:
    """A fixed hash of the key, not Python's (salted per process): the same split on every run."""
    point = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0 ** 64
    return "eval" if point < eval_fraction else "train"


# -------------------------------------------------------------------------------------------- tokenizer
class TrainedBPE:
    """A byte-level BPE of `vocab` tokens (its end-of-text token included) trained on the training side.
    `tokenizers` trains it deterministically (ties between pairs are broken by the pair), with any
    number of threads: the same input gives the same vocabulary and merges."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.kind = "trained-bpe"

    def stamp(self) -> dict:
        return {"train_bpe": self.vocab}

    def make(self, corpus: Corpus, err: TextIO) -> Any:
        tokenizers = _need("tokenizers", "hf")
        transformers = _need("transformers", "hf")
        print(f"prepare: training a byte-level BPE of {self.vocab} tokens on "
              f"{corpus.sides.count('train')} documents", file=err, flush=True)
        bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
        bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = tokenizers.decoders.ByteLevel()
        trainer = tokenizers.trainers.BpeTrainer(
            vocab_size=self.vocab, special_tokens=[EOT], show_progress=False,
            initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
        bpe.train_from_iterator(corpus.train_texts(), trainer)
        if bpe.get_vocab_size() < self.vocab:
            print(f"prepare: the corpus gave {bpe.get_vocab_size()} tokens, not {self.vocab} (too little text for "
                  f"more merges); the manifest says {bpe.get_vocab_size()}", file=err, flush=True)
        return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOT, bos_token=EOT)


class GivenTokenizer:
    """A local tokenizer: a folder `transformers.AutoTokenizer` loads (files only), or a bare
    `tokenizer.json` of the `tokenizers` library (its end-of-text token named by `eos_token`, else the
    first of EOS_NAMES in its vocabulary)."""

    def __init__(self, path: Path, eos_token: str | None) -> None:
        if not path.exists():
            raise ConfigError(f"prepare: --tokenizer {path}: no such file or folder")
        self.path, self.eos_token = path, eos_token
        self.kind = ""
        """Set by `make`: the loaded tokenizer's class, or `tokenizers` for a bare tokenizer.json."""

    def stamp(self) -> dict:
        files = sorted(p for p in self.path.rglob("*") if p.is_file()) if self.path.is_dir() else [self.path]
        return {"tokenizer": str(self.path.resolve()), "files": _file_stamps(files, self.path.parent)}

    def make(self, corpus: Corpus, err: TextIO) -> Any:
        transformers = _need("transformers", "hf")
        tokenizers = _need("tokenizers", "hf")
        try:
            if self.path.is_file():
                bare = tokenizers.Tokenizer.from_file(str(self.path))
                tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bare, eos_token=self._bare_eos(bare))
                self.kind = "tokenizers"
            else:
                extra = {"eos_token": self.eos_token} if self.eos_token else {}
                tok = transformers.AutoTokenizer.from_pretrained(str(self.path), local_files_only=True, **extra)
                self.kind = type(tok).__name__
        except ConfigError:
            raise
        except Exception as error:  # noqa: BLE001 - whatever a tokenizer's loader raises, said in one line
            text = str(error).splitlines()[0][:200] if str(error).strip() else type(error).__name__
            raise ConfigError(f"prepare: --tokenizer {self.path}: cannot be loaded as a tokenizer ({text})") from None
        if tok.eos_token is None or tok.eos_token not in tok.get_vocab():
            raise ConfigError(f"prepare: --tokenizer {self.path} has no end-of-text token in its vocabulary "
                              f"(eos {tok.eos_token!r}); name one with --eos-token")
        return tok

    def _bare_eos(self, bare: Any) -> str:
        vocab = bare.get_vocab(with_added_tokens=True)
        found = [self.eos_token] if self.eos_token else [name for name in EOS_NAMES if name in vocab][:1]
        if not found or found[0] not in vocab:
            raise ConfigError(f"prepare: --tokenizer {self.path}: no end-of-text token "
                              f"({self.eos_token or ', '.join(EOS_NAMES)}) in its vocabulary; name one with --eos-token")
        return found[0]


TokenizerSource = TrainedBPE | GivenTokenizer


class Encoder:
    """The saved tokenizer: documents to token ids, each followed by the end-of-text id."""

    def __init__(self, folder: Path) -> None:
        transformers = _need("transformers", "hf")
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        self.vocab_size = len(self.tokenizer)
        self.eos_id = int(self.tokenizer.eos_token_id)
        self.dtype = np.dtype("<u2") if self.vocab_size <= 1 << 16 else np.dtype("<u4")

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:  # a fast tokenizer: the batch over its threads, no length warnings
            ids = [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
        else:
            ids = self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        return [np.array([*row, self.eos_id], dtype=self.dtype) for row in ids]


# ----------------------------------------------------------------------------------------------- shards
class ShardWriter:
    """One side's shards. Tokens fill a buffer of `capacity`; a full buffer is written as the next shard
    (temp file + rename), and the point its successor starts at is kept: the document, and how many of its
    tokens are in shards already. `on_shard` runs after each shard (the progress file is written there)."""

    def __init__(self, folder: Path, dtype: np.dtype, capacity: int, state: dict | None,
                 on_shard: Callable[[], None]) -> None:
        self.folder, self.dtype, self.capacity, self._on_shard = folder, dtype, capacity, on_shard
        self.shards: list[dict] = list(state["shards"]) if state else []
        self.next_doc, self.offset = (int(state["next_doc"]), int(state["offset"])) if state else (0, 0)
        self._buffer = np.empty(capacity, dtype=dtype)
        self._fill = 0

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards) + self._fill

    def state(self) -> dict:
        return {"shards": self.shards, "next_doc": self.next_doc, "offset": self.offset}

    def add(self, doc: int, tokens: np.ndarray, first: int) -> None:
        """Document `doc`'s tokens from its `first` on (those before are in shards already)."""
        at = first
        while at < len(tokens):
            take = min(len(tokens) - at, self.capacity - self._fill)
            self._buffer[self._fill:self._fill + take] = tokens[at:at + take]
            self._fill, at = self._fill + take, at + take
            if self._fill == self.capacity:
                self._write(doc, at)

    def close(self, documents: int) -> None:
        if self._fill:
            self._write(documents, 0)

    def _write(self, next_doc: int, offset: int) -> None:
        data = self._buffer[:self._fill].tobytes()
        name = f"shard-{len(self.shards):05d}.bin"
        write_bytes_atomic(self.folder / name, data)
        self.shards.append({"name": name, "tokens": self._fill, "sha256": hashlib.sha256(data).hexdigest()})
        self.next_doc, self.offset, self._fill = next_doc, offset, 0
        self._on_shard()


class Progress:
    """Documents and tokens done, of the total documents, with the rate: on a terminal one line rewritten
    (at most every `every_s`), elsewhere a line at each tenth of the documents."""

    def __init__(self, total: int, err: TextIO, kept_tokens: int, every_s: float = 0.25) -> None:
        """`kept_tokens`: those in shards kept from an interrupted run (not this run's rate)."""
        self.total, self.err, self.every_s, self._kept = total, err, every_s, kept_tokens
        self.tty = bool(getattr(err, "isatty", lambda: False)())
        self.started, self._shown, self._tenth = time.monotonic(), 0.0, 0

    def __call__(self, docs: int, tokens: int, final: bool = False) -> None:
        now = time.monotonic()
        tenth = docs * 10 // self.total
        if not final and (now - self._shown < self.every_s if self.tty else tenth <= self._tenth):
            return
        self._shown, self._tenth = now, tenth
        rate = (tokens - self._kept) / max(now - self.started, 1e-9)
        line = (f"prepare: {docs:,}/{self.total:,} documents ({100.0 * docs / self.total:.0f}%), "
                f"{tokens:,} tokens, {rate:,.0f} tokens/s")
        print(("\r" + line) if self.tty else line, end="\n" if final or not self.tty else "", file=self.err, flush=True)


# ---------------------------------------------------------------------------------------------- the run
class Preparation:
    """One prepare into OUT.partial: the tokenizer, then the shards (resumed where a progress file with
    the same fingerprint says), then the manifest, then the rename to OUT."""

    def __init__(self, options: PrepareOptions, err: TextIO, after_shard: Callable[[str, str], None] | None) -> None:
        options.check()
        self.options, self.err, self.after_shard = options, err, after_shard
        self.out = Path(options.out).expanduser().absolute()
        if self.out.exists() and not options.overwrite:
            raise ConfigError(f"prepare: {self.out} exists; pass --overwrite to replace it")
        self.partial = self.out.with_name(self.out.name + ".partial")
        self.corpus = Corpus(options)
        self.source: TokenizerSource = TrainedBPE(options.train_bpe) if options.train_bpe is not None \
            else GivenTokenizer(Path(str(options.tokenizer)).expanduser(), options.eos_token)
        described = json.dumps({"version": VERSION, "inputs": self.corpus.stamp(), "tokenizer": self.source.stamp(),
                                "options": options.stamp()}, sort_keys=True)
        self.fingerprint = hashlib.sha256(described.encode()).hexdigest()
        self.progress = self._resumed()
        self.writers: dict[str, ShardWriter] = {}

    def _resumed(self) -> dict:
        """The progress file of an interrupted prepare of the same inputs and options, else {} (an
        unusable partial folder removed)."""
        if not self.partial.exists():
            return {}
        try:
            progress = json.loads((self.partial / PROGRESS_FILE).read_text())
        except (OSError, ValueError):
            progress = None
        if isinstance(progress, dict) and progress.get("fingerprint") == self.fingerprint:
            done = sum(len(progress.get(side, {}).get("shards", [])) for side in SIDES)
            print(f"prepare: resuming the interrupted prepare in {self.partial} ({done} shard(s) done)",
                  file=self.err, flush=True)
            return progress
        print(f"prepare: {self.partial} holds an interrupted prepare of other inputs, tokenizer or options; "
              f"starting over", file=self.err, flush=True)
        shutil.rmtree(self.partial)
        return {}

    def _save_progress(self) -> None:
        write_json_atomic(self.partial / PROGRESS_FILE, {**self.progress, "fingerprint": self.fingerprint,
                                                         **{s: w.state() for s, w in self.writers.items()}})

    def _tokenizer(self) -> Encoder:
        """The tokenizer saved in the partial folder (made and saved first, unless a resumed run did)."""
        folder = self.partial / TOKENIZER_DIR
        if "tokenizer_kind" not in self.progress:
            tok = self.source.make(self.corpus, self.err)
            self.partial.mkdir(parents=True, exist_ok=True)  # after the tokenizer: a bad one leaves nothing
            staging = self.partial / (TOKENIZER_DIR + ".tmp")
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(folder, ignore_errors=True)
            tok.save_pretrained(str(staging))
            staging.rename(folder)
            self.progress["tokenizer_kind"] = self.source.kind
            self._save_progress()
        return Encoder(folder)

    def run(self) -> Manifest:
        encoder = self._tokenizer()
        for side in SIDES:
            self.writers[side] = ShardWriter(self.partial / side, encoder.dtype, self.options.shard_tokens,
                                             self.progress.get(side), functools.partial(self._shard_done, side))
            (self.partial / side).mkdir(exist_ok=True)
        self._encode(encoder)
        for side, writer in self.writers.items():
            writer.close(len(self.corpus))
            if not writer.shards:  # nothing held out: no eval folder (the manifest's eval is None)
                (self.partial / side).rmdir()
        write_json_atomic(self.partial / MANIFEST_FILE, self._manifest(encoder))
        (self.partial / PROGRESS_FILE).unlink()
        publish(self.partial, self.out)
        return read_manifest(self.out)

    def _shard_done(self, side: str) -> None:
        self._save_progress()
        if self.after_shard is not None:
            self.after_shard(side, self.writers[side].shards[-1]["name"])

    def _encode(self, encoder: Encoder) -> None:
        """Every document from the first not wholly in a kept shard on, in order, each onto its side's writer."""
        resume = {side: (w.next_doc, w.offset) for side, w in self.writers.items()}
        start = min(doc for doc, _ in resume.values())
        progress = Progress(len(self.corpus), self.err, sum(w.tokens for w in self.writers.values()))
        sides = self.corpus.sides
        for batch in range(start, len(self.corpus), BATCH_DOCUMENTS):
            wanted = [i for i in range(batch, min(batch + BATCH_DOCUMENTS, len(self.corpus))) if i >= resume[sides[i]][0]]
            for i, tokens in zip(wanted, encoder.encode(self.corpus.texts(wanted))):
                self.writers[sides[i]].add(i, tokens, resume[sides[i]][1] if i == resume[sides[i]][0] else 0)
            if batch + BATCH_DOCUMENTS < len(self.corpus):  # the last batch's line is the final one below
                progress(batch + BATCH_DOCUMENTS, sum(w.tokens for w in self.writers.values()))
        progress(len(self.corpus), sum(w.tokens for w in self.writers.values()), final=True)

    def _manifest(self, encoder: Encoder) -> dict:
        return {"format": FORMAT, "version": VERSION,
                "tokenizer": {"path": TOKENIZER_DIR, "kind": self.progress["tokenizer_kind"],
                              "class": type(encoder.tokenizer).__name__,
                              "source": str(Path(self.options.tokenizer).expanduser().resolve())
                              if self.options.tokenizer else None},
                "vocab_size": encoder.vocab_size, "eos_id": encoder.eos_id, "dtype": encoder.dtype.name,
                **{side: {"documents": self.corpus.sides.count(side), "tokens": w.tokens, "shards": w.shards}
                   for side, w in self.writers.items()},
                "inputs": [str(Path(p).expanduser().resolve()) for p in self.options.inputs],
                "options": self.options.stamp()}


def publish(staging: Path, out: Path) -> None:
    """The folder `staging` becomes `out` by a rename; an `out` there already (replaced on purpose) is
    moved aside first and removed after, so `out` is never a half-written folder."""
    aside = None
    if out.exists():
        aside = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
        out.rename(aside / out.name)
    staging.rename(out)
    if aside is not None:
        shutil.rmtree(aside)


def prepare(options: PrepareOptions, err: TextIO | None = None,
            after_shard: Callable[[str, str], None] | None = None) -> Manifest:
    """Run a prepare (see the module's text); ConfigError in one line on bad input. Progress goes to `err`
    (default: sys.stderr); `after_shard(side, name)` runs after each shard is recorded (tests stop a run there)."""
    return Preparation(options, err or sys.stderr, after_shard).run()
