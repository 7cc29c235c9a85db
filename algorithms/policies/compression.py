"""Codecs: pure compress/decompress pairs for tensors on the wire, and error feedback.

A codec turns a float tensor into one flat uint8 payload, so that a payload (plus anything appended
to it, such as the vote tail) travels in a single collective, and back. Codecs hold no state: the
caller owns every buffer and may pass `out=` to reuse it, so a step allocates no large tensors.
Every payload's length is a multiple of 4 bytes, so a float32 header or tail placed right after it
stays aligned for a zero-copy `view(torch.float32)`.

Payload layouts (numel = d elements; pad = zero bytes up to a multiple of 4):
- `fp16`, `bf16`: d 2-byte floats, pad. Round-to-nearest-even cast; relative error at most 2**-11
  (fp16, inside its normal range; overflow beyond 65504 becomes inf) or 2**-8 (bf16).
- `uint8` (BAGUA's MinMaxUInt8, applied per call, i.e. per chunk): float32 min, float32 max, d
  levels q in 0..255, pad. step = (max - min) / 255; q = round((x - min) / step) (torch.round:
  deterministic round half to even); x' = min + q * step. Error per element at most step / 2 =
  (max - min) / 510, plus float32 rounding (`uint8_bound`). max == min decodes exactly to min.
- `onebit` (scaled sign): float32 scale = mean |x|, ceil(d / 8) bytes of sign bits (most significant
  bit first, 1 for x >= 0), pad. x' = scale * sign(x), so ||x - x'||^2 = ||x||^2 - ||x||_1^2 / d
  (at most (1 - 1/d) ||x||^2): a contraction, which is what error feedback needs to stay bounded.

Non-finite inputs give non-finite outputs (the step's loss vote is where a run notices them).
`ErrorFeedback` keeps a residual (what compression lost) to add to the next input; a new residual
is staged during a step and kept only when the step commits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_ALIGN = 4
_BITS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
_SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _buffer(out: torch.Tensor | None, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    if out is None:
        return torch.empty(numel, dtype=dtype, device=device)
    if out.numel() != numel or out.dtype != dtype:
        raise ValueError(f"out has {out.numel()} x {out.dtype}, needs {numel} x {dtype}")
    return out


class Codec:
    """A pure compress/decompress pair; `payload_bytes(d)` is the exact size of `compress` of d elements."""

    name: str
    needs_feedback: bool = False
    """Biased codecs (1-bit) drift without error feedback: callers must enable it."""

    def payload_bytes(self, numel: int) -> int:
        raise NotImplementedError

    def compress(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x (any float dtype, any shape) -> flat uint8 payload of `payload_bytes(x.numel())` bytes."""
        raise NotImplementedError

    def decompress(self, payload: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """payload -> flat float32 tensor of `numel` elements (written into `out` when given)."""
        raise NotImplementedError


@dataclass(frozen=True)
class CastCodec(Codec):
    """fp16 / bf16: the payload is the cast tensor's bytes."""

    name: str
    dtype: torch.dtype

    def payload_bytes(self, numel: int) -> int:
        return _aligned(2 * numel)

    def compress(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        payload = _buffer(out, self.payload_bytes(x.numel()), torch.uint8, x.device)
        payload[2 * x.numel():].zero_()
        payload[:2 * x.numel()].view(self.dtype).copy_(x.reshape(-1))
        return payload

    def decompress(self, payload: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        result = _buffer(out, numel, torch.float32, payload.device)
        return result.copy_(payload[:2 * numel].view(self.dtype))


@dataclass(frozen=True)
class MinMaxUInt8(Codec):
    """Per call: min and max in a float32 header, 256 evenly spaced levels between them."""

    name: str = "uint8"
    header: int = 8

    def payload_bytes(self, numel: int) -> int:
        return _aligned(self.header + numel)

    def compress(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        d = x.numel()
        payload = _buffer(out, self.payload_bytes(d), torch.uint8, x.device)
        payload[self.header + d:].zero_()
        head = payload[:self.header].view(torch.float32)
        if d == 0:
            head.zero_()
            return payload
        flat = x.reshape(-1).float()
        head[0], head[1] = torch.aminmax(flat)
        lo, step = head[0], (head[1] - head[0]) / 255
        levels = (flat - lo).div_(torch.where(step > 0, step, 1.0)).round_().clamp_(0, 255)
        payload[self.header:self.header + d].copy_(levels)
        return payload

    def decompress(self, payload: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        result = _buffer(out, numel, torch.float32, payload.device)
        head = payload[:self.header].view(torch.float32)
        step = (head[1] - head[0]) / 255
        return result.copy_(payload[self.header:self.header + numel]).mul_(step).add_(head[0])


def uint8_bound(x: torch.Tensor) -> float:
    """The stated per-element bound of `uint8` on x: (max - min) / 510 plus float32 rounding."""
    if x.numel() == 0:
        return 0.0
    lo, hi = float(x.min()), float(x.max())
    return (hi - lo) / 510 + 8 * torch.finfo(torch.float32).eps * max(abs(lo), abs(hi))


@dataclass(frozen=True)
class OneBit(Codec):
    """Per call: the mean magnitude in a float32 header, then one sign bit per element."""

    name: str = "onebit"
    needs_feedback: bool = True
    header: int = 4

    def payload_bytes(self, numel: int) -> int:
        return _aligned(self.header + -(-numel // 8))

    def compress(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        d = x.numel()
        nbytes = -(-d // 8)
        payload = _buffer(out, self.payload_bytes(d), torch.uint8, x.device)
        payload[self.header + nbytes:].zero_()
        flat = x.reshape(-1)
        head = payload[:self.header].view(torch.float32)
        head[0] = flat.float().abs().mean() if d else 0.0
        bits = torch.zeros(nbytes * 8, dtype=torch.uint8, device=x.device)
        torch.ge(flat, 0, out=bits[:d].view(torch.bool))
        packed = bits.view(nbytes, 8).mul_(_BITS.to(x.device))
        torch.sum(packed, dim=1, dtype=torch.uint8, out=payload[self.header:self.header + nbytes])
        return payload

    def decompress(self, payload: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        result = _buffer(out, numel, torch.float32, payload.device)
        packed = payload[self.header:self.header + -(-numel // 8)]
        bits = packed.unsqueeze(1).bitwise_right_shift(_SHIFTS.to(payload.device)).bitwise_and_(1).view(-1)[:numel]
        scale = payload[:self.header].view(torch.float32)[0]
        return result.copy_(bits).mul_(2).sub_(1).mul_(scale)


CODECS: dict[str, Codec] = {codec.name: codec for codec in (
    CastCodec("fp16", torch.float16), CastCodec("bf16", torch.bfloat16), MinMaxUInt8(), OneBit())}


def get_codec(name: str) -> Codec:
    """The codec registered as `name`; a ValueError listing the valid names otherwise."""
    if name not in CODECS:
        raise ValueError(f"compression.codec: unknown codec {name!r}; valid: {', '.join(sorted(CODECS))}")
    return CODECS[name]


class ErrorFeedback:
    """A residual carried between steps: staged during a step, kept on commit, dropped on discard.

    Two float32 buffers swap roles on commit, so a step allocates nothing once they exist.
    """

    def __init__(self) -> None:
        self._kept: torch.Tensor | None = None
        self._staged: torch.Tensor | None = None
        self._has_staged = False

    @property
    def residual(self) -> torch.Tensor | None:
        """The committed residual (None before the first commit or after a reset)."""
        return self._kept

    def compensate(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x + the committed residual, written into `out` when given (x itself may be `out`)."""
        if self._kept is None:
            return x.clone() if out is None else out.copy_(x)
        return torch.add(x, self._kept.view_as(x), out=out)

    def buffer(self, numel: int, device: torch.device | None = None) -> torch.Tensor:
        """The float32 staging buffer: compute a new residual in it and `stage()` it without a copy."""
        if self._staged is None or self._staged.numel() != numel:
            self._staged = torch.empty(numel, dtype=torch.float32, device=device)
        return self._staged

    def stage(self, new_residual: torch.Tensor) -> None:
        """What this step's compression lost; it replaces the residual only on `commit()`."""
        staged = self.buffer(new_residual.numel(), new_residual.device)
        if staged.data_ptr() != new_residual.data_ptr():
            staged.copy_(new_residual.reshape(-1))
        self._has_staged = True

    def commit(self) -> None:
        if self._has_staged:
            self._kept, self._staged = self._staged, self._kept
            self._has_staged = False

    def discard(self) -> None:
        self._has_staged = False

    def reset(self) -> None:
        self._kept = self._staged = None
        self._has_staged = False
