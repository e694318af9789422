"""FlashInfer's paged prefill over the engine's ring KV cache, read in position order without moving it: an experiment
for docs/PERFORMANCE.md ("What remains": the span of 600 columns, B = 1 and into 1 of 64 sessions).

The engine's cache of one layer is ``[R, H, C, Dh]`` (R = batch rows + the scratch row; the slot of position ``p``
is ``p % C``). Seen through ``as_strided`` as FlashInfer's NHD paged cache with a page size of 1 -- page stride
``Dh``, head stride ``C * Dh``, so the page of (row b, slot s) is ``b * H * C + s`` -- a sequence's page list can
name the ring's slots oldest position first, which a wrapped ring does not store in order. A block of L new
tokens (a Context Span, with the next position) attends to the ring and to its own keys; those must not be in the
ring yet (a block that wraps evicts keys its own earlier queries need: ``cspan.core.kv_cache``'s docstring), so
they are staged in spare slots of the scratch row (slot 0 is the padding decode's) and listed after the ring's.
With ``causal=True`` (FlashInfer aligns query i with key ``kv_len - qo_len + i``) and ``window_left = window - 1``
the mask is exactly the engine's ``0 <= pos_q - pos_k < window``: only the ``window - 1`` newest ring positions
are listed. FlashInfer takes custom strides of the paged cache since 0.2 (flashinfer-ai/flashinfer#513).

Not checked here (the engine's next step would): pinned persona sinks (``cspan.core.window.PinnedSinks`` keeps
their keys in ring slots whose positions stay in the window, so the position order should cover them); FP8 rings
(FlashInfer's FP8 KV has one scale per tensor, the engine's one per position and head).

Usage:
  python scripts/flashinfer_prefill.py --cpu-check   # the page lists against the engine's mask (CPU, float32)
  python scripts/flashinfer_prefill.py               # on the device: FlashInfer against fused.prefill_attention
"""

from __future__ import annotations

import argparse
import math
import sys

import torch


def ring_pages(buffer: torch.Tensor) -> torch.Tensor:
    """One layer's ring buffer ``[R, H, C, Dh]`` (contiguous) as an NHD paged cache of page size 1:
    ``[pages, 1, H, Dh]``, page ``b * H * C + s`` = row b's slot s (the view shares the buffer's storage)."""
    R, H, C, Dh = buffer.shape
    assert buffer.is_contiguous()
    return buffer.as_strided((R * H * C - (H - 1) * C, 1, H, Dh), (Dh, Dh, C * Dh, 1))


def page_table(
    offsets: list[int], rows: list[int], lengths: list[int], capacity: int, window: int, heads: int, stage_row: int
) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """Host page lists of blocks of ``lengths[i]`` new tokens for cache rows ``rows[i]`` whose next position is
    ``offsets[row]``: (qo_indptr, kv_indptr, kv_indices, the stage-row slots each block's keys go to)."""
    qo, kv, indices, stage = [0], [0], [], []
    free = 1  # slot 0 of the scratch row holds the padding rows' decode
    for row, n in zip(rows, lengths, strict=True):
        pos0 = offsets[row]
        ring = min(pos0, window - 1)
        indices += [row * heads * capacity + p % capacity for p in range(pos0 - ring, pos0)]
        slots = list(range(free, free + n))
        if slots and slots[-1] >= capacity:
            raise ValueError(f"{sum(lengths)} block tokens do not fit the scratch row's {capacity - 1} free slots")
        free += n
        indices += [stage_row * heads * capacity + s for s in slots]
        stage.append(slots)
        qo.append(qo[-1] + n)
        kv.append(kv[-1] + ring + n)
    return qo, kv, indices, stage


def paged_reference(q, pages_k, pages_v, qo, kv, indices, window: int) -> torch.Tensor:
    """FlashInfer's causal paged prefill with ``window_left = window - 1``, in float32 torch: q [N, H, Dh] ->
    [N, H, Dh] (what FlashInfer computes, for checking the page lists)."""
    out = torch.empty(q.shape, dtype=torch.float32)
    idx = torch.tensor(indices, dtype=torch.long)
    for s in range(len(qo) - 1):
        qs = q[qo[s] : qo[s + 1]].float()
        ks = pages_k[idx[kv[s] : kv[s + 1]], 0].float()  # [kv_len, H, Dh]
        vs = pages_v[idx[kv[s] : kv[s + 1]], 0].float()
        n, kv_len = qs.shape[0], ks.shape[0]
        i = torch.arange(n)[:, None] + (kv_len - n)
        j = torch.arange(kv_len)[None, :]
        mask = (j <= i) & (j >= i - (window - 1))
        scores = torch.einsum("qhd,khd->hqk", qs, ks) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~mask, float("-inf"))
        out[qo[s] : qo[s + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs)
    return out


def engine_reference(q, k, v, keys, values, offsets, rows, lengths, window: int) -> torch.Tensor:
    """The engine's rule: a block's queries over its row's ring (slot positions from the offset) and its own keys,
    visible iff ``0 <= pos_q - pos_k < window``; float32."""
    from cspan.core.kv_cache import attention_mask, slot_positions

    C = keys.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32)
    start = 0
    for row, n in zip(rows, lengths, strict=True):
        pos0 = offsets[row]
        ring_pos = slot_positions(torch.tensor([pos0]), C)[0]
        pos_k = torch.cat([ring_pos, pos0 + torch.arange(n)])
        ks = torch.cat([keys[row].transpose(0, 1), k[start : start + n]]).float()  # [C + n, H, Dh]
        vs = torch.cat([values[row].transpose(0, 1), v[start : start + n]]).float()
        mask = attention_mask((pos0 + torch.arange(n))[None], pos_k[None], window)[0]
        scores = torch.einsum("qhd,khd->hqk", q[start : start + n].float(), ks) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~mask, float("-inf"))
        out[start : start + n] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs)
        start += n
    return out


def cpu_check() -> None:
    """Page lists against the engine's mask: rings filling, full and wrapped, blocks longer than the window."""
    torch.manual_seed(0)
    H, C, Dh, window = 4, 64, 16, 48
    B = 4
    offsets = [5, 64, 1000, 47]  # filling, exactly full, wrapped, filling past the window
    for rows, lengths in [([0], [7]), ([1, 2], [20, 3]), ([2, 3, 0], [5, 50, 1])]:
        R = B + 1
        keys, values = torch.randn(R, H, C, Dh), torch.randn(R, H, C, Dh)
        n = sum(lengths)
        q, k, v = (torch.randn(n, H, Dh) for _ in range(3))
        qo, kv, indices, stage = page_table(offsets, rows, lengths, C, window, H, stage_row=B)
        start = 0
        for slots in stage:  # stage the blocks' keys in the scratch row
            keys[B, :, slots] = k[start : start + len(slots)].transpose(0, 1)
            values[B, :, slots] = v[start : start + len(slots)].transpose(0, 1)
            start += len(slots)
        got = paged_reference(q, ring_pages(keys), ring_pages(values), qo, kv, indices, window)
        want = engine_reference(q, k, v, keys, values, offsets, rows, lengths, window)
        err = (got - want).abs().max().item()
        print(f"rows {rows} lengths {lengths}: max |paged - engine| {err:.2e}")
        assert err < 1e-5, err
    print("page lists: exact")


def device_run(lengths_sets: list[list[int]], layers: int = 4) -> None:
    """Per layer, FlashInfer's paged prefill through the page lists against ``fused.prefill_attention`` (full
    3000-slot bf16 rings, 32 heads of 128), the max |difference| and the times, for blocks of each length set (one
    cache row per block)."""
    for lengths in lengths_sets:
        _device_case(lengths, layers)
        torch.cuda.empty_cache()


def _device_case(lengths: list[int], layers: int) -> None:
    import flashinfer

    from cspan.core.modules import fused

    sys.path.insert(0, "scripts")
    from perf_h200 import _events_ms

    dev = torch.device("cuda")
    H, C, Dh, window = 32, 3000, 128, 3000
    B = len(lengths)
    rows, offsets = list(range(B)), [10 * C] * B
    keys = [torch.randn(B + 1, H, C, Dh, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    values = [torch.randn_like(x) for x in keys]
    n = sum(lengths)
    q, k, v = (torch.randn(n, H, Dh, device=dev, dtype=torch.bfloat16) for _ in range(3))
    qo, kv, indices, stage = page_table(offsets, rows, lengths, C, window, H, stage_row=B)
    stage_slots = torch.tensor([s for slots in stage for s in slots], device=dev)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(
        i32(qo), i32(kv), i32(indices), i32([1] * B), H, H, Dh, 1, causal=True, window_left=window - 1,
        q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
    )  # fmt: skip
    views = [(ring_pages(kk), ring_pages(vv)) for kk, vv in zip(keys, values, strict=True)]

    def run_fi():
        for kk, vv, view in zip(keys, values, views, strict=True):
            kk[B][:, stage_slots] = k.transpose(0, 1)  # the staging write (the engine would fuse it)
            vv[B][:, stage_slots] = v.transpose(0, 1)
            wrapper.run(q, view)

    t = lambda x: torch.tensor(x, dtype=torch.long, device=dev)  # noqa: E731
    bm = fused.block_m_for(max(lengths))
    qb = [(s, j) for s in range(B) for j in range(0, lengths[s], bm)]
    ragged = fused.Ragged(
        seq_row=t(rows), seq_start=t([sum(lengths[:i]) for i in range(B)]), seq_len=t(lengths),
        qb_seq=t([s for s, _ in qb]), qb_j=t([j for _, j in qb]),
        tok_row=t([r for r, m in zip(rows, lengths, strict=True) for _ in range(m)]),
        tok_j=t([j for m in lengths for j in range(m)]), tok_keep=t([1] * n).bool(), block_m=bm,
    ).at(t([*offsets, 0]))  # fmt: skip

    def run_ours():
        for kk, vv in zip(keys, values, strict=True):
            fused.prefill_attention(q, k, v, kk, vv, ragged, window)

    run_fi()
    got = wrapper.run(q, views[0]).float()
    want = fused.prefill_attention(q, k, v, keys[0], values[0], ragged, window).float().view(n, H, Dh)
    diff = (got - want).abs().max().item()
    for _ in range(2):
        run_fi()
        run_ours()
    us_fi = _events_ms(run_fi, 10) * 1000 / layers
    us_ours = _events_ms(run_ours, 10) * 1000 / layers
    flops = sum(4 * m * (window - 1 + m / 2) * H * Dh for m in lengths)
    print(
        f"blocks {lengths}: ours {us_ours:7.1f} us/layer ({flops / us_ours / 1e6:.0f} TFLOP/s), flashinfer paged "
        f"page 1 {us_fi:7.1f} ({flops / us_fi / 1e6:.0f} TFLOP/s, staging included), max |diff| {diff:.3g}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-check", action="store_true", help="check the page lists on the CPU and stop")
    args = parser.parse_args()
    if args.cpu_check:
        cpu_check()
        return
    device_run([[601], [257], [601, 41], [17]])


if __name__ == "__main__":
    main()
