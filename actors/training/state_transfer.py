"""A committed training state sent from one member to the others of a group, tensor by tensor, in chunks of
bounded size: no member builds a buffer of the whole state.

The state (a nested dict of tensors and plain values: the model's and the optimizer's state dicts, the
policy's state, the data position, ...) is split into its tensors and a skeleton that names each tensor's
place, shape and dtype (`split_tensors`). The source broadcasts the skeleton (small: torch.save of plain
values), then the tensors' bytes as one stream cut into chunks of at most `CHUNK_BYTES`, each packed into one
reused chunk buffer and broadcast. A receiver allocates each tensor once (the state itself, on the CPU) and
copies every chunk's slices into them; a member that only takes part (its own state is kept) receives into the
chunk buffer and drops it. What any member allocates for a transfer beyond the state it receives is one
chunk buffer. A failure in the middle (a peer's death) raises the group's CommError; nothing was loaded, as
the receiver loads only a complete state.
"""
from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from typing import Any

import torch

CHUNK_BYTES = 256 * 2 ** 20
"""The largest chunk of a transfer (DDP syncs module states in buckets of 250 MB)."""

_SLOT = "__tensor__"


def map_state_tensors(state: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`state` rebuilt with `fn(t)` in place of each tensor t (dicts, their subclasses and attributes such as
    a state dict's `_metadata`, lists and tuples kept; other values as they are)."""
    return _rebuilt(state, lambda value: fn(value) if isinstance(value, torch.Tensor) else _INSIDE)


def split_tensors(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """`state` with every tensor replaced by a slot naming its index (as `map_state_tensors` rebuilds it),
    and the tensors in that order."""
    tensors: list[torch.Tensor] = []

    def slot(value: torch.Tensor) -> dict:
        tensors.append(value.detach())
        return {_SLOT: len(tensors) - 1}
    return map_state_tensors(state, slot), tensors


def join_tensors(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The state `split_tensors` split: each slot replaced by its tensor."""
    return _rebuilt(skeleton, lambda value: tensors[value[_SLOT]] if isinstance(value, dict) and set(value) == {_SLOT}
                    else _INSIDE)


_INSIDE = object()
"""What a `_rebuilt` replacement returns for a value it leaves to the walk (a container's items are walked)."""


def _rebuilt(value: Any, replace: Callable[[Any], Any]) -> Any:
    """`value` rebuilt with `replace(v)` in place of each value for which it returns other than `_INSIDE`, the
    items of dicts (of their own type, with their attributes), lists and tuples walked."""
    replaced = replace(value)
    if replaced is not _INSIDE:
        return replaced
    if isinstance(value, dict):
        out = _like(value)
        for key, item in value.items():
            out[key] = _rebuilt(item, replace)
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuilt(item, replace) for item in value)
    return value


def _like(mapping: dict) -> dict:
    """An empty mapping of `mapping`'s type, with its attributes (a state dict's `_metadata`)."""
    out = type(mapping)()
    attributes = getattr(mapping, "__dict__", None)
    if attributes:
        out.__dict__.update(attributes)
    return out


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, as a flat uint8 view (a copy only where the tensor is not contiguous)."""
    return tensor.reshape(-1).contiguous().view(torch.uint8)


def _spans(sizes: list[int], chunk: int) -> Iterator[tuple[int, list[tuple[int, int, int, int]]]]:
    """The stream of the tensors' bytes (sizes in order) cut into chunks of at most `chunk` bytes: for each,
    its length and the pieces it holds (tensor index, offset in the tensor, offset in the chunk, length)."""
    pieces: list[tuple[int, int, int, int]] = []
    filled = 0
    for index, size in enumerate(sizes):
        done = 0
        while done < size:
            take = min(size - done, chunk - filled)
            pieces.append((index, done, filled, take))
            done += take
            filled += take
            if filled == chunk:
                yield filled, pieces
                pieces, filled = [], 0
    if filled:
        yield filled, pieces


def broadcast_state(comm: Any, src: int, state: dict | None, keep: bool, chunk_bytes: int = CHUNK_BYTES) -> dict | None:
    """`src`'s `state` to every member of `comm` (a collective every member calls; `state` is read on `src`
    only). Returns the state received, on the CPU, or None on `src` and where `keep` (this member takes part
    but keeps its own)."""
    device = comm.device
    size = torch.zeros(1, dtype=torch.int64, device=device)
    header: torch.Tensor | None = None
    tensors: list[torch.Tensor] = []
    if comm.rank == src:
        assert state is not None
        skeleton, tensors = split_tensors(state)
        metas = [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors]
        buf = io.BytesIO()
        torch.save({"skeleton": skeleton, "metas": metas}, buf)
        header = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(device)
        size[0] = header.numel()
    comm.broadcast(size, src).wait()
    if header is None:
        header = torch.empty(int(size[0]), dtype=torch.uint8, device=device)
    comm.broadcast(header, src).wait()
    described = torch.load(io.BytesIO(header.cpu().numpy().tobytes()), weights_only=True)
    metas = described["metas"]
    receiving = comm.rank != src and not keep
    if receiving:  # the state itself, allocated once, on the CPU
        tensors = [torch.empty(shape, dtype=getattr(torch, dtype)) for shape, dtype in metas]
    sizes = [int(torch.Size(shape).numel()) * getattr(torch, dtype).itemsize for shape, dtype in metas]
    chunk = torch.empty(min(chunk_bytes, max(sum(sizes), 1)), dtype=torch.uint8, device=device)
    flat = [flat_bytes(t) for t in tensors] if comm.rank == src or receiving else []
    for length, pieces in _spans(sizes, chunk.numel()):
        if comm.rank == src:
            for index, at, into, n in pieces:
                chunk[into:into + n].copy_(flat[index][at:at + n])
        comm.broadcast(chunk[:length], src).wait()
        if receiving:
            for index, at, into, n in pieces:
                flat[index][at:at + n].copy_(chunk[into:into + n])
    if not receiving:
        return None
    return join_tensors(described["skeleton"], tensors)
