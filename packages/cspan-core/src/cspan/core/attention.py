"""Library decode attention for the engine's step: FlashInfer's paged decode over the ring KV cache, zero copy.

The ring of one layer, ``[B, H, C, Dh]`` (:class:`cspan.core.kv_cache.KVCache`), is FlashInfer's paged cache in its
``HND`` layout with one page of C slots per row: row r is page r, and a query at position ``p`` attends to the
``min(p + 1, C)`` first slots of its page (the slots holding positions ``<= p`` while the ring fills; all C, every
one in the window, once it is full). That is the engine's rule when the window equals the ring (the temporal
transformer's: 3000 and 3000), and the page table is just the rows. The new position's key and value are written
first (:func:`cspan.core.modules.fused.kv_write`), so the ring holds them when FlashInfer reads it.

Measured on an H200 (docs/perf/round4/c8/attention.log, full 3000-slot rings, bf16, us per 32-head layer, the
project's Triton kernel at its best configuration per batch size): FlashInfer reads the ring at the copy bandwidth
from 8 rows on (B = 8 / 16 / 24 / 48 / 64 / 80 / 128: 90.2 / 178.3 / 264.6 / 519.4 / 681.5 / 850.4 / 1357.7 against
Triton's 93.6 / 181.1 / 268.5 / 521.4 / 689.2 / 857.8 / 1367.6), except at 32 rows (367.2 against 351.6; C101, the
Triton kernel's tensor-core form: 376.9 against 345.6); one page per row leaves it no key split at one row (41.8
against 21.3; C101: 41.9 against 18.5). :data:`FASTER_ROWS` holds that sweep, and the plan
uses FlashInfer for a step of b rows when it was at least as fast at the smallest measured size >= b, it imports,
and the cache is bf16 / fp16 (:func:`cspan.core.plan.resolve_plan`; ``CSPAN_ATTENTION=triton`` keeps the Triton
kernel everywhere, ``=flashinfer`` uses FlashInfer everywhere). FlashInfer compiles its kernels on first use (nvcc,
a few seconds). Source: FlashInfer, ``BatchDecodeWithPagedKVCacheWrapper``
(flashinfer-ai/flashinfer, ``flashinfer/decode.py``).

``plan`` runs on the host before each step (the rows and their key counts are host-known; a plan equal to the last
one is skipped); with CUDA graphs the wrapper of a row bucket keeps fixed buffers that the captured kernels read, as
vLLM does.
"""

from __future__ import annotations

from typing import Any

import torch

FASTER_ROWS = (
    (1, False),
    (4, False),
    (8, True),
    (16, True),
    (24, True),
    (32, False),
    (48, True),
    (64, True),
    (80, True),
    (128, True),
)
"""(rows, FlashInfer at least as fast as the Triton kernel) per batch size of the C8 sweep (module docstring)."""
WORKSPACE_BYTES = 128 << 20
HEAD_DIMS = (64, 128, 256)
"""Head sizes FlashInfer's decode kernels are built for (others: the Triton kernel)."""


def library_faster(rows: int) -> bool:
    """Whether FlashInfer's decode was at least as fast as the Triton kernel for a step of ``rows`` rows: the
    measurement at the smallest swept size >= rows (the largest beyond the sweep)."""
    return next((faster for size, faster in FASTER_ROWS if size >= rows), FASTER_ROWS[-1][1])


def available() -> bool:
    """Whether FlashInfer imports."""
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return True


class FlashInferDecode:
    """FlashInfer decode over the engine's ring KV cache (see the module docstring).

    Args:
        device: the CUDA device.
        num_heads, head_dim, capacity: of the cache (H, Dh, C).
        dtype: of the queries and the cache (bf16 / fp16).
        cuda_graphs: keep one wrapper per row count with fixed buffers (for graph capture).
    """

    def __init__(
        self, device: torch.device, num_heads: int, head_dim: int, capacity: int, dtype: torch.dtype, cuda_graphs: bool
    ) -> None:
        import flashinfer

        self._flashinfer = flashinfer
        self.device, self.num_heads, self.head_dim, self.capacity = device, num_heads, head_dim, capacity
        self.dtype, self.cuda_graphs = dtype, cuda_graphs
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrappers: dict[int, Any] = {}
        self._planned: tuple | None = None  # (rows, lengths) of the plan the workspace holds

    def _wrapper(self, rows: int) -> Any:
        if rows not in self._wrappers:
            fi = self._flashinfer
            if self.cuda_graphs:
                self._wrappers[rows] = fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace,
                    "HND",
                    use_cuda_graph=True,
                    paged_kv_indptr_buffer=torch.zeros(rows + 1, dtype=torch.int32, device=self.device),
                    paged_kv_indices_buffer=torch.zeros(rows, dtype=torch.int32, device=self.device),
                    paged_kv_last_page_len_buffer=torch.zeros(rows, dtype=torch.int32, device=self.device),
                )
            else:
                self._wrappers[rows] = fi.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "HND")
        return self._wrappers[rows]

    def plan(self, rows: list[int], positions: list[int]) -> None:
        """Before a step (host): the cache rows of its b queries (padding rows included) and the position each
        query feeds; the query attends to ``min(position + 1, C)`` slots of its row.

        A plan equal to the last one is not made again: the wrappers share one workspace, which still holds it
        (on full rings every plain step's plan is the last one's: about 0.6 ms of host time per step at 64 rows on
        the H200's host, C83)."""
        b = len(rows)
        lengths = [min(p + 1, self.capacity) for p in positions]
        key = (tuple(rows), tuple(lengths))
        if key == self._planned:
            return
        self._planned = None  # until the plan below has been made
        self._wrapper(b).plan(
            torch.arange(b + 1, dtype=torch.int32),
            torch.tensor(rows, dtype=torch.int32),
            torch.tensor(lengths, dtype=torch.int32),
            self.num_heads,
            self.num_heads,
            self.head_dim,
            self.capacity,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )
        self._planned = key

    def run(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q [b, H, Dh] (RoPE applied) over one layer's rings [B, H, C, Dh] -> [b, H * Dh]."""
        out = self._wrapper(q.shape[0]).run(q, (keys, values))
        return out.reshape(q.shape[0], -1)


__all__ = ["FASTER_ROWS", "FlashInferDecode", "available", "library_faster"]
