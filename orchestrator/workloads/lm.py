"""A causal language model on real text that every machine already has: the Python standard library's
own source files, read as bytes (a vocabulary of 256: no tokenizer, no download).

The text: every `.py` file under `sysconfig.get_paths()["stdlib"]` (test packages and
`site-packages` left out), in sorted order of their paths. Files are split, not bytes: a file whose
path hashes into the held-out twentieth goes to the evaluation text, so no file is in both. Each
side is one flat array of bytes, written once into the cache directory (atomically: a temporary
file renamed into place) under a name that fingerprints the files (paths and sizes) and the build
version; every worker on the machine then maps the same file (`numpy.memmap`), and the training
windows are a strided view of it (`as_strided`), so no worker copies the text.

The model: a GPT-style decoder (pre-norm blocks, causal self-attention through
`scaled_dot_product_attention`, a 4x GELU MLP, learned positions, the output layer tied to the token
embedding), no dropout. Sizes: `tiny` (0.83M parameters, 64-byte context) and `small` (10.8M,
256-byte context, for GPUs); any field can be overridden.

A training sample is a window of `seq_len + 1` bytes (windows do not overlap); the loss is the mean
next-byte cross-entropy over the batch. Evaluation: the loss on `eval_windows` windows spread evenly
over the held-out text (the same ones every time), with its perplexity and bits per byte.
"""
from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import Dataset, TensorDataset

from orchestrator.workloads import MeanEvaluation, Workload, with_modelled_compute
from orchestrator.workloads.flops import flops_per_token

BUILD = 1
"""The text's build version: part of the cache name, bumped when the selection or split changes."""
HELD_OUT = 20
"""One file in about this many goes to the evaluation text."""
VOCAB = 256


@dataclass(frozen=True)
class GPTConfig:
    d_model: int
    n_layer: int
    n_head: int
    seq_len: int
    vocab: int = VOCAB


SIZES = {
    "tiny": GPTConfig(d_model=128, n_layer=4, n_head=4, seq_len=64),
    "small": GPTConfig(d_model=384, n_layer=6, n_head=6, seq_len=256),
}


# ------------------------------------------------------------------ the text
def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "elastic-orchestrator"


def source_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """(relative path, path) of every standard-library source file the text is made of, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        parts = rel.split("/")
        if parts[0] == "site-packages" or "test" in parts or "tests" in parts or not path.is_file():
            continue
        out.append((rel, path))
    return sorted(out)


def held_out(rel: str) -> bool:
    """Whether the file at `rel` belongs to the evaluation text (a fixed hash of its path)."""
    return hashlib.sha256(rel.encode()).digest()[0] % HELD_OUT == 0


def _fingerprint(files: list[tuple[str, Path]]) -> str:
    h = hashlib.sha256(f"build {BUILD}\n".encode())
    for rel, path in files:
        h.update(f"{rel}\t{path.stat().st_size}\n".encode())
    return h.hexdigest()[:16]


def _write_atomic(path: Path, chunks: list[bytes]) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@lru_cache(maxsize=4)
def text_arrays(root: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(train bytes, held-out bytes) as read-only-in-practice memory maps (copy-on-write: nothing
    writes them), built into the cache directory on first use."""
    files = source_files(Path(root) if root else None)
    if not files:
        raise RuntimeError(f"workload lm: no .py files under {root or sysconfig.get_paths()['stdlib']}")
    key = _fingerprint(files)
    folder = _cache_dir()
    paths = {side: folder / f"lm-stdlib-{key}.{side}.u8" for side in ("train", "eval")}
    if not all(p.exists() for p in paths.values()):
        chunks: dict[str, list[bytes]] = {"train": [], "eval": []}
        for rel, path in files:
            chunks["eval" if held_out(rel) else "train"].append(path.read_bytes())
        folder.mkdir(parents=True, exist_ok=True)
        for side, path in paths.items():
            _write_atomic(path, chunks[side])
    return tuple(np.memmap(paths[side], dtype=np.uint8, mode="c") for side in ("train", "eval"))  # type: ignore[return-value]


def windows(text: np.ndarray, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows of `seq_len + 1` bytes (the last byte of one is the first of the
    next): a strided view of `text`, no copy. Row i starts at byte i * seq_len."""
    flat = torch.from_numpy(text)
    count = (len(text) - 1) // seq_len
    return flat.as_strided((count, seq_len + 1), (seq_len, 1))


def eval_windows(text: np.ndarray, seq_len: int, count: int) -> torch.Tensor:
    """`count` windows spread evenly over the held-out text (a copy: they are few)."""
    starts = np.linspace(0, len(text) - seq_len - 1, num=min(count, len(text) - seq_len)).astype(np.int64)
    return torch.from_numpy(np.stack([np.asarray(text[s:s + seq_len + 1]) for s in starts]))


# ------------------------------------------------------------------ the model
class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, `n_layer` pre-norm blocks, a final LayerNorm, and an output
    layer that shares the token embedding's weight."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"workload lm: d_model {cfg.d_model} is not a multiple of n_head {cfg.n_head}")
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.n_head) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.checkpointing = False
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2 or name == "pos":
                # GPT-2's: N(0, 0.02), the residual projections scaled down by the depth
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def gradient_checkpointing_enable(self) -> None:
        """Recompute each block's activations in the backward instead of keeping them (`training.
        activation_checkpointing`; the name and meaning are Hugging Face models' own)."""
        self.checkpointing = True

    def position_tables(self) -> list[torch.Tensor]:
        """The learned position table, looked up, not multiplied: what a count of training FLOPs leaves out
        (orchestrator/workloads/flops.py)."""
        return [self.pos]

    def no_weight_decay(self) -> set[str]:
        """The position table is an embedding held as a bare parameter: no weight decay (the optimizer's
        default groups exempt the modules they recognize as embeddings, and these names)."""
        return {"pos"}

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"workload lm: a sequence of {t} bytes is longer than the context ({self.cfg.seq_len})")
        x = self.tok(idx) + self.pos[:t]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing and self.training else block(x)
        return self.head(self.ln_f(x))


# ------------------------------------------------------------------ loss and evaluation
def next_byte_loss(model: nn.Module, batch) -> torch.Tensor:
    """Mean cross-entropy of each byte of the window predicted from the bytes before it."""
    (rows,) = batch if isinstance(batch, (tuple, list)) else (batch,)
    device = next(model.parameters()).device
    rows = rows.to(device=device, dtype=torch.long)
    logits = model(rows[:, :-1])
    if logits.dtype in (torch.float16, torch.bfloat16):  # the softmax of a half-precision model in float32
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))


@torch.no_grad()
def loss_sums(model: nn.Module, rows: torch.Tensor, loss: Callable[[nn.Module, Any], torch.Tensor],
              batch: int = 32) -> tuple[float, float]:
    """(`loss` summed over `rows`, the number of rows), in eval mode, in chunks of `batch` rows, each chunk's
    mean weighted by its rows."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        total += float(loss(model, (chunk,))) * len(chunk)
    model.train(was_training)
    return total, float(len(rows))


def _held_out_sums(model: nn.Module, data: TensorDataset) -> dict[str, tuple[float, float]]:
    return {"eval_loss": loss_sums(model, data.tensors[0], next_byte_loss)}


def _per_byte(means: dict[str, float]) -> dict[str, float]:
    loss = means["eval_loss"]
    return {"perplexity": math.exp(min(loss, 50.0)), "bits_per_byte": loss / math.log(2)}


held_out_loss = MeanEvaluation(_held_out_sums, _per_byte)
"""The mean next-byte loss over the held-out windows (each the same length), its perplexity and bits per
byte; split across the members of a synchronous policy (core/workload_api.py `MeanEvaluation`)."""


def gpt(size: str = "tiny", d_model: int | None = None, n_layer: int | None = None, n_head: int | None = None,
        seq_len: int | None = None, dtype: str = "float32", eval_count: int = 64, text_root: str | None = None,
        shards: str | None = None, eval_shards: str | None = None, shard_dtype: str = "uint16",
        vocab: int | None = None) -> Workload:
    """The byte-level GPT on the standard library's source (`size`: tiny or small; each field can be
    overridden), parameters in `dtype` (float32 or bfloat16). With `shards` (a directory or storage
    prefix of `.bin`/`.npy` token files, orchestrator/data/shards.py) it trains on those tokens
    instead, with a vocabulary of `vocab` (default: all values of `shard_dtype`, up to 65,536), and
    evaluates on `eval_shards` (the first `eval_count` windows) when given."""
    if size not in SIZES:
        raise ValueError(f"workload lm: size must be one of {sorted(SIZES)}, got {size!r}")
    base = SIZES[size]
    length = seq_len or base.seq_len
    if shards is not None:
        from orchestrator.data.shards import TokenShards

        vocab = vocab or min(2 ** (8 * np.dtype(shard_dtype).itemsize), 65_536)
        train_data: Dataset = TokenShards(shards, length, shard_dtype, vocab=vocab)  # a token past the embedding: a bad sample
        eval_data = None
        if eval_shards is not None:
            held_shards = TokenShards(eval_shards, length, shard_dtype, vocab=vocab)
            eval_data = TensorDataset(torch.stack([held_shards[i][0] for i in range(min(eval_count, len(held_shards)))]))
    else:
        train, held = text_arrays(text_root)
        train_data = TensorDataset(windows(train, length))
        eval_data = TensorDataset(eval_windows(held, length, eval_count))
    cfg = GPTConfig(d_model=d_model or base.d_model, n_layer=n_layer or base.n_layer,
                    n_head=n_head or base.n_head, seq_len=length, vocab=vocab or VOCAB)
    model = GPT(cfg).to(getattr(torch, dtype))
    return Workload(model=model, train_data=train_data, eval_data=eval_data,
                    loss=next_byte_loss, evaluate=held_out_loss if eval_data is not None else None,
                    tokens_per_sample=cfg.seq_len, flops_per_token=flops_per_token(model, cfg.seq_len))


def lab_gpt(compute_ms: float = 0.0, slow: dict | None = None, jitter_sigma: float = 0.0, seed: int = 0,
            **params) -> Workload:
    """The GPT (`gpt(**params)`) with a modelled compute time added to its own, for the network lab
    (benchmarks/lm_lab.py): see `orchestrator.workloads.with_modelled_compute`."""
    return with_modelled_compute(gpt(**params), compute_ms, slow, jitter_sigma, seed)
