"""Transformer building blocks: norms, RoPE, sin embedding, GLU sizes, streaming == non-streaming, per-step weights."""

from __future__ import annotations

import math

import pytest
import torch

from cspan.core.modules.norms import LayerNormF32, RMSNorm, make_norm
from cspan.core.modules.rope import apply_rope, rope_tables, rotate, sin_embedding
from cspan.core.modules.transformer import StreamingTransformer, gated_hidden_size


def test_rms_norm_is_float32_with_eps_1e8() -> None:
    torch.manual_seed(0)
    norm = make_norm("rms_norm_f32", 16, dtype=torch.bfloat16)
    assert isinstance(norm, RMSNorm)
    assert norm.alpha.shape == (1, 1, 16)
    with torch.no_grad():
        norm.alpha.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 16).to(torch.bfloat16)
    y = norm(x)
    assert y.dtype == torch.bfloat16
    xf = x.float()
    expected = xf * (norm.alpha.float() * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-8))
    assert torch.equal(y, expected.to(torch.bfloat16))
    # the eps is 1e-8 (1e-5 would give 0.953 here): a small input is still normalised to unit RMS
    tiny = torch.full((1, 1, 16), 1e-2)
    ones = make_norm("rms_norm_f32", 16)(tiny)
    assert torch.allclose(ones, torch.ones_like(ones), atol=1e-4)


def test_layer_norms() -> None:
    ln = make_norm("layer_norm", 8)
    assert isinstance(ln, torch.nn.LayerNorm) and ln.eps == 1e-5 and ln.bias is not None
    ln32 = make_norm("layer_norm_f32", 8, dtype=torch.bfloat16)
    assert isinstance(ln32, LayerNormF32) and ln32.eps == 1e-8
    x = torch.randn(2, 8).to(torch.bfloat16)
    assert ln32(x).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown norm"):
        make_norm("batch_norm", 8)


def test_gated_hidden_sizes() -> None:
    assert gated_hidden_size(4096, 16896) == 11264  # Moshi 7B temporal
    assert gated_hidden_size(1024, 4224) == 2816  # Moshi 7B depformer
    assert gated_hidden_size(64, 264) == 176  # shaped fixtures
    assert gated_hidden_size(16, 16) == 10  # Kyutai tiny depformer
    assert gated_hidden_size(64, 256) == 168  # the 4*dim rule: 21 * dim // 8


def test_rope_is_an_interleaved_rotation_by_absolute_position() -> None:
    torch.manual_seed(1)
    B, H, T, D = 2, 3, 5, 8
    q, k = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    positions = torch.tensor([[0, 1, 2, 3, 4], [100, 101, 102, 103, 104]])
    qr, kr = apply_rope(q, k, positions, max_period=10000)
    freqs = 10000.0 ** (-2 * torch.arange(D // 2, dtype=torch.float64) / D)
    angle = positions.double()[:, None, :, None] * freqs  # [B, 1, T, D/2]
    rot = torch.polar(torch.ones_like(angle), angle)
    q_c = torch.view_as_complex(q.double().reshape(B, H, T, D // 2, 2))
    expected = torch.view_as_real(q_c * rot).reshape(B, H, T, D)
    assert torch.allclose(qr.double(), expected, atol=1e-5)
    # scores depend only on relative positions
    shifted_q, shifted_k = apply_rope(q, k, positions + 37, max_period=10000)
    s1 = qr @ kr.transpose(-1, -2)
    s2 = shifted_q @ shifted_k.transpose(-1, -2)
    assert torch.allclose(s1, s2, atol=1e-4)


def test_rope_rotates_queries_and_keys_together_in_float32_whatever_their_dtype() -> None:
    """``rotate`` of stacked queries and keys (the layers' one call) equals rotating each alone, and a bfloat16
    input is rotated in float32 and rounded once, as the float32 result rounded (the eager step of a bf16 engine)."""
    torch.manual_seed(2)
    B, H, T, D = 2, 3, 4, 8
    q, k = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    tables = rope_tables(torch.tensor([[5, 6, 7, 8], [40, 41, 42, 43]]), D, 10_000.0)
    both = rotate(torch.stack([q, k]), tables)
    assert torch.equal(both[0], rotate(q, tables)) and torch.equal(both[1], rotate(k, tables))
    qk16 = torch.stack([q, k]).bfloat16()
    out16 = rotate(qk16, tables)
    assert out16.dtype == torch.bfloat16 and torch.equal(out16, rotate(qk16.float(), tables).bfloat16())
    one_row = rope_tables(torch.tensor([[5, 6, 7, 8]]), D, 10_000.0)  # [1, T, D/2]: broadcast over the rows
    assert torch.equal(rotate(q, one_row)[1], rotate(q[1:], one_row)[0])


def test_sin_embedding_cos_then_sin() -> None:
    positions = torch.tensor([[0, 3, 10]])
    emb = sin_embedding(positions, 8, max_period=10000)
    assert emb.shape == (1, 3, 8)
    for t, p in enumerate([0, 3, 10]):
        for i in range(4):
            phase = p / 10000 ** (i / 3)
            assert math.isclose(emb[0, t, i].item(), math.cos(phase), abs_tol=1e-6)
            assert math.isclose(emb[0, t, 4 + i].item(), math.sin(phase), abs_tol=1e-6)


def _mimi_like(**overrides) -> StreamingTransformer:
    kwargs = dict(
        d_model=16,
        num_heads=2,
        num_layers=2,
        dim_feedforward=32,
        causal=True,
        context=3,
        positional_embedding="rope",
        gating="none",
        norm="layer_norm",
        layer_scale=0.01,
    )
    kwargs.update(overrides)
    return StreamingTransformer(**kwargs)


def test_parameter_names_mimi_and_depformer_layouts() -> None:
    mimi = _mimi_like()
    shapes = {k: tuple(v.shape) for k, v in mimi.state_dict().items() if k.startswith("layers.0.")}
    assert shapes == {
        "layers.0.self_attn.in_proj_weight": (48, 16),
        "layers.0.self_attn.out_proj.weight": (16, 16),
        "layers.0.norm1.weight": (16,),
        "layers.0.norm1.bias": (16,),
        "layers.0.norm2.weight": (16,),
        "layers.0.norm2.bias": (16,),
        "layers.0.linear1.weight": (32, 16),
        "layers.0.linear2.weight": (16, 32),
        "layers.0.layer_scale_1.scale": (16,),
        "layers.0.layer_scale_2.scale": (16,),
    }
    dep = StreamingTransformer(
        d_model=16,
        num_heads=1,
        num_layers=1,
        dim_feedforward=16,
        causal=True,
        positional_embedding="none",
        gating="silu",
        norm="rms_norm_f32",
        weights_per_step=3,
        weights_per_step_schedule=[0, 1, 1],
    )
    shapes = {k: tuple(v.shape) for k, v in dep.state_dict().items()}
    assert shapes == {
        "layers.0.self_attn.in_proj_weight": (96, 16),
        "layers.0.self_attn.out_proj.weight": (32, 16),
        "layers.0.norm1.alpha": (1, 1, 16),
        "layers.0.norm2.alpha": (1, 1, 16),
        "layers.0.gating.0.linear_in.weight": (20, 16),
        "layers.0.gating.0.linear_out.weight": (16, 10),
        "layers.0.gating.1.linear_in.weight": (20, 16),
        "layers.0.gating.1.linear_out.weight": (16, 10),
    }


@pytest.mark.parametrize("pos_emb", ["rope", "sin", "sin_rope"])
def test_streaming_equals_plain_forward(pos_emb: str) -> None:
    """Frame-by-frame (T=1), Mimi-style pairs (T=2) and long chunks reproduce the windowed plain forward."""
    torch.manual_seed(2)
    model = _mimi_like(positional_embedding=pos_emb).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.layer_scale_1.scale.fill_(0.7)
            layer.layer_scale_2.scale.fill_(1.3)
    x = torch.randn(2, 13, 16)
    with torch.no_grad():
        full = model(x)
        for chunk in (1, 2, 5):
            state = model.new_state(2)
            out = torch.cat([model(x[:, s : s + chunk], state) for s in range(0, 13, chunk)], dim=1)
            assert torch.allclose(out, full, atol=1e-5, rtol=0), chunk
            assert state.offset.tolist() == [13, 13]


def test_weights_per_step_schedule_streaming_equals_plain() -> None:
    torch.manual_seed(3)
    dep = StreamingTransformer(
        d_model=16,
        num_heads=2,
        num_layers=2,
        dim_feedforward=16,
        causal=True,
        positional_embedding="sin",
        gating="silu",
        norm="layer_norm",
        weights_per_step=3,
        weights_per_step_schedule=[0, 1, 1],
    ).eval()
    assert dep.weight_sets(0, 3) == [0, 1, 1]
    x = torch.randn(4, 3, 16)
    with torch.no_grad():
        full = dep(x)
        state = dep.new_state(4)
        assert state.cache.capacity == 3
        steps = torch.cat([dep(x[:, k : k + 1], state) for k in range(3)], dim=1)
        assert torch.allclose(steps, full, atol=1e-6, rtol=0)
        # explicit steps after a reset give the same; a fourth step has no weights
        state.reset()
        again = torch.cat([dep(x[:, k : k + 1], state, step=k) for k in range(3)], dim=1)
        assert torch.allclose(again, full, atol=1e-6, rtol=0)
        with pytest.raises(ValueError, match="weights-per-step"):
            dep(x[:, :1], state)
        # the weight sets matter: a different schedule changes the output
        assert not torch.allclose(dep(x[:, [0, 0]])[:, 1], full[:, 0], atol=1e-3)


def test_builds_on_meta_and_rejects_bad_arguments() -> None:
    meta = _mimi_like(device="meta")
    assert all(p.device.type == "meta" for p in meta.parameters())
    with pytest.raises(ValueError, match="positional_embedding"):
        _mimi_like(positional_embedding="alibi")
    with pytest.raises(ValueError, match="divisible"):
        _mimi_like(num_heads=3)
    with pytest.raises(ValueError, match="smaller than the attention context"):
        _mimi_like().new_state(1, capacity=2)
    with pytest.raises(ValueError, match="schedule"):
        StreamingTransformer(16, 1, 1, gating="silu", weights_per_step=2, weights_per_step_schedule=[0, 1, 1])
