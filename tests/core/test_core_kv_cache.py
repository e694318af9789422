"""KV cache: chunked appends are exact across the window boundary and ring wrap, per-row offsets, rows."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from cspan.core.kv_cache import KVCache, attention_mask, slot_positions

H, DH = 2, 8


def _attend(cache: KVCache, q, k, v, window: int, rows=None) -> torch.Tensor:
    """One single-layer attention append through the cache: q/k/v [B', H, T, DH] -> [B', H, T, DH]."""
    step = cache.begin(q.shape[2], rows)
    keys, values = cache.update(0, k, v, step)
    mask = attention_mask(step.positions, step.key_positions, window)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    cache.advance(step)
    return out


def _reference(q_all, k_all, v_all, window: int) -> torch.Tensor:
    """Brute force over the whole history: position p attends to positions max(0, p - window + 1) .. p."""
    n = q_all.shape[2]
    pos = torch.arange(n)
    delta = pos[:, None] - pos[None, :]
    mask = (delta >= 0) & (delta < window)
    return F.scaled_dot_product_attention(q_all, k_all, v_all, attn_mask=mask)


def _qkv(batch: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, H, n, DH, generator=g) for _ in range(3)]


def test_slot_positions_follow_the_ring() -> None:
    end = torch.tensor([0, 1, 3, 5, 7, 12])
    got = slot_positions(end, 5)
    expected = torch.tensor(
        [
            [-1, -1, -1, -1, -1],
            [0, -1, -1, -1, -1],
            [0, 1, 2, -1, -1],
            [0, 1, 2, 3, 4],
            [5, 6, 2, 3, 4],
            [10, 11, 7, 8, 9],
        ]
    )
    assert torch.equal(got, expected)


def test_attention_mask_window_and_validity() -> None:
    pos_q = torch.tensor([[6, 7]])
    pos_k = torch.tensor([[5, 6, -1, 3, 4, 7]])
    mask = attention_mask(pos_q, pos_k, window=4)
    assert mask.shape == (1, 1, 2, 6)
    assert mask[0, 0].tolist() == [
        [True, True, False, True, True, False],
        [True, True, False, False, True, True],
    ]
    unbounded = attention_mask(pos_q, pos_k, window=None)
    assert unbounded[0, 0, 0].tolist() == [True, True, False, True, True, False]


@pytest.mark.parametrize("context", [4, 5])
def test_chunk_equals_single_steps_across_window_and_wrap(context: int) -> None:
    """A chunk of T = 1 .. C + 3 positions appended in one call, from every start offset in 0 .. 2C, gives the
    attention outputs of T single steps and of the brute-force windowed attention (capacity == context: the case
    where a write-first ring evicts keys the chunk's own queries still need)."""
    capacity = context
    worst = 0.0
    for start in range(0, 2 * capacity + 1):
        for chunk in range(1, capacity + 4):
            n = start + chunk + 2
            q, k, v = _qkv(1, n, seed=100 * start + chunk)
            ref = _reference(q, k, v, context)

            stepped = KVCache(1, 1, H, DH, capacity)
            step_out = torch.cat(
                [
                    _attend(stepped, q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], context)
                    for i in range(n)
                ],
                dim=2,
            )

            chunked = KVCache(1, 1, H, DH, capacity)
            outs = [
                _attend(chunked, q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], context)
                for i in range(start)
            ]
            sl = slice(start, start + chunk)
            outs.append(_attend(chunked, q[:, :, sl], k[:, :, sl], v[:, :, sl], context))
            # two more single steps read what the chunk left in the ring
            for i in range(start + chunk, n):
                outs.append(_attend(chunked, q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], context))
            chunk_out = torch.cat(outs, dim=2)

            assert torch.equal(chunked.offset, torch.tensor([n]))
            worst = max(worst, (chunk_out - step_out).abs().max().item(), (step_out - ref).abs().max().item())
            assert torch.allclose(chunked.keys, stepped.keys, atol=0, rtol=0)
            assert torch.allclose(chunked.values, stepped.values, atol=0, rtol=0)
    assert worst <= 1e-6


def test_capacity_larger_than_window_and_unbounded_window() -> None:
    context, capacity, n = 3, 7, 20
    q, k, v = _qkv(1, n, seed=7)
    cache = KVCache(1, 1, H, DH, capacity)
    out = torch.cat(
        [_attend(cache, q[:, :, s : s + 4], k[:, :, s : s + 4], v[:, :, s : s + 4], context) for s in range(0, n, 4)],
        dim=2,
    )
    assert torch.allclose(out, _reference(q, k, v, context), atol=1e-6, rtol=0)

    # window None behaves as a window of `capacity`, in chunks as in single steps
    cache_a, cache_b = KVCache(1, 1, H, DH, capacity), KVCache(1, 1, H, DH, capacity)
    a = torch.cat(
        [_attend(cache_a, q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], capacity) for i in range(n)],
        dim=2,
    )
    b = torch.cat(
        [
            _attend(cache_b, q[:, :, s : s + 5], k[:, :, s : s + 5], v[:, :, s : s + 5], capacity)
            for s in range(0, n, 5)
        ],
        dim=2,
    )
    assert torch.allclose(a, b, atol=1e-6, rtol=0)
    assert torch.allclose(a, _reference(q, k, v, capacity), atol=1e-6, rtol=0)


def test_rows_at_different_offsets() -> None:
    """Rows advance independently; a `rows` subset leaves the other rows' cache and offset untouched; a reset row
    sees none of its old keys."""
    context, n = 4, 14
    q, k, v = _qkv(3, n, seed=11)
    refs = [_reference(q[b : b + 1], k[b : b + 1], v[b : b + 1], context) for b in range(3)]
    cache = KVCache(1, 3, H, DH, context)
    done = [0, 0, 0]

    def advance(rows: list[int], t: int) -> None:
        idx = torch.tensor(rows)
        s = done[rows[0]]
        assert all(done[r] == s for r in rows)
        sl = slice(s, s + t)
        out = _attend(cache, q[idx][:, :, sl], k[idx][:, :, sl], v[idx][:, :, sl], context, rows=idx)
        for j, r in enumerate(rows):
            assert torch.allclose(out[j : j + 1], refs[r][:, :, sl], atol=1e-6, rtol=0)
            done[r] += t

    advance([0], 3)
    advance([1], 6)
    keys_row2 = cache.keys[:, 2].clone()
    advance([0], 3)  # rows 0 and 1 are now both at offset 6
    advance([1, 0], 5)  # crosses the window and wraps the ring for both
    assert torch.equal(cache.keys[:, 2], keys_row2)
    assert cache.offset.tolist() == [11, 11, 0]
    advance([2], 7)
    assert cache.offset.tolist() == [11, 11, 7]

    cache.reset(torch.tensor([1]))
    assert cache.offset.tolist() == [11, 0, 7]
    assert (cache.begin(1, torch.tensor([1])).key_positions[:, 1:] == -1).all()  # only the new slot is visible
    q1, k1, v1 = _qkv(1, 1, seed=12)
    out = _attend(cache, q1, k1, v1, context, rows=torch.tensor([1]))  # a reset row attends to its new key only
    torch.testing.assert_close(out, v1)
    cache.reset()
    assert cache.offset.tolist() == [0, 0, 0]


def test_fp8_rings_take_their_own_decode_configs() -> None:
    """The decode kernel's config per step size: FP8 rings use the FP8 table (C27's sweep from 64 rows on, C8's
    per-slot entries below), 16-bit rings the bf16 one (the tensor-core form at 1-7 and 32 rows, C101 / C106); the last
    entry at or below the row count applies."""
    from cspan.core.modules import fused

    assert fused.decode_config(96, fp8=True) == (32, 64, 8, 4, 3, 1)
    assert fused.decode_config(127, fp8=True) == (32, 64, 8, 4, 3, 1)
    assert fused.decode_config(200, fp8=True) == fused.decode_config(128, fp8=True) == (32, 16, 2, 4, 4, 1)
    assert fused.decode_config(96) == fused.decode_config(80) != fused.decode_config(96, fp8=True)
    assert fused.decode_config(1) == fused.decode_config(3) == (32, 8, 8, 2, 3, 2)
    assert fused.decode_config(32) == (64, 16, 2, 4, 2, 2) != fused.decode_config(32, fp8=True) == (32, 16, 2, 4, 3, 1)
    assert fused.decode_config(33) == fused.decode_config(63) == (32, 16, 2, 4, 3, 1)  # form 2 timed at 32 only
    assert all(config[-1] < 2 for _, config in fused.DECODE_CONFIGS_FP8)  # form 2 reads 16-bit rings only
