"""One generic CUDA-graph helper: a function replayed from a graph per key of static shapes.

After kyutai-labs/moshi ``moshi/utils/compile.py`` (``CUDAGraphed``): the first call of a key runs the function
eagerly (it warms up the libraries: cuBLAS handles, Triton compilations), the second captures it on static copies
of its inputs and replays the graph, later calls copy their inputs into those static buffers and replay. The
function must be a pure function of its tensor inputs and of state tensors it updates in place (no host
synchronisation, no Python branch on tensor values), so a replay equals an eager call. The duplex engine graphs its
token step per (live-row bucket, block-column bucket, kind of call) and the whole frame the same way.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Hashable
from typing import Any

import torch


def clone_outputs(value: Any) -> Any:
    """A copy of a function's outputs (tensors cloned; tuples, lists and dataclasses rebuilt): a graph's static
    outputs are overwritten by its next replay."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(clone_outputs(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: clone_outputs(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **fields)
    return value


class _Captured:
    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: list[Any], outputs: Any) -> None:
        self.graph = graph
        self.inputs = inputs
        self.outputs = outputs


class GraphCache:
    """``fn(*inputs)`` replayed from one CUDA graph per key (see the module docstring).

    Args:
        fn: the function; its tensor inputs are copied into the graph's static buffers at each replay, its other
            inputs (None, host objects) are those of the capture for every replay of the key; its outputs are
            tensors in tuples, lists or dataclasses.
        enabled: False runs ``fn`` eagerly every time (CPU, ``cuda_graphs=False``).

    Attributes:
        graphs: key -> captured graph (None while a key has been seen once).
    """

    def __init__(self, fn: Callable[..., Any], enabled: bool = True) -> None:
        self.fn = fn
        self.enabled = enabled
        self.graphs: dict[Hashable, _Captured | None] = {}
        self._pool: Any = None

    def __call__(self, key: Hashable | None, *inputs: Any) -> Any:
        """Run ``fn(*inputs)``: eagerly without graphs, for a None key, or on a key's first use; else replayed."""
        if not self.enabled or key is None:
            return self.fn(*inputs)
        if key not in self.graphs:
            self.graphs[key] = None
            return self.fn(*inputs)
        captured = self.graphs[key]
        if captured is None:
            captured = self._capture(inputs)
            self.graphs[key] = captured
        else:
            for static, given in zip(captured.inputs, inputs, strict=True):
                if isinstance(static, torch.Tensor):
                    static.copy_(given, non_blocking=True)
        captured.graph.replay()
        return clone_outputs(captured.outputs)

    def _capture(self, inputs: tuple[Any, ...]) -> _Captured:
        device = next((x.device for x in inputs if isinstance(x, torch.Tensor) and x.is_cuda), None)
        static = [x.to(device).clone() if isinstance(x, torch.Tensor) else x for x in inputs]
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # No garbage collection inside the capture (torch.cuda.graph collects before it starts): a collection
        # triggered by the captured code's allocations could destroy another graph (a dropped engine's, in a
        # reference cycle), a call CUDA refuses while a stream captures, which invalidates this capture (seen in
        # the GPU test run C13: "operation not permitted when stream is capturing (function reset)").
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self._pool):  # records only: no state moves until the replay
                outputs = self.fn(*static)
        finally:
            if collecting:
                gc.enable()
        return _Captured(graph, static, outputs)


__all__ = ["GraphCache", "clone_outputs"]
