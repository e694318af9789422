"""GPU: one whole frame (temporal step, text argmax, dep_q depformer steps) runs without host synchronisation and
replays from a CUDA graph with the eager results, across the sliding-window wrap."""

from __future__ import annotations

import pytest
import torch

from cspan.core.config import LMConfig
from cspan.core.lm import LMModel

DELAYS = [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]


def _tiny_7b_shaped(dep_q: int) -> LMConfig:
    return LMConfig(
        dim=64,
        text_card=100,
        n_q=16,
        dep_q=dep_q,
        card=64,
        num_heads=4,
        num_layers=2,
        hidden_scale=4.125,
        causal=True,
        context=8,
        gating="silu",
        norm="rms_norm_f32",
        positional_embedding="rope",
        depformer_dim=32,
        depformer_dim_feedforward=132,
        depformer_num_heads=2,
        depformer_num_layers=2,
        depformer_multi_linear=True,
        depformer_gating="silu",
        depformer_pos_emb="none",
        depformer_weights_per_step=True,
        delays=DELAYS,
    )


def _frame(model: LMModel, column: torch.Tensor, state, dep_state) -> tuple[torch.Tensor, torch.Tensor]:
    hidden, text_logits = model.temporal(column, state)
    text = text_logits[:, 0].float().argmax(-1)
    dep_state.reset()
    prev, tokens = text, [text]
    for k in range(model.dep_q):
        prev = model.depformer_logits(k, hidden[:, 0], prev, dep_state).float().argmax(-1)
        tokens.append(prev)
    return text_logits[:, 0], torch.stack(tokens, dim=1)


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "dep_q"), [(torch.float32, 8), (torch.bfloat16, 16)])
def test_frame_step_has_no_host_sync_and_replays_from_a_cuda_graph(dtype: torch.dtype, dep_q: int) -> None:
    torch.manual_seed(0)
    model = LMModel(_tiny_7b_shaped(dep_q), device="cuda", dtype=dtype).eval()
    B, steps = 3, 20  # 20 frames > context 8: the ring wraps twice
    columns = torch.randint(0, 64, (steps, B, 17, 1), device="cuda")
    columns[:, :, 0] = torch.randint(0, 100, (steps, B, 1), device="cuda")

    with torch.no_grad():
        state, dep_state = model.new_state(B), model.new_depformer_state(B)
        _frame(model, columns[0], state, dep_state)  # first call: lazy library initialisation
        state.reset()
        eager = []
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for t in range(steps):
                eager.append(_frame(model, columns[t], state, dep_state))
        finally:
            torch.cuda.set_sync_debug_mode("default")

        g_state, g_dep = model.new_state(B), model.new_depformer_state(B)
        static_column = columns[0].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _frame(model, static_column, g_state, g_dep)
        torch.cuda.current_stream().wait_stream(side)
        g_state.reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_logits, out_tokens = _frame(model, static_column, g_state, g_dep)
        assert g_state.offset.tolist() == [0, 0, 0]  # capture recorded, did not run

        atol = 1e-5 if dtype == torch.float32 else 2e-2
        for t in range(steps):
            static_column.copy_(columns[t])
            graph.replay()
            ref_logits, ref_tokens = eager[t]
            assert torch.allclose(out_logits.float(), ref_logits.float(), atol=atol, rtol=0), t
            assert torch.equal(out_tokens, ref_tokens), t
        assert g_state.offset.tolist() == [steps] * B


@pytest.mark.gpu
def test_a_capture_survives_garbage_collection_of_another_graph() -> None:
    """A graph that becomes garbage (in a reference cycle: a dropped engine's) while another graph is captured does
    not break the capture, and the capture replays the eager result. (C13's GPU run lost a capture to "operation not
    permitted when stream is capturing (function reset)", a graph destroyed mid-capture, after earlier tests had
    dropped engines; this test did not reproduce that cascade on the code before the fix, C15: it guards the
    property, with collector thresholds of 1.)"""
    import gc

    from cspan.core.graphs import GraphCache

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.randn(64, 64, device="cuda")

    def work(a: torch.Tensor) -> torch.Tensor:
        out = a
        for _ in range(20):
            out = [out @ a][0] / 64  # Python objects: chances to collect
        return out

    old = GraphCache(work)
    for _ in range(3):
        old(("k",), x)
    assert old.graphs[("k",)] is not None
    old.cycle = old  # type: ignore[attr-defined]  # collectable only by the cycle collector
    holder = [old]
    del old

    def drop_then_work(a: torch.Tensor) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing():
            holder.clear()  # the old graph's cache is garbage from here, inside the capture
        return work(a)

    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        new = GraphCache(drop_then_work)
        for _ in range(3):
            got = new(("k",), x)
    finally:
        gc.set_threshold(*threshold)
    assert not holder and new.graphs[("k",)] is not None
    torch.testing.assert_close(got, work(x))
    gc.collect()
