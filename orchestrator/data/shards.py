"""Token shards: a directory, or a storage prefix (`s3://bucket/tokens/train`, any location
actors/runs/storage.py opens), of token files read as one map-style dataset of training windows.

- A shard is a `.bin` file (raw tokens of `dtype` without a header, as nanoGPT writes them, or llm.c's
  layout: a 1,024-byte header with magic 20240520, its version, uint16 (1) or uint32 (2) tokens, and
  the token count) or a `.npy` file (one 1-D array; its own dtype). Token dtypes are integers. Shards
  are taken in name order.
- Sample i is a window of `seq_len + 1` tokens (inputs and next-token targets), as an int64 tensor.
  Windows start every `seq_len` tokens within a shard and never cross its end (a shard's last
  `len % seq_len` tokens, short of a window, are not trained on).
- Nothing is loaded whole: a window is one read (`os.pread` of a local shard's open file, a range
  request of a remote one). Opening checks every shard's size against its layout (a `.bin` that is
  not a whole number of tokens, a file whose size is not what its `.npy` or llm.c header says) and
  fails with the shard's name. A window read short (a shard truncated since it was opened) raises a
  `ValueError` with its name, which the data source reports as a bad sample; a memory map would have
  killed the process with SIGBUS instead. With `vocab`, each window's smallest and largest token are
  checked against [0, vocab) as it is read (two reductions over `seq_len + 1` tokens, a few
  microseconds a window, instead of a read of every shard at open).

Being map-style, token shards go through the global sampler as any dataset does: within a data epoch
every window is trained once across deaths, joins and restarts.
"""
from __future__ import annotations

import bisect
import io
import os
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from actors.runs.storage import Storage, is_remote, open_storage

SUFFIXES = (".bin", ".npy")
LLMC_MAGIC, LLMC_HEADER_BYTES = 20240520, 1024
LLMC_DTYPES: dict[int, np.dtype] = {1: np.dtype("uint16"), 2: np.dtype("uint32")}
"""llm.c's `.bin` header: 256 int32 (magic, version, token count, ...); the version says the token dtype."""


def integer_dtype(dtype: np.dtype, where: str) -> np.dtype:
    if dtype.kind not in "iu":
        raise ValueError(f"token shards: {where} has {dtype.name} tokens; token ids are integers (uint16, uint32, "
                         f"int32, ...): a float or other array is not a token shard")
    return dtype


class TokenShards(torch.utils.data.Dataset):
    thread_safe = True
    """Each read is a `pread` (no shared file position) or a range request: the loader's threads may
    read windows at once (docs/data.md, background loading)."""

    def __init__(self, location: str, seq_len: int, dtype: str = "uint16",
                 storage_options: dict[str, str] | None = None, vocab: int | None = None) -> None:
        """`vocab`: every token must be in [0, vocab), checked per window as it is read (None: not checked)."""
        if seq_len < 1:
            raise ValueError(f"token shards: seq_len must be at least 1, got {seq_len}")
        if vocab is not None and vocab < 1:
            raise ValueError(f"token shards: vocab must be at least 1, got {vocab}")
        self.location, self.seq_len, self.vocab = str(location), seq_len, vocab
        self.default_dtype = integer_dtype(np.dtype(dtype), f"dtype={dtype!r}")
        self.storage: Storage = open_storage(self.location, storage_options) if is_remote(self.location) \
            else open_storage(str(Path(self.location).expanduser()))
        names = sorted(key for key, size in self.storage.list("") if key.endswith(SUFFIXES) and size >= 0)
        if not names:
            raise ValueError(f"token shards: no .bin or .npy token shards under {self.location}")
        self.shards: list[tuple[str, int, np.dtype, int]] = []
        """(key, data offset in bytes, dtype, tokens) of each shard."""
        self._starts = [0]
        for key in names:
            offset, shard_dtype, tokens = self._layout(key)
            self.shards.append((key, offset, shard_dtype, tokens))
            self._starts.append(self._starts[-1] + max(0, (tokens - 1) // seq_len))
        self._files: dict[int, BinaryIO] = {}
        """Each local shard's file, opened at its first read (in this process: a loader process opens its own)."""

    def _layout(self, key: str) -> tuple[int, np.dtype, int]:
        size = self.storage.size(key) or 0
        if key.endswith(".bin"):
            header = self._llmc_header(key, size)
            if header is not None:
                return header
            dtype = self.default_dtype
            if size % dtype.itemsize:
                raise ValueError(f"token shards: {self.storage.location(key)} has {size} bytes, not a whole number "
                                 f"of {dtype.name} tokens ({dtype.itemsize} bytes each): truncated?")
            return 0, dtype, size // dtype.itemsize
        head = io.BytesIO(self.storage.read_range(key, 0, 4096))
        try:
            version = np.lib.format.read_magic(head)
            shape, fortran, dtype = (np.lib.format.read_array_header_1_0(head) if version == (1, 0)
                                     else np.lib.format.read_array_header_2_0(head))
        except ValueError as err:
            raise ValueError(f"token shards: {self.storage.location(key)} is not a .npy array: {err}") from None
        if len(shape) != 1 or dtype.hasobject:
            raise ValueError(f"token shards: {self.storage.location(key)} holds a {shape} {dtype} array; a shard "
                             f"is one 1-D array of integer tokens")
        integer_dtype(dtype, self.storage.location(key))
        offset, tokens = head.tell(), int(shape[0])
        if size != offset + tokens * dtype.itemsize:
            raise ValueError(f"token shards: {self.storage.location(key)} has {size} bytes, but its header says "
                             f"{tokens} tokens ({offset + tokens * dtype.itemsize} bytes)"
                             + (": truncated?" if size < offset + tokens * dtype.itemsize else ""))
        return offset, dtype, tokens

    def _llmc_header(self, key: str, size: int) -> tuple[int, np.dtype, int] | None:
        """(offset, dtype, tokens) of a `.bin` that starts with llm.c's header, else None (a raw shard)."""
        if size < LLMC_HEADER_BYTES:
            return None
        magic, version, tokens = np.frombuffer(self.storage.read_range(key, 0, 12), dtype="<i4").tolist()
        if magic != LLMC_MAGIC or version not in LLMC_DTYPES:
            return None
        dtype = LLMC_DTYPES[version]
        if size != LLMC_HEADER_BYTES + tokens * dtype.itemsize:
            raise ValueError(f"token shards: {self.storage.location(key)} has {size} bytes, but its llm.c header "
                             f"says {tokens} {dtype.name} tokens ({LLMC_HEADER_BYTES + tokens * dtype.itemsize} bytes)"
                             + (": truncated?" if size < LLMC_HEADER_BYTES + tokens * dtype.itemsize else ""))
        return LLMC_HEADER_BYTES, dtype, tokens

    def __len__(self) -> int:
        return self._starts[-1]

    def where(self, index: int) -> tuple[str, int]:
        """(shard name, first token) of sample `index`."""
        shard = bisect.bisect_right(self._starts, index) - 1
        return self.shards[shard][0].rsplit("/", 1)[-1], (index - self._starts[shard]) * self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"token shards: sample {index} of {len(self)}")
        shard = bisect.bisect_right(self._starts, index) - 1
        key, offset, dtype, size = self.shards[shard]
        first = (index - self._starts[shard]) * self.seq_len
        count = self.seq_len + 1
        start, length = offset + first * dtype.itemsize, count * dtype.itemsize
        if self.storage.remote:
            raw = self.storage.read_range(key, start, length)
        else:  # pread, not a memory map: a shard truncated under a map kills the process with SIGBUS
            raw = os.pread(self._file(shard).fileno(), length, start)
        tokens = np.frombuffer(raw, dtype=dtype, count=len(raw) // dtype.itemsize)
        if len(tokens) != count:
            raise ValueError(f"token shards: {self.storage.location(key)} held {size} tokens when opened, but now "
                             f"ends before token {first + count}, which sample {index} needs (truncated while training?)")
        if self.vocab is not None:
            self._check_vocab(tokens, self.vocab, key, first)
        return (torch.from_numpy(tokens.astype(np.int64)),)

    def _check_vocab(self, tokens: np.ndarray, vocab: int, key: str, first: int) -> None:
        low = int(tokens.min()) if tokens.dtype.kind == "i" else 0  # unsigned tokens are never negative
        if low < 0 or int(tokens.max()) >= vocab:
            at = int(np.argmax((tokens < 0) | (tokens >= vocab)))
            raise ValueError(f"token shards: {self.storage.location(key)} has token id {int(tokens[at])} at token "
                             f"{first + at}, outside the vocabulary [0, {vocab})")

    def _file(self, shard: int) -> BinaryIO:
        file = self._files.get(shard)
        if file is None:  # two threads may open it at once: the first kept is everyone's, the other closed
            opened = open(self.storage.path(self.shards[shard][0]), "rb", buffering=0)
            file = self._files.setdefault(shard, opened)
            if file is not opened:
                opened.close()
        return file
