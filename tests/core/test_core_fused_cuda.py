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
    """Issue 4: the CUDA-graph step equals the eager step for 20 frames in greedy mode (random 7B weights)."""
    kw = {"batch_size": 1, "temp": 0.0, "temp_text": 0.0, "seed": 0}
    eager = DuplexEngine(lm7b, cuda_graphs=False, **kw)
    graphed = DuplexEngine(lm7b, cuda_graphs=True, **kw)
    gen = torch.Generator().manual_seed(3)
    for t in range(20):
        user = torch.randint(0, 2048, (1, 8), generator=gen).cuda()
        a, b = eager.step_tokens(user), graphed.step_tokens(user)
        assert torch.equal(a.column, b.column), f"frame {t}: graph replay differs from eager"
        assert torch.equal(a.text_logits, b.text_logits), f"frame {t}"
    assert graphed._graphs[(False, True)] is not None


def test_7b_graphed_span_prefill_equals_stepping(lm7b: LMModel) -> None:
    """A span read by the bucketed prefill graph (padded 40 -> 64) gives the KV cache and the next step's logits of
    reading it one position at a time (chunk=1), within bf16 rounding."""
    kw = {"batch_size": 2, "temp": 0.0, "temp_text": 0.0, "seed": 0}
    engines = [DuplexEngine(lm7b, cuda_graphs=True, **kw), DuplexEngine(lm7b, cuda_graphs=False, **kw)]
    gen = torch.Generator().manual_seed(5)
    users = [torch.randint(0, 2048, (2, 8), generator=gen).cuda() for _ in range(6)]
    span = ContextSpan.from_ids(torch.randint(32, 32000, (38,), generator=gen).tolist())
    outs = []
    for engine, chunk in zip(engines, (None, 1), strict=True):
        for u in users[:3]:
            engine.step_tokens(u)
        report = engine.inject_span(1, span, chunk=chunk)
        assert report.n == 40
        outs.append([engine.step_tokens(u).text_logits.float() for u in users[3:]])
    assert engines[0].injector.graphs is not None and 64 in engines[0].injector.graphs._graphs
    ca, cb = (e.lm_state.transformer.cache for e in engines)
    assert torch.equal(ca.offset, cb.offset)
    assert _rel(ca.keys, cb.keys) < 2e-2 and _rel(ca.values, cb.values) < 2e-2
    for la, lb in zip(outs[0], outs[1], strict=True):
        assert _rel(la, lb) < 5e-2


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
