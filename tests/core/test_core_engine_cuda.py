"""GPU: the engine's per-frame token step has no host synchronisation and, replayed from CUDA graphs, gives the
eager engine's tokens across personas, spans and resets (sampling on, one generator per session)."""

from __future__ import annotations

import pytest
import torch

from cspan.core.config import LMConfig
from cspan.core.engine import DuplexEngine
from cspan.core.lm import LMModel
from cspan.core.span import ContextSpan


def _lm(dep_q: int, dtype: torch.dtype) -> LMModel:
    data = LMConfig.personaplex_7b().to_upstream()
    data.update(
        dim=64,
        num_heads=4,
        num_layers=2,
        text_card=200,
        dep_q=dep_q,
        context=24,
        depformer_dim=32,
        depformer_num_heads=2,
        depformer_num_layers=2,
        depformer_dim_feedforward=132,
    )
    torch.manual_seed(0)
    return LMModel(LMConfig.from_upstream(data), device="cuda", dtype=dtype).eval()


def _script(engine: DuplexEngine, steps: int = 14) -> list[torch.Tensor]:
    """Personas, live steps, a span, a reset and a new persona in the middle; returns each step's frames."""
    g = torch.Generator().manual_seed(1)
    voices = [torch.randint(0, 2048, (8, 4 + i), generator=g) for i in range(3)]
    for i in range(3):
        engine.set_persona(i, None, voices[i], seed=10 + i)
    frames = []
    for t in range(steps):
        if t == 3:
            engine.inject_span(1, ContextSpan.from_ids(list(range(20, 50))))  # crosses the window of 24
        if t == 5:
            engine.reset(2, seed=99)
        if t == 8:
            engine.set_persona(0, None, voices[2], seed=5)
        user = torch.randint(0, 2048, (3, 8), generator=g)
        frames.append(engine.step_tokens(user).frame.cpu())
    return frames


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "dep_q"), [(torch.float32, 16), (torch.bfloat16, 8)])
def test_graphed_engine_equals_eager_engine(dtype: torch.dtype, dep_q: int) -> None:
    lm = _lm(dep_q, dtype)
    eager = DuplexEngine(lm, batch_size=3, cuda_graphs=False)
    graphed = DuplexEngine(lm, batch_size=3, cuda_graphs=True)
    assert graphed.cuda_graphs and not eager.cuda_graphs
    a, b = _script(eager), _script(graphed)
    for t, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"step {t}: graph replay differs from eager"
    assert graphed._graphs[(False, True, True)] is not None  # the step was captured and replayed


@pytest.mark.gpu
def test_steady_state_step_has_no_host_sync() -> None:
    lm = _lm(16, torch.bfloat16)
    engine = DuplexEngine(lm, batch_size=2, cuda_graphs=False, seed=0)
    engine.set_persona(0, None, torch.randint(0, 2048, (8, 5)))
    user = torch.randint(0, 2048, (2, 8), device="cuda")
    engine.step_tokens(user)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            engine.step_tokens(user)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_graphs_need_cuda(reference_lm) -> None:
    lm = reference_lm("lm-moshi-shaped")
    with pytest.raises(ValueError, match="CUDA device"):
        DuplexEngine(lm, device="cpu", cuda_graphs=True, agent_placeholder=[1] * 8, user_placeholder=[2] * 8)
    engine = DuplexEngine(lm, device="cpu", agent_placeholder=[1] * 8, user_placeholder=[2] * 8)
    assert engine.cuda_graphs is False
