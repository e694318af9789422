"""GPU: the engine's token step has no host synchronisation and, replayed from CUDA graphs (per row bucket, block
bucket and kind of call), gives the eager engine's tokens across personas, spans in several rows of one step,
resets and idle rows (sampling on); the FP8 cache through the kernels equals the FP8 cache through the eager
attention."""

from __future__ import annotations

import pytest
import torch

from cspan.core.config import LMConfig
from cspan.core.engine import DuplexEngine
from cspan.core.lm import LMModel
from cspan.core.span import ContextSpan


def _lm(dep_q: int, dtype: torch.dtype, head_dim: int = 16) -> LMModel:
    data = LMConfig.personaplex_7b().to_upstream()
    data.update(
        dim=4 * head_dim,
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


def _script(engine: DuplexEngine, steps: int = 16) -> list[torch.Tensor]:
    """Personas, live steps, spans (two rows in one step, one crossing the window of 24), a reset, a new persona
    while another row reads a span, an idle stretch; returns each step's frames."""
    g = torch.Generator().manual_seed(1)
    voices = [torch.randint(0, 2048, (8, 4 + i), generator=g) for i in range(3)]
    for i in range(3):
        engine.set_persona(i, None, voices[i], seed=10 + i)
    frames = []
    for t in range(steps):
        if t == 3:
            engine.inject_span(1, ContextSpan.from_ids(list(range(20, 50))))  # crosses the window of 24
            engine.inject_span(2, ContextSpan.from_ids([30, 31]))
        if t == 5:
            engine.reset(2, seed=99)
        if t == 8:
            engine.set_persona(0, None, voices[2], seed=5)
            engine.inject_span(1, ContextSpan.from_ids(list(range(40, 47))))
        if t == 10:
            engine.set_live(2, False)
        if t == 12:
            engine.set_live(2, True)
        user = torch.randint(0, 2048, (3, 8), generator=g)
        frames.append(engine.step_tokens(user).frame.cpu())
    return frames


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "dep_q", "kv"), [(torch.float32, 16, "auto"), (torch.bfloat16, 8, "auto"),
                                                    (torch.bfloat16, 16, "fp8")])  # fmt: skip
def test_graphed_engine_equals_eager_engine(dtype: torch.dtype, dep_q: int, kv: str) -> None:
    lm = _lm(dep_q, dtype)
    eager = DuplexEngine(lm, batch_size=3, cuda_graphs=False, kv_dtype=kv)
    graphed = DuplexEngine(lm, batch_size=3, cuda_graphs=True, kv_dtype=kv)
    assert graphed.cuda_graphs and not eager.cuda_graphs
    assert graphed.plan.fused is (dtype == torch.bfloat16)
    a, b = _script(eager), _script(graphed)
    for t, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"step {t}: graph replay differs from eager"
    assert any(g is not None for g in graphed._step_graphs.graphs.values())  # captured and replayed


@pytest.mark.gpu
def test_fp8_kernels_equal_the_eager_fp8_attention() -> None:
    """The fused FP8 path (quantize in the kernels, dequantize as the keys are loaded) against the eager FP8 cache
    (quantize_fp8, dequantize + SDPA) on the same bf16 model and the same forced token history (a persona, spans
    across the window): text logits within bf16 rounding at every step."""
    lm = _lm(16, torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    users = torch.randint(0, 2048, (10, 2, 8), generator=g)
    forced = torch.randint(0, 2048, (10, 2, 17), generator=g)
    forced[:, :, 0] = torch.randint(0, 200, (10, 2), generator=g)
    voice = torch.randint(0, 2048, (8, 5), generator=g)
    logits = []
    for fused in (False, True):
        engine = DuplexEngine(lm, batch_size=2, cuda_graphs=False, kv_dtype="fp8", fused=fused, temp=0, temp_text=0)
        engine.set_persona(0, None, voice)
        got = []
        for t in range(10):
            if t in (2, 6):
                engine.inject_span(t // 6, ContextSpan.from_ids(list(range(20, 40))))
            got.append(engine.step_tokens(users[t], forced[t]).text_logits.float())
        logits.append(torch.stack(got))
    rel = ((logits[0] - logits[1]).norm() / logits[1].norm()).item()
    assert rel < 5e-2, rel


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
        DuplexEngine(lm, cuda_graphs=True, agent_placeholder=[1] * 8, user_placeholder=[2] * 8)
    engine = DuplexEngine(lm, agent_placeholder=[1] * 8, user_placeholder=[2] * 8)
    assert engine.cuda_graphs is False and engine.plan.fused is False


@pytest.mark.gpu
def test_flashinfer_decode_equals_the_triton_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where FlashInfer is installed, its paged decode over the ring (one page per row, min(p + 1, C) slots) gives
    the Triton kernel's text logits on the same forced history (personas, spans across the window, idle rows)."""
    from cspan.core import attention

    if not attention.available():
        pytest.skip("flashinfer is not installed (scripts/perf_h200.sh carries it in .whl/flashinfer)")
    lm = _lm(16, torch.bfloat16, head_dim=64)  # a head size FlashInfer is built for (attention.HEAD_DIMS)
    g = torch.Generator().manual_seed(3)
    users = torch.randint(0, 2048, (16, 3, 8), generator=g)
    forced = torch.randint(0, 2048, (16, 3, 17), generator=g)
    forced[:, :, 0] = torch.randint(0, 200, (16, 3), generator=g)
    logits = []
    for backend in ("triton", "flashinfer"):
        monkeypatch.setenv("CSPAN_ATTENTION", backend)
        engine = DuplexEngine(lm, batch_size=3, cuda_graphs=True, temp=0, temp_text=0)
        assert (engine.plan.library is not None) is (backend == "flashinfer")
        engine.set_persona(0, None, torch.randint(0, 2048, (8, 5), generator=torch.Generator().manual_seed(1)))
        got = []
        for t in range(16):
            if t in (3, 9):
                engine.inject_span(1, ContextSpan.from_ids(list(range(20, 50))))  # crosses the window of 24
                engine.prepare()  # its step's inputs and decode plan built ahead (read as they are)
            engine.set_live(2, not 6 <= t < 8)
            got.append(engine.step_tokens(users[t], forced[t]).text_logits.float())
        logits.append(torch.stack(got))
    rel = ((logits[0] - logits[1]).norm() / logits[0].norm()).item()
    assert rel < 5e-2, rel


@pytest.mark.gpu
def test_flashinfer_plan_equal_to_the_last_is_not_made_again() -> None:
    """``FlashInferDecode.plan`` skips a plan equal to the last one (the shared workspace still holds it) and makes
    one again after another plan: the outputs equal a fresh plan's."""
    from cspan.core import attention

    if not attention.available():
        pytest.skip("flashinfer is not installed (scripts/perf_h200.sh carries it in .whl/flashinfer)")
    H, Dh, C = 4, 128, 64
    decode = attention.FlashInferDecode(torch.device("cuda"), H, Dh, C, torch.bfloat16, cuda_graphs=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    keys, values = (torch.randn(5, H, C, Dh, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    q = torch.randn(3, H, Dh, device="cuda", dtype=torch.bfloat16, generator=g)
    calls = []
    wrapper = decode._wrapper(3)
    plan = wrapper.plan
    wrapper.plan = lambda *a, **k: calls.append(1) or plan(*a, **k)
    decode.plan([0, 2, 4], [C + 10, 20, 3])
    first = decode.run(q, keys, values).clone()
    decode.plan([0, 2, 4], [C + 10, 20, 3])  # the same: skipped
    assert len(calls) == 1 and torch.equal(decode.run(q, keys, values), first)
    decode.plan([1, 2, 3], [5, 6, 7])  # another plan over the shared workspace
    other = decode.run(q, keys, values).clone()
    decode.plan([0, 2, 4], [C + 10, 20, 3])  # made again
    assert len(calls) == 3 and torch.equal(decode.run(q, keys, values), first)
    assert not torch.equal(other, first)
