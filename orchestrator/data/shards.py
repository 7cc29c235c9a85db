"""Token shards: a directory, or a storage prefix (`s3://bucket/tokens/train`, any location
actors/runs/storage.py opens), of token files read as one map-style dataset of training windows.

- A shard is a `.bin` file (raw tokens of `dtype`, the nanoGPT/llm.c layout without a header) or a
  `.npy` file (one 1-D array; its own dtype). Shards are taken in name order.
- Sample i is a window of `seq_len + 1` tokens (inputs and next-token targets), as an int64 tensor.
  Windows start every `seq_len` tokens within a shard and never cross its end (a shard's last
  `len % seq_len` tokens, short of a window, are not trained on).
- Nothing is loaded whole: a local shard is memory-mapped, a remote one read by range, one window per
  read. Opening checks every shard's size against its dtype (a `.bin` that is not a whole number of
  tokens, a `.npy` shorter than its header says) and fails with the shard's name.

Being map-style, token shards go through the global sampler as any dataset does: within a data epoch
every window is trained once across deaths, joins and restarts.
"""
from __future__ import annotations

import bisect
import io
from pathlib import Path

import numpy as np
import torch

from actors.runs.storage import Storage, is_remote, open_storage

SUFFIXES = (".bin", ".npy")


class TokenShards(torch.utils.data.Dataset):
    def __init__(self, location: str, seq_len: int, dtype: str = "uint16",
                 storage_options: dict[str, str] | None = None) -> None:
        if seq_len < 1:
            raise ValueError(f"token shards: seq_len must be at least 1, got {seq_len}")
        self.location, self.seq_len, self.default_dtype = str(location), seq_len, np.dtype(dtype)
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
        self._maps: dict[int, np.ndarray] = {}

    def _layout(self, key: str) -> tuple[int, np.dtype, int]:
        size = self.storage.size(key) or 0
        if key.endswith(".bin"):
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
        offset, tokens = head.tell(), int(shape[0])
        if size < offset + tokens * dtype.itemsize:
            raise ValueError(f"token shards: {self.storage.location(key)} is truncated: its header says {tokens} "
                             f"tokens ({offset + tokens * dtype.itemsize} bytes), the file has {size} bytes")
        return offset, dtype, tokens

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
        key, offset, dtype, _ = self.shards[shard]
        first = (index - self._starts[shard]) * self.seq_len
        count = self.seq_len + 1
        if not self.storage.remote:
            tokens = self._mapped(shard)[first:first + count]
        else:
            raw = self.storage.read_range(key, offset + first * dtype.itemsize, count * dtype.itemsize)
            tokens = np.frombuffer(raw, dtype=dtype)
            if len(tokens) != count:
                raise ValueError(f"token shards: {self.storage.location(key)} ended at token {first + len(tokens)} "
                                 f"while sample {index} was read (the shard changed since it was opened?)")
        return (torch.from_numpy(tokens.astype(np.int64)),)

    def _mapped(self, shard: int) -> np.ndarray:
        if shard not in self._maps:
            key, offset, dtype, tokens = self.shards[shard]
            self._maps[shard] = np.memmap(self.storage.path(key), dtype=dtype, mode="r", offset=offset, shape=(tokens,))
        return self._maps[shard]
