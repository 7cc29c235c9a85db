"""The state digest members compare at every membership epoch (actors/training/training_state.py
`checksum`) is computed where the tensors are, so a GPU member sends the host 8 bytes, not its model.
These check it against its definition, written here independently in Python integers:

    digest = sum over chunks k of m_k * sum over words i of w_i * x_ki   (mod 2**64, as int64)

with x the tensors' bytes as little-endian int32 words, 2**16 words a chunk (a tensor starts a new
chunk), w_i = i * P | 1 and m_k = (2k + 1) * M (P, M odd constants); that it does not depend on how
many chunks one pass takes (the CPU's few, a GPU's many); and that it tells states apart the way the
epoch entry needs: any one byte changed, two tensors swapped, a word moved."""
from __future__ import annotations

import struct

import pytest
import torch

from actors.training import training_state
from actors.training.training_state import DIGEST_CHUNK_WORDS, checksum

P = 0x9E3779B97F4A7C15
M = 0x5851F42D4C957F2D
MOD = 1 << 64


def reference(tensors: list[torch.Tensor]) -> int:
    total, k, chunk = 0, 0, training_state.DIGEST_CHUNK_WORDS
    for t in tensors:
        raw = t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        raw += b"\0" * (-len(raw) % 4)
        words = struct.unpack(f"<{len(raw) // 4}i", raw)
        for start in range(0, len(words), chunk):
            inner = sum(x * ((i * P % MOD) | 1) for i, x in enumerate(words[start:start + chunk]))
            total += (2 * k + 1) * M * inner
            k += 1
    total %= MOD
    return total - MOD if total >= 1 << 63 else total  # as a signed int64


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 16 words, so a small tensor spans several (the weights are made per chunk size)."""
    monkeypatch.setattr(training_state, "DIGEST_CHUNK_WORDS", 16)
    monkeypatch.setattr(training_state, "_weights", {})


def tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(37, generator=g), torch.randn(3, 5, generator=g).to(torch.bfloat16),
            torch.randint(-2**31, 2**31 - 1, (9,), generator=g, dtype=torch.int64), torch.tensor([True, False, True])]


def test_the_digest_is_its_definition_over_several_chunks_and_dtypes(small_chunks):
    ts = tensors()
    assert checksum(ts) == reference(ts)
    assert checksum([]) == 0


def test_the_digest_is_its_definition_at_the_real_chunk_size():
    t = torch.randn(2 * DIGEST_CHUNK_WORDS + 5)  # two full chunks and a short one
    assert checksum([t]) == reference([t])


def test_the_digest_does_not_depend_on_how_many_chunks_a_pass_takes(small_chunks, monkeypatch):
    ts = tensors() + [torch.randn(1000)]  # 63 chunks of 16 words and a short one
    expected = reference(ts)
    for slab in (1, 2, 7, 1000):
        monkeypatch.setitem(training_state.DIGEST_SLAB_CHUNKS, "cpu", slab)
        assert checksum(ts) == expected, slab


def test_changing_any_one_byte_changes_the_digest(small_chunks):
    ts = tensors()
    before = checksum(ts)
    for which, t in enumerate(ts):
        for pos in range(t.reshape(-1).view(torch.uint8).numel()):
            changed = [u.clone() for u in ts]
            changed[which].reshape(-1).view(torch.uint8)[pos] ^= 1 << (pos % 8)
            assert checksum(changed) != before, (which, pos)


def test_swapped_tensors_and_moved_words_change_the_digest(small_chunks):
    a, b = torch.arange(40, dtype=torch.float32), torch.arange(40, dtype=torch.float32) + 100
    assert checksum([a, b]) != checksum([b, a])
    moved = a.clone()
    moved[[3, 30]] = moved[[30, 3]]  # the same words, two of them in each other's place (other chunks)
    assert checksum([moved]) != checksum([a])
    near = a.clone()
    near[[3, 4]] = near[[4, 3]]  # within one chunk
    assert checksum([near]) != checksum([a])


def test_a_view_at_an_odd_offset_is_read_as_its_own_bytes():
    base = torch.arange(11, dtype=torch.bfloat16)
    view = base[1:]  # storage offset of 2 bytes: not a multiple of 4
    assert checksum([view]) == checksum([view.clone()]) == reference([view.clone()])
