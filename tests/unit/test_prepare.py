"""`python -m orchestrator prepare` (orchestrator/prepare.py) and the manifest reader
(orchestrator/data/manifest.py), in process, on text no one here wrote (the standard library's `json`
package): the shards hold every document's tokens, each followed by the end-of-text id, in order, on
the side a fixed hash of its path puts it (checked against the tokenizer called here, and decoded back
to the text); the trained BPE is the same twice; an interrupted prepare resumes from its last shard
and equals a clean run byte for byte without rewriting that shard, and nothing is at OUT until the
end; a re-run with other options starts over; a changed shard fails `verify`; a saved dataset and a
bare tokenizer.json (a vocabulary past uint16) work; bad input is one line and exit 2."""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[hf]') is not installed")
import transformers

from orchestrator import cli
from orchestrator.data.manifest import read_manifest, verify
from orchestrator.data.shards import TokenShards
from orchestrator.prepare import EOT, Corpus, PrepareOptions, Progress, prepare

FRACTION = 0.3
SHARD = 4000


@pytest.fixture
def corpus(tmp_path) -> Path:
    """The json package's sources (about 32,000 tokens of a 300-token BPE; 3 of 5 files held out)."""
    folder = tmp_path / "corpus" / "json"
    shutil.copytree(Path(json.__file__).parent, folder, ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def options(corpus: Path, out: Path, **over) -> PrepareOptions:
    fields = {"inputs": (str(corpus),), "out": str(out), "train_bpe": 300, "glob": "**/*.py",
              "eval_fraction": FRACTION, "shard_tokens": SHARD} | over
    return PrepareOptions(**fields)


def held_out(key: str) -> bool:
    """The split from its definition: the first 8 bytes of the key's sha256, as a fraction of 2**64."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2 ** 64 < FRACTION


def shard_tokens(folder: Path, dtype: str = "uint16") -> np.ndarray:
    parts = [np.fromfile(p, dtype=dtype) for p in sorted(folder.glob("shard-*.bin"))]
    return np.concatenate(parts) if parts else np.array([], dtype=dtype)


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_shards_hold_each_document_then_its_end_of_text_on_its_side(corpus, tmp_path, capsys):
    out = tmp_path / "tokens"
    assert cli.main(["prepare", str(corpus), "--out", str(out), "--train-bpe", "300", "--glob", "**/*.py",
                     "--eval-fraction", str(FRACTION), "--shard-tokens", str(SHARD)]) == 0
    printed = capsys.readouterr()
    assert "prepared" in printed.out and "documents (100%)" in printed.err
    m = read_manifest(out)
    tok = transformers.AutoTokenizer.from_pretrained(str(m.tokenizer), local_files_only=True)
    assert (m.vocab_size, len(tok), m.dtype, m.eos_id) == (300, 300, "uint16", tok.convert_tokens_to_ids(EOT))
    assert m.tokenizer == out / "tokenizer" and m.train == out / "train" and m.eval == out / "eval"
    paths = sorted(p for p in corpus.rglob("*.py"))
    sides = {"eval": [p for p in paths if held_out(p.relative_to(corpus).as_posix())]}
    sides["train"] = [p for p in paths if p not in sides["eval"]]
    assert sides["eval"] and sides["train"], "the corpus must put documents on both sides for this test"
    for side, folder, tokens in (("train", m.train, m.train_tokens), ("eval", m.eval, m.eval_tokens)):
        texts = [p.read_text() for p in sides[side]]
        expected = [i for t in texts for i in tok(t, add_special_tokens=False)["input_ids"] + [m.eos_id]]
        got = shard_tokens(folder)
        assert got.tolist() == expected and len(got) == tokens
        assert tok.decode(got.tolist()) == EOT.join(texts) + EOT  # byte-level: the text comes back whole
        assert [len(np.fromfile(p, dtype="uint16")) for p in sorted(folder.glob("*.bin"))][:-1] == \
            [SHARD] * (len(list(folder.glob("*.bin"))) - 1)
    assert (m.train_documents, m.eval_documents) == (len(sides["train"]), len(sides["eval"]))
    windows = TokenShards(str(m.train), 16, m.dtype, vocab=m.vocab_size)
    assert windows[0][0].tolist() == shard_tokens(m.train)[:17].tolist()
    assert verify(out) == m


def test_training_the_bpe_twice_gives_the_same_tokenizer_and_shards(corpus, tmp_path):
    first, second = (prepare(options(corpus, tmp_path / name), err=io.StringIO()) for name in ("a", "b"))
    assert files_of(first.tokenizer) == files_of(second.tokenizer)
    assert first.shards == second.shards


def test_an_interrupted_prepare_resumes_after_its_last_shard_and_equals_a_clean_run(corpus, tmp_path):
    clean = prepare(options(corpus, tmp_path / "clean"), err=io.StringIO())
    out = tmp_path / "tokens"

    def stop(side: str, name: str) -> None:
        raise KeyboardInterrupt  # the process dies right after its first shard is recorded

    with pytest.raises(KeyboardInterrupt):
        prepare(options(corpus, out), err=io.StringIO(), after_shard=stop)
    assert not out.exists(), "an interrupted prepare left a half-written OUT"
    partial = tmp_path / "tokens.partial"
    (kept,) = [p for p in partial.rglob("shard-*.bin")]
    point = json.loads((partial / "progress.json").read_text())[kept.parent.name]
    assert point["offset"] > 0, "the first shard ends between documents: the test would not resume within one"
    before = (kept.stat().st_ino, kept.stat().st_mtime_ns)
    written: list[str] = []
    log = io.StringIO()
    again = prepare(options(corpus, out), err=log, after_shard=lambda side, name: written.append(f"{side}/{name}"))
    assert kept.relative_to(partial).as_posix() not in written, f"the kept shard was written again: {written}"
    assert (out / kept.relative_to(partial)).stat().st_ino == before[0]
    assert files_of(out) == files_of(tmp_path / "clean") and again.shards == clean.shards
    assert "resuming" in log.getvalue()
    assert not partial.exists()


def test_a_rerun_with_other_options_starts_over(corpus, tmp_path):
    out = tmp_path / "tokens"

    def stop(side: str, name: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(options(corpus, out), err=io.StringIO(), after_shard=stop)
    log = io.StringIO()
    other = prepare(options(corpus, out, shard_tokens=3000), err=log)
    assert "starting over" in log.getvalue()
    assert other.shards == prepare(options(corpus, tmp_path / "clean", shard_tokens=3000), err=io.StringIO()).shards


def test_a_changed_shard_fails_verify_and_a_truncated_or_missing_one_fails_reading(corpus, tmp_path):
    out = tmp_path / "tokens"
    m = prepare(options(corpus, out), err=io.StringIO())
    shard = m.shard_path(m.shards[1])
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    read_manifest(out)  # the size is right
    with pytest.raises(ValueError, match=f"{shard}: its sha256 is not the manifest's"):
        verify(out)
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(ValueError, match=f"{shard}: {len(data) - 2} bytes, the manifest says .* truncated"):
        read_manifest(out)
    shard.unlink()
    with pytest.raises(ValueError, match=f"{shard}: No such file"):
        read_manifest(out)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps(manifest | {"version": 99}))
    with pytest.raises(ValueError, match="manifest version 99"):
        read_manifest(out)


def test_a_saved_dataset_and_the_tokenizer_of_another_prepare(corpus, tmp_path):
    """Rows of a dataset saved with save_to_disk are the documents (in row order); a tokenizer folder
    (`--tokenizer`), and its bare tokenizer.json, encode as the run that trained it did."""
    datasets = pytest.importorskip("datasets", reason="the datasets extra is not installed")
    first = prepare(options(corpus, tmp_path / "bpe", eval_fraction=0.0), err=io.StringIO())
    assert first.eval is None and not (tmp_path / "bpe" / "eval").exists()
    for given in (first.tokenizer, first.tokenizer / "tokenizer.json"):
        again = prepare(options(corpus, tmp_path / f"again-{given.name}", eval_fraction=0.0, train_bpe=None,
                                tokenizer=str(given)), err=io.StringIO())
        assert again.shards == first.shards and again.vocab_size == 300
    texts = [p.read_text() for p in sorted(corpus.rglob("*.py"))]
    datasets.Dataset.from_dict({"body": texts, "n": list(range(len(texts)))}).save_to_disk(str(tmp_path / "ds"))
    rows = prepare(options(tmp_path / "ds", tmp_path / "rows", eval_fraction=0.0, train_bpe=None, text_column="body",
                           tokenizer=str(first.tokenizer)), err=io.StringIO())
    assert shard_tokens(rows.train).tolist() == shard_tokens(first.train).tolist()


def word_level_tokenizer(path: Path, words: int) -> Path:
    """A bare `tokenizer.json`: `words` words w0, w1, ... split on whitespace, then `[UNK]` and `<eos>`."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(words)} | {"[UNK]": words, "<eos>": words + 1}
    bare = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    bare.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    bare.save(str(path))
    return path


def test_a_vocabulary_past_uint16_is_written_as_uint32(tmp_path):
    word_level_tokenizer(tmp_path / "tokenizer.json", 70_000)
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("w1 w69999 w65536 nope")
    m = prepare(PrepareOptions(inputs=(str(tmp_path / "text"),), out=str(tmp_path / "tokens"), eval_fraction=0.0,
                               tokenizer=str(tmp_path / "tokenizer.json"), eos_token="<eos>"), err=io.StringIO())
    assert (m.dtype, m.vocab_size, m.eos_id) == ("uint32", 70_002, 70_001)
    assert shard_tokens(m.train, "uint32").tolist() == [1, 69999, 65536, 70_000, 70_001]


def test_a_folders_documents_are_the_files_its_glob_matches_less_the_excluded_in_path_order(corpus):
    (corpus / "site-packages" / "pkg").mkdir(parents=True)
    (corpus / "site-packages" / "pkg" / "x.py").write_text("x = 1\n")
    (corpus / "notes.txt").write_text("not python\n")

    def keys(**over) -> list[str]:
        found = Corpus(options(corpus, corpus.parent / "out", **over))
        return [found.key(i) for i in range(len(found))]

    assert keys() == ["__init__.py", "decoder.py", "encoder.py", "scanner.py", "site-packages/pkg/x.py", "tool.py"]
    assert keys(exclude=("site-packages/*",)) == ["__init__.py", "decoder.py", "encoder.py", "scanner.py", "tool.py"]
    assert keys(glob="**/*.txt") == ["notes.txt"]


def test_the_progress_line_comes_at_each_tenth_without_a_terminal():
    err = io.StringIO()
    progress = Progress(100, err, kept_tokens=0)
    for docs in range(1, 100):
        progress(docs, docs * 10)
    progress(100, 1000, final=True)
    lines = err.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == [f"{d}/100" for d in range(10, 100, 10)] + ["100/100"]
    assert lines[-1].startswith("prepare: 100/100 documents (100%), 1,000 tokens, ")


@pytest.mark.parametrize("argv, says", [
    (["nowhere"], "nowhere: no such file or folder"),
    (["{corpus}", "--glob", "*.md"], "no documents in"),
    (["{corpus}", "--train-bpe", "100"], "--train-bpe 100: a byte-level BPE needs at least 257 tokens"),
    (["{corpus}", "--eval-fraction", "1"], "--eval-fraction 1.0: must be in [0, 1)"),
    (["{corpus}", "--tokenizer", "{corpus}/__init__.py"], "cannot be loaded as a tokenizer"),
    (["{corpus}", "--tokenizer", "{corpus}/nowhere"], "no such file or folder"),
    (["{corpus}", "--out", "{corpus}"], "exists; pass --overwrite to replace it"),
])
def test_bad_input_is_one_line_and_exit_2_with_nothing_written(corpus, tmp_path, capsys, argv, says):
    out = tmp_path / "tokens"
    args = [a.format(corpus=corpus) for a in argv]
    if "--tokenizer" not in args and "--train-bpe" not in args:
        args += ["--train-bpe", "300"]
    if "--out" not in args:
        args += ["--out", str(out)]
    assert cli.main(["prepare", *args, "--glob", "**/*.py"] if "--glob" not in args else ["prepare", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: prepare: ") and says in err and err.count("\n") == 1, err
    assert not out.exists() and not (tmp_path / "tokens.partial").exists()
    assert sorted(os.listdir(corpus)) == sorted(p.name for p in Path(json.__file__).parent.iterdir() if p.name != "__pycache__")
