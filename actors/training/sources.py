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

A sample that cannot be read, or whose layout (nesting, shapes, dtypes) differs from the rest of its
batch, is a `BadSample` naming its id: a deterministic error of the data, which the coordinator ends
the job on in one line (`workload.on_bad_sample: fail`, the default) instead of retrying the worker.
`skip` trains the rest of the share and reports each skipped id. A Ray Data column that cannot become
a tensor is a `BadSample` naming its block's rows; a block that cannot be fetched is not (Ray's error).

A workload's `collate_fn` (core/workload_api.py `Workload`), where it gives one, makes each share's batch from
its samples in order, in place of torch's `default_collate`: then no layout check applies (ragged rows and
strings are its to pad or encode), a `TensorDataset` is read sample by sample, a Hugging Face dataset row by
row, and a Ray Data share reaches it as one dict per row, string columns included. What it raises is the
workload's bug (actors/training/user_code.py).

A map-style dataset's `__getitem__` is never entered by two threads at once (the step and the loader's
threads share one source) unless the dataset declares `thread_safe = True`.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import threading
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from actors.training import user_code
from algorithms.rules.kinds import SYNCHRONOUS, Kind
from algorithms.rules.sampler import GlobalSampler
from algorithms.rules.supervision import DataFault
from core.schema import WorkloadRefused

log = logging.getLogger(__name__)
Collate = Callable[[list[Any]], Any]
"""A workload's `collate_fn`: a share's samples, in order, to its batch."""


def collated(collate: Collate | None, samples: list[Any]) -> Any:
    """The batch of `samples`: the workload's `collate_fn`, or torch's `default_collate` without one."""
    if collate is None:
        return torch.utils.data.default_collate(samples)
    return user_code.call("collate_fn", collate, samples)


class BadSample(Exception):
    """A training sample (or rows of a block) that cannot be trained: `sample` names it ("sample 17",
    "rows 40..59 (Ray Data block 3)"), `error` says why in one line. The same in every try, so the
    worker's outcome carries it as a `DataFault` and the coordinator ends the job on it."""

    def __init__(self, sample: str, error: str, message: str = "") -> None:
        super().__init__(message or f"training {sample} could not be read: {error}")
        self.sample, self.error = sample, error

    def __reduce__(self) -> tuple:  # a loader process sends it back pickled
        return type(self), (self.sample, self.error, str(self))

    @property
    def fault(self) -> DataFault:
        return DataFault(self.sample, self.error)


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


def declares_thread_safe(data: Any) -> bool:
    """Whether a dataset says its `__getitem__` may run in several threads at once (`thread_safe = True`)."""
    return getattr(data, "thread_safe", False) is True


def layout(sample: Any) -> Hashable:
    """What `default_collate` needs alike in every sample of a batch: the nesting, each tensor's or
    array's shape and dtype, and each other leaf's type (it would stack a float64 with float32s into
    float64, or fail on unequal shapes without naming the sample)."""
    if isinstance(sample, torch.Tensor):
        return "tensor", tuple(sample.shape), str(sample.dtype).removeprefix("torch.")
    if isinstance(sample, np.ndarray):
        return "array", sample.shape, sample.dtype.name
    if isinstance(sample, Mapping):
        return "dict", tuple((str(k), layout(v)) for k, v in sorted(sample.items(), key=lambda kv: str(kv[0])))
    if isinstance(sample, (tuple, list)):
        return type(sample).__name__, tuple(layout(v) for v in sample)
    return (type(sample).__name__,)


def show_layout(shape: Hashable) -> str:
    """A layout as a reader writes it: `(tensor[4] float32, int)`, `{x: array(3,) int64}`."""
    if not isinstance(shape, tuple) or not shape:
        return str(shape)
    kind = shape[0]
    if kind == "tensor":
        return f"tensor{list(shape[1])} {shape[2]}"
    if kind == "array":
        return f"array{shape[1]} {shape[2]}"
    if kind == "dict":
        return "{" + ", ".join(f"{k}: {show_layout(v)}" for k, v in shape[1]) + "}"
    if len(shape) == 2 and isinstance(shape[1], tuple):
        return "(" + ", ".join(show_layout(v) for v in shape[1]) + ")"
    return str(kind)


def odd_ones_out(samples: list[Any]) -> tuple[list[int], Hashable]:
    """The positions of the samples whose layout differs from the batch's most common one (the first
    seen of those tied), and that layout."""
    shapes = [layout(s) for s in samples]
    common = collections.Counter(shapes).most_common(1)[0][0] if shapes else None
    return [k for k, shape in enumerate(shapes) if shape != common], common


def mismatch(sample_id: int, sample: Any, common: Hashable, others: int) -> BadSample:
    """Sample `sample_id` does not have its batch's `common` layout (which `others` samples have)."""
    error = f"its layout {show_layout(layout(sample))} differs from the {show_layout(common)} of the other {others} " \
            f"samples of its batch"
    return BadSample(f"sample {sample_id}", error, f"training sample {sample_id} does not match its batch: {error}")


class MapSource:
    kind = "map-style"

    def __init__(self, data: Any, seed: int, skip_bad: bool = False, thread_safe: bool | None = None,
                 collate: Collate | None = None) -> None:
        """`thread_safe`: whether `data[i]` may run in several threads at once (None: as `data` declares);
        `collate`: the workload's `collate_fn` (None: `default_collate`)."""
        self.data, self.skip_bad, self._collate = data, skip_bad, collate
        self.sampler = self._sampler(seed)
        self.n = self.sampler.n
        tensors = isinstance(data, torch.utils.data.TensorDataset) and collate is None
        self._tensors = data.tensors if tensors else None
        safe = declares_thread_safe(data) if thread_safe is None else thread_safe
        self._reading: contextlib.AbstractContextManager = contextlib.nullcontext() if safe else threading.Lock()
        """Held around every read of `data`: the step and the loader's threads never enter it together."""

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
        """Each sample read on its own: one that raises, or whose layout differs from the rest of its
        batch, fails the batch with its id, or is skipped."""
        samples: list[Any] = []
        kept: list[int] = []
        skipped: list[int] = []
        first_bad = ""
        for i in ids.tolist():
            try:
                with self._reading:
                    sample = self.data[i]
            except Exception as err:  # noqa: BLE001 - a user's dataset may raise anything
                why = self._bad(BadSample(f"sample {i}", _reason(err)), skipped, i, err)
                first_bad = first_bad or why
                continue
            samples.append(sample)
            kept.append(i)
        odd, common = odd_ones_out(samples) if self._collate is None else ([], None)
        for k in odd:
            why = self._bad(mismatch(kept[k], samples[k], common, len(samples) - len(odd)), skipped, kept[k])
            first_bad = first_bad or why
        if odd:
            samples, kept = [s for k, s in enumerate(samples) if k not in odd], [i for k, i in enumerate(kept) if k not in odd]
        if not samples:
            raise BadSample(f"sample {skipped[0]}", f"{first_bad}; every sample of its micro-batch ({len(ids)}) was "
                                                    f"bad: nothing to train (workload.on_bad_sample: skip)")
        return Fetched(collated(self._collate, samples), np.asarray(kept, dtype=np.int64) if skipped else ids, skipped)

    def _bad(self, bad: BadSample, skipped: list[int], i: int, err: BaseException | None = None) -> str:
        """`fail`: raise `bad`; `skip`: note sample `i` skipped. Returns why it was bad."""
        if not self.skip_bad:
            raise bad from err
        log.warning("skipped training %s (workload.on_bad_sample: skip): %s", bad.sample, bad.error)
        skipped.append(i)
        return bad.error

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

    def __init__(self, data: Any, seed: int, skip_bad: bool = False, collate: Collate | None = None) -> None:
        safe = declares_thread_safe(data)  # before `with_format`, which makes a new object
        if getattr(data, "format", {}).get("type") is None and collate is None:  # a collate_fn takes the rows as stored
            data = data.with_format("torch")
        super().__init__(data, seed, skip_bad, safe, collate)

    def fetch(self, ids: np.ndarray, cursor: int) -> Fetched:
        if self._collate is not None:
            return self._one_by_one(ids)  # its rows, one dict each, to the workload's collate_fn
        try:
            with self._reading:
                batch = self.data[ids.tolist()]  # a dict of columns, rows in `ids` order
        except Exception:  # noqa: BLE001 - find the sample that fails, one by one
            return self._one_by_one(ids)
        if any(isinstance(v, list) and v and isinstance(v[0], torch.Tensor) for v in batch.values()):
            return self._one_by_one(ids)  # a ragged column (rows of unequal shapes): find the odd rows
        return Fetched(batch, ids)


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
                 refresh: Callable[[], list[tuple[Any, int]]] | None = None, collate: Collate | None = None) -> None:
        self.refs = [ref for ref, _ in blocks]
        self._refresh = refresh
        """Asks the run's holder for its blocks again (after the holder was restarted and made new ones)."""
        self.order = BlockOrder([rows for _, rows in blocks], seed)
        super().__init__(None, seed, skip_bad, collate=collate)
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
        try:
            block = ray.get(self.refs[b])
        except ray.exceptions.ObjectLostError:
            if self._refresh is None:
                raise
            self._reattach(self._refresh)  # the holder was restarted: its blocks are new objects
            block = ray.get(self.refs[b])
        except ray.exceptions.RayError as err:  # Ray's, not the data's: the worker fails and is replaced
            raise RuntimeError(f"Ray Data block {b} ({self._rows(b)}) could not be fetched: {_reason(err)}") from err
        try:
            columns = BlockAccessor.for_block(block).to_batch_format("numpy")
        except Exception as err:
            raise BadSample(self._rows(b), _reason(err), f"Ray Data block {b} ({self._rows(b)}) could not be "
                                                         f"read: {_reason(err)}") from err
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

    def _rows(self, b: int) -> str:
        return f"rows {int(self.order.starts[b])}..{int(self.order.starts[b + 1]) - 1}"

    def fetch(self, ids: np.ndarray, cursor: int) -> Fetched:
        blocks = np.searchsorted(self.order.starts, ids, side="right") - 1
        parts: dict[int, dict[str, np.ndarray]] = {}
        for b in dict.fromkeys(blocks.tolist()):  # in the share's order: each block once
            rows = ids[blocks == b] - self.order.starts[b]
            parts[b] = {k: v[rows] for k, v in self._block(b).items()}
        if self._collate is not None:  # one dict a row, in the share's order, any column's values as stored
            rows_of = [dict(zip(part, values)) for part in parts.values() for values in zip(*part.values())]
            return Fetched(collated(self._collate, rows_of), ids)
        return Fetched(self._columns(parts), ids)

    def _columns(self, parts: dict[int, dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
        """The share's columns as tensors; a column a block lacks, or that cannot be a tensor (strings,
        ragged rows), is a `BadSample` naming the block's rows."""
        first = next(iter(parts))
        batch = {}
        for name in parts[first]:
            for b, part in parts.items():
                if name not in part:
                    raise BadSample(f"{self._rows(b)} (Ray Data block {b})",
                                    f"no column {name!r}, which block {first} has")
            try:
                batch[name] = torch.as_tensor(np.concatenate([part[name] for part in parts.values()]))
            except (TypeError, ValueError, RuntimeError) as err:
                where = " and ".join(f"{self._rows(b)} (Ray Data block {b})" for b in parts)
                raise BadSample(where, f"column {name!r} cannot be a tensor: {_reason(err)}") from err
        return batch

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

    def __init__(self, stream: Any, collate: Collate | None = None) -> None:
        self.stream, self._collate = stream, collate
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
        odd, common = odd_ones_out(items) if self._collate is None else ([], None)
        if odd:
            raise mismatch(int(recorded[odd[0]]), items[odd[0]], common, len(items) - len(odd))
        return Fetched(collated(self._collate, items), recorded)

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
    """A Hugging Face map-style `datasets.Dataset` (an `IterableDataset` is not: `is_hf_iterable`)."""
    return type(data).__module__.startswith("datasets") and hasattr(data, "with_format") and not is_hf_iterable(data)


def is_hf_iterable(data: Any) -> bool:
    if not type(data).__module__.startswith("datasets"):
        return False
    import datasets

    return isinstance(data, datasets.IterableDataset)


HF_ITERABLE_REFUSED = (
    "train_data is a Hugging Face IterableDataset, which cannot be positioned exactly (its state_dict() "
    "drops the shuffle buffer's contents and keeps a loaded state into the next epoch), so a failure or a "
    "join would lose or repeat samples; use a map-style datasets.Dataset (load_dataset without streaming, "
    "or Dataset.from_generator), token shards (orchestrator.data.shards.TokenShards) or Ray Data "
    "(ray.data.from_huggingface); docs/data.md")


def indexable(data: Any) -> bool:
    return (hasattr(data, "__getitem__") and hasattr(data, "__len__")
            and not isinstance(data, torch.utils.data.IterableDataset))


def source_for(data: Any, seed: int, on_bad_sample: str = "fail",
               ray_blocks: Callable[[Any], list[tuple[Any, int]]] | None = None, kind: Kind = SYNCHRONOUS,
               collate: Collate | None = None) -> Any:
    """The source for a workload's `train_data`; WorkloadRefused (one line) for data it cannot resume.
    `kind`: the policy's kind; those whose samples a server deals (it runs a server) take only
    data they can index (a Ray Data or a stream source has no such order); `collate`: the workload's
    `collate_fn` (None: torch's `default_collate`)."""
    skip = on_bad_sample == "skip"
    if is_hf_iterable(data):
        raise WorkloadRefused(HF_ITERABLE_REFUSED)
    if kind.runs_server and (is_ray_dataset(data) or not indexable(data)):
        raise WorkloadRefused(f"train_data is a {'Ray Data Dataset' if is_ray_dataset(data) else type(data).__name__}, "
                         f"which the {kind} policies cannot deal from (their server leases sample indices): use a "
                         f"map-style dataset, or a policy that shares a cursor (bsp, local_sgd, diloco, gossip ...)")
    if is_ray_dataset(data):
        if ray_blocks is None:
            raise WorkloadRefused("train_data is a Ray Data Dataset, which needs Ray (the worker's holder actor)")
        return BlockSource(ray_blocks(data), seed, skip, refresh=lambda: ray_blocks(data), collate=collate)
    if is_hf_dataset(data):
        return ArrowSource(data, seed, skip, collate)
    if indexable(data):
        return MapSource(data, seed, skip, collate=collate)
    if hasattr(data, "__iter__"):
        if callable(getattr(data, "state_dict", None)) and callable(getattr(data, "load_state_dict", None)):
            if skip:
                raise WorkloadRefused("workload.on_bad_sample: skip is for map-style data; a stream's samples are "
                                 "read in order (skip bad items inside the stream)")
            return StreamSource(data, collate)
        raise WorkloadRefused(f"train_data is an iterable ({type(data).__name__}) without state_dict()/load_state_dict(): "
                         f"it cannot be positioned after a failure, so samples would be lost or repeated; make it "
                         f"map-style or give it those two methods (docs/data.md)")
    raise WorkloadRefused(f"train_data must be a map-style dataset, a Hugging Face or Ray Data dataset, or a positioned "
                     f"iterable; got {type(data).__name__}")
