"""Fused GPU kernels (Triton) for the streaming transformers: the duplex engine's ragged step, the depformer, Mimi.

Why: a PersonaPlex frame is one temporal position through 32 layers plus 16 depformer steps of 6 layers each. In
eager PyTorch that is about 5,000 kernel launches (RoPE alone is ~25 element-wise kernels per layer), so even
replayed from a CUDA graph the step costs ~12 ms on an H200 for ~4 ms of weight reading. The kernels here cut a
layer to a few launches (the matrix products through cuBLAS plus these) without changing the model:

- :func:`rms_norm` -- float32 RMSNorm in one pass, optionally adding the residual branch first (``x + h`` rounded
  to the activation dtype, exactly what ``x = x + update`` does in the eager layer);
- :func:`silu_gate` -- the gated FFN's ``silu(a) * b``;
- :func:`decode_attention` -- one new position per query row (every session's next position in the engine's
  step): RoPE on q and k, the write of k and v into the ring KV cache, and attention over the ring, in one kernel
  (split over the keys when few rows and heads would leave the GPU idle: flash-decoding, Dao et al. 2023,
  "Flash-Decoding for long-context inference", with a second small kernel that merges the splits by their
  log-sum-exp; a split that saw no key, as most of a short ring's do, writes its log-sum-exp alone and the merge
  reads nothing else of it);
- :func:`rope_split`, :func:`prefill_attention`, :func:`kv_write` -- blocks of new positions (Context Spans,
  persona prefixes, Mimi's chunks), RAGGED: any number of rows, each with its own length, in one launch each:
  RoPE, FlashAttention-2 style attention (Dao 2023, arXiv:2307.08691, algorithm 1: online softmax over key
  blocks) over each row's old ring *and* its own new keys, then the write of the new keys (:class:`Ragged`
  describes the rows; the layout of vLLM's / FlashAttention's varlen kernels);
- :func:`sample_top_k`, :func:`race_noise` -- temperature / top-k sampling with counter-based noise (a pure
  function of the session's seed, its frame counter, the stream and the vocabulary index: :func:`noise_keys`), so
  a session's draws never depend on which batch row, graph or device it runs in;
- :func:`embed_add`, :func:`embed_sum`, :func:`gemv` -- embedding lookups (the temporal input's K tables in one
  launch), and the depformer's small products with their norm, gate and residual fused in.

Masking is computed in the kernels from absolute positions, with the eager path's rule
(:func:`cspan.core.kv_cache.attention_mask`): a key at position p is visible to a query at q iff p was written and
``0 <= q - p < window``. Ring slot s of a row that has written ``end`` positions holds position
``end - 1 - ((end - 1 - s) mod C)`` (:func:`cspan.core.kv_cache.slot_positions`); only the first ``min(end, C)``
slots are read, so a short stream in a long cache costs what it holds, not the capacity. The cache layout is the
one of :class:`cspan.core.kv_cache.KVCache`: ``[B, H, C, Dh]`` per layer, optionally FP8 (e4m3 codes with one
float32 scale per position and head, dequantized as they are loaded).

Numerics: the same roundings as the eager modules (RMSNorm and RoPE in float32, results rounded to the activation
dtype where eager rounds them); reductions and the softmax run in another order, so results match eager within
the dtype's rounding, not bit for bit. Every kernel is deterministic (no atomics), so a graph replay equals an
eager run of the same path exactly.

On Hopper and later every kernel is launched with programmatic dependent launch (``pdl``): it may start while its
predecessor finishes, and waits for it before touching its outputs.

Switches (read once, by :func:`settings_from_env`; the duplex engine reads them when it is built, see
:mod:`cspan.core.plan`): ``CSPAN_FUSED=0`` turns every kernel off (the eager modules run instead), ``CSPAN_FUSED=1``
also runs them in float32 and, with ``TRITON_INTERPRET=1``, on CPU tensors through Triton's interpreter (tests);
``CSPAN_PDL=0`` launches without PDL; ``CSPAN_GEMV=0`` keeps the depformer's products on cuBLAS;
``CSPAN_DECODE_CONFIG="block_n,max_splits,waves,warps,stages,form"`` overrides :data:`DECODE_CONFIGS` (tuning);
``CSPAN_ATTENTION=triton|flashinfer`` chooses the engine's decode attention (:mod:`cspan.core.attention`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class KernelSettings:
    """The kernel switches of the environment (see the module docstring), read by :func:`settings_from_env`.

    Attributes:
        enabled: False with ``CSPAN_FUSED=0``.
        forced: True with ``CSPAN_FUSED=1`` (float32 too; CPU tensors under the interpreter).
        interpret: ``TRITON_INTERPRET=1`` and ``CSPAN_FUSED=1``: CPU tensors run through Triton's interpreter.
        pdl: False with ``CSPAN_PDL=0``.
        gemv: False with ``CSPAN_GEMV=0``.
        decode_config: ``CSPAN_DECODE_CONFIG`` parsed, or None.
        attention: ``CSPAN_ATTENTION``: "auto" (default), "triton" or "flashinfer" (:mod:`cspan.core.attention`).
        span_overlap: False with ``CSPAN_SPAN_OVERLAP=0``: a step's block attention runs after its decode attention
            instead of beside it on a second stream (:class:`cspan.core.plan.ExecutionPlan`).
    """

    enabled: bool
    forced: bool
    interpret: bool
    pdl: bool
    gemv: bool
    decode_config: tuple[int, int, int, int, int, int] | None
    attention: str = "auto"
    span_overlap: bool = True


def settings_from_env() -> KernelSettings:
    """The switches as the environment sets them now (the one place they are read).

    Raises:
        ValueError: ``CSPAN_DECODE_CONFIG`` is not six integers.
    """
    fused = os.environ.get("CSPAN_FUSED")
    env = os.environ.get("CSPAN_DECODE_CONFIG")
    config = None
    attention = os.environ.get("CSPAN_ATTENTION", "auto")
    if attention not in ("auto", "triton", "flashinfer"):
        raise ValueError(f"CSPAN_ATTENTION must be auto, triton or flashinfer, got {attention!r}")
    span_overlap = os.environ.get("CSPAN_SPAN_OVERLAP", "1")
    if span_overlap not in ("0", "1"):
        raise ValueError(f"CSPAN_SPAN_OVERLAP must be 0 or 1, got {span_overlap!r}")
    if env:
        try:
            bn, splits, waves, warps, stages, form = (int(v) for v in env.split(","))
        except ValueError as exc:
            raise ValueError(
                f"CSPAN_DECODE_CONFIG must be six integers 'block_n,max_splits,waves,warps,stages,form', got {env!r}"
            ) from exc
        config = (bn, splits, waves, warps, stages, form)
    return KernelSettings(
        enabled=fused != "0",
        forced=fused == "1",
        interpret=os.environ.get("TRITON_INTERPRET") == "1" and fused == "1",
        pdl=os.environ.get("CSPAN_PDL") != "0",
        gemv=os.environ.get("CSPAN_GEMV") != "0",
        decode_config=config,
        attention=attention,
        span_overlap=span_overlap == "1",
    )


DEFAULT = settings_from_env()
"""The switches at import: what modules that are not given an execution plan use (Mimi, norms, embeddings)."""


def _interpreting() -> bool:
    return DEFAULT.interpret


def runs_on(device: torch.device, settings: KernelSettings = DEFAULT) -> bool:
    """Whether the kernels can run on ``device``: Triton present, not disabled, CUDA (or CPU under the interpreter)."""
    if not HAVE_TRITON or not settings.enabled:
        return False
    return device.type == "cuda" or (device.type == "cpu" and settings.interpret)


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernels may run on these tensors (:func:`runs_on` their device with :data:`DEFAULT`) with no
    autograd through them (training keeps the eager modules)."""
    if not runs_on(tensors[0].device):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


@lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


@lru_cache(maxsize=8)
def pdl_supported(device: torch.device) -> bool:
    """Whether ``device`` can launch with programmatic dependent launch (PDL: Hopper and later, Triton >= 3.3).

    With PDL a kernel may start while the one before it in the stream is still running: every kernel here first
    signals ``griddepcontrol.launch_dependents`` (its successor may be scheduled), and waits
    (``griddepcontrol.wait``, which returns once the predecessor grid has finished and its memory is visible)
    before it reads or writes anything a predecessor produces or reads. Only :func:`gemv` does work before the
    wait: it loads its weights, which no kernel writes, so the weight stream of one product overlaps the tail of
    the previous one. CUDA graphs keep these programmatic edges. Kernels after a non-PDL launch (cuBLAS, PyTorch)
    still wait for it to finish, so the result is the same with PDL on or off.
    Source: CUDA Programming Guide, "Programmatic Dependent Launch and Synchronization"; PTX ISA, griddepcontrol.
    """
    return HAVE_GDC and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """PDL for kernels launched without an explicit choice (:data:`DEFAULT` and :func:`pdl_supported`)."""
    return DEFAULT.pdl and not DEFAULT.interpret and pdl_supported(device)


def _launch_opts(device: torch.device, pdl: bool | None = None, **opts):
    """Launch keyword arguments plus the PDL switch (the ``PDL`` constexpr and Triton's ``launch_pdl``); ``pdl``
    None takes :func:`pdl_enabled`."""
    if pdl is None:
        pdl = pdl_enabled(device)
    if pdl:
        opts.update(PDL=True, launch_pdl=True)
    else:
        opts["PDL"] = False
    return opts


DecodeConfig = tuple[int, int, int, int, int, int]
DECODE_CONFIGS: tuple[tuple[int, DecodeConfig], ...] = (
    (1, (32, 8, 8, 2, 3, 2)),
    (4, (32, 16, 2, 2, 3, 2)),
    (8, (32, 16, 2, 8, 3, 1)),
    (16, (32, 16, 2, 4, 3, 1)),
    (24, (32, 64, 8, 4, 4, 1)),
    (32, (64, 16, 2, 4, 2, 2)),
    (33, (32, 16, 2, 4, 3, 1)),
    (64, (32, 64, 8, 4, 4, 1)),
    (80, (32, 16, 2, 4, 2, 1)),
    (128, (32, 16, 2, 4, 4, 1)),
)
"""(smallest batch, (block_n, max_splits, waves, num_warps, num_stages, form)) of :func:`decode_attention` for
head dimensions > 64 (block_n is 64 for smaller heads); the last entry whose batch is at most the step's row count
applies: key block, the most key splits, the waves of programs the splits aim for, warps, pipeline stages, and the
loop's ``form``: 0 one online softmax per program, 1 one per key slot of a block (no reduction across warps inside
the loop), 2 the query as row 0 of a 16-row tile through tensor-core products (a bf16 / fp16 ring of the query's
dtype; other rings run form 1 with the same fields). The entries
are the fastest per batch size of the full-ring sweeps (``scripts/perf_h200.py attention``, 32 heads x 128, 3000
slots, bf16): device call C8 for forms 0 / 1 (docs/perf/round4/c8/attention.log), C101 for form 2 at 32 rows
(docs/perf/round4/c101/attention.log: 345.6 us per layer against 351.9 for the form-1 entry, SDPA 345.7), C106 for
form 2 at 1 and 4 rows with 8 and 16 key splits in the sweep (docs/perf/round4/c106/attention.log: 17.6 / 51.0
against 19.1 / 52.4 for C101's entries, (64, 64, 8, 4, 2, 2) / (64, 16, 2, 4, 3, 2), and 21.6 / 54.0 for form 1's
best; SDPA 18.6 / 49.7; the floor at one row 11.6); from 33 rows C8's entries. With
FlashInfer installed the engine runs this kernel for steps of 1 to 4 and 25 to 32 rows (graphed steps pad rows to
the buckets 1 / 2 / 4 / 32; :data:`cspan.core.attention.FASTER_ROWS`), FlashInfer's decode for the others."""


DECODE_CONFIGS_FP8: tuple[tuple[int, DecodeConfig], ...] = (
    (1, (64, 16, 2, 4, 2, 1)),
    (8, (32, 16, 2, 8, 3, 1)),
    (16, (32, 16, 2, 4, 3, 1)),
    (24, (32, 64, 8, 4, 4, 1)),
    (32, (32, 16, 2, 4, 3, 1)),
    (64, (32, 16, 2, 4, 4, 1)),
    (96, (32, 64, 8, 4, 3, 1)),
    (128, (32, 16, 2, 4, 4, 1)),
)
"""Entries of :data:`DECODE_CONFIGS`' form for FP8 rings (e4m3 with one scale per position and head): from 64 rows
on the fastest of device call C27's sweep (``scripts/perf_h200.py attention-fp8``, docs/perf/round4/c27, full
3000-slot rings; B = 64 / 96 / 128: 384.2 / 582.5 / 769.4 us per layer against FP8 bytes floors of 381.7 / 572.5 /
763.3; at 96 rows the bf16 table's entry took 663.8); below 64 rows C8's per-slot entries (form 2 takes 16-bit
rings only, and no FP8 sweep timed it)."""


def decode_config(rows: int, fp8: bool = False) -> DecodeConfig:
    """The :data:`DECODE_CONFIGS` entry for a step of ``rows`` query rows (FP8 rings: :data:`DECODE_CONFIGS_FP8`)."""
    table = DECODE_CONFIGS_FP8 if fp8 else DECODE_CONFIGS
    chosen = table[0][1]
    for smallest, config in table:
        if rows >= smallest:
            chosen = config
    return chosen


def _splits(device: torch.device, programs: int, key_blocks: int, max_splits: int = 16, waves: int = 2) -> int:
    """Key splits per (row, head, query block): enough programs for about ``waves`` waves of the GPU, each split
    at least two key blocks long, at most ``max_splits``."""
    target = waves * _num_sms(device)
    if programs * 2 >= target:
        return 1
    return max(1, min(max_splits, triton.cdiv(target, programs), triton.cdiv(key_blocks, 2)))


_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed 64-bit integer
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (wrapping products, logical shifts), Steele et al. 2014, "Fast
    splittable pseudorandom number generators"."""
    z = (z ^ ((z >> 30) & 0x3FFFFFFFF)) * _MIX1
    z = (z ^ ((z >> 27) & 0x1FFFFFFFFF)) * _MIX2
    return z ^ ((z >> 31) & 0x1FFFFFFFF)


def noise_keys(seed: torch.Tensor, counter: torch.Tensor, stream: int | range) -> torch.Tensor:
    """[b] int64 keys of the noise of (session seed, frame counter, stream) for :func:`race_noise` ([b, S] for a
    range of S streams)."""
    base = _mix64(seed + _GOLDEN) + counter * 64 + _GOLDEN  # wrapping int64 sums: the order changes nothing
    if isinstance(stream, range):
        # an arange, not torch.tensor(stream): no copy from the host, so a CUDA graph can capture it
        streams = torch.arange(stream.start, stream.stop, stream.step, device=seed.device, dtype=torch.long)
        return _mix64(base[:, None] + streams)
    return _mix64(base + stream)


def race_noise(seed: torch.Tensor, counter: torch.Tensor, stream: int | range, vocab: int) -> torch.Tensor:
    """Exp(1) noise of the exponential race: entry v of row r is ``-log(u)``, ``u`` the top 24 bits of
    ``mix64(key_r + (v + 1) * golden) + 1/2`` over 2^24, ``key_r`` = :func:`noise_keys` (seed_r, counter_r, stream).

    The same integers on every device (and in :func:`sample_top_k`'s kernel), so the draws of a session depend only
    on its seed, its frame counter, the stream (0 text, 1 + k depformer codebook k) and the entry.

    Args:
        seed, counter: [b] long.
        stream: 0 .. 63, or a range of them (the depformer's codebooks of a frame in one call: on the CPU each
            call costs its operations' overhead more than their work).
        vocab: V.

    Returns:
        [b, V] float32, or [b, S, V] for a range of S streams (entry s: the noise of stream ``stream[s]``, bit
        for bit).
    """
    keys = noise_keys(seed, counter, stream)
    v = torch.arange(1, vocab + 1, device=seed.device, dtype=torch.long) * _GOLDEN
    z = _mix64(keys[..., None] + v)
    u = (((z >> 40) & 0xFFFFFF).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(u)


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
    def _mix64_tl(z):
        """:func:`_mix64` on int64 values."""
        z = (z ^ ((z >> 30) & 0x3FFFFFFFF)) * -4658895280553007687
        z = (z ^ ((z >> 27) & 0x1FFFFFFFFF)) * -7723592293110705685
        return z ^ ((z >> 31) & 0x1FFFFFFFF)

    @triton.jit
    def _race_noise_tl(seed, counter, stream, v):
        """:func:`race_noise` of entries ``v`` (int64 tensor) for one row."""
        golden = -7046029254386353131
        key = _mix64_tl(_mix64_tl(seed + golden) + counter * 64 + stream + golden)
        z = _mix64_tl(key + (v + 1) * golden)
        u = (((z >> 40) & 0xFFFFFF).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        return -tl.log(u)

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
    def _rotate_pairs(x, c, s, BH: tl.constexpr, DH: tl.constexpr):
        """:func:`_rotate` of BH head vectors x [BH, DH] at once (c, s [1, DH / 2]), each pair split from the
        vector it was loaded in instead of loaded again at ``d ^ 1``: the same products, sums and rounding."""
        even, odd = tl.split(tl.reshape(x, (BH, DH // 2, 2)))
        return tl.reshape(tl.join(even * c - odd * s, even * s + odd * c), (BH, DH))

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
    def _quantize_fp8(x, FP8_TY: tl.constexpr):
        """(e4m3 codes, float32 scale) of one vector: ``x ~ codes * scale``, scale = max|x| / 448."""
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, 1.1754943508222875e-38)
        codes = tl.minimum(tl.maximum(x / scale, -448.0), 448.0).to(FP8_TY)
        return codes, scale

    @triton.jit
    def _decode_attn_kernel(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        kc_ptr,
        vc_ptr,
        ks_ptr,
        vs_ptr,
        rows_ptr,
        pos_ptr,
        out_ptr,
        part_o_ptr,
        part_lse_ptr,
        H,
        C,
        window,
        scale_log2,
        stride_q,
        stride_cb,
        stride_ch,
        stride_cs,
        stride_sb,
        stride_sh,
        stride_ss,
        ROPE: tl.constexpr,
        FP8: tl.constexpr,
        DH: tl.constexpr,
        BN: tl.constexpr,
        SPLITS: tl.constexpr,
        STAGES: tl.constexpr,
        LANES: tl.constexpr,
        MMA: tl.constexpr,
        PDL: tl.constexpr,
    ):
        _pdl_start(PDL)
        _pdl_wait(PDL)
        pid = tl.program_id(0)
        sid = tl.program_id(1)
        b = pid // H
        h = pid % H
        row = tl.load(rows_ptr + b).to(tl.int64)
        pos = tl.load(pos_ptr + b).to(tl.int32)  # this query's position; the ring holds positions < pos
        d = tl.arange(0, DH)
        base = qkv_ptr + b.to(tl.int64) * stride_q + h * DH
        q = tl.load(base + d).to(tl.float32)
        k = tl.load(base + H * DH + d).to(tl.float32)
        v = tl.load(base + 2 * H * DH + d)
        if ROPE:
            even = (d % 2) == 0
            c = tl.load(cos_ptr + b * (DH // 2) + d // 2)
            s = tl.load(sin_ptr + b * (DH // 2) + d // 2)
            q = _rotate(q, tl.load(base + (d ^ 1)).to(tl.float32), c, s, even)
            k = _rotate(k, tl.load(base + H * DH + (d ^ 1)).to(tl.float32), c, s, even)
        q = q.to(qkv_ptr.dtype.element_ty).to(tl.float32)
        k = k.to(qkv_ptr.dtype.element_ty).to(tl.float32)
        cache = row * stride_cb + h * stride_ch
        scales = row * stride_sb + h * stride_sh
        slot = pos % C  # held position pos - C, which no query from now on can see
        if FP8:
            k_code, k_scale = _quantize_fp8(k, kc_ptr.dtype.element_ty)
            v_code, v_scale = _quantize_fp8(v.to(tl.float32), vc_ptr.dtype.element_ty)
            k = k_code.to(tl.float32) * k_scale
            v_new = v_code.to(tl.float32) * v_scale
            if sid == 0:
                tl.store(kc_ptr + cache + slot * stride_cs + d, k_code)
                tl.store(vc_ptr + cache + slot * stride_cs + d, v_code)
                tl.store(ks_ptr + scales + slot * stride_ss, k_scale)
                tl.store(vs_ptr + scales + slot * stride_ss, v_scale)
        else:
            k_store = k.to(kc_ptr.dtype.element_ty)
            v_store = v.to(vc_ptr.dtype.element_ty)
            k = k_store.to(tl.float32)
            v_new = v_store.to(tl.float32)
            if sid == 0:
                tl.store(kc_ptr + cache + slot * stride_cs + d, k_store)
                tl.store(vc_ptr + cache + slot * stride_cs + d, v_store)

        n_ring = tl.minimum(pos, C)
        last = pos - 1
        if MMA:
            # the query as row 0 of a 16-row tile (rows 1-15 zero): both products on tensor cores (FlashAttention's
            # decode as a prefill of one query), the scores' and the output's reductions in the MMA units instead of
            # across threads; the other rows' softmax states are computed and discarded
            row0 = tl.arange(0, 16) == 0
            q16 = tl.where(row0[:, None], q[None, :], 0.0).to(kc_ptr.dtype.element_ty)
            m_2 = tl.full((16,), -1.0e30, tl.float32)
            l_2 = tl.zeros((16,), tl.float32)
            acc_2 = tl.zeros((16, DH), tl.float32)
        elif LANES:
            # one online softmax per key slot of the block (a BN-way split inside the program): the loop has no
            # reduction across warps; the BN states are merged once, after it
            m_v = tl.full((BN,), -1.0e30, tl.float32)
            l_v = tl.zeros((BN,), tl.float32)
            acc_v = tl.zeros((BN, DH), tl.float32)
        else:
            m_i = tl.full((), -1.0e30, tl.float32)
            l_i = tl.full((), 0.0, tl.float32)
            acc = tl.zeros((DH,), tl.float32)
        # split s takes key blocks s, s + SPLITS, ...: the work spreads over the splits however full the ring is
        for blk in tl.range(sid, tl.cdiv(n_ring, BN), SPLITS, num_stages=STAGES):
            slots = blk * BN + tl.arange(0, BN)
            smask = slots < n_ring
            p_k = last - ((last - slots) % C)
            visible = smask & ((pos - p_k) < window)
            # both loads issued before any arithmetic: two blocks of memory in flight per iteration
            kb = tl.load(kc_ptr + cache + slots[:, None] * stride_cs + d[None, :], mask=smask[:, None], other=0.0)
            vb = tl.load(vc_ptr + cache + slots[:, None] * stride_cs + d[None, :], mask=smask[:, None], other=0.0)
            if MMA:
                m_2, l_2, acc_2 = _attend_block(q16, kb, vb, m_2, l_2, acc_2, scale_log2, visible[None, :], True, False)
            else:
                scores = tl.sum(kb.to(tl.float32) * q[None, :], axis=1) * scale_log2
                if FP8:
                    ksc = tl.load(ks_ptr + scales + slots * stride_ss, mask=smask, other=0.0)
                    vsc = tl.load(vs_ptr + scales + slots * stride_ss, mask=smask, other=0.0)
                    scores = scores * ksc
                if LANES:
                    scores = tl.where(visible, scores, -1.0e30)
                    m_new = tl.maximum(m_v, scores)
                    alpha_v = tl.exp2(m_v - m_new)
                    p = tl.where(visible, tl.exp2(scores - m_new), 0.0)
                    l_v = l_v * alpha_v + p
                    if FP8:
                        p = p * vsc
                    acc_v = acc_v * alpha_v[:, None] + p[:, None] * vb.to(tl.float32)
                    m_v = m_new
                else:
                    m_i, l_i, alpha, p = _softmax_update_1d(m_i, l_i, scores, visible)
                    if FP8:
                        p = p * vsc
                    acc = acc * alpha + tl.sum(p[:, None] * vb.to(tl.float32), axis=0)
        if MMA:  # row 0's state
            w0 = row0.to(tl.float32)
            m_i = tl.max(tl.where(row0, m_2, -1.0e30), axis=0)
            l_i = tl.sum(l_2 * w0, axis=0)
            acc = tl.sum(acc_2 * w0[:, None], axis=0)
        elif LANES:  # merge the BN softmax states
            m_i = tl.max(m_v, axis=0)
            w = tl.where(l_v > 0.0, tl.exp2(m_v - m_i), 0.0)
            l_i = tl.sum(l_v * w, axis=0)
            acc = tl.sum(acc_v * w[:, None], axis=0)
        if sid == SPLITS - 1:  # the new key: always visible to its own query
            score = tl.sum(q * k, axis=0) * scale_log2
            m_new = tl.maximum(m_i, score)
            alpha = tl.exp2(m_i - m_new)
            p1 = tl.exp2(score - m_new)
            l_i = l_i * alpha + p1
            acc = acc * alpha + p1 * v_new
            m_i = m_new
        safe_l = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / safe_l
        if SPLITS == 1:
            tl.store(out_ptr + pid.to(tl.int64) * DH + d, o.to(out_ptr.dtype.element_ty))
        else:
            n_rows = tl.num_programs(0)
            idx = sid * n_rows + pid
            tl.store(part_o_ptr + idx.to(tl.int64) * DH + d, o, mask=(l_i > 0.0) & (d < DH))  # none: lse only
            lse = tl.where(l_i > 0.0, m_i + tl.log2(safe_l), -1.0e30)
            tl.store(part_lse_ptr + idx, lse)

    @triton.jit
    def _combine_kernel(
        part_o_ptr, part_lse_ptr, out_ptr, R, DH: tl.constexpr, SPLITS: tl.constexpr, SP2: tl.constexpr,
        BR: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Merge SPLITS partial attention outputs of (query, head) rows r = BR * program .. + BR - 1 by their
        log-sum-exp (base 2) into ``out[r]`` (out is [R, DH]: queries x heads, head-minor)."""
        _pdl_start(PDL)
        _pdl_wait(PDL)
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        rmask = r < R
        sp = tl.arange(0, SP2)
        smask = sp < SPLITS
        d = tl.arange(0, DH)
        valid = rmask[:, None] & smask[None, :]  # [BR, SP2]
        lse = tl.load(part_lse_ptr + sp[None, :] * R + r[:, None], mask=valid, other=-1.0e30)
        w = tl.where(smask[None, :], tl.exp2(lse - tl.max(lse, axis=1)[:, None]), 0.0)
        # a split that saw no key wrote its lse only (-1e30, weight 0): its output is not read
        seen = valid & (lse > -1.0e29)
        at = (sp[None, :] * R + r[:, None]).to(tl.int64)[:, :, None] * DH + d[None, None, :]
        o = tl.load(part_o_ptr + at, mask=seen[:, :, None], other=0.0)
        out = tl.sum(o * w[:, :, None], axis=1) / tl.sum(w, axis=1)[:, None]
        dst = r.to(tl.int64)[:, None] * DH + d[None, :]
        tl.store(out_ptr + dst, out.to(out_ptr.dtype.element_ty), mask=rmask[:, None])

    @triton.jit
    def _rope_split_kernel(
        qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, H, ROPE: tl.constexpr, DH: tl.constexpr, BH: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        """Program (t, g): token t's heads g * BH .. g * BH + BH - 1 as one tile (:func:`_head_tiles`)."""
        _pdl_start(PDL)
        _pdl_wait(PDL)
        t = tl.program_id(0)  # token
        h = tl.program_id(1) * BH + tl.arange(0, BH)
        d = tl.arange(0, DH)
        hmask = (h < H)[:, None]
        head = h[:, None] * DH
        base = qkv_ptr + t.to(tl.int64) * 3 * H * DH
        q = tl.load(base + head + d[None, :], mask=hmask, other=0.0).to(tl.float32)
        k = tl.load(base + H * DH + head + d[None, :], mask=hmask, other=0.0).to(tl.float32)
        v = tl.load(base + 2 * H * DH + head + d[None, :], mask=hmask, other=0.0)
        if ROPE:
            c = tl.load(cos_ptr + t * (DH // 2) + tl.arange(0, DH // 2))[None, :]
            s = tl.load(sin_ptr + t * (DH // 2) + tl.arange(0, DH // 2))[None, :]
            q = _rotate_pairs(q, c, s, BH, DH)
            k = _rotate_pairs(k, c, s, BH, DH)
        dst = t.to(tl.int64) * H * DH + head + d[None, :]
        tl.store(q_ptr + dst, q.to(q_ptr.dtype.element_ty), mask=hmask)
        tl.store(k_ptr + dst, k.to(k_ptr.dtype.element_ty), mask=hmask)
        tl.store(v_ptr + dst, v.to(v_ptr.dtype.element_ty), mask=hmask)

    @triton.jit
    def _ring_step(q, m_i, l_i, acc, kc_ptr, vc_ptr, ks_ptr, vs_ptr, cache, scales, first, first_slot, start_k, end,
                   qpos, window, C, d, stride_cs, stride_ss, scale_log2, BN: tl.constexpr, FP8: tl.constexpr,
                   IEEE: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
        """One key block of the ring in position order: keys ``t = start_k .. start_k + BN - 1`` below ``end``
        (position ``first + t``, slot ``(first_slot + t) % C``, ``first_slot = first % C``; an FP8 ring dequantized
        by its per-slot scales), then :func:`_attend_block` (with MASKED, each query's window
        ``0 <= qpos - position < window``): (m, l, acc)."""
        t = start_k + tl.arange(0, BN)
        valid = t < end
        slots = first_slot + t
        slots = tl.where(slots >= C, slots - C, slots)
        at = cache + slots[:, None] * stride_cs + d[None, :]
        kb = tl.load(kc_ptr + at, mask=valid[:, None], other=0.0)
        vb = tl.load(vc_ptr + at, mask=valid[:, None], other=0.0)
        if FP8:
            ksc = tl.load(ks_ptr + scales + slots * stride_ss, mask=valid, other=0.0)
            vsc = tl.load(vs_ptr + scales + slots * stride_ss, mask=valid, other=0.0)
            kb = (kb.to(tl.float32) * ksc[:, None]).to(q.dtype)
            vb = (vb.to(tl.float32) * vsc[:, None]).to(q.dtype)
        visible = valid[None, :] & ((qpos[:, None] - (first + t)[None, :]) < window)
        return _attend_block(q, kb, vb, m_i, l_i, acc, scale_log2, visible, MASKED, IEEE)

    @triton.jit
    def _attend_block(q, kb, vb, m_i, l_i, acc, scale_log2, visible, MASKED: tl.constexpr, IEEE: tl.constexpr):
        """One online-softmax step (base 2) of queries q [BM, DH] over keys / values [BN, DH]: (m, l, acc). With
        MASKED the scores where ``visible`` [BM, BN] is False are left out; without, every score counts and
        ``visible`` is not read (the caller's keys are all visible to all queries)."""
        if IEEE:
            scores = tl.dot(q, tl.trans(kb), input_precision="ieee") * scale_log2
        else:
            scores = tl.dot(q, tl.trans(kb)) * scale_log2
        if MASKED:
            m_i, l_i, alpha, p = _softmax_update_2d(m_i, l_i, scores, visible)
        else:
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            m_i, l_i = m_new, l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, vb.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
        return m_i, l_i, acc

    @triton.jit
    def _prefill_tile(
        qb,
        h,
        sid,
        q_ptr,
        k_ptr,
        v_ptr,
        kc_ptr,
        vc_ptr,
        ks_ptr,
        vs_ptr,
        seq_row_ptr,
        seq_start_ptr,
        seq_len_ptr,
        seq_pos_ptr,
        qb_seq_ptr,
        qb_j_ptr,
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
        stride_sb,
        stride_sh,
        stride_ss,
        blocks_per_split,
        n_tokens,
        IEEE: tl.constexpr,
        FP8: tl.constexpr,
        DH: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        QG: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        """Tile (query block qb, head h, key split sid) of :func:`_prefill_attn_kernel`."""
        seq_raw = tl.load(qb_seq_ptr + qb)
        live = seq_raw >= 0  # padding programs (fixed grids of CUDA graphs) do nothing
        seq = tl.maximum(seq_raw, 0)
        j0 = tl.load(qb_j_ptr + qb).to(tl.int32)
        row = tl.load(seq_row_ptr + seq).to(tl.int64)
        start = tl.load(seq_start_ptr + seq).to(tl.int64)
        L = tl.where(live, tl.load(seq_len_ptr + seq).to(tl.int32), 0)
        pos0 = tl.load(seq_pos_ptr + seq).to(tl.int32)  # the first new position; the ring holds < pos0
        d = tl.arange(0, DH)
        i = j0 + tl.arange(0, BM)
        imask = i < L
        tok = start + i
        qpos = pos0 + i
        m_i = tl.full((BM,), -1.0e30, tl.float32)
        l_i = tl.zeros((BM,), tl.float32)
        acc = tl.zeros((BM, DH), tl.float32)
        cache = row * stride_cb + h * stride_ch
        scales = row * stride_sb + h * stride_sh
        # the ring's keys in position order: key t (0 <= t < n_ring) is position first + t, in slot (first + t) % C
        n_ring = tl.where(live, tl.minimum(pos0, C), 0)
        first = pos0 - n_ring
        first_slot = first % C
        lo = sid * blocks_per_split * BN
        hi = tl.minimum(lo + blocks_per_split * BN, n_ring)
        # query i sees key t iff t > i + n_ring - window, so every query of the QG-query group holding this block
        # sees every key from group end + n_ring - window on. A padded step's BM differs from the unpadded one's,
        # and both should add the same scores in the same order, so what a query's key block goes through must not
        # depend on BM: the key blocks stay at lo + k * BN, and the bound is the group's (QG, a multiple of every
        # BM), not the block's (the masked and the unmasked loop may round a block differently: on sm_90 a score's
        # multiply-subtract contracts to an FMA in one and not the other). The whole blocks before the first one
        # past that bound take the window mask, the whole blocks after it none, the partial last block (keys up to
        # hi) the mask of its end
        whole = tl.maximum(hi - lo, 0) // BN  # (hi < lo: a split past a short ring's keys, nothing to read)
        j_end = (j0 // QG + 1) * QG
        t_all = lo + tl.minimum(tl.cdiv(tl.maximum(j_end + n_ring - window - lo, 0), BN), whole) * BN
        t_tail = lo + whole * BN
        # a split past a short ring's keys (most of a fresh ring's splits) reads nothing, not even its queries
        work = (hi > lo) | (sid == SPLITS - 1)
        q = tl.load(q_ptr + (tok * H + h)[:, None] * DH + d[None, :], mask=imask[:, None] & work, other=0.0)
        for start_k in range(lo, t_all, BN):
            m_i, l_i, acc = _ring_step(q, m_i, l_i, acc, kc_ptr, vc_ptr, ks_ptr, vs_ptr, cache, scales, first,
                                       first_slot, start_k, hi, qpos, window, C, d, stride_cs, stride_ss, scale_log2,
                                       BN, FP8, IEEE, True)  # fmt: skip
        for start_k in range(t_all, t_tail, BN):  # whole blocks every query sees
            m_i, l_i, acc = _ring_step(q, m_i, l_i, acc, kc_ptr, vc_ptr, ks_ptr, vs_ptr, cache, scales, first,
                                       first_slot, start_k, t_tail, qpos, window, C, d, stride_cs, stride_ss,
                                       scale_log2, BN, FP8, IEEE, False)  # fmt: skip
        for start_k in range(t_tail, hi, BN):
            m_i, l_i, acc = _ring_step(q, m_i, l_i, acc, kc_ptr, vc_ptr, ks_ptr, vs_ptr, cache, scales, first,
                                       first_slot, start_k, hi, qpos, window, C, d, stride_cs, stride_ss, scale_log2,
                                       BN, FP8, IEEE, True)  # fmt: skip
        if sid == SPLITS - 1:  # the row's own new keys, causal: up to the last query of this block
            hi_new = tl.minimum(L, j0 + BM)
            for start_j in range(0, hi_new, BN):
                j = start_j + tl.arange(0, BN)
                jmask = j < L
                src = ((start + j) * H + h)[:, None] * DH + d[None, :]
                kb = tl.load(k_ptr + src, mask=jmask[:, None], other=0.0)
                vb = tl.load(v_ptr + src, mask=jmask[:, None], other=0.0)
                delta = i[:, None] - j[None, :]
                visible = jmask[None, :] & (delta >= 0) & (delta < window)
                m_i, l_i, acc = _attend_block(q, kb, vb, m_i, l_i, acc, scale_log2, visible, True, IEEE)
        safe_l = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / safe_l[:, None]
        r = tok * H + h  # (token, head) row of the [n_tokens * H, DH] output
        if SPLITS == 1:
            tl.store(out_ptr + r[:, None] * DH + d[None, :], o.to(out_ptr.dtype.element_ty), mask=imask[:, None])
        else:
            idx = sid * n_tokens * H + r
            # a query that saw no key in this split writes its lse only (the combine reads no output for it): a
            # fresh ring's empty splits would otherwise write SPLITS x n_tokens x H x DH float32 zeros per layer
            tl.store(part_o_ptr + idx[:, None] * DH + d[None, :], o, mask=(imask & (l_i > 0.0))[:, None])
            lse = tl.where(l_i > 0.0, m_i + tl.log2(safe_l), -1.0e30)
            tl.store(part_lse_ptr + idx, lse, mask=imask)

    @triton.jit(do_not_specialize=["n_qb", "n_tiles"])  # one compiled kernel whatever the grid's size
    def _prefill_attn_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        kc_ptr,
        vc_ptr,
        ks_ptr,
        vs_ptr,
        seq_row_ptr,
        seq_start_ptr,
        seq_len_ptr,
        seq_pos_ptr,
        qb_seq_ptr,
        qb_j_ptr,
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
        stride_sb,
        stride_sh,
        stride_ss,
        blocks_per_split,
        n_tokens,
        n_qb,
        n_tiles,
        IEEE: tl.constexpr,
        FP8: tl.constexpr,
        DH: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        QG: tl.constexpr,
        SPLITS: tl.constexpr,
        PERSISTENT: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Program (qb, h, sid): query block qb of ``block_m`` queries, head h, key split sid; with PERSISTENT a 1-D
        grid of P programs, program p running the tiles p, p + P, ... of the n_tiles (query block fastest: ``tile =
        (sid * H + h) * n_qb + qb``, so the programs running at once share a head's ring in the L2; see
        :func:`prefill_attention`'s ``programs``). A tile computes the same either way. A padded grid's idle query
        blocks (at most one per sequence past the first, and the bucket's padding: under 64 tokens) take their turn
        in that order too, so a program may get up to about 1.5 times an even share of the live tiles (18 blocks, 11
        of them live, 132 programs: 4 against 2.7)."""
        _pdl_start(PDL)
        _pdl_wait(PDL)
        if PERSISTENT:
            for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
                qb, h, sid = tile % n_qb, (tile // n_qb) % H, tile // (n_qb * H)
                _prefill_tile(
                    qb, h, sid, q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, seq_row_ptr, seq_start_ptr,
                    seq_len_ptr, seq_pos_ptr, qb_seq_ptr, qb_j_ptr, out_ptr, part_o_ptr, part_lse_ptr, H, C, window,
                    scale_log2, stride_cb, stride_ch, stride_cs, stride_sb, stride_sh, stride_ss, blocks_per_split,
                    n_tokens, IEEE, FP8, DH, BM, BN, QG, SPLITS,
                )  # fmt: skip
        else:
            _prefill_tile(
                tl.program_id(0), tl.program_id(1), tl.program_id(2), q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr,
                vs_ptr, seq_row_ptr, seq_start_ptr, seq_len_ptr, seq_pos_ptr, qb_seq_ptr, qb_j_ptr, out_ptr, part_o_ptr,
                part_lse_ptr, H, C, window, scale_log2, stride_cb, stride_ch, stride_cs, stride_sb, stride_sh,
                stride_ss, blocks_per_split, n_tokens, IEEE, FP8, DH, BM, BN, QG, SPLITS,
            )  # fmt: skip

    @triton.jit
    def _kv_write_kernel(
        k_ptr,
        v_ptr,
        kc_ptr,
        vc_ptr,
        ks_ptr,
        vs_ptr,
        tok_row_ptr,
        tok_pos_ptr,
        cos_ptr,
        sin_ptr,
        NR,
        H,
        C,
        stride_cb,
        stride_ch,
        stride_cs,
        stride_sb,
        stride_sh,
        stride_ss,
        FP8: tl.constexpr,
        ROPE: tl.constexpr,
        DH: tl.constexpr,
        BH: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Program (t, g): token t's keys and values of heads g * BH .. g * BH + BH - 1 as one tile
        (:func:`_head_tiles`); with ROPE the keys are rotated by the token's (cos, sin) row first (float32, rounded
        once)."""
        _pdl_start(PDL)
        _pdl_wait(PDL)
        t = tl.program_id(0)
        pos = tl.load(tok_pos_ptr + t)
        if pos >= 0:  # -1: not stored (padding, or overwritten by a later position of the same chunk)
            row = tl.load(tok_row_ptr + t).to(tl.int64)
            h = tl.program_id(1) * BH + tl.arange(0, BH)
            d = tl.arange(0, DH)
            hmask = (h < H)[:, None]
            src = t.to(tl.int64) * H * DH + h[:, None] * DH + d[None, :]
            dst = row * stride_cb + h[:, None] * stride_ch + (pos % C) * stride_cs + d[None, :]
            k = tl.load(k_ptr + src, mask=hmask, other=0.0)
            v = tl.load(v_ptr + src, mask=hmask, other=0.0)
            if ROPE:
                even = ((d % 2) == 0)[None, :]
                tr = (t % NR).to(tl.int64)
                c = tl.load(cos_ptr + tr * (DH // 2) + d // 2)[None, :]
                s = tl.load(sin_ptr + tr * (DH // 2) + d // 2)[None, :]
                partner = tl.load(k_ptr + src + (d ^ 1)[None, :] - d[None, :], mask=hmask, other=0.0).to(tl.float32)
                k = _rotate(k.to(tl.float32), partner, c, s, even)
            if FP8:  # one scale per (position, head): max|x| / 448 over the head's Dh values (_quantize_fp8)
                kf = k.to(tl.float32)
                vf = v.to(tl.float32)
                k_scale = tl.maximum(tl.max(tl.abs(kf), axis=1) / 448.0, 1.1754943508222875e-38)
                v_scale = tl.maximum(tl.max(tl.abs(vf), axis=1) / 448.0, 1.1754943508222875e-38)
                k_code = tl.minimum(tl.maximum(kf / k_scale[:, None], -448.0), 448.0).to(kc_ptr.dtype.element_ty)
                v_code = tl.minimum(tl.maximum(vf / v_scale[:, None], -448.0), 448.0).to(vc_ptr.dtype.element_ty)
                tl.store(kc_ptr + dst, k_code, mask=hmask)
                tl.store(vc_ptr + dst, v_code, mask=hmask)
                sdst = row * stride_sb + h * stride_sh + (pos % C) * stride_ss
                tl.store(ks_ptr + sdst, k_scale, mask=h < H)
                tl.store(vs_ptr + sdst, v_scale, mask=h < H)
            else:
                tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=hmask)
                tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=hmask)

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
    def _embed_sum_kernel(
        tables,
        ids_ptr,
        out_ptr,
        D,
        T,
        stride_ib,
        stride_ik,
        stride_it,
        NT: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Row r's input embedding: ``tables[i]`` looked up at stream ``(i + 1) % NT``, summed in table order and
        rounded to the output dtype after every add (the chain of :func:`embed_add`). Every lookup is independent,
        so all NT rows are in flight at once."""
        _pdl_start(PDL)
        _pdl_wait(PDL)
        r = tl.program_id(0)  # (row, position)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < D
        ids = ids_ptr + (r // T) * stride_ib + (r % T) * stride_it
        idx = tl.load(ids + (1 % NT) * stride_ik)
        acc = tl.load(tables[0] + tl.maximum(idx, 0).to(tl.int64) * D + cols, mask=mask & (idx != -1), other=0.0)
        acc = acc.to(tl.float32)
        for i in tl.static_range(1, NT):
            idx = tl.load(ids + ((i + 1) % NT) * stride_ik)
            e = tl.load(tables[i] + tl.maximum(idx, 0).to(tl.int64) * D + cols, mask=mask & (idx != -1), other=0.0)
            acc = (acc + e.to(tl.float32)).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + r.to(tl.int64) * D + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _noise_kernel(seed_ptr, counter_ptr, out_ptr, V, stream, BLOCK: tl.constexpr, PDL: tl.constexpr):
        _pdl_start(PDL)
        _pdl_wait(PDL)
        b = tl.program_id(0)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        q = _race_noise_tl(tl.load(seed_ptr + b), tl.load(counter_ptr + b), stream, i.to(tl.int64))
        tl.store(out_ptr + b.to(tl.int64) * V + i, q, mask=i < V)

    @triton.jit
    def _sample_kernel(
        logits_ptr,
        temp_ptr,
        top_k_ptr,
        seed_ptr,
        counter_ptr,
        target_ptr,
        out_ptr,
        V,
        stride_l,
        stride_t,
        stride_o,
        stream,
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
        temperature = tl.load(temp_ptr + b)
        greedy = temperature <= 0.0
        top_k = tl.load(top_k_ptr + b).to(tl.int32)
        top_k = tl.where((top_k <= 0) | (top_k >= V), V, top_k)
        s = x / tl.where(greedy, 1.0, temperature)
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
        q = _race_noise_tl(tl.load(seed_ptr + b), tl.load(counter_ptr + b), stream, i.to(tl.int64))
        choice = tl.where(greedy, tl.argmax(x, axis=0), tl.argmax(tl.where(in_top, p / q, -1.0), axis=0))
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


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    pdl: bool | None = None,
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
        **_launch_opts(x.device, pdl, HAS_RES=residual is not None, BLOCK=block, num_warps=8 if block >= 2048 else 4),
    )  # fmt: skip
    return s.view(x.shape), y.view(x.shape)


def silu_gate(h: torch.Tensor, pdl: bool | None = None) -> torch.Tensor:
    """``silu(h[..., :H]) * h[..., H:]`` of a gated FFN's input projection h [..., 2H] -> [..., H] (the SiLU result
    rounded to h's dtype before the product, as the eager module)."""
    H = h.shape[-1] // 2
    h2 = h.contiguous().view(-1, 2 * H)
    y = torch.empty(h2.shape[0], H, device=h.device, dtype=h.dtype)
    block = 1024
    _silu_gate_kernel[(h2.shape[0], triton.cdiv(H, block))](
        h2, y, H, **_launch_opts(h.device, pdl, BLOCK=block, num_warps=4)
    )
    return y.view(*h.shape[:-1], H)


def _scale_args(
    keys: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """(key_scale, value_scale, strides over rows, heads, slots) of [B, H, C] scales: dummies without FP8."""
    if scales is None:
        return keys, keys, 0, 0, 0
    ks, vs = scales
    return ks, vs, ks.stride(0), ks.stride(1), ks.stride(2)


def decode_attention(
    qkv: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    window: int,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: DecodeConfig | None = None,
    pdl: bool | None = None,
    sized_rows: int | None = None,
) -> torch.Tensor:
    """Attention of ONE new position per query row over its cache row's ring, with the new key/value written in.

    Args:
        qkv: [b, 3 * H * Dh] (or [b, 1, 3 * H * Dh]) the fused projection's output ([q; k; v], head-major).
        keys, values: one layer's ring buffers [B, H, C, Dh] (updated in place at slot ``position % C``).
        positions: [b] long, each query's position; its cache row holds positions ``< position`` (and keeps them).
        rows: [b] long cache rows.
        window: attention window in positions (<= C).
        rope: (cos, sin) [b, Dh/2] from :func:`cspan.core.modules.rope.rope_tables`, or None (no RoPE).
        scales: (key_scale, value_scale) [B, H, C] float32 of an FP8 cache, else None.
        config: (block_n, max_splits, waves, num_warps, num_stages, form); default :func:`decode_config`.
        pdl: launch with PDL (None: :func:`pdl_enabled`).
        sized_rows: the row count the launch is sized for (the default config and the key splits), default b.
            The duplex step sizes an unpadded step as the CUDA-graph row bucket it would pad to, so that a row's
            keys are split the same way in both.

    Returns:
        [b, H * Dh] (heads concatenated; [b, 1, H * Dh] for a 3-D qkv), in qkv's dtype.
    """
    qkv2 = qkv.reshape(-1, qkv.shape[-1])
    if qkv2.stride(-1) != 1:
        qkv2 = qkv2.contiguous()
    b = qkv2.shape[0]
    sized = sized_rows or b
    _, H, C, DH = keys.shape
    out = torch.empty(b, H * DH, device=qkv.device, dtype=qkv.dtype)
    BN, max_splits, waves, warps, stages, form = (
        config or DEFAULT.decode_config or decode_config(sized, fp8=scales is not None)
    )
    if config is None and DEFAULT.decode_config is None and DH <= 64:
        BN = 64
    splits = _splits(qkv.device, sized * H, triton.cdiv(C, BN), max_splits, waves)
    # the tensor-core form takes 16-bit rings; FP8 and float32 rings run the per-slot form instead
    mma = form == 2 and scales is None and keys.dtype in (torch.bfloat16, torch.float16) and keys.dtype == qkv.dtype
    part_o = part_lse = out
    if splits > 1:
        part_o = torch.empty(splits, b * H, DH, device=qkv.device, dtype=torch.float32)
        part_lse = torch.empty(splits, b * H, device=qkv.device, dtype=torch.float32)
    cos, sin = rope if rope is not None else (out, out)
    ks, vs, *scale_strides = _scale_args(keys, scales)
    _decode_attn_kernel[(b * H, splits)](
        qkv2, cos, sin, keys, values, ks, vs, rows, positions, out, part_o, part_lse,
        H, C, int(window), _LOG2E / math.sqrt(DH), qkv2.stride(0), *keys.stride()[:3], *scale_strides,
        **_launch_opts(qkv.device, pdl, ROPE=rope is not None, FP8=scales is not None, DH=DH, BN=BN, SPLITS=splits,
                       STAGES=stages, LANES=form > 0, MMA=mma, num_warps=warps),
    )  # fmt: skip
    if splits > 1:
        _combine(part_o, part_lse, out, b * H, splits, pdl)
    return out.view(*qkv.shape[:-1], H * DH)


def _tile_warps(elements: int) -> int:
    """Warps for a program that moves ``elements`` values of one token: about 16 per thread, 1 to 8 warps."""
    return max(1, min(8, elements // 512))


def _head_tiles(device: torch.device, tokens: int, heads: int) -> tuple[int, int]:
    """(heads per program BH, head groups G) of a per-token kernel over ``tokens`` tokens: whole tokens (G = 1,
    BH = H rounded up to a power of two) once they fill about two programs per multiprocessor, else the heads
    split into G power-of-two groups until they do. A head per program spent a 600-token block's time on
    scheduling (25 us per layer at B = 1, 68 at B = 64, docs/perf/round4/c8); a token per program left a 17-token
    block on 17 multiprocessors (6 us per layer against 1.7, ``scripts/step_anatomy.py``, 2026-12-02)."""
    if heads & (heads - 1):  # not a power of two: whole tokens, masked
        return triton.next_power_of_2(heads), 1
    groups = 1
    while groups < heads and tokens * groups < 2 * _num_sms(device):
        groups *= 2
    return heads // groups, groups


def rope_split(
    qkv: torch.Tensor, num_heads: int, rope: tuple[torch.Tensor, torch.Tensor] | None = None, pdl: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the fused projection [N, 3 * H * Dh] of N tokens into q, k, v [N, H, Dh] (contiguous), RoPE applied to
    q and k when ``rope`` (cos, sin [N, Dh/2]) is given, rounded to qkv's dtype."""
    N, three_d = qkv.shape
    DH = three_d // (3 * num_heads)
    qkv = qkv.contiguous()
    q, k, v = (torch.empty(N, num_heads, DH, device=qkv.device, dtype=qkv.dtype) for _ in range(3))
    cos, sin = rope if rope is not None else (qkv, qkv)
    BH, G = _head_tiles(qkv.device, N, num_heads)
    _rope_split_kernel[(N, G)](
        qkv, cos, sin, q, k, v, num_heads,
        **_launch_opts(qkv.device, pdl, ROPE=rope is not None, DH=DH, BH=BH, num_warps=_tile_warps(BH * DH)),
    )  # fmt: skip
    return q, k, v


def block_m_for(length: int) -> int:
    """Queries per block of :func:`prefill_attention` for sequences of at most ``length`` new tokens."""
    return 16 if length <= 16 else 32 if length <= 32 else PREFILL_CONFIG[0]


@dataclass
class Ragged:
    """S sequences of new tokens of some cache rows, laid out one after the other along the token dimension of
    q / k / v (the varlen layout of FlashAttention and vLLM), for :func:`prefill_attention` and :func:`kv_write`.

    Build it with :meth:`uniform` (B' rows of T tokens each, on the device) or from host tables (the duplex
    engine's step, :func:`cspan.core.sessions.build_step`), then :meth:`at` adds the positions.

    Attributes:
        seq_row, seq_start, seq_len: [S] long: each sequence's cache row, first token index, and token count.
        qb_seq, qb_j: [Q] long: the sequence of each query block of ``block_m`` queries (-1: an idle program of a
            fixed-size grid) and the index of its first query within the sequence.
        tok_row, tok_j: [N] long: each token's cache row and index within its sequence (-1: padding).
        tok_keep: [N] bool: the token is stored (not padding, and not overwritten by a later position of the same
            sequence in a ring of C slots).
        block_m: queries per block (:func:`block_m_for`).
        seq_pos: [S] long, the sequences' first positions (their rows' offsets), from :meth:`at`.
        tok_pos: [N] long, each token's position, from :meth:`at`.
        store_pos: [N] long, ``tok_pos`` where the token is stored, else -1, from :meth:`at`.
        live_blocks: the live query blocks :func:`prefill_attention`'s key splits are sized for, or None: those
            the tokens fill (:func:`prefill_grid`). The duplex step sizes an unpadded step as the CUDA-graph bucket
            it would pad to, so that both split the keys alike.
    """

    seq_row: torch.Tensor
    seq_start: torch.Tensor
    seq_len: torch.Tensor
    qb_seq: torch.Tensor
    qb_j: torch.Tensor
    tok_row: torch.Tensor
    tok_j: torch.Tensor
    tok_keep: torch.Tensor
    block_m: int
    seq_pos: torch.Tensor | None = None
    tok_pos: torch.Tensor | None = None
    store_pos: torch.Tensor | None = None
    live_blocks: int | None = None

    def at(self, offset: torch.Tensor) -> Ragged:
        """This layout with the positions of cache offsets ``offset`` [B] (device ops only)."""
        seq_pos = offset.index_select(0, self.seq_row)
        tok_pos = offset.index_select(0, self.tok_row) + self.tok_j.clamp_min(0)
        store_pos = torch.where(self.tok_keep, tok_pos, -1)
        return dataclasses.replace(self, seq_pos=seq_pos, tok_pos=tok_pos, store_pos=store_pos)

    @classmethod
    def uniform(cls, rows: torch.Tensor, num_tokens: int, capacity: int) -> Ragged:
        """B' = ``len(rows)`` sequences of ``num_tokens`` (T) tokens each, row-major (token ``b * T + j``)."""
        dev = rows.device
        T = num_tokens
        bm = block_m_for(T)
        per = -(-T // bm)
        Bq = rows.shape[0]
        qb = torch.arange(Bq * per, device=dev)
        j = torch.arange(T, device=dev)
        return cls(
            seq_row=rows,
            seq_start=torch.arange(Bq, device=dev) * T,
            seq_len=torch.full((Bq,), T, device=dev, dtype=torch.long),
            qb_seq=qb // per,
            qb_j=(qb % per) * bm,
            tok_row=rows.repeat_interleave(T),
            tok_j=j.repeat(Bq),
            tok_keep=(j >= T - capacity).repeat(Bq),  # a chunk longer than the ring keeps its last C
            block_m=bm,
        )


PREFILL_CONFIG = (64, 64, 4, 3)
"""(block_m, block_n, num_warps, num_stages) of :func:`prefill_attention` (the best of scripts/perf_h200.py's
sweep on the H200, see docs/PERFORMANCE.md; block_m is smaller for short sequences, :func:`block_m_for`)."""
PREFILL_WAVES = 2
"""Key splits of :func:`prefill_attention`: the live query blocks' programs times the splits aim at about this many
programs per multiprocessor (two are resident per SM: one wave), rounded down, and at least two splits while the
programs without splits are fewer than two waves. On the H200 (C47, ``scripts/attention_splits.py``, us per layer, a
full 3000-position ring / a fresh one) a 17-token block takes 8 splits (23.3 / 10.5 against 29.8 / 16.2 with the
16 that four programs per SM gave), 65 tokens 4 (30.8 / 15.5 against 39.6 / 22.2), 257 tokens 2 (71.9 / 28.6 against
88.6 / 46.9), a 601-token span still 2 (14% faster than 1, ``scripts/perf_h200.py tune-prefill``); a split count
is a launch constant, sized for a full ring."""
PREFILL_BESIDE_PROGRAMS = 1
"""Programs per SM of :func:`prefill_attention` beside a decode attention (one key split per query block): each
loops over its share of the tiles, so every SM keeps room for the decode's programs from the start (the block's
kernel's program needs about half an SM's shared memory, 112 KB, so two fit per SM; a full grid of them takes the
SMs first and the decode starts late, C77: 71 us per layer). Used only while the decode attention really runs at
the same time (a second stream, ``ExecutionPlan.attention_stream``): alone, the looping grid is slower than one
program per tile (C89: 190 against 159 us per layer)."""


def prefill_grid(
    query_blocks: int,
    tokens: int,
    block_m: int,
    heads: int,
    key_blocks: int,
    sms: int,
    beside_decode: bool = False,
    splits: int | None = None,
    programs: int | None = None,
    concurrent: bool = True,
    live_blocks: int | None = None,
) -> tuple[int, int]:
    """(key splits, programs) of :func:`prefill_attention`'s launch: Q = ``query_blocks`` query blocks of the grid
    (``tokens`` N fill at most ``ceil(N / block_m)`` of them; ``live_blocks``, if given, is the count the splits are
    sized for instead: :attr:`Ragged.live_blocks`), ``heads`` heads, a ring of ``key_blocks`` key blocks, ``sms``
    multiprocessors.

    Given splits / programs are kept (programs at most the tiles; ValueError if below 1). The defaults: splits as
    :data:`PREFILL_WAVES` says; beside a decode attention (``beside_decode``), once the live query blocks times the
    heads are at least the SMs, one split, and, if the decode runs at the same time (``concurrent``),
    :data:`PREFILL_BESIDE_PROGRAMS` programs per SM; one program per tile of (query block, head, key split)
    otherwise. (With ``concurrent`` False the decode runs after the block: one split still, so that both orders
    give the same bits, on the full grid, which is faster alone.)"""
    if programs is not None and programs < 1:
        raise ValueError(f"prefill_grid: programs must be at least 1, got {programs}")
    if splits is None:  # see PREFILL_WAVES; each split at least two key blocks long
        # counted over the query blocks that N tokens fill, not the grid: a graph's grid has room for any split of
        # its bucket across its S sequences, ceil(N / block_m) + S - 1 blocks (a 641-token bucket of 8 sequences: 18
        # blocks, 11 counted)
        target = PREFILL_WAVES * sms
        live = (live_blocks or max(1, min(query_blocks, -(-tokens // block_m)))) * heads
        splits = max(target // live, 2 if live < 2 * target else 1)
        splits = max(1, min(16, splits, -(-key_blocks // 2)))
        if beside_decode and live >= sms:
            # fewer, longer programs, which share the SMs with the decode attention's (C73 / C74: 46-52 % of a
            # 600-column block's attention hidden under 64 rows' decode, against 0-6 % with the splits above);
            # a short block keeps its splits (its few programs would each walk the whole ring)
            splits = 1
            if programs is None and concurrent:
                programs = PREFILL_BESIDE_PROGRAMS * sms
    tiles = query_blocks * heads * splits
    return splits, tiles if programs is None else min(programs, tiles)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    ragged: Ragged,
    window: int,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: tuple[int, int, int, int] | None = None,
    splits: int | None = None,
    pdl: bool | None = None,
    beside_decode: bool = False,
    programs: int | None = None,
    concurrent: bool = True,
) -> torch.Tensor:
    """Causal attention of ragged sequences of new tokens, each over its cache row's ring (read in place, not
    modified) and its own new tokens.

    Args:
        q, k, v: [N, H, Dh] new queries/keys/values (RoPE applied), laid out as ``ragged`` says.
        keys, values: one layer's ring buffers [B, H, C, Dh].
        ragged: the sequences, with positions (:meth:`Ragged.at`).
        window: attention window in positions (<= C).
        scales: (key_scale, value_scale) [B, H, C] of an FP8 cache, else None.
        config: (block_m, block_n, num_warps, num_stages) for tuning; block_m must be ``ragged.block_m``
            (default :data:`PREFILL_CONFIG`).
        splits: key splits per query block, for tuning (default: see :data:`PREFILL_WAVES`).
        pdl: launch with PDL (None: :func:`pdl_enabled`).
        beside_decode: the step also has decode slots, whose attention may run beside this one (default splits
            and programs only): one key split per query block once the query blocks alone give every SM a
            program, and then :data:`PREFILL_BESIDE_PROGRAMS` programs per SM.
        programs: the grid's programs, for tuning (default: one per tile of (query block, head, key split), or
            as ``beside_decode`` says); fewer loop over the tiles, with the same results.
        concurrent: with ``beside_decode``, the decode attention runs at the same time (another stream); False:
            after this one (:func:`prefill_grid`).

    Raises:
        ValueError: ``programs`` below 1.

    Returns:
        [N, H * Dh] in q's dtype (rows of padding tokens, and of tokens outside ``ragged``'s query blocks, are
        undefined).
    """
    N, H, DH = q.shape
    C = keys.shape[2]
    out = torch.empty(N, H * DH, device=q.device, dtype=q.dtype)
    _, BN, warps, stages = config or PREFILL_CONFIG
    BM = ragged.block_m
    Q = ragged.qb_seq.shape[0]
    key_blocks = triton.cdiv(C, BN)
    sms = _num_sms(q.device)
    splits, programs = prefill_grid(
        Q, N, BM, H, key_blocks, sms, beside_decode, splits, programs, concurrent, ragged.live_blocks
    )
    per = triton.cdiv(key_blocks, splits)
    tiles = Q * H * splits
    part_o = part_lse = out
    if splits > 1:
        part_o = torch.empty(splits, N * H, DH, device=q.device, dtype=torch.float32)
        # every live query block writes all its splits' partials; a padding token's (and, at the last layer, a
        # token outside the query blocks asked for) are left unwritten: its output is undefined, as documented
        part_lse = torch.empty(splits, N * H, device=q.device, dtype=torch.float32)
    ks, vs, *scale_strides = _scale_args(keys, scales)
    assert ragged.seq_pos is not None, "prefill_attention needs the positions: Ragged.at(offset)"
    # the loop a key block goes through is decided per group of QG queries, the same for every BM up to 64 (the
    # masked and the unmasked loop may round a block differently: see the kernel)
    QG = max(BM, 64)
    persistent = programs < tiles
    _prefill_attn_kernel[(programs,) if persistent else (Q, H, splits)](
        q, k, v, keys, values, ks, vs, ragged.seq_row, ragged.seq_start, ragged.seq_len, ragged.seq_pos,
        ragged.qb_seq, ragged.qb_j, out, part_o, part_lse,
        H, C, int(window), _LOG2E / math.sqrt(DH), *keys.stride()[:3], *scale_strides, per, N, Q, tiles,
        **_launch_opts(q.device, pdl, IEEE=q.dtype == torch.float32, FP8=scales is not None, DH=DH, BM=BM, BN=BN,
                       QG=QG, SPLITS=splits, PERSISTENT=persistent, num_warps=warps, num_stages=stages),
    )  # fmt: skip
    if splits > 1:
        _combine(part_o, part_lse, out, N * H, splits, pdl)
    return out


COMBINE_TILE = 32
"""Rows times split slots (splits rounded up to a power of two) one program of the split combine holds: 16 rows of
a two-split prefill (a 601-token block's 19,232 rows in 1,202 programs instead of one program per row, whose
combine took 16.3 us a layer in device call C96; the 600-column span at one row −0.62 ms in C100), 4 of an
eight-split one (the one-row decode's), 1 from 17 splits on. The rows per program follow from the split count alone,
never from the number of rows, so a step padded to its graph bucket computes every row with the same instructions
as the unpadded step when both split the keys alike (the duplex step sizes an unpadded step's attention as its
graph's: :attr:`Ragged.live_blocks`, :func:`decode_attention`'s ``sized_rows``)."""


def _combine(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, rows: int, splits: int, pdl) -> None:
    """Merge the key splits' partial outputs [splits, rows, DH] (float32) by their log-sum-exp [splits, rows] into
    out [rows, DH] (``_combine_kernel``; rows per program: :data:`COMBINE_TILE`)."""
    sp2 = triton.next_power_of_2(splits)
    br = max(1, COMBINE_TILE // sp2)  # splits >= 2 here: at most 16 rows
    DH = part_o.shape[-1]
    _combine_kernel[(triton.cdiv(rows, br),)](
        part_o, part_lse, out, rows,
        **_launch_opts(out.device, pdl, DH=DH, SPLITS=splits, SP2=sp2, BR=br, num_warps=4),
    )  # fmt: skip


def kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    pdl: bool | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    rope_rows: int | None = None,
) -> None:
    """Store new keys/values k, v [N, H, Dh] into the ring buffers [B, H, C, Dh] (FP8 with ``scales``): token t at
    slot ``positions[t] % C`` of row ``rows[t]``, where ``positions[t] >= 0`` (a ragged block: ``Ragged.tok_row``
    and ``Ragged.store_pos``). With ``rope`` (cos, sin [N, Dh/2] float32) each key is rotated first, as
    :func:`rope_split` rotates (the pinned persona's sinks, :class:`cspan.core.window.PinnedSinks`); token t takes
    row ``t % rope_rows`` of the tables (default N: its own)."""
    N, H, DH = k.shape
    C = keys.shape[2]
    ks, vs, *scale_strides = _scale_args(keys, scales)
    cos, sin = rope if rope is not None else (k, k)
    BH, G = _head_tiles(k.device, N, H)
    _kv_write_kernel[(N, G)](
        k, v, keys, values, ks, vs, rows, positions, cos, sin, rope_rows or N, H, C, *keys.stride()[:3], *scale_strides,
        **_launch_opts(k.device, pdl, FP8=scales is not None, ROPE=rope is not None, DH=DH, BH=BH,
                       num_warps=_tile_warps(BH * DH)),
    )  # fmt: skip


def embed_add(x: torch.Tensor | None, table: torch.Tensor, ids: torch.Tensor, pdl: bool | None = None) -> torch.Tensor:
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
        **_launch_opts(table.device, pdl, HAS_X=x is not None, BLOCK=block, num_warps=4),
    )  # fmt: skip
    return out if ids.dim() == 2 else out[:, 0]


def embed_sum(tables: Sequence[torch.Tensor], ids: torch.Tensor, pdl: bool | None = None) -> torch.Tensor:
    """The temporal transformer's input in one launch: ``tables[i][ids[:, (i + 1) % K]]`` summed over the K tables
    in their order (id -1 a zero row), rounded to the tables' dtype after every add: the same values as the chain
    of :func:`embed_add` it replaces (audio codebooks 1..K-1, then the text stream 0: upstream ``LMModel`` order).

    Args:
        tables: K tables [V_i, D] of one dtype (vocabularies may differ).
        ids: [B, K, T] long ids in [-1, V_i), any strides.

    Returns:
        [B, T, D] in the tables' dtype.
    """
    B, K, T = ids.shape
    if len(tables) != K:
        raise ValueError(f"embed_sum: {len(tables)} tables for {K} streams of ids")
    D = tables[0].shape[1]
    out = torch.empty(B, T, D, device=tables[0].device, dtype=tables[0].dtype)
    block = min(1024, triton.next_power_of_2(D))
    _embed_sum_kernel[(B * T, triton.cdiv(D, block))](
        tuple(tables), ids, out, D, T, *ids.stride(),
        **_launch_opts(out.device, pdl, NT=K, BLOCK=block, num_warps=4),
    )  # fmt: skip
    return out


SAMPLE_MAX_VOCAB = 8192
"""Largest vocabulary :func:`sample_top_k` handles (one program holds a row in registers): the audio codebooks."""


def race_noise_fused(
    seed: torch.Tensor, counter: torch.Tensor, stream: int, vocab: int, pdl: bool | None = None
) -> torch.Tensor:
    """:func:`race_noise` in one kernel: [b, V] float32."""
    b = seed.shape[0]
    out = torch.empty(b, vocab, device=seed.device, dtype=torch.float32)
    block = 1024
    _noise_kernel[(b, triton.cdiv(vocab, block))](
        seed, counter, out, vocab, int(stream), **_launch_opts(seed.device, pdl, BLOCK=block, num_warps=4)
    )
    return out


def sample_top_k(
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    top_k: int | torch.Tensor,
    seed: torch.Tensor,
    counter: torch.Tensor,
    stream: int,
    known: torch.Tensor,
    out: torch.Tensor,
    pdl: bool | None = None,
) -> torch.Tensor:
    """One token per row in one kernel: temperature / top-k exponential-race sampling, or greedy, then forcing.

    The rule of :func:`cspan.core.sampling.sample_race` (kyutai-labs/moshi ``sample_token``: ``argmax_{i in top-k}
    softmax(logits / T)_i / q_i`` with ``q_i ~ Exp(1)``, a draw from the top-k distribution; logits tied with the
    k-th largest all stay in the race); greedy (``temperature <= 0``) is the first argmax. The noise ``q`` is
    :func:`race_noise` of (seed, counter, stream), computed in the kernel. Each row reads its own temperature and
    top-k (the k-th largest found by bisection over the row, so any k costs the same).

    Args:
        logits: [B, V] (V <= :data:`SAMPLE_MAX_VOCAB`).
        temperature: [B] float32 per row, or one for all rows; ``<= 0``: greedy.
        top_k: [B] long per row, or one for all rows; ``<= 0`` or ``>= V`` keeps all.
        seed, counter: [B] long, each row's session seed and frame counter.
        stream: the noise stream (1 + k for depformer codebook k).
        known: [B] long, the token to keep where it is not -2 (forced entries), any stride.
        out: [B] long destination (any stride, e.g. a column of the frame being built); also returned.
        pdl: launch with PDL (None: :func:`pdl_enabled`).
    """
    B, V = logits.shape
    if not isinstance(temperature, torch.Tensor):
        temperature = torch.full((B,), float(temperature), device=logits.device, dtype=torch.float32)
    if not isinstance(top_k, torch.Tensor):
        top_k = torch.full((B,), int(top_k), device=logits.device, dtype=torch.long)
    _sample_kernel[(B,)](
        logits, temperature.float().contiguous(), top_k.contiguous(), seed, counter, known, out, V,
        logits.stride(0), known.stride(0), out.stride(0), int(stream),
        **_launch_opts(logits.device, pdl, KEY16=logits.element_size() == 2, BLOCK=triton.next_power_of_2(V),
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
    pdl: bool | None = None,
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
        **_launch_opts(x.device, pdl, NORM=norm is not None, RES=residual is not None, GATE=gate, BM=BM, BN=BN, BK=BK,
                       num_warps=warps),
    )  # fmt: skip
    return y


__all__ = [
    "DECODE_CONFIGS",
    "DECODE_CONFIGS_FP8",
    "GEMV_MAX_K",
    "GEMV_MAX_ROWS",
    "HAVE_TRITON",
    "SAMPLE_MAX_VOCAB",
    "KernelSettings",
    "Ragged",
    "block_m_for",
    "decode_attention",
    "decode_config",
    "embed_add",
    "embed_sum",
    "gemv",
    "kv_write",
    "noise_keys",
    "pdl_enabled",
    "pdl_supported",
    "prefill_attention",
    "prefill_grid",
    "race_noise",
    "race_noise_fused",
    "rms_norm",
    "rope_split",
    "runs_on",
    "sample_top_k",
    "settings_from_env",
    "silu_gate",
    "usable",
]
