"""Codecs round-trip within their stated bounds; 1-bit with error feedback tracks its inputs."""
from __future__ import annotations

import math

import pytest
import torch

from algorithms.policies.compression import CODECS, ErrorFeedback, get_codec, uint8_bound

SIZES = (0, 1, 2, 7, 31, 1001)
RELATIVE = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
"""Round-to-nearest into 11 (fp16) and 8 (bf16) significant bits."""
SUBNORMAL = {"fp16": 2.0 ** -25, "bf16": 0.0}
"""Half the spacing of fp16's subnormals (bf16 shares float32's range)."""


def _inputs(size: int, constant: bool, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if constant:
        return torch.full((size,), -3.3)
    return torch.randn(size, generator=gen) * 10 + 2


def _round_trip(name: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    codec = get_codec(name)
    payload = codec.compress(x)
    return payload, codec.decompress(payload, x.numel())


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("size", SIZES)
def test_payload_is_flat_uint8_of_the_stated_aligned_size(name, size):
    payload, decoded = _round_trip(name, _inputs(size, False, size))
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    assert payload.numel() == CODECS[name].payload_bytes(size) and payload.numel() % 4 == 0
    assert decoded.dtype == torch.float32 and decoded.shape == (size,)


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("constant", [False, True])
def test_casts_within_their_relative_rounding(name, size, constant):
    x = _inputs(size, constant, size)
    _, decoded = _round_trip(name, x)
    assert torch.all((decoded - x).abs() <= RELATIVE[name] * x.abs() + SUBNORMAL[name])


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e4])
def test_uint8_within_half_a_level(size, scale):
    x = _inputs(size, False, size) * scale
    _, decoded = _round_trip("uint8", x)
    assert torch.all((decoded - x).abs() <= uint8_bound(x))
    if size:
        assert decoded.min() >= x.min() - uint8_bound(x) and decoded.max() <= x.max() + uint8_bound(x)


@pytest.mark.parametrize("size", SIZES)
def test_uint8_constant_tensor_is_exact(size):
    x = _inputs(size, True, 0)
    assert torch.equal(_round_trip("uint8", x)[1], x)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("constant", [False, True])
def test_onebit_keeps_signs_and_the_mean_magnitude(size, constant):
    x = _inputs(size, constant, size)
    x[::5] = 0.0  # zeros decode as +scale
    _, decoded = _round_trip("onebit", x)
    scale = x.abs().mean() if size else torch.tensor(0.0)
    assert torch.equal(decoded >= 0, x >= 0)
    assert torch.allclose(decoded.abs(), scale.expand(size), rtol=1e-6)
    # The scaled sign is a contraction: ||x - C(x)||^2 = ||x||^2 - ||x||_1^2 / d.
    if size:
        lost = (x.double() - decoded.double()).square().sum()
        expected = x.double().square().sum() - x.double().abs().sum() ** 2 / size
        assert math.isclose(lost, expected, rel_tol=1e-5, abs_tol=1e-4)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_out_buffers_are_reused(name):
    codec = CODECS[name]
    x = torch.randn(33)
    payload = torch.empty(codec.payload_bytes(33), dtype=torch.uint8)
    decoded = torch.empty(33)
    assert codec.compress(x, out=payload).data_ptr() == payload.data_ptr()
    assert codec.decompress(payload, 33, out=decoded).data_ptr() == decoded.data_ptr()
    assert torch.equal(decoded, codec.decompress(codec.compress(x), 33))
    with pytest.raises(ValueError, match="needs"):
        codec.compress(x, out=torch.empty(payload.numel() + 4, dtype=torch.uint8))


def test_unknown_codec_lists_the_valid_names():
    with pytest.raises(ValueError, match="compression.codec.*'int4'.*bf16, fp16, onebit, uint8"):
        get_codec("int4")


def test_error_feedback_keeps_a_residual_only_on_commit():
    feedback = ErrorFeedback()
    x = torch.ones(4)
    assert torch.equal(feedback.compensate(x), x)
    feedback.stage(torch.full((4,), 0.5))
    assert torch.equal(feedback.compensate(x), x)  # staged, not kept
    feedback.commit()
    assert torch.equal(feedback.compensate(x), torch.full((4,), 1.5))
    feedback.stage(torch.full((4,), 9.0))
    feedback.discard()
    feedback.commit()  # nothing staged any more: the residual stays
    assert torch.equal(feedback.compensate(x), torch.full((4,), 1.5))
    staged = feedback.buffer(4)
    staged.fill_(-1.0)
    feedback.stage(staged)
    feedback.commit()
    assert torch.equal(feedback.residual, torch.full((4,), -1.0))
    feedback.reset()
    assert feedback.residual is None and torch.equal(feedback.compensate(x), x)


def _onebit_tracking(steps: int, feedback: bool, d: int = 64) -> tuple[float, float]:
    """Send x_t = v + noise for `steps` steps; return ||sum decoded - sum x|| and max ||x_t||."""
    codec = CODECS["onebit"]
    gen = torch.Generator().manual_seed(7)
    v = torch.randn(d, generator=gen, dtype=torch.float64).float() * torch.linspace(0.1, 2.0, d)
    residual = ErrorFeedback()
    sent = torch.zeros(d, dtype=torch.float64)
    received = torch.zeros(d, dtype=torch.float64)
    largest = 0.0
    for _ in range(steps):
        x = v + 0.1 * torch.randn(d, generator=gen)
        largest = max(largest, float(x.norm()))
        corrected = residual.compensate(x) if feedback else x
        decoded = codec.decompress(codec.compress(corrected), d)
        residual.stage(corrected - decoded)
        residual.commit()
        sent += x.double()
        received += decoded.double()
    return float((received - sent).norm()), largest


def test_onebit_with_error_feedback_tracks_the_sum_of_inputs():
    # e_{t+1} = c_t - C(c_t) with c_t = x_t + e_t, so sum_t C(c_t) = sum_t x_t - e_T, and the
    # contraction gives ||e|| <= rho / (1 - rho) * max ||x_t||, rho = sqrt(1 - 1/d).
    # Measured (d = 64, ||x_t|| <= 10.2): a gap of about 114 after 500 and after 2000 steps,
    # against a bound of about 1300.
    d = 64
    rho = math.sqrt(1 - 1 / d)
    gaps = []
    for steps in (500, 2000):
        gap, largest = _onebit_tracking(steps, feedback=True, d=d)
        assert gap <= rho / (1 - rho) * largest
        gaps.append(gap)
    assert gaps[1] <= 1.2 * gaps[0]  # bounded: four times the steps, no growth


def test_onebit_without_error_feedback_drifts():
    with_feedback, largest = _onebit_tracking(2000, feedback=True)
    short, _ = _onebit_tracking(1000, feedback=False)
    long, _ = _onebit_tracking(2000, feedback=False)
    assert long > 1.8 * short  # grows linearly with the steps
    assert long > 50 * with_feedback
    assert long > math.sqrt(1 - 1 / 64) / (1 - math.sqrt(1 - 1 / 64)) * largest  # past the bound EF keeps
