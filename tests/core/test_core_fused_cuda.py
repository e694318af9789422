"""GPU: the fused kernels (cspan.core.modules.fused) against the eager modules, the 7B-dimension engine's CUDA-graph
step against its eager step (greedy, 20 frames), the graphed span prefill against stepping, and Mimi's codes on
the GPU against the CPU reference (TF32 off inside Mimi whatever the global flags say)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.nn import functional as F

from cspan.core.config import LMConfig
from cspan.core.engine import DuplexEngine
from cspan.core.kv_cache import KVCache, attention_mask
from cspan.core.lm import LMModel
from cspan.core.modules import fused
from cspan.core.modules.rope import apply_rope
from cspan.core.span import ContextSpan

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 7, 100])
@pytest.mark.parametrize("subset", [False, True])
def test_attention_kernels_equal_the_eager_cache_path(dtype: torch.dtype, T: int, subset: bool) -> None:
    """Decode (T = 1) and prefill (T > 1) attention + cache writes = KVCache.update + masked SDPA, through a ring
    that has wrapped (window < capacity) and on a subset of rows."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(T)
    B, H, Dh, C, window = 3, 4, 128, 160, 150
    cache, ref = (KVCache(1, B, H, Dh, C, dev, dtype) for _ in range(2))
    for hist, rows in ((170, None), (60, torch.tensor([0, 2], device=dev))):  # ring wrapped; rows at 230 / 170
        Bq = B if rows is None else 2
        k0 = torch.randn(Bq, H, hist, Dh, device=dev, generator=gen).to(dtype)
        v0 = torch.randn(Bq, H, hist, Dh, device=dev, generator=gen).to(dtype)
        for c in (cache, ref):
            st = c.begin(hist, rows)
            c._write(0, k0, v0, st)
            c.advance(st)
    rows = torch.tensor([1], device=dev) if subset else None
    Bq = 1 if subset else B
    qkv = torch.randn(Bq, T, 3 * H * Dh, device=dev, generator=gen).to(dtype)
    pos = (ref.offset if rows is None else ref.offset[rows])[:, None] + torch.arange(T, device=dev)
    q, k, v = qkv.view(Bq, T, 3, H, Dh).permute(2, 0, 3, 1, 4)
    q, k = apply_rope(q, k, pos, 10_000.0)
    st = ref.begin(T, rows)
    keys, values = ref.update(0, k, v, st)
    mask = attention_mask(st.positions, st.key_positions, window)
    want = F.scaled_dot_product_attention(q.double(), keys.double(), values.double(), attn_mask=mask)
    want = want.transpose(1, 2).reshape(Bq, T, H * Dh)
    ref.advance(st)

    rope = fused.rope_tables(pos, Dh, 10_000.0)
    tol_rope = 1e-2 if dtype == torch.bfloat16 else 1e-6
    if T == 1:
        got = fused.decode_attention(qkv, cache.keys[0], cache.values[0], cache.offset, window, rope, rows)
    else:
        q2, k2, v2 = fused.rope_split(qkv, H, rope)
        assert _rel(q2, q) < tol_rope and _rel(k2, k) < tol_rope  # same formula; FMA contraction may differ
        got = fused.prefill_attention(q2, k2, v2, cache.keys[0], cache.values[0], cache.offset, window, rows)
        fused.kv_write(k2, v2, cache.keys[0], cache.values[0], cache.offset, rows)
    cache.advance_by(T, rows)
    torch.cuda.synchronize()
    assert _rel(got, want) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert torch.equal(cache.offset, ref.offset) and torch.equal(cache.values, ref.values)
    assert _rel(cache.keys, ref.keys) < tol_rope


def test_norm_and_gate_kernels_equal_the_eager_arithmetic() -> None:
    dev = torch.device("cuda")
    x = torch.randn(5, 4096, device=dev).bfloat16()
    r = torch.randn(5, 4096, device=dev).bfloat16()
    w = torch.rand(1, 1, 4096, device=dev).bfloat16()
    s, y = fused.rms_norm(x, w, 1e-8, r)
    assert torch.equal(s, x + r)
    sf = (x + r).float()
    want = (sf * (w.float().view(-1) * torch.rsqrt(1e-8 + (sf * sf).mean(-1, keepdim=True)))).bfloat16()
    assert (y.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
    h = torch.randn(3, 2 * 2816, device=dev).bfloat16()
    want = (F.silu(h[:, :2816]) * h[:, 2816:]).float()
    assert ((fused.silu_gate(h).float() - want).abs() <= 2**-7 * want.abs() + 1e-6).all()


@pytest.mark.parametrize(
    ("M", "N", "K", "norm", "gate", "residual"),
    [
        (1, 3072, 1024, True, False, False),  # depformer qkv
        (1, 1024, 2816, False, False, True),  # depformer FFN out
        (4, 2816, 1024, True, True, False),  # depformer FFN in (gated), 4 rows
        (1, 12288, 4096, True, False, False),  # temporal qkv (large config)
        (2, 4096, 11264, False, False, True),  # temporal FFN out: K not a power of two
        (1, 11264, 4096, True, True, False),  # temporal FFN in (gated)
    ],
)
def test_gemv_kernel_equals_the_eager_arithmetic(
    M: int, N: int, K: int, norm: bool, gate: bool, residual: bool
) -> None:
    """fused.gemv against norm -> F.linear -> gate / residual in float64 on the same bf16 inputs."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(N + K)
    x = torch.randn(M, K, device=dev, generator=gen).bfloat16()
    w = (torch.randn(2 * N if gate else N, K, device=dev, generator=gen) / math.sqrt(K)).bfloat16()
    alpha = (torch.rand(K, device=dev, generator=gen) + 0.5).bfloat16()
    r = torch.randn(M, N, device=dev, generator=gen).bfloat16()
    y = fused.gemv(x, w, norm=(alpha, 1e-8) if norm else None, residual=r if residual else None, gate=gate)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    h = x.double()
    if norm:
        h = (h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-8) * alpha.double()).bfloat16().double()
    want = h @ w.double().T
    if gate:
        want = F.silu(want[:, :N]) * want[:, N:]
    if residual:
        want = want + r.double()
    assert _rel(y, want) < 1e-2
    with pytest.raises(ValueError, match="at most"):
        fused.gemv(torch.zeros(fused.GEMV_MAX_ROWS + 1, K, device=dev, dtype=torch.bfloat16), w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sample_kernel_is_the_top_k_exponential_race(dtype: torch.dtype) -> None:
    """fused.sample_top_k (16-bit keys for 16-bit logits) picks argmax over the top k of softmax(l / T) / q, ties
    with the k-th largest included, and keeps forced entries."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(11)
    logits = (torch.randn(8, 2048, device=dev, generator=gen) * 3).to(dtype)
    logits[0, :12] = logits[0, 7]  # a run of ties
    noise = torch.empty(8, 2048, device=dev).exponential_(generator=gen)
    known = torch.full((8,), -2, dtype=torch.long, device=dev)
    known[3] = 5
    got = fused.sample_top_k(logits, 0.8, 250, noise, known, torch.empty(8, dtype=torch.long, device=dev))
    s = logits.float() / 0.8
    threshold = s.topk(250, dim=-1).values[:, -1:]
    want = torch.where(s >= threshold, torch.softmax(s, -1) / noise, -1.0).argmax(-1)
    want[3] = 5
    assert got.tolist() == want.tolist()
    greedy = fused.sample_top_k(logits, 0.0, 250, None, known, torch.empty(8, dtype=torch.long, device=dev))
    want_greedy = logits.float().argmax(-1)
    want_greedy[3] = 5
    assert greedy.tolist() == want_greedy.tolist()


def _random_7b(dtype: torch.dtype = torch.bfloat16) -> LMModel:
    """PersonaPlex 7B dimensions (dep_q 16), random weights built directly on the GPU."""
    lm = LMModel(LMConfig.personaplex_7b(), device="meta", dtype=dtype).to_empty(device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if p.dim() < 2 or name.endswith("alpha"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]), generator=gen)
    return lm.eval()


@pytest.fixture(scope="module")
def lm7b() -> LMModel:
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("the 7B-dimension model needs a GPU with 40 GB")
    lm = _random_7b()
    yield lm
    del lm
    torch.cuda.empty_cache()


def test_7b_graph_step_equals_eager_step_greedy(lm7b: LMModel) -> None:
    """Issue 4: the CUDA-graph step equals the eager step for 20 frames in greedy mode (random 7B weights); with
    the user-stream predictions skipped (serve / infer) the agent and text columns stay the same."""
    kw = {"batch_size": 1, "temp": 0.0, "temp_text": 0.0, "seed": 0}
    columns = {}
    for predict_user in (True, False):
        eager = DuplexEngine(lm7b, cuda_graphs=False, predict_user=predict_user, **kw)
        graphed = DuplexEngine(lm7b, cuda_graphs=True, predict_user=predict_user, **kw)
        gen = torch.Generator().manual_seed(3)
        columns[predict_user] = []
        for t in range(20):
            user = torch.randint(0, 2048, (1, 8), generator=gen).cuda()
            a, b = eager.step_tokens(user), graphed.step_tokens(user)
            assert torch.equal(a.column, b.column), f"frame {t}: graph replay differs from eager"
            assert torch.equal(a.text_logits, b.text_logits), f"frame {t}"
            columns[predict_user].append(b.column)
        assert graphed._graphs[(False, True, predict_user)] is not None
    for a, b in zip(columns[True], columns[False], strict=True):
        assert torch.equal(a[:, :9], b[:, :9])


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="PDL needs sm_90 or later"
)
def test_7b_graph_step_is_the_same_with_and_without_pdl(lm7b: LMModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Programmatic dependent launch changes when kernels start, never what they compute: graphed steps captured
    with CSPAN_PDL=0 and with PDL on give identical columns and logits, with the temporal GEMV path on as well."""
    kw = {"batch_size": 1, "temp": 0.0, "temp_text": 0.0, "seed": 0}
    for temporal_gemv in (None, True):
        lm7b.transformer.gemv = temporal_gemv
        try:
            monkeypatch.setenv("CSPAN_PDL", "0")
            off = DuplexEngine(lm7b, cuda_graphs=True, **kw)
            gen = torch.Generator().manual_seed(4)
            users = [torch.randint(0, 2048, (1, 8), generator=gen).cuda() for _ in range(6)]
            want = [off.step_tokens(u) for u in users]
            monkeypatch.delenv("CSPAN_PDL")
            assert fused.pdl_enabled(torch.device("cuda"))
            on = DuplexEngine(lm7b, cuda_graphs=True, **kw)
            for t, (u, a) in enumerate(zip(users, want, strict=True)):
                b = on.step_tokens(u)
                assert torch.equal(a.column, b.column), f"frame {t}: PDL changed the column"
                assert torch.equal(a.text_logits, b.text_logits), f"frame {t}"
        finally:
            lm7b.transformer.gemv = None


def test_7b_deferred_span_graphs_equal_immediate_injection(lm7b: LMModel) -> None:
    """A span read with the next position in one graphed forward (defer_spans, the default for one session) gives
    the next step's logits and the KV cache of reading it at inject_span (prefill graph) within bf16 rounding;
    the same token history is forced into both engines, and the combined graph is captured and replayed."""
    kw = {"batch_size": 1, "temp": 0.0, "temp_text": 0.0, "seed": 0, "cuda_graphs": True}
    engines = [DuplexEngine(lm7b, defer_spans=False, **kw), DuplexEngine(lm7b, **kw)]
    assert engines[1].defer_spans and not engines[0].defer_spans
    gen = torch.Generator().manual_seed(8)
    users = [torch.randint(0, 2048, (1, 8), generator=gen).cuda() for _ in range(14)]
    forced = []
    for _ in range(14):
        col = torch.randint(0, 2048, (1, 17), generator=gen)
        col[:, 0] = torch.randint(32, 32000, (1,), generator=gen)
        forced.append(col.cuda())
    span = ContextSpan.from_ids(torch.randint(32, 32000, (62,), generator=gen).tolist())  # 64 columns
    logits = [[], []]
    for e, engine in enumerate(engines):
        for t in range(14):
            if t in (3, 6, 9):
                report = engine.inject_span(0, span)
                assert report.n == 64 and report.deferred is (e == 1)
            logits[e].append(engine.step_tokens(users[t], forced[t]).text_logits.float())
    assert engines[1]._span_graphs[(65, False, False, True)] is not None  # captured on the 2nd use, replayed on the 3rd
    ca, cb = (e.lm_state.transformer.cache for e in engines)
    assert torch.equal(ca.offset, cb.offset) and int(ca.offset[0]) == 14 + 3 * 64
    end = int(ca.offset[0])
    assert _rel(ca.keys[..., :end, :], cb.keys[..., :end, :]) < 2e-2
    assert _rel(ca.values[..., :end, :], cb.values[..., :end, :]) < 2e-2
    for t, (la, lb) in enumerate(zip(*logits, strict=True)):
        assert _rel(la, lb) < 5e-2, f"step {t}"


def test_7b_graphed_span_prefill_equals_stepping(lm7b: LMModel) -> None:
    """A span read by the bucketed prefill graph (padded 40 -> 64) gives the KV cache and the next step's logits of
    reading it one position at a time (chunk=1), within bf16 rounding."""
    kw = {"batch_size": 2, "temp": 0.0, "temp_text": 0.0, "seed": 0}
    engines = [DuplexEngine(lm7b, cuda_graphs=True, **kw), DuplexEngine(lm7b, cuda_graphs=False, **kw)]
    gen = torch.Generator().manual_seed(5)
    users = [torch.randint(0, 2048, (2, 8), generator=gen).cuda() for _ in range(6)]
    span = ContextSpan.from_ids(torch.randint(32, 32000, (38,), generator=gen).tolist())
    outs, caches = [], []
    for engine, chunk in zip(engines, (None, 1), strict=True):
        for u in users[:3]:
            engine.step_tokens(u)
        report = engine.inject_span(1, span, chunk=chunk)
        assert report.n == 40
        cache = engine.lm_state.transformer.cache
        caches.append((cache.offset.clone(), cache.keys.clone(), cache.values.clone()))
        outs.append(engine.step_tokens(users[3]).text_logits.float())
    assert engines[0].injector.graphs is not None and 64 in engines[0].injector.graphs._graphs
    (oa, ka, va), (ob, kb, vb) = caches
    assert torch.equal(oa, ob) and int(oa[1] - oa[0]) == 40
    # the cache right after the span (the frames, then the 40 span columns), both rows
    end = int(oa[1])
    assert _rel(ka[..., :end, :], kb[..., :end, :]) < 2e-2 and _rel(va[..., :end, :], vb[..., :end, :]) < 2e-2
    assert _rel(outs[0], outs[1]) < 5e-2


def test_mimi_gpu_codes_equal_cpu_reference_with_tf32_allowed(fixture_file) -> None:
    """Mimi turns TF32 off itself: even with the global flags on, GPU codes equal the CPU reference codes."""
    from safetensors.torch import load_file

    from cspan.core.config import MimiConfig
    from cspan.core.mimi import Mimi

    cfg = MimiConfig.from_upstream(json.loads(fixture_file("reference", "mimi-small", "config.json").read_text()))
    pcm = load_file(fixture_file("reference", "mimi-small", "input.safetensors"))["pcm"]
    want = load_file(fixture_file("reference", "mimi-small", "codes.safetensors"))["codes"]
    model = Mimi(cfg, device="cuda").eval()
    model.load_state_dict(load_file(fixture_file("reference", "mimi-small", "model.safetensors")), strict=True)
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        with torch.no_grad():
            codes = model.encode(pcm.cuda())
            state = model.new_encoder_state(1)
            steps = [
                model.encode_step(pcm[..., 1920 * t : 1920 * (t + 1)].cuda(), state) for t in range(want.shape[-1])
            ]
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (True, True)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    assert torch.equal(codes.cpu(), want)
    assert torch.equal(torch.cat(steps, -1).cpu(), want)


def test_fused_streaming_convs_equal_the_eager_convs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mimi's SEANet encoder and decoder and its learnt down/upsampling at the released dimensions (random
    weights), streamed frame by frame through the fused conv kernels (where they are chosen) against the eager
    cuDNN path, one row (weight-streaming kernels) and two rows (the batched choice), a reset in the middle:
    outputs within float32 rounding."""
    from cspan.core.config import MimiConfig
    from cspan.core.mimi import Mimi

    torch.manual_seed(0)
    model = Mimi(MimiConfig.mimi_24khz(), device="cuda").eval()
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(1)
    parts = [
        (model.encoder, (1, 1920), 0.1),
        (model.decoder, (512, 2), 1.0),
        (model.downsample, (512, 2), 1.0),
        (model.upsample, (512, 1), 1.0),
    ]
    try:
        for module, shape, scale in parts:
            for rows in (1, 2):
                monkeypatch.setenv("CSPAN_FUSED", "0")
                eager_state = module.new_state(rows)
                monkeypatch.delenv("CSPAN_FUSED")
                fused_state = module.new_state(rows)
                for t in range(5):
                    if t == 3:
                        eager_state.reset([rows - 1])
                        fused_state.reset([rows - 1])
                    x = torch.randn(rows, *shape, device="cuda", generator=gen) * scale
                    with torch.no_grad():
                        monkeypatch.setenv("CSPAN_FUSED", "0")
                        want = module(x, eager_state)
                        monkeypatch.delenv("CSPAN_FUSED")
                        got = module(x, fused_state)
                    assert got.shape == want.shape
                    assert _rel(got, want) < 1e-5, (type(module).__name__, rows, t, _rel(got, want))
    finally:
        torch.backends.cudnn.allow_tf32 = saved
