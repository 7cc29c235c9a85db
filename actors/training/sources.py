"""Data sources: the seam between a workload's `train_data` and a step's batch (docs/data.md).

A source answers two questions. `global_batch(cursor, size)`: which sample ids the global batch at
position `cursor` holds (the same answer on every member, from (seed, cursor) alone). `fetch(ids,
cursor)`: this member's share of it, collated (`Fetched`: the batch, and the ids it trained). The
position is the global cursor, which advances only when a step commits and is part of every state a
joiner receives and every checkpoint, plus `state_dict()` for a source that needs more (a stream's
own state at that cursor). Hence, for every source, within a data epoch each sample is trained once
across deaths, joins, leaves, coordinator restarts and `--resume`: a step that did not commit is
redone with the same ids, and no member ever iterates anything the others must agree on.

- `MapSource`: any map-style dataset (`__len__`, `__getitem__`), `TensorDataset`s gathered with one
  `index_select` per tensor; one seeded permutation of the indices per data epoch.
- `ArrowSource`: a Hugging Face `datasets.Dataset`: the same order, a share read with one batched
  Arrow `take` (`dataset[ids]`), columns as tensors.
- `BlockSource`: a Ray Data `Dataset`, materialized once per run by a holder actor (its blocks live
  as long as the run); data epoch e visits the blocks in a permutation seeded by (seed, e), each
  block's rows in order; a member reads only the blocks its share touches.
- `StreamSource`: an iterable that can be positioned (`state_dict()`/`load_state_dict()`): every
  member reads the stream in order and keeps its share; the stream's state at the committed cursor
  travels with the model. An iterable without them is refused (`source_for`).

`on_bad_sample: skip` (a map-style or Arrow sample that raises) trains the rest of the share and
reports each skipped id; `fail` (the default) fails the step with the sample's id and the error.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from algorithms.rules.sampler import GlobalSampler
from core.schema import WorkloadRefused

log = logging.getLogger(__name__)


class BadSample(Exception):
    """A sample (or a block of samples) could not be read; its message names it and the error."""


@dataclass
class Fetched:
    batch: Any
    ids: np.ndarray
    """The ids the batch holds: the share's ids less any skipped, or a sample's own `id` field."""
    skipped: list[int] = field(default_factory=list)
    ready: Any = None
    """A CUDA event recorded after the batch's copy to the device on a loader's stream (None: ready)."""


def _reason(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}".rstrip(": ")


class MapSource:
    kind = "map-style"

    def __init__(self, data: Any, seed: int, skip_bad: bool = False) -> None:
        self.data, self.skip_bad = data, skip_bad
        self.sampler = self._sampler(seed)
        self.n = self.sampler.n
        self._tensors = data.tensors if isinstance(data, torch.utils.data.TensorDataset) else None

    def _sampler(self, seed: int) -> GlobalSampler:
        return GlobalSampler(len(self.data), seed)

    def global_batch(self, cursor: int, size: int) -> np.ndarray:
        return self.sampler.global_batch(cursor, size)

    def fetch(self, ids: np.ndarray, cursor: int) -> Fetched:
        if self._tensors is not None:  # a gather per tensor (index_select: the rows `t[index]` gives, without its dispatch)
            index = torch.from_numpy(ids)
            return Fetched(tuple([torch.index_select(t, 0, index) for t in self._tensors]), ids)
        return self._one_by_one(ids)

    def _one_by_one(self, ids: np.ndarray) -> Fetched:
        """Each sample read on its own: one that raises fails the batch with its id, or is skipped."""
        samples: list[Any] = []
        kept: list[int] = []
        skipped: list[int] = []
        for i in ids.tolist():
            try:
                samples.append(self.data[i])
            except Exception as err:  # noqa: BLE001 - a user's dataset may raise anything
                self._bad(i, err, skipped)
                continue
            kept.append(i)
        return Fetched(self._collate(samples, ids), np.asarray(kept, dtype=np.int64) if skipped else ids, skipped)

    def _bad(self, i: int, err: BaseException, skipped: list[int]) -> None:
        if not self.skip_bad:
            raise BadSample(f"training sample {i} could not be read: {_reason(err)}") from err
        log.warning("skipped training sample %d (workload.on_bad_sample: skip): %s", i, _reason(err))
        skipped.append(i)

    def _collate(self, samples: list, ids: np.ndarray) -> Any:
        if not samples:
            raise BadSample(f"every sample of a batch was bad (ids {ids[:8].tolist()}...): nothing to train")
        return torch.utils.data.default_collate(samples)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def committed(self, cursor: int) -> None:
        """A commit point at `cursor`: what a source keeps for the positions before it can go."""

    def fingerprint(self) -> str:
        """What a checkpoint's cursor means: the same on resume, or the data changed under it."""
        return f"{self.kind} n={self.n}"


class ArrowSource(MapSource):
    """A Hugging Face `datasets.Dataset`: memory-mapped Arrow, a share read in one batched `take`."""

    kind = "datasets"

    def __init__(self, data: Any, seed: int, skip_bad: bool = False) -> None:
        if getattr(data, "format", {}).get("type") is None:
            data = data.with_format("torch")
        super().__init__(data, seed, skip_bad)

    def fetch(self, ids: np.ndarray, cursor: int) -> Fetched:
        try:
            return Fetched(self.data[ids.tolist()], ids)  # a dict of columns, rows in `ids` order
        except Exception:  # noqa: BLE001 - find the sample that fails, one by one
            return self._one_by_one(ids)


class BlockOrder(GlobalSampler):
    """Data epoch e: the blocks in a permutation seeded by (seed, e), each block's rows in order; a row's
    id is its position in the materialized dataset."""

    def __init__(self, rows: list[int], seed: int) -> None:
        super().__init__(int(sum(rows)), seed)
        self.rows = np.asarray(rows, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.rows)])

    def draw(self, data_epoch: int) -> np.ndarray:
        blocks = np.random.default_rng([self.seed, data_epoch]).permutation(len(self.rows))
        return np.concatenate([np.arange(self.starts[b], self.starts[b + 1]) for b in blocks])


class BlockSource(MapSource):
    """A Ray Data `Dataset`'s rows by block (`blocks`: (ObjectRef, rows) of each block, in dataset order)."""

    kind = "ray data"
    CACHED_BLOCKS = 4

    def __init__(self, blocks: list[tuple[Any, int]], seed: int, skip_bad: bool = False,
                 refresh: Callable[[], list[tuple[Any, int]]] | None = None) -> None:
        self.refs = [ref for ref, _ in blocks]
        self._refresh = refresh
        """Asks the run's holder for its blocks again (after the holder was restarted and made new ones)."""
        self.order = BlockOrder([rows for _, rows in blocks], seed)
        super().__init__(None, seed, skip_bad)
        self._cache: collections.OrderedDict[int, dict[str, np.ndarray]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _sampler(self, seed: int) -> GlobalSampler:
        return self.order

    def _block(self, b: int) -> dict[str, np.ndarray]:
        import ray
        from ray.data.block import BlockAccessor

        with self._lock:
            if b in self._cache:
                self._cache.move_to_end(b)
                return self._cache[b]
        first, last = int(self.order.starts[b]), int(self.order.starts[b + 1]) - 1
        try:
            try:
                block = ray.get(self.refs[b])
            except ray.exceptions.ObjectLostError:
                if self._refresh is None:
                    raise
                self._reattach(self._refresh)  # the holder was restarted: its blocks are new objects
                block = ray.get(self.refs[b])
            columns = BlockAccessor.for_block(block).to_batch_format("numpy")
        except Exception as err:
            raise BadSample(f"Ray Data block {b} (rows {first}..{last}) could not be read: {_reason(err)}") from err
        if not isinstance(columns, dict):
            columns = {"data": columns}
        with self._lock:
            self._cache[b] = columns
            while len(self._cache) > self.CACHED_BLOCKS:
                self._cache.popitem(last=False)
        return columns

    def _reattach(self, refresh: Callable[[], list[tuple[Any, int]]]) -> None:
        blocks = refresh()
        rows = np.asarray([r for _, r in blocks], dtype=np.int64)
        if not np.array_equal(rows, self.order.rows):
            raise RuntimeError("the Ray Data holder was restarted and materialized other blocks than before")
        self.refs = [ref for ref, _ in blocks]

    def fetch(self, ids: np.ndarray, cursor: int) -> Fetched:
        blocks = np.searchsorted(self.order.starts, ids, side="right") - 1
        parts: list[dict[str, np.ndarray]] = []
        for b in dict.fromkeys(blocks.tolist()):  # in the share's order: each block once
            rows = ids[blocks == b] - self.order.starts[b]
            parts.append({k: v[rows] for k, v in self._block(b).items()})
        batch = {k: torch.as_tensor(np.concatenate([p[k] for p in parts])) for k in parts[0]}
        return Fetched(batch, ids)

    def fingerprint(self) -> str:
        digest = hashlib.sha256(self.order.rows.tobytes()).hexdigest()[:16]
        return f"{self.kind} n={self.n} blocks={len(self.refs)} rows={digest}"


class StreamSource:
    """An iterable positioned by its own `state_dict()`/`load_state_dict()`: `state_dict()` says where
    the stream is (the item `next()` would give), and after `load_state_dict(s)` a new `iter()` goes
    on from there; a stream that ends ends the data epoch, and the next `iter()` begins the next one.
    Sample ids are positions in the stream (counted over data epochs); a dict sample with an integer
    `id` is recorded by that id instead. Every member reads every item in order and keeps its share."""

    kind = "stream"

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.n = int(len(stream)) if hasattr(stream, "__len__") else None
        self._lock = threading.Lock()
        self._iter: Any = None
        self.position = 0
        self.states: dict[int, dict] = {0: stream.state_dict()}
        """The stream's state at each global-batch start passed since the newest commit point."""
        self.mark = 0

    def global_batch(self, cursor: int, size: int) -> np.ndarray:
        return np.arange(cursor, cursor + size, dtype=np.int64)

    def _seek(self, position: int) -> None:
        if position < self.position or self._iter is None:
            start = max((p for p in self.states if p <= position), default=None)
            if start is None:
                raise RuntimeError(f"stream: no state at or before position {position} (kept: {sorted(self.states)})")
            self.stream.load_state_dict(self.states[start])
            self._iter, self.position = iter(self.stream), start
        while self.position < position:
            self._next()

    def _next(self) -> Any:
        try:
            item = next(self._iter)
        except StopIteration:  # the data epoch ends: the next one begins
            self._iter = iter(self.stream)
            try:
                item = next(self._iter)
            except StopIteration:
                raise RuntimeError("stream: a new data epoch yielded nothing (an empty stream?)") from None
        self.position += 1
        return item

    def fetch(self, ids: np.ndarray, cursor: int) -> Fetched:
        with self._lock:
            self._seek(cursor)
            self.states.setdefault(cursor, self.stream.state_dict())
            self._seek(int(ids[0]))
            items = [self._next() for _ in range(len(ids))]
        own = [s.get("id") for s in items] if all(isinstance(s, dict) for s in items) else []
        recorded = np.asarray(own, dtype=np.int64) if own and all(isinstance(i, int) for i in own) else ids
        return Fetched(torch.utils.data.default_collate(items), recorded)

    def committed(self, cursor: int) -> None:
        with self._lock:
            self._seek(cursor)  # the state at the commit point: what a joiner and a checkpoint receive
            self.states.setdefault(cursor, self.stream.state_dict())
            self.mark = cursor
            self.states = {p: s for p, s in self.states.items() if p >= cursor}

    def state_dict(self) -> dict:
        with self._lock:
            if self.mark not in self.states:
                self._seek(self.mark)
                self.states[self.mark] = self.stream.state_dict()
            return {"position": self.mark, "stream": self.states[self.mark]}

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self.position = self.mark = int(state["position"])
            self.states = {self.mark: state["stream"]}
            self._iter = None

    def fingerprint(self) -> str:
        return f"{self.kind} n={self.n}"


def is_ray_dataset(data: Any) -> bool:
    return type(data).__module__.startswith("ray.data") and hasattr(data, "iter_internal_ref_bundles")


def is_hf_dataset(data: Any) -> bool:
    return type(data).__module__.startswith("datasets") and hasattr(data, "with_format")


def _indexable(data: Any) -> bool:
    return (hasattr(data, "__getitem__") and hasattr(data, "__len__")
            and not isinstance(data, torch.utils.data.IterableDataset))


def source_for(data: Any, seed: int, on_bad_sample: str = "fail",
               ray_blocks: Callable[[Any], list[tuple[Any, int]]] | None = None, kind: str = "synchronous") -> Any:
    """The source for a workload's `train_data`; WorkloadRefused (one line) for data it cannot resume.
    `kind`: the policy's kind; those whose samples a server deals (`server`, `background`) take only
    data they can index (a Ray Data or a stream source has no such order)."""
    skip = on_bad_sample == "skip"
    if kind in ("server", "background") and (is_ray_dataset(data) or not _indexable(data)):
        raise WorkloadRefused(f"train_data is a {'Ray Data Dataset' if is_ray_dataset(data) else type(data).__name__}, "
                         f"which the {kind} policies cannot deal from (their server leases sample indices): use a "
                         f"map-style dataset, or a policy that shares a cursor (bsp, local_sgd, diloco, gossip ...)")
    if is_ray_dataset(data):
        if ray_blocks is None:
            raise WorkloadRefused("train_data is a Ray Data Dataset, which needs Ray (the worker's holder actor)")
        return BlockSource(ray_blocks(data), seed, skip, refresh=lambda: ray_blocks(data))
    if is_hf_dataset(data):
        return ArrowSource(data, seed, skip)
    if _indexable(data):
        return MapSource(data, seed, skip)
    if hasattr(data, "__iter__"):
        if callable(getattr(data, "state_dict", None)) and callable(getattr(data, "load_state_dict", None)):
            if skip:
                raise WorkloadRefused("workload.on_bad_sample: skip is for map-style data; a stream's samples are "
                                 "read in order (skip bad items inside the stream)")
            return StreamSource(data)
        raise WorkloadRefused(f"train_data is an iterable ({type(data).__name__}) without state_dict()/load_state_dict(): "
                         f"it cannot be positioned after a failure, so samples would be lost or repeated; make it "
                         f"map-style or give it those two methods (docs/data.md)")
    raise WorkloadRefused(f"train_data must be a map-style dataset, a Hugging Face or Ray Data dataset, or a positioned "
                     f"iterable; got {type(data).__name__}")
