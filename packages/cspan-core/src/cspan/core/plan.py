"""The execution plan of a duplex engine: which kernels, graphs and cache format run the step, chosen once.

vLLM picks its attention backend once (``get_attn_backend``) and hands it to the layers; the engine does the same
here: :func:`resolve_plan` looks at the model, the device, the arguments and the environment (the switches of
:func:`cspan.core.modules.fused.settings_from_env`, and ``NO_CUDA_GRAPH``) when the engine is built, and the step,
the transformer and the sampler only read the resulting :class:`ExecutionPlan`: nothing on the per-frame path
reads the environment or decides a kernel path again. That includes the decode attention: the project's Triton
kernel, or FlashInfer's (:mod:`cspan.core.attention`) for steps of many rows when it is installed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import attention
from .kv_cache import FP8
from .modules import fused as kernels

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128)
"""Live-row counts the step's CUDA graphs are captured at (a step of b live rows runs at the smallest bucket >= b;
the padding rows compute on a scratch row and change nothing)."""
BLOCK_BUCKETS = tuple(sorted((0, 17, 33, 65, *range(129, 1026, 64), 601, 1281, 1537, 2049)))
"""Ragged tokens per step (every block row's n columns and its next position: n + 1 per row, all rows together)
the graphs are captured at; a step with more runs eagerly. One row's block of 16, 32, 64, 128, ... 1024 columns
or of the default longest span (600) fits exactly; from 129 on the step is compute-bound (its products grow with
the tokens), so the buckets are 64 apart up to 1025: a step pads at most 63 tokens there (past 1025, several rows'
blocks together, 255 to 511) (a bucket 50 % too large cost a
256-column span 2.5 ms, 22 %, in the device call of 2026-12-02)."""
KV_DTYPES = ("auto", "bf16", "fp16", "fp32", "fp8")


@dataclass(frozen=True)
class ExecutionPlan:
    """How one engine runs its step (see the module docstring).

    Attributes:
        device: where the model runs.
        fused: the Triton kernels of :mod:`cspan.core.modules.fused` for the temporal transformer's ragged step,
            the depformer and sampling (else the eager modules).
        depformer_gemv: the depformer's one-position layers as GEMV launches (fused path, at most
            ``kernels.GEMV_MAX_ROWS`` rows).
        pdl: programmatic dependent launch for every kernel (Hopper and later).
        cuda_graphs: replay the step (and the whole frame) from CUDA graphs keyed by static shapes.
        buckets: lay every step out padded to the graph buckets (live rows padded with the scratch row, block
            columns with padding columns): on with ``cuda_graphs``; on without them only to run a graph's exact
            layout eagerly (tests: ``dataclasses.replace(engine.plan, buckets=True)``).
        kv_dtype: the KV cache's storage dtype (the model's, or ``torch.float8_e4m3fn``).
        decode_config: :func:`cspan.core.modules.fused.decode_attention`'s config for every batch size (tuning
            runs), or None for :data:`cspan.core.modules.fused.DECODE_CONFIGS`.
        library: which steps read the ring with FlashInfer's decode (:mod:`cspan.core.attention`): "measured" (the
            row counts where it was at least as fast, :func:`cspan.core.attention.library_faster`), "always"
            (``CSPAN_ATTENTION=flashinfer``), or None: never (not installed, ``CSPAN_ATTENTION=triton``, an FP8
            cache, or the eager path).
        attention_stream: the CUDA stream a step's ragged sequences' attention runs on beside the decode slots'
            attention (:meth:`cspan.core.modules.transformer.StreamingTransformer.forward_step`), or None: one
            after the other (CPU, the eager path, ``CSPAN_SPAN_OVERLAP=0``).
        row_buckets, block_buckets: the graph buckets (:data:`ROW_BUCKETS`, :data:`BLOCK_BUCKETS`).
    """

    device: torch.device
    fused: bool
    depformer_gemv: bool
    pdl: bool
    cuda_graphs: bool
    kv_dtype: torch.dtype
    decode_config: tuple[int, int, int, int, int, int] | None = None
    library: str | None = None
    attention_stream: torch.cuda.Stream | None = None
    row_buckets: tuple[int, ...] = ROW_BUCKETS
    block_buckets: tuple[int, ...] = BLOCK_BUCKETS
    buckets: bool = False

    @property
    def fp8(self) -> bool:
        return self.kv_dtype == FP8

    def library_decode(self, rows: int) -> bool:
        """Whether a step of ``rows`` (padded) rows reads the ring with the library decode."""
        if self.library is None:
            return False
        return self.library == "always" or attention.library_faster(rows)

    def graph_rows(self, rows: int) -> int:
        """The row bucket of ``rows`` live rows (``rows`` itself past the largest), with or without :attr:`buckets`."""
        return next((b for b in self.row_buckets if b >= rows), rows)

    def graph_tokens(self, tokens: int) -> int | None:
        """The block bucket of ``tokens`` ragged tokens, or None past the largest, with or without :attr:`buckets`."""
        return next((b for b in self.block_buckets if b >= tokens), None)

    def rows_bucket(self, rows: int) -> int:
        """The padded row count of a step of ``rows`` live rows (``rows`` itself without buckets)."""
        return self.graph_rows(rows) if self.buckets else rows

    def block_bucket(self, columns: int) -> int | None:
        """The padded block column count of a step reading ``columns`` block columns (``columns`` without buckets),
        or None when no graph serves it (the step runs eagerly, unpadded)."""
        if not self.buckets:
            return columns
        if not self.fused and columns:  # the eager path lays blocks out on the host: graphed without blocks only
            return None
        return self.graph_tokens(columns)


def parse_kv_dtype(kv_dtype: str | torch.dtype | None, model_dtype: torch.dtype) -> torch.dtype:
    """The cache storage dtype for ``kv_dtype`` ("auto" / None = the model's, "bf16", "fp16", "fp32", "fp8", or one
    of those as a torch dtype: ``torch.bfloat16``, ``torch.float16``, ``torch.float32``, ``torch.float8_e4m3fn``).

    Raises:
        ValueError: an unknown name or another dtype (an int8 or float64 ring was accepted and ran, its keys and
            values truncated or read back in the wrong precision).
    """
    if kv_dtype is None or kv_dtype == "auto":
        return model_dtype
    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": FP8}
    if isinstance(kv_dtype, torch.dtype):
        if kv_dtype not in names.values():
            raise ValueError(
                f"kv_dtype {kv_dtype} is not a KV cache storage: use one of {', '.join(KV_DTYPES)} (or "
                "torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)"
            )
        return kv_dtype
    if kv_dtype not in names:
        raise ValueError(f"kv_dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    return names[kv_dtype]


def resolve_plan(
    lm: torch.nn.Module,
    *,
    cuda_graphs: bool | None = None,
    kv_dtype: str | torch.dtype | None = None,
    fused: bool | None = None,
) -> ExecutionPlan:
    """Choose how an engine over ``lm`` runs (the only place the engine's kernel switches are read).

    Args:
        lm: the :class:`cspan.core.lm.LMModel`, on its device and dtype.
        cuda_graphs: None: on for CUDA unless ``NO_CUDA_GRAPH`` is set; True off CUDA raises.
        kv_dtype: see :func:`parse_kv_dtype`.
        fused: None: the Triton kernels for bfloat16 / float16 models on CUDA (and whenever ``CSPAN_FUSED=1``,
            also on CPU tensors under ``TRITON_INTERPRET=1``) unless ``CSPAN_FUSED=0``; True / False to force (True
            where the kernels cannot run raises).

    Raises:
        ValueError: ``cuda_graphs=True`` off CUDA, ``fused=True`` where the kernels cannot run, an unknown kv_dtype.
    """
    device = lm.device
    settings = kernels.settings_from_env()
    if cuda_graphs is None:
        cuda_graphs = device.type == "cuda" and not os.environ.get("NO_CUDA_GRAPH")
    elif cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a CUDA device, the engine runs on {device}")
    can_fuse = kernels.runs_on(device, settings) and lm.transformer.fused_supported()
    if fused is None:
        fused_on = can_fuse and (settings.forced or lm.dtype in (torch.bfloat16, torch.float16))
    elif fused and not can_fuse:
        raise ValueError(
            f"fused=True: the Triton kernels cannot run this model on {device} (they need CUDA and Triton, or "
            "TRITON_INTERPRET=1 CSPAN_FUSED=1 on the CPU, and a causal RoPE transformer)"
        )
    else:
        fused_on = bool(fused)
    kv = parse_kv_dtype(kv_dtype, lm.dtype)
    overlap = fused_on and device.type == "cuda" and settings.span_overlap
    library = None
    window_is_ring = lm.cfg.context is not None  # the temporal cache holds exactly the window
    library_ok = (
        fused_on
        and device.type == "cuda"
        and kv in (torch.bfloat16, torch.float16)
        and window_is_ring
        and lm.transformer.head_dim in attention.HEAD_DIMS
    )
    if library_ok and settings.attention != "triton" and attention.available():
        library = "always" if settings.attention == "flashinfer" else "measured"
    return ExecutionPlan(
        device=device,
        fused=fused_on,
        depformer_gemv=fused_on and settings.gemv,
        pdl=fused_on and settings.pdl and not settings.interpret and kernels.pdl_supported(device),
        cuda_graphs=bool(cuda_graphs),
        kv_dtype=kv,
        decode_config=settings.decode_config,
        library=library,
        attention_stream=torch.cuda.Stream(device, priority=-1) if overlap else None,
        buckets=bool(cuda_graphs),
    )


__all__ = ["BLOCK_BUCKETS", "KV_DTYPES", "ROW_BUCKETS", "ExecutionPlan", "parse_kv_dtype", "resolve_plan"]
