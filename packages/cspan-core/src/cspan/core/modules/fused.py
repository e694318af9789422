"""Fused GPU kernels (Triton) for the streaming transformer's per-frame step and its span prefill.

Why: a PersonaPlex frame is one temporal position through 32 layers plus 16 depformer steps of 6 layers each. In
eager PyTorch that is about 5,000 kernel launches (RoPE alone is ~25 element-wise kernels per layer), so even
replayed from a CUDA graph the step costs ~12 ms on an H200 for ~4 ms of weight reading. The kernels here cut a
layer to eight launches (four matrix products through cuBLAS plus four of these) without changing the model:

- :func:`rms_norm` -- float32 RMSNorm in one pass, optionally adding the residual branch first (``x + h`` rounded
  to the activation dtype, exactly what ``x = x + update`` does in the eager layer);
- :func:`silu_gate` -- the gated FFN's ``silu(a) * b``;
- :func:`decode_attention` -- one new position per row (the frame step): RoPE on q and k, the write of k and v
  into the ring KV cache, and attention over the ring plus the new key, in one kernel (split over the keys when
  few rows and heads would leave the GPU idle: flash-decoding, Dao et al. 2023, "Flash-Decoding for long-context
  inference", with a second small kernel that merges the splits by their log-sum-exp);
- :func:`rope_split`, :func:`prefill_attention`, :func:`kv_write` -- T > 1 new positions (a span or prompt
  prefill): RoPE, FlashAttention-2 style attention (Dao 2023, arXiv:2307.08691, algorithm 1: online softmax over
  key blocks) over the old ring *and* the new keys, then the write of the new keys. Reading the ring in place
  avoids the copy and concatenation of the whole cache that the eager path needs.

Masking is computed in the kernels from absolute positions, with the eager path's rule
(:func:`cspan.core.kv_cache.attention_mask`): a key at position p is visible to a query at q iff p was written and
``0 <= q - p < window``. Ring slot s of a row that has written ``end`` positions holds position
``end - 1 - ((end - 1 - s) mod C)`` (:func:`cspan.core.kv_cache.slot_positions`); only the first ``min(end, C)``
slots are read, so a short stream in a long cache costs what it holds, not the capacity. Prefill lengths can be
padded (CUDA graphs at a few fixed lengths): ``n_valid`` (a device tensor) limits the KV writes, and padded
positions, which come after every real one, are invisible to real queries.

Numerics: the same roundings as the eager modules (RMSNorm and RoPE in float32, results rounded to the activation
dtype where eager rounds them); reductions and the softmax run in another order, so results match eager within
the dtype's rounding, not bit for bit. Every kernel is deterministic (no atomics), so a graph replay equals an
eager run of the same path exactly.

On Hopper and later every kernel is launched with programmatic dependent launch (:func:`pdl_enabled`): it may
start while its predecessor finishes, and waits for it before touching its outputs.

Used on CUDA tensors in inference (no autograd) when Triton imports. ``CSPAN_FUSED=0`` turns every kernel off
(the eager modules run instead); with ``TRITON_INTERPRET=1`` and ``CSPAN_FUSED=1`` they also run on CPU tensors
through Triton's interpreter (tests).
"""

from __future__ import annotations

import math
import os
from functools import lru_cache

import torch

try:  # Triton ships with PyTorch's CUDA wheels; CPU-only installs run the eager modules
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None
    HAVE_TRITON = False

try:  # grid dependency control (programmatic dependent launch, sm_90+), Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAVE_GDC = True
except ImportError:  # pragma: no cover - depends on the installation
    gdc_launch_dependents = gdc_wait = None
    HAVE_GDC = False

_LOG2E = 1.4426950408889634


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("CSPAN_FUSED") == "1"


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernels may run on these tensors: Triton present, not disabled (``CSPAN_FUSED=0``), CUDA
    tensors (or CPU ones under the interpreter), and no autograd through them (training keeps the eager modules)."""
    if not HAVE_TRITON or os.environ.get("CSPAN_FUSED") == "0":
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    first = tensors[0]
    return first.is_cuda or (first.device.type == "cpu" and _interpreting())


@lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


@lru_cache(maxsize=8)
def _pdl_device(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with programmatic dependent launch (PDL, Hopper and later).

    With PDL a kernel may start while the one before it in the stream is still running: every kernel here first
    signals ``griddepcontrol.launch_dependents`` (its successor may be scheduled), and waits
    (``griddepcontrol.wait``, which returns once the predecessor grid has finished and its memory is visible)
    before it reads or writes anything a predecessor produces or reads. Only :func:`gemv` does work before the
    wait: it loads its weights, which no kernel writes, so the weight stream of one product overlaps the tail of
    the previous one. CUDA graphs keep these programmatic edges. Kernels after a non-PDL launch (cuBLAS, PyTorch)
    still wait for it to finish, so the result is the same with PDL on or off. ``CSPAN_PDL=0`` turns it off.
    Source: CUDA Programming Guide, "Programmatic Dependent Launch and Synchronization"; PTX ISA, griddepcontrol.
    """
    return HAVE_GDC and os.environ.get("CSPAN_PDL") != "0" and not _interpreting() and _pdl_device(device)


def _launch_opts(device: torch.device, **opts):
    """Launch keyword arguments plus the PDL switch (the ``PDL`` constexpr and Triton's ``launch_pdl``)."""
    if pdl_enabled(device):
        opts.update(PDL=True, launch_pdl=True)
    else:
        opts["PDL"] = False
    return opts


DECODE_CONFIG = (32, 64, 8, 4)
"""(block_n, max_splits, waves, num_warps) of :func:`decode_attention` for head dimensions > 64 (block_n is 64
for smaller heads): key block, the most key splits, the waves of programs the splits aim for, warps."""


def _decode_config() -> tuple[int, int, int, int]:
    """:data:`DECODE_CONFIG`, or ``CSPAN_DECODE_CONFIG="block_n,max_splits,waves,warps"`` (for tuning runs)."""
    env = os.environ.get("CSPAN_DECODE_CONFIG")
    if not env:
        return DECODE_CONFIG
    try:
        bn, splits, waves, warps = (int(v) for v in env.split(","))
    except ValueError as exc:
        raise ValueError(
            f"CSPAN_DECODE_CONFIG must be four integers 'block_n,max_splits,waves,warps', got {env!r}"
        ) from exc
    return bn, splits, waves, warps


def _splits(device: torch.device, programs: int, key_blocks: int, max_splits: int = 16, waves: int = 2) -> int:
    """Key splits per (row, head, query block): enough programs for about ``waves`` waves of the GPU, each split
    at least two key blocks long, at most ``max_splits``."""
    target = waves * _num_sms(device)
    if programs * 2 >= target:
        return 1
    return max(1, min(max_splits, triton.cdiv(target, programs), triton.cdiv(key_blocks, 2)))


if HAVE_TRITON:

    @triton.jit
    def _pdl_start(PDL: tl.constexpr):
        """Let the next kernel be scheduled now (PDL); it waits for this one before touching our outputs."""
        if PDL:
            gdc_launch_dependents()

    @triton.jit
    def _pdl_wait(PDL: tl.constexpr):
        """Wait until the previous kernel in the stream has finished and its writes are visible (PDL)."""
        if PDL:
            gdc_wait()

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, res_ptr, sum_ptr, w_ptr, y_ptr, D, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
    ):
        _pdl_start(PDL)
        _pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(res_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
            s = (x + r).to(sum_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * D + cols, s, mask=mask)
            x = s.to(tl.float32)
        var = tl.sum(x * x, axis=0) / D + eps
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = x * (w * (1.0 / tl.sqrt(var)))
        tl.store(y_ptr + row * D + cols, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_gate_kernel(h_ptr, y_ptr, H, BLOCK: tl.constexpr, PDL: tl.constexpr):
        _pdl_start(PDL)
        _pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        a = tl.load(h_ptr + row * 2 * H + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(h_ptr + row * 2 * H + H + cols, mask=mask, other=0.0).to(tl.float32)
        s = (a / (1.0 + tl.exp(-a))).to(y_ptr.dtype.element_ty).to(tl.float32)
        tl.store(y_ptr + row * H + cols, (s * b).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotate(x, partner, c, s, even):
        """Interleaved RoPE of one head vector: pair (2i, 2i+1) times exp(j * angle_i)."""
        return tl.where(even, x * c - partner * s, partner * s + x * c)

    @triton.jit
    def _softmax_update_1d(m_i, l_i, scores, visible):
        """One online-softmax step (base 2) of one query over a block of key scores [BN]: (m, l, rescale, p)."""
        scores = tl.where(visible, scores, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.where(visible, tl.exp2(scores - m_new), 0.0)
        return m_new, l_i * alpha + tl.sum(p, axis=0), alpha, p

    @triton.jit
    def _softmax_update_2d(m_i, l_i, scores, visible):
        """The same for a block of queries: scores [BM, BN], m and l [BM]."""
        scores = tl.where(visible, scores, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.where(visible, tl.exp2(scores - m_new[:, None]), 0.0)
        return m_new, l_i * alpha + tl.sum(p, axis=1), alpha, p

    @triton.jit
    def _decode_attn_kernel(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        kc_ptr,
        vc_ptr,
        rows_ptr,
        offset_ptr,
        out_ptr,
        part_o_ptr,
        part_lse_ptr,
        H,
        C,
        window,
        scale_log2,
        stride_cb,
        stride_ch,
        stride_cs,
        HAS_ROWS: tl.constexpr,
        ROPE: tl.constexpr,
        DH: tl.constexpr,
        BN: tl.constexpr,
        SPLITS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        _pdl_start(PDL)
        _pdl_wait(PDL)
        pid = tl.program_id(0)
        sid = tl.program_id(1)
        b = pid // H
        h = pid % H
        row = tl.load(rows_ptr + b) if HAS_ROWS else b.to(tl.int64)
        offset = tl.load(offset_ptr + row).to(tl.int32)  # this query's position; the ring holds < offset
        d = tl.arange(0, DH)
        base = qkv_ptr + b.to(tl.int64) * 3 * H * DH + h * DH
        q = tl.load(base + d).to(tl.float32)
        k = tl.load(base + H * DH + d).to(tl.float32)
        v = tl.load(base + 2 * H * DH + d)
        if ROPE:
            even = (d % 2) == 0
            c = tl.load(cos_ptr + b * (DH // 2) + d // 2)
            s = tl.load(sin_ptr + b * (DH // 2) + d // 2)
            q = _rotate(q, tl.load(base + (d ^ 1)).to(tl.float32), c, s, even)
            k = _rotate(k, tl.load(base + H * DH + (d ^ 1)).to(tl.float32), c, s, even)
        q = q.to(kc_ptr.dtype.element_ty).to(tl.float32)
        k_store = k.to(kc_ptr.dtype.element_ty)
        k = k_store.to(tl.float32)
        cache = row * stride_cb + h * stride_ch
        if sid == 0:
            # the slot of position ``offset`` held position offset - C, which no query from now on can see
            slot = offset % C
            tl.store(kc_ptr + cache + slot * stride_cs + d, k_store)
            tl.store(vc_ptr + cache + slot * stride_cs + d, v.to(vc_ptr.dtype.element_ty))

        m_i = tl.full((), -1.0e30, tl.float32)
        l_i = tl.full((), 0.0, tl.float32)
        acc = tl.zeros((DH,), tl.float32)
        n_ring = tl.minimum(offset, C)
        last = offset - 1
        # split s takes key blocks s, s + SPLITS, ...: the work spreads over the splits however full the ring is
        for blk in range(sid, tl.cdiv(n_ring, BN), SPLITS):
            slots = blk * BN + tl.arange(0, BN)
            smask = slots < n_ring
            pos = last - ((last - slots) % C)
            visible = smask & ((offset - pos) < window)
            # both loads issued before any arithmetic: two blocks of memory in flight per iteration
            kb = tl.load(kc_ptr + cache + slots[:, None] * stride_cs + d[None, :], mask=smask[:, None], other=0.0)
            vb = tl.load(vc_ptr + cache + slots[:, None] * stride_cs + d[None, :], mask=smask[:, None], other=0.0)
            scores = tl.sum(kb.to(tl.float32) * q[None, :], axis=1) * scale_log2
            m_i, l_i, alpha, p = _softmax_update_1d(m_i, l_i, scores, visible)
            acc = acc * alpha + tl.sum(p[:, None] * vb.to(tl.float32), axis=0)
        if sid == SPLITS - 1:  # the new key: always visible to its own query
            score = tl.sum(q * k, axis=0) * scale_log2
            m_new = tl.maximum(m_i, score)
            alpha = tl.exp2(m_i - m_new)
            p1 = tl.exp2(score - m_new)
            l_i = l_i * alpha + p1
            acc = acc * alpha + p1 * v.to(tl.float32)
            m_i = m_new
        safe_l = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / safe_l
        if SPLITS == 1:
            tl.store(out_ptr + pid.to(tl.int64) * DH + d, o.to(out_ptr.dtype.element_ty))
        else:
            n_rows = tl.num_programs(0)
            idx = sid * n_rows + pid
            tl.store(part_o_ptr + idx.to(tl.int64) * DH + d, o)
            lse = tl.where(l_i > 0.0, m_i + tl.log2(safe_l), -1.0e30)
            tl.store(part_lse_ptr + idx, lse)

    @triton.jit
    def _combine_kernel(
        part_o_ptr,
        part_lse_ptr,
        out_ptr,
        R,
        H,
        T,
        DH: tl.constexpr,
        SPLITS: tl.constexpr,
        SP2: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Merge SPLITS partial attention outputs of one (row, head, query) by their log-sum-exp (base 2)."""
        _pdl_start(PDL)
        _pdl_wait(PDL)
        r = tl.program_id(0)
        sp = tl.arange(0, SP2)
        smask = sp < SPLITS
        d = tl.arange(0, DH)
        lse = tl.load(part_lse_ptr + sp * R + r, mask=smask, other=-1.0e30)
        w = tl.where(smask, tl.exp2(lse - tl.max(lse, axis=0)), 0.0)
        o = tl.load(part_o_ptr + (sp[:, None] * R + r).to(tl.int64) * DH + d[None, :], mask=smask[:, None], other=0.0)
        out = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
        bh = r // T
        i = r % T
        b = bh // H
        h = bh % H
        dst = ((b * T + i) * H + h).to(tl.int64) * DH + d
        tl.store(out_ptr + dst, out.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _rope_split_kernel(
        qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, H, T, ROPE: tl.constexpr, DH: tl.constexpr, PDL: tl.constexpr
    ):
        _pdl_start(PDL)
        _pdl_wait(PDL)
        pid = tl.program_id(0)  # (row, position)
        h = tl.program_id(1)
        b = pid // T
        t = pid % T
        d = tl.arange(0, DH)
        base = qkv_ptr + pid.to(tl.int64) * 3 * H * DH + h * DH
        q = tl.load(base + d).to(tl.float32)
        k = tl.load(base + H * DH + d).to(tl.float32)
        v = tl.load(base + 2 * H * DH + d)
        if ROPE:
            even = (d % 2) == 0
            c = tl.load(cos_ptr + pid * (DH // 2) + d // 2)
            s = tl.load(sin_ptr + pid * (DH // 2) + d // 2)
            q = _rotate(q, tl.load(base + (d ^ 1)).to(tl.float32), c, s, even)
            k = _rotate(k, tl.load(base + H * DH + (d ^ 1)).to(tl.float32), c, s, even)
        dst = ((b * H + h) * T + t).to(tl.int64) * DH + d
        tl.store(q_ptr + dst, q.to(q_ptr.dtype.element_ty))
        tl.store(k_ptr + dst, k.to(k_ptr.dtype.element_ty))
        tl.store(v_ptr + dst, v.to(v_ptr.dtype.element_ty))

    @triton.jit
    def _prefill_attn_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        kc_ptr,
        vc_ptr,
        rows_ptr,
        offset_ptr,
        out_ptr,
        part_o_ptr,
        part_lse_ptr,
        H,
        T,
        C,
        window,
        scale_log2,
        stride_cb,
        stride_ch,
        stride_cs,
        blocks_per_split,
        HAS_ROWS: tl.constexpr,
        IEEE: tl.constexpr,
        DH: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        SPLITS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        _pdl_start(PDL)
        _pdl_wait(PDL)
        pid_bh = tl.program_id(0)
        pid_m = tl.program_id(1)
        sid = tl.program_id(2)
        b = pid_bh // H
        h = pid_bh % H
        row = tl.load(rows_ptr + b) if HAS_ROWS else b.to(tl.int64)
        offset = tl.load(offset_ptr + row).to(tl.int32)  # new key 0's position; the ring holds < offset
        d = tl.arange(0, DH)
        i = pid_m * BM + tl.arange(0, BM)
        imask = i < T
        head = pid_bh.to(tl.int64) * T
        q = tl.load(q_ptr + (head + i)[:, None] * DH + d[None, :], mask=imask[:, None], other=0.0)
        qpos = offset + i
        m_i = tl.full((BM,), -1.0e30, tl.float32)
        l_i = tl.zeros((BM,), tl.float32)
        acc = tl.zeros((BM, DH), tl.float32)
        cache = row * stride_cb + h * stride_ch
        n_ring = tl.minimum(offset, C)
        last = offset - 1
        lo = sid * blocks_per_split * BN
        hi = tl.minimum(lo + blocks_per_split * BN, n_ring)
        for start in range(lo, hi, BN):
            slots = start + tl.arange(0, BN)
            smask = slots < hi
            pos = last - ((last - slots) % C)
            kb = tl.load(kc_ptr + cache + slots[:, None] * stride_cs + d[None, :], mask=smask[:, None], other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(kb), input_precision="ieee") * scale_log2
            else:
                scores = tl.dot(q, tl.trans(kb)) * scale_log2
            visible = smask[None, :] & ((qpos[:, None] - pos[None, :]) < window)
            m_i, l_i, alpha, p = _softmax_update_2d(m_i, l_i, scores, visible)
            vb = tl.load(vc_ptr + cache + slots[:, None] * stride_cs + d[None, :], mask=smask[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, vb.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
        if sid == SPLITS - 1:  # the new keys, causal: up to the last query of this block
            hi_new = tl.minimum(T, (pid_m + 1) * BM)
            for start in range(0, hi_new, BN):
                j = start + tl.arange(0, BN)
                jmask = j < T
                kb = tl.load(k_ptr + (head + j)[:, None] * DH + d[None, :], mask=jmask[:, None], other=0.0)
                if IEEE:
                    scores = tl.dot(q, tl.trans(kb), input_precision="ieee") * scale_log2
                else:
                    scores = tl.dot(q, tl.trans(kb)) * scale_log2
                delta = i[:, None] - j[None, :]
                visible = jmask[None, :] & (delta >= 0) & (delta < window)
                m_i, l_i, alpha, p = _softmax_update_2d(m_i, l_i, scores, visible)
                vb = tl.load(v_ptr + (head + j)[:, None] * DH + d[None, :], mask=jmask[:, None], other=0.0)
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p, vb.to(tl.float32), input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
        safe_l = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / safe_l[:, None]
        if SPLITS == 1:
            dst = ((b * T + i) * H + h).to(tl.int64)[:, None] * DH + d[None, :]
            tl.store(out_ptr + dst, o.to(out_ptr.dtype.element_ty), mask=imask[:, None])
        else:
            n_rows = tl.num_programs(0) * T
            idx = (sid * n_rows + head + i).to(tl.int64)
            tl.store(part_o_ptr + idx[:, None] * DH + d[None, :], o, mask=imask[:, None])
            lse = tl.where(l_i > 0.0, m_i + tl.log2(safe_l), -1.0e30)
            tl.store(part_lse_ptr + idx, lse, mask=imask)

    @triton.jit
    def _kv_write_kernel(
        k_ptr,
        v_ptr,
        kc_ptr,
        vc_ptr,
        rows_ptr,
        offset_ptr,
        n_valid_ptr,
        H,
        T,
        C,
        stride_cb,
        stride_ch,
        stride_cs,
        HAS_ROWS: tl.constexpr,
        HAS_N: tl.constexpr,
        DH: tl.constexpr,
        BT: tl.constexpr,
        PDL: tl.constexpr,
    ):
        _pdl_start(PDL)
        _pdl_wait(PDL)
        pid_bh = tl.program_id(0)
        b = pid_bh // H
        h = pid_bh % H
        row = tl.load(rows_ptr + b) if HAS_ROWS else b.to(tl.int64)
        offset = tl.load(offset_ptr + row).to(tl.int32)
        n = tl.load(n_valid_ptr).to(tl.int32) if HAS_N else T
        d = tl.arange(0, DH)
        j = tl.program_id(1) * BT + tl.arange(0, BT)
        jmask = (j < n) & (j >= n - C)  # a chunk longer than the ring keeps its last C positions
        slots = (offset + j) % C
        src = (pid_bh.to(tl.int64) * T + j)[:, None] * DH + d[None, :]
        dst = row * stride_cb + h * stride_ch + slots[:, None] * stride_cs + d[None, :]
        tl.store(kc_ptr + dst, tl.load(k_ptr + src, mask=jmask[:, None], other=0.0), mask=jmask[:, None])
        tl.store(vc_ptr + dst, tl.load(v_ptr + src, mask=jmask[:, None], other=0.0), mask=jmask[:, None])

    @triton.jit
    def _embed_add_kernel(
        x_ptr,
        table_ptr,
        ids_ptr,
        out_ptr,
        D,
        T,
        stride_ib,
        stride_it,
        HAS_X: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        _pdl_start(PDL)
        _pdl_wait(PDL)
        r = tl.program_id(0)  # (row, position)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < D
        idx = tl.load(ids_ptr + (r // T) * stride_ib + (r % T) * stride_it)
        e = tl.load(table_ptr + tl.maximum(idx, 0) * D + cols, mask=mask & (idx != -1), other=0.0)
        if HAS_X:
            x = tl.load(x_ptr + r.to(tl.int64) * D + cols, mask=mask, other=0.0)
            e = (x.to(tl.float32) + e.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + r.to(tl.int64) * D + cols, e, mask=mask)

    @triton.jit
    def _sample_kernel(
        logits_ptr,
        noise_ptr,
        target_ptr,
        out_ptr,
        V,
        stride_l,
        stride_n,
        stride_t,
        stride_o,
        temperature,
        top_k,
        GREEDY: tl.constexpr,
        KEY16: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        _pdl_start(PDL)
        _pdl_wait(PDL)
        b = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        mask = i < V
        raw = tl.load(logits_ptr + b * stride_l + i, mask=mask, other=float("-inf"))
        x = raw.to(tl.float32)
        if GREEDY:
            choice = tl.argmax(x, axis=0)
        else:
            s = x / temperature
            # order-preserving integer key of each float, then the k-th largest key by bisection. Dividing by the
            # temperature keeps the order of 16-bit logits strictly (8 or 11 significant bits become 24), so their
            # own bit patterns serve as keys: 16 halvings instead of 32.
            if KEY16:
                bits = raw.to(tl.int16, bitcast=True).to(tl.int64)
                key = tl.where(bits < 0, -1 - (bits + 32768), bits)
                lo = tl.full((), -32768, tl.int64)
                hi = tl.full((), 32768, tl.int64)
            else:
                bits = s.to(tl.int32, bitcast=True).to(tl.int64)
                key = tl.where(bits < 0, -1 - (bits + 2147483648), bits)
                lo = tl.full((), -2147483648, tl.int64)
                hi = tl.full((), 2147483648, tl.int64)
            key = tl.where(mask, key, -(1 << 40))
            for _ in tl.static_range(16 if KEY16 else 32):
                mid = (lo + hi) >> 1
                enough = tl.sum((key >= mid).to(tl.int32), axis=0) >= top_k
                lo = tl.where(enough, mid, lo)
                hi = tl.where(enough, hi, mid)
            in_top = mask & (key >= lo)
            p = tl.exp(s - tl.max(s, axis=0))
            q = tl.load(noise_ptr + b * stride_n + i, mask=mask, other=1.0)
            choice = tl.argmax(tl.where(in_top, p / q, -1.0), axis=0)
        known = tl.load(target_ptr + b * stride_t)
        token = tl.where(known != -2, known, choice.to(tl.int64))
        tl.store(out_ptr + b * stride_o, token)

    @triton.jit
    def _gemv_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        res_ptr,
        alpha_ptr,
        M,
        N,
        K,
        eps,
        NORM: tl.constexpr,
        RES: tl.constexpr,
        GATE: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """BN output features of M <= BM rows; the whole reduction (BK >= K) in one tile, so every weight load of
        the program is in flight at once (these layers are latency-bound, not bandwidth-bound). The weights are
        loaded before the PDL wait: they overlap the previous kernel."""
        _pdl_start(PDL)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = n < N
        m = tl.arange(0, BM)
        mmask = m < M
        k = tl.arange(0, BK)
        kmask = k < K
        wmask = nmask[:, None] & kmask[None, :]
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=wmask, other=0.0)
        if GATE:
            wb = tl.load(w_ptr + (n + N)[:, None].to(tl.int64) * K + k[None, :], mask=wmask, other=0.0)
        if NORM:
            alpha = tl.load(alpha_ptr + k, mask=kmask, other=0.0).to(tl.float32)
        _pdl_wait(PDL)
        xb = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        xb = xb.to(tl.float32)
        if NORM:  # RMSNorm prologue, rounded to the activation dtype as the norm module's output is
            rstd = 1.0 / tl.sqrt(tl.sum(xb * xb, axis=1) / K + eps)
            xb = (xb * (alpha[None, :] * rstd[:, None])).to(y_ptr.dtype.element_ty).to(tl.float32)
        y = tl.sum(xb[:, None, :] * w.to(tl.float32)[None, :, :], axis=2).to(y_ptr.dtype.element_ty)
        if GATE:  # silu(a) * b with the eager roundings (linear outputs, SiLU result, product)
            yb = tl.sum(xb[:, None, :] * wb.to(tl.float32)[None, :, :], axis=2).to(y_ptr.dtype.element_ty)
            a = y.to(tl.float32)
            sa = (a / (1.0 + tl.exp(-a))).to(y_ptr.dtype.element_ty).to(tl.float32)
            y = (sa * yb.to(tl.float32)).to(y_ptr.dtype.element_ty)
        omask = mmask[:, None] & nmask[None, :]
        if RES:
            r = tl.load(res_ptr + m[:, None] * N + n[None, :], mask=omask, other=0.0)
            y = (r.to(tl.float32) + y.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + m[:, None] * N + n[None, :], y, mask=omask)

# --- wrappers ------------------------------------------------------------------------------------------------------


def _rows_arg(rows: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like if rows is None else rows


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 RMSNorm of ``x + residual`` (or of ``x``): ``y = s * (w * rsqrt(mean(s^2) + eps))``.

    Args:
        x: [..., D] activations; residual: same shape or None.
        weight: the gain, D elements (any shape that flattens to [D]).
        eps: added to the mean square.

    Returns:
        (s, y): ``s = x + residual`` rounded to x's dtype (``x`` itself when no residual), and y [..., D] in x's
        dtype.
    """
    D = x.shape[-1]
    x2 = x.contiguous().view(-1, D)
    y = torch.empty_like(x2)
    s = x2
    res = x2
    if residual is not None:
        res = residual.contiguous().view(-1, D)
        s = torch.empty_like(x2)
    block = triton.next_power_of_2(D)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, res, s, weight.reshape(-1), y, D, float(eps),
        **_launch_opts(x.device, HAS_RES=residual is not None, BLOCK=block, num_warps=8 if block >= 2048 else 4),
    )  # fmt: skip
    return s.view(x.shape), y.view(x.shape)


def silu_gate(h: torch.Tensor) -> torch.Tensor:
    """``silu(h[..., :H]) * h[..., H:]`` of a gated FFN's input projection h [..., 2H] -> [..., H] (the SiLU result
    rounded to h's dtype before the product, as the eager module)."""
    H = h.shape[-1] // 2
    h2 = h.contiguous().view(-1, 2 * H)
    y = torch.empty(h2.shape[0], H, device=h.device, dtype=h.dtype)
    block = 1024
    _silu_gate_kernel[(h2.shape[0], triton.cdiv(H, block))](
        h2, y, H, **_launch_opts(h.device, BLOCK=block, num_warps=4)
    )
    return y.view(*h.shape[:-1], H)


def rope_tables(positions: torch.Tensor, head_dim: int, max_period: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [B, T, Dh/2] float32 of the RoPE angles of ``positions`` [B, T], computed as
    :func:`cspan.core.modules.rope.apply_rope` does (once per forward, shared by every layer)."""
    half = head_dim // 2
    ds = torch.arange(half, device=positions.device, dtype=torch.float32)
    freqs = torch.exp(ds * (-math.log(max_period) * 2 / head_dim))
    angles = freqs * positions.to(torch.float32)[..., None]
    return torch.cos(angles).contiguous(), torch.sin(angles).contiguous()


def decode_attention(
    qkv: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    offset: torch.Tensor,
    window: int,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    rows: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Attention of ONE new position per row over its ring KV cache, with the new key/value written in.

    Args:
        qkv: [B', 1, 3 * H * Dh] the fused projection's output ([q; k; v], head-major).
        keys, values: one layer's ring buffers [B, H, C, Dh] (updated in place at slot ``offset % C``).
        offset: [B] long, each row's position count before this step (the new position).
        window: attention window in positions (<= C).
        rope: (cos, sin) [B', 1, Dh/2] from :func:`rope_tables`, or None (no RoPE).
        rows: [B'] long rows of the cache, None for all rows.
        config: (block_n, max_splits, waves, num_warps) for tuning (default :data:`DECODE_CONFIG`).

    Returns:
        [B', 1, H * Dh] attention output (heads concatenated), in qkv's dtype.
    """
    Bq = qkv.shape[0]
    _, H, C, DH = keys.shape
    qkv = qkv.contiguous()
    out = torch.empty(Bq, 1, H * DH, device=qkv.device, dtype=qkv.dtype)
    BN, max_splits, waves, warps = config or _decode_config()
    if config is None and DH <= 64:
        BN = 64
    key_blocks = triton.cdiv(C, BN)
    splits = _splits(qkv.device, Bq * H, key_blocks, max_splits, waves)
    part_o = part_lse = out
    if splits > 1:
        part_o = torch.empty(splits, Bq * H, DH, device=qkv.device, dtype=torch.float32)
        part_lse = torch.empty(splits, Bq * H, device=qkv.device, dtype=torch.float32)
    cos, sin = rope if rope is not None else (out, out)
    _decode_attn_kernel[(Bq * H, splits)](
        qkv, cos, sin, keys, values, _rows_arg(rows, offset), offset, out, part_o, part_lse,
        H, C, int(window), _LOG2E / math.sqrt(DH), keys.stride(0), keys.stride(1), keys.stride(2),
        **_launch_opts(qkv.device, HAS_ROWS=rows is not None, ROPE=rope is not None, DH=DH, BN=BN, SPLITS=splits,
                       num_warps=warps),
    )  # fmt: skip
    if splits > 1:
        _combine_kernel[(Bq * H,)](
            part_o, part_lse, out, Bq * H, H, 1,
            **_launch_opts(qkv.device, DH=DH, SPLITS=splits, SP2=triton.next_power_of_2(splits), num_warps=4),
        )  # fmt: skip
    return out


def rope_split(
    qkv: torch.Tensor, num_heads: int, rope: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the fused projection [B', T, 3 * H * Dh] into q, k, v [B', H, T, Dh] (contiguous), RoPE applied to q
    and k when ``rope`` (cos, sin [B', T, Dh/2]) is given, rounded to qkv's dtype."""
    Bq, T, three_d = qkv.shape
    DH = three_d // (3 * num_heads)
    qkv = qkv.contiguous()
    q, k, v = (torch.empty(Bq, num_heads, T, DH, device=qkv.device, dtype=qkv.dtype) for _ in range(3))
    cos, sin = rope if rope is not None else (qkv, qkv)
    _rope_split_kernel[(Bq * T, num_heads)](
        qkv, cos, sin, q, k, v, num_heads, T,
        **_launch_opts(qkv.device, ROPE=rope is not None, DH=DH, num_warps=1 if DH <= 64 else 2),
    )  # fmt: skip
    return q, k, v


PREFILL_CONFIG = (64, 64, 4, 3)
"""(block_m, block_n, num_warps, num_stages) of :func:`prefill_attention` (the best of scripts/perf_h200.py's
sweep on the H200, see docs/PERFORMANCE.md)."""
PREFILL_WAVES = 4
"""Key splits of :func:`prefill_attention` aim at this many programs per multiprocessor: with two resident per
SM, a 601-position span (10 query blocks x 32 heads) then runs in two splits, 14% faster than in one
(``scripts/perf_h200.py tune-prefill``)."""


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    offset: torch.Tensor,
    window: int,
    rows: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of T new positions per row over the ring (read in place, not modified) and themselves.

    Args:
        q, k, v: [B', H, T, Dh] new queries/keys/values (RoPE applied), new position j at ``offset[row] + j``.
        keys, values: one layer's ring buffers [B, H, C, Dh].
        offset: [B] long position counts before this forward.
        window: attention window in positions (<= C).
        rows: [B'] long rows of the cache, None for all rows.
        config: (block_m, block_n, num_warps, num_stages) for tuning (default :data:`PREFILL_CONFIG`, block_m
            shrunk to 16 / 32 for short chunks).
        splits: key splits per query block, for tuning (default: see :data:`PREFILL_WAVES`).

    Returns:
        [B', T, H * Dh] in q's dtype.
    """
    Bq, H, T, DH = q.shape
    C = keys.shape[2]
    out = torch.empty(Bq, T, H * DH, device=q.device, dtype=q.dtype)
    BM, BN, warps, stages = config or PREFILL_CONFIG
    if config is None and T <= 32:
        BM = 16 if T <= 16 else 32
    m_blocks = triton.cdiv(T, BM)
    key_blocks = triton.cdiv(C, BN)
    if splits is None:  # about PREFILL_WAVES waves of programs, each split at least two key blocks long
        target = PREFILL_WAVES * _num_sms(q.device)
        splits = max(1, min(16, triton.cdiv(target, Bq * H * m_blocks), triton.cdiv(key_blocks, 2)))
    per = triton.cdiv(key_blocks, splits)
    part_o = part_lse = out
    if splits > 1:
        part_o = torch.empty(splits, Bq * H * T, DH, device=q.device, dtype=torch.float32)
        part_lse = torch.empty(splits, Bq * H * T, device=q.device, dtype=torch.float32)
    _prefill_attn_kernel[(Bq * H, m_blocks, splits)](
        q, k, v, keys, values, _rows_arg(rows, offset), offset, out, part_o, part_lse,
        H, T, C, int(window), _LOG2E / math.sqrt(DH), keys.stride(0), keys.stride(1), keys.stride(2), per,
        **_launch_opts(q.device, HAS_ROWS=rows is not None, IEEE=q.dtype == torch.float32, DH=DH, BM=BM, BN=BN,
                       SPLITS=splits, num_warps=warps, num_stages=stages),
    )  # fmt: skip
    if splits > 1:
        _combine_kernel[(Bq * H * T,)](
            part_o, part_lse, out, Bq * H * T, H, T,
            **_launch_opts(q.device, DH=DH, SPLITS=splits, SP2=triton.next_power_of_2(splits), num_warps=4),
        )  # fmt: skip
    return out


def kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    offset: torch.Tensor,
    rows: torch.Tensor | None = None,
    n_valid: torch.Tensor | None = None,
) -> None:
    """Store new keys/values k, v [B', H, T, Dh] (position ``offset[row] + j``) into the ring buffers [B, H, C, Dh]
    at slots ``(offset + j) % C``; only ``j < n_valid`` ([1] long device tensor; all T when None), and of those the
    last C."""
    Bq, H, T, DH = k.shape
    C = keys.shape[2]
    BT = 16
    _kv_write_kernel[(Bq * H, triton.cdiv(T, BT))](
        k, v, keys, values, _rows_arg(rows, offset), offset, offset if n_valid is None else n_valid,
        H, T, C, keys.stride(0), keys.stride(1), keys.stride(2),
        **_launch_opts(k.device, HAS_ROWS=rows is not None, HAS_N=n_valid is not None, DH=DH, BT=BT, num_warps=2),
    )  # fmt: skip


def embed_add(x: torch.Tensor | None, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``x + table[ids]`` with id -1 giving a zero row (``ScaledEmbedding`` without low rank), the sum rounded to
    the table's dtype as ``x + e`` is; ``table[ids]`` alone when x is None.

    Args:
        x: [B, T, D] or [B, D] (matching ids [B, T] / [B]), or None.
        table: [V, D].
        ids: long ids in [-1, V), any strides.

    Returns:
        Same shape as x (or ids.shape + [D]).
    """
    D = table.shape[1]
    ids2 = ids if ids.dim() == 2 else ids[:, None]
    B, T = ids2.shape
    out = torch.empty(B, T, D, device=table.device, dtype=table.dtype)
    xc = out if x is None else x.contiguous()
    block = min(1024, triton.next_power_of_2(D))
    _embed_add_kernel[(B * T, triton.cdiv(D, block))](
        xc, table, ids2, out, D, T, ids2.stride(0), ids2.stride(1),
        **_launch_opts(table.device, HAS_X=x is not None, BLOCK=block, num_warps=4),
    )  # fmt: skip
    return out if ids.dim() == 2 else out[:, 0]


SAMPLE_MAX_VOCAB = 8192
"""Largest vocabulary :func:`sample_top_k` handles (one program holds a row in registers): the audio codebooks."""


def sample_top_k(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    noise: torch.Tensor | None,
    known: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """One token per row in one kernel: temperature / top-k exponential-race sampling, or greedy, then forcing.

    The same rule as :func:`cspan.core.sampling.sample_token` (kyutai-labs/moshi ``sample_token``):
    ``argmax_{i in top-k} softmax(logits / T)_i / q_i`` with ``q_i ~ Exp(1)``, which is a draw from the top-k
    distribution; greedy (``temperature <= 0``) is the first argmax. Here the noise has one entry per vocabulary
    entry (drawn by the caller, e.g. once per frame) rather than one per top-k rank, and logits tied with the k-th
    largest all stay in the race: the same distribution, other random draws than the eager function for one seed.

    Args:
        logits: [B, V] (V <= :data:`SAMPLE_MAX_VOCAB`).
        temperature, top_k: as :func:`sample_token` (top_k <= 0 or >= V keeps all).
        noise: [B, V] float32 Exp(1) draws (rows may be strided), None when greedy.
        known: [B] long, the token to keep where it is not -2 (forced entries), any stride.
        out: [B] long destination (any stride, e.g. a column of the frame being built); also returned.
    """
    B, V = logits.shape
    greedy = temperature <= 0
    k = V if top_k <= 0 or top_k >= V else int(top_k)
    noise_arg = logits if noise is None else noise
    _sample_kernel[(B,)](
        logits, noise_arg, known, out, V, logits.stride(0), noise_arg.stride(0), known.stride(0), out.stride(0),
        float(temperature) if not greedy else 1.0, k,
        **_launch_opts(logits.device, GREEDY=greedy, KEY16=logits.element_size() == 2, BLOCK=triton.next_power_of_2(V),
                       num_warps=4),
    )  # fmt: skip
    return out


GEMV_MAX_ROWS = 4
"""Largest batch :func:`gemv` takes (above it, the matrix units through cuBLAS win)."""
GEMV_MAX_K = 16384
"""Longest reduction :func:`gemv` takes (one program holds whole weight rows)."""
GEMV_TILE = 8192
"""Weight elements per program (BN rows x BK columns x BM rows of x, gate tiles counted twice), for products of
at most :data:`GEMV_LARGE` weight elements."""
GEMV_LARGE = 1 << 24
"""Products with more weight elements than this (the temporal transformer's) use :data:`GEMV_LARGE_CONFIG`."""
GEMV_LARGE_CONFIG = (16384, 8)
"""(weight elements per program, num_warps) of :func:`gemv` for large products: fewer programs, so the input row
and the norm are re-read less often."""


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
    gate: bool = False,
    config: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``y = x @ weight.T`` for a few rows, with the layer's neighbours fused in (one launch instead of two or
    three, for the small launch-bound layers of the depformer).

    Args:
        x: [M, K] (M <= :data:`GEMV_MAX_ROWS`, K <= :data:`GEMV_MAX_K`), contiguous.
        weight: [N, K] (``nn.Linear`` layout), or [2H, K] with ``gate``.
        norm: (alpha, eps): apply float32 RMSNorm with gain alpha to x first (rounded to x's dtype, as the norm
            module's output is).
        residual: [M, N]: return ``residual + y`` (rounded as ``x = x + update`` is).
        gate: the weight is a gated FFN's input projection: return ``silu(y[:, :H]) * y[:, H:]`` [M, H].
        config: (weight elements per program, num_warps), for tuning; default :data:`GEMV_TILE` with 4 warps,
            or :data:`GEMV_LARGE_CONFIG` above :data:`GEMV_LARGE` weight elements.

    Returns:
        [M, N] (or [M, H]) in x's dtype.

    Raises:
        ValueError: M or K beyond the limits above.
    """
    M, K = x.shape
    if M > GEMV_MAX_ROWS or K > GEMV_MAX_K:
        raise ValueError(f"gemv takes at most {GEMV_MAX_ROWS} rows of at most {GEMV_MAX_K} features; got {M} x {K}")
    N = weight.shape[0] // 2 if gate else weight.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    BM, BK = triton.next_power_of_2(M), triton.next_power_of_2(K)
    if config is None:
        config = GEMV_LARGE_CONFIG if weight.numel() > GEMV_LARGE else (GEMV_TILE, 4)
    tile, warps = config
    BN = max(1, tile // (BK * BM * (2 if gate else 1)))
    alpha, eps = norm if norm is not None else (x, 0.0)
    _gemv_kernel[(triton.cdiv(N, BN),)](
        x, weight, y, y if residual is None else residual.contiguous(), alpha.reshape(-1), M, N, K, float(eps),
        **_launch_opts(x.device, NORM=norm is not None, RES=residual is not None, GATE=gate, BM=BM, BN=BN, BK=BK,
                       num_warps=warps),
    )  # fmt: skip
    return y


__all__ = [
    "DECODE_CONFIG",
    "GEMV_MAX_K",
    "GEMV_MAX_ROWS",
    "HAVE_TRITON",
    "SAMPLE_MAX_VOCAB",
    "decode_attention",
    "embed_add",
    "gemv",
    "kv_write",
    "pdl_enabled",
    "prefill_attention",
    "rms_norm",
    "rope_split",
    "rope_tables",
    "sample_top_k",
    "silu_gate",
    "usable",
]
