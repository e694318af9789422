"""A 601-token block's attention over a full ring (a 600-column span and its step, B = 1) by library kernels, against
the engine's Triton kernel (``fused.prefill_attention``): an experiment for docs/PERFORMANCE.md ("What remains":
span n = 600 + step at B = 1, 17.05 ms against <= 15).

The engine's kernel reads the 601 queries against 3000 ring slots and the block's own keys in one masked pass at
about 275 TFLOP/s (C96: 117.8 us a layer), where Hopper's attention kernels reach 500+ TFLOP/s on unmasked tiles.
The mask splits into pieces that need no mask or a plain causal one. With old key j = position ``P - 2999 + j``
(j in [0, 2999), the ring's positions still in some query's window; P is the block's first position) query i sees

- the rectangle j in [600, 2999): every query, no mask (80 % of the FLOPs; at most two ring segments);
- the triangle j in [0, 600), j >= i: with queries and keys reversed, a causal square (a gather of 600 keys);
- the block's own keys 0..i: a causal square;

and the pieces' outputs merge by their log-sum-exp. FlashInfer takes the old keys' mask directly (``window_left``
without ``causal``) on ring segments in place (HND views) or as a paged cache of 8-slot pages.

Usage (device): ``python3 scripts/span_attention_libs.py`` (see ``span-libs`` in scripts/perf_h200.sh). Prints us
per layer (LAYERS rings per timing, graph replays) and each variant's max |difference| from a float32 reference.
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from perf_h200 import HEAD_DIM, HEADS, LAYERS, RING, _events_ms, _graph, _one_span

N = 601  # 600 span columns and the step's position
DEV = torch.device(os.environ.get("PROBE_DEVICE", "cuda"))
SCALE = 1.0 / math.sqrt(HEAD_DIM)


def slots_of(first: int, count: int) -> list[tuple[int, int, int]]:
    """Ring segments (slot start, slot end, j of the first) of ``count`` positions from position ``first``."""
    out, j, p = [], 0, first
    while j < count:
        s = p % RING
        n = min(count - j, RING - s)
        out.append((s, s + n, j))
        j, p = j + n, p + n
    return out


def reference(q, k, v, keys, values, P: int) -> torch.Tensor:
    """float32 attention of the block over ring row 0 and itself with the engine's mask: [N, H, Dh]."""
    slot_pos = torch.tensor([P - RING + ((s - P) % RING) for s in range(RING)], device=DEV)
    pos_k = torch.cat([slot_pos, P + torch.arange(N, device=DEV)])
    pos_q = P + torch.arange(N, device=DEV)
    K = torch.cat([keys[0][0].float(), k.transpose(0, 1).float()], 1)  # [H, C + N, Dh]
    V = torch.cat([values[0][0].float(), v.transpose(0, 1).float()], 1)
    d = pos_q[:, None] - pos_k[None, :]
    mask = (d >= 0) & (d < RING)
    s = torch.einsum("qhd,hkd->hqk", q.float(), K) * SCALE
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,hkd->qhd", s.softmax(-1), V)


def merge(outs, lses):
    """Merge states: outs [S] of [H, N, Dh], lses [S] of [H, N] (natural log; -inf: empty) -> [N, H, Dh] float32."""
    lse = torch.stack(lses)  # [S, H, N]
    m = lse.amax(0)
    w = torch.exp(lse - m)
    o = sum(wi[..., None] * oi.float() for wi, oi in zip(w, outs, strict=True)) / w.sum(0)[..., None]
    return o.transpose(0, 1)


def torch_pieces(op, q, k, v, keys, values, P, pieces=("rect", "tri", "block")):
    """The three pieces by an aten SDPA op (cudnn / flash) returning (out [1, H, L, Dh], lse [1, H, L])."""

    def call(qq, kk, vv, causal):
        if op == "math":  # float32 torch (the CPU check of the decomposition)
            sc = torch.einsum("bhqd,bhkd->bhqk", qq.float(), kk.float()) * SCALE
            if causal:
                sc = sc.masked_fill(torch.ones(sc.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
            return torch.einsum("bhqk,bhkd->bhqd", sc.softmax(-1), vv.float())[0], sc.logsumexp(-1).reshape(HEADS, -1)
        if op == "cudnn":
            r = torch.ops.aten._scaled_dot_product_cudnn_attention(
                qq, kk, vv, None, True, 0.0, causal, False, scale=SCALE
            )
        else:
            r = torch.ops.aten._scaled_dot_product_flash_attention(qq, kk, vv, 0.0, causal, False, scale=SCALE)
        return r[0][0], r[1].reshape(HEADS, -1)

    q4 = q.transpose(0, 1).unsqueeze(0)  # [1, H, N, Dh] (a view)
    rect = slots_of(P - RING + 1 + 600, RING - 1 - 600)
    tri_idx = torch.tensor([(P - RING + 1 + j) % RING for j in range(599, -1, -1)], device=DEV)  # reversed
    qt = q[:600].flip(0).transpose(0, 1).unsqueeze(0)
    kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (k, v))
    pad = torch.full((HEADS, 1), float("-inf"), device=DEV)
    zero = torch.zeros(HEADS, 1, HEAD_DIM, device=DEV, dtype=q.dtype)

    def layer(kk, vv):
        outs, lses = [], []
        if "rect" in pieces:
            for s0, s1, _ in rect:
                o, lse = call(q4, kk[:1, :, s0:s1], vv[:1, :, s0:s1], False)
                outs.append(o)
                lses.append(lse)
        if "tri" in pieces:
            o, lse = call(qt, kk[:1].index_select(2, tri_idx), vv[:1].index_select(2, tri_idx), True)
            outs.append(torch.cat([o.flip(1), zero], 1))
            lses.append(torch.cat([lse.flip(1), pad], 1))
        if "block" in pieces:
            o, lse = call(q4, kb, vb, True)
            outs.append(o)
            lses.append(lse)
        return merge(outs, lses)

    return layer


def flashinfer_segments(fi, backend, q, k, v, P):
    """FlashInfer single prefill: the old keys in place as ring segments (HND views, ``window_left`` masks the
    triangle), the block causal, merged by ``merge_state``."""
    old = slots_of(P - RING + 1, RING - 1)

    def layer(kk, vv):
        o = s = None
        for s0, s1, a in old:
            L = s1 - s0
            w = L - N + a if a < N else -1
            oi, si = fi.single_prefill_with_kv_cache(q, kk[0, :, s0:s1], vv[0, :, s0:s1], causal=False,
                                                     kv_layout="HND", window_left=w, backend=backend, return_lse=True)  # fmt: skip
            o, s = (oi, si) if o is None else fi.merge_state(o, s, oi, si)
        ob, sb = fi.single_prefill_with_kv_cache(q, k, v, causal=True, backend=backend, return_lse=True)
        return fi.merge_state(o, s, ob, sb)[0]

    return layer


PAGE = 8


def paged_plan_args(P: int, page: int = PAGE):
    """FlashInfer page list of the old keys of a block at position P (pages, last page length, window_left)."""
    first, last = (P - RING + 1) % RING, (P - 1) % RING
    p0, p1 = first // page, last // page
    pages = list(range(p0, RING // page)) + list(range(0, p1 + 1)) if p1 <= p0 else list(range(p0, p1 + 1))
    extra, last_len = first - p0 * page, last - p1 * page + 1
    kv_len = (len(pages) - 1) * page + last_len
    return pages, last_len, kv_len - N - extra


def ring_pages(x: torch.Tensor) -> torch.Tensor:
    """Ring row 0 of a layer's buffer [1, H, C, Dh] as FlashInfer's HND pages [C / PAGE, H, PAGE, Dh] (a view)."""
    return x[0].as_strided((RING // PAGE, HEADS, PAGE, HEAD_DIM), (PAGE * HEAD_DIM, RING * HEAD_DIM, HEAD_DIM, 1))


def plan_paged(wrapper, P: int) -> None:
    """Plan ``wrapper`` (FlashInfer's paged prefill) for the old keys of a block at position P."""
    pages, last_len, window_left = paged_plan_args(P)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    wrapper.plan(i32([0, N]), i32([0, len(pages)]), i32(pages), i32([last_len]), HEADS, HEADS, HEAD_DIM, PAGE,
                 causal=False, window_left=window_left, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)  # fmt: skip


def paged_layer(fi, backend, wrapper, q, k, v):
    """One layer: the planned paged read of the ring, the block causal by single prefill, merged."""

    def layer(kk, vv):
        o, s = wrapper.run(q, (ring_pages(kk), ring_pages(vv)), return_lse=True)
        ob, sb = fi.single_prefill_with_kv_cache(q, k, v, causal=True, backend=backend, return_lse=True)
        return fi.merge_state(o, s, ob, sb)[0]

    return layer


def flashinfer_paged(fi, backend, q, k, v, P):
    """FlashInfer's paged prefill over the ring as 8-slot pages (HND, in place), one call for all old keys, then the
    block causal by single prefill, merged."""
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "HND", backend=backend)
    plan_paged(wrapper, P)
    return paged_layer(fi, backend, wrapper, q, k, v)


def paged_graph_check(fi, backend, q, k, v, keys, values, positions):
    """Is the paged old-key read capturable with a plan made per step (vLLM's use of FlashInfer with CUDA graphs)?
    A wrapper with fixed buffers, captured at positions[0], re-planned and replayed at each position: max |diff|
    from the float32 reference there."""
    i32 = lambda n: torch.zeros(n, dtype=torch.int32, device=DEV)  # noqa: E731
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(
        ws, "HND", use_cuda_graph=True, backend=backend, qo_indptr_buf=i32(2), paged_kv_indptr_buf=i32(2),
        paged_kv_indices_buf=i32(RING // PAGE + 1), paged_kv_last_page_len_buf=i32(1),
    )  # fmt: skip
    layer = paged_layer(fi, backend, wrapper, q, k, v)
    out = {}

    def run():
        out["o"] = layer(keys[0], values[0])

    plan_paged(wrapper, positions[0])
    replay = _graph(run)
    for P in positions:
        plan_paged(wrapper, P)
        replay()
        torch.cuda.synchronize()
        err = (out["o"].float() - reference(q, k, v, keys, values, P)).abs().max().item()
        print(f"  flashinfer {backend} paged, graph captured at P % 3000 = {positions[0] % RING}, replayed at "
              f"{P % RING}: max|diff| {err:.2e}", flush=True)  # fmt: skip


def timed(name, layer, keys, values, ref, flops):
    try:
        out = layer(keys[0], values[0])
        # a rate-only row (another shape than the block's output) has no difference to report
        err = (
            (out.float().reshape(N, HEADS, HEAD_DIM) - ref).abs().max().item()
            if out.numel() == ref.numel()
            else math.nan
        )

        def run():
            for kk, vv in zip(keys, values, strict=True):
                layer(kk, vv)

        try:
            us = _events_ms(_graph(run), 10) * 1000 / len(keys)
            how = "graph"
        except Exception as exc:  # not capturable: eager (host launches may show)
            print(f"  ({name}: graph capture failed, {type(exc).__name__}: {str(exc)[:120]}; timed eagerly)")
            torch.cuda.synchronize()
            for _ in range(3):
                run()
            us = _events_ms(run, 10) * 1000 / len(keys)
            how = "eager"
        print(
            f"{name:44s} {us:8.1f} us/layer  {flops / us / 1e6:5.0f} TFLOP/s  max|diff| {err:.2e}  ({how})", flush=True
        )
    except Exception as exc:
        print(f"{name:44s} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)


@torch.no_grad()
def main() -> None:
    from cspan.core.modules import fused

    torch.manual_seed(0)
    P = 10 * RING + 1234  # a wrapped ring: the old keys lie in two segments
    keys = [torch.randn(1, HEADS, RING, HEAD_DIM, device=DEV, dtype=torch.bfloat16) for _ in range(LAYERS)]
    values = [torch.randn_like(x) for x in keys]
    q, k, v = (torch.randn(N, HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    ref = reference(q, k, v, keys, values, P)
    flops = 4 * N * RING * HEADS * HEAD_DIM  # every query sees 3000 keys
    print(f"block of {N} over a full ring of {RING} ({HEADS} x {HEAD_DIM}, bf16), {flops / 1e9:.1f} GFLOP a layer")

    offset = torch.full((1,), P, dtype=torch.long, device=DEV)
    ragged = _one_span(N, fused.block_m_for(N), offset)
    timed("ours (fused.prefill_attention)", lambda kk, vv: fused.prefill_attention(q, k, v, kk, vv, ragged, RING),
          keys, values, ref, flops)  # fmt: skip
    for op in ("cudnn", "flash"):
        timed(f"torch {op}: rect + tri + block, torch merge", torch_pieces(op, q, k, v, keys, values, P),
              keys, values, ref, flops)  # fmt: skip
        for piece in ("rect", "tri", "block"):
            part = torch_pieces(op, q, k, v, keys, values, P, pieces=(piece,))
            timed(
                f"  torch {op}: {piece} alone (+ merge)",
                part,
                keys,
                values,
                torch.zeros_like(ref) + float("nan"),
                flops,
            )
    # the rectangle's rate with more programs: the 2400 keys as c chunks in the batch dimension (q broadcast)
    for c in (1, 2, 4, 8):
        L = 2400 // c

        def rect_chunks(kk, vv, c=c, L=L):
            kc = kk[0].as_strided((c, HEADS, L, HEAD_DIM), (L * HEAD_DIM, RING * HEAD_DIM, HEAD_DIM, 1))
            vc = vv[0].as_strided((c, HEADS, L, HEAD_DIM), (L * HEAD_DIM, RING * HEAD_DIM, HEAD_DIM, 1))
            qc = q.transpose(0, 1).unsqueeze(0).expand(c, -1, -1, -1)
            return torch.ops.aten._scaled_dot_product_cudnn_attention(
                qc, kc, vc, None, True, 0.0, False, False, scale=SCALE
            )[0]

        r = 4 * N * 2400 * HEADS * HEAD_DIM
        timed(f"  cudnn rect 601 x 2400 as {c} chunk(s)", rect_chunks, keys, values, ref, r)
    if os.environ.get("PROBE_FLASHINFER") == "0":
        return
    try:
        import flashinfer as fi

        print(f"flashinfer {fi.__version__}")
        for backend in ("fa2", "fa3"):
            timed(f"flashinfer {backend}: ring segments + block, merge_state", flashinfer_segments(fi, backend, q, k, v, P),
                  keys, values, ref, flops)  # fmt: skip
            try:
                timed(f"flashinfer {backend}: paged ring + block, merge_state", flashinfer_paged(fi, backend, q, k, v, P),
                      keys, values, ref, flops)  # fmt: skip
            except Exception as exc:
                print(f"flashinfer {backend} paged: failed to plan: {type(exc).__name__}: {str(exc)[:300]}")
            try:
                paged_graph_check(fi, backend, q, k, v, keys, values, [P, P + 5, P + 1771, P + 2999])
            except Exception as exc:
                print(f"flashinfer {backend} paged in a graph: failed: {type(exc).__name__}: {str(exc)[:300]}")
    except ImportError as exc:
        print(f"flashinfer: not available ({exc})")


if __name__ == "__main__":
    main()
