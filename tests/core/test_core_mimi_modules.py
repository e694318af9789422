"""MimiConfig, the real-codec module layout on the meta device, streaming convolutions and the RVQ."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from cspan.core import Mimi, MimiConfig
from cspan.core.modules.conv import (
    ConvDownsample1d,
    ConvTrUpsample1d,
    StreamingConv1d,
    StreamingConvTranspose1d,
)
from cspan.core.modules.quantization import EuclideanCodebook, SplitResidualVectorQuantizer

# ---------------------------------------------------------------------------------------------------------------
# MimiConfig
# ---------------------------------------------------------------------------------------------------------------


def test_config_round_trips_the_fixture_dict(fixture_file) -> None:
    raw = json.loads(fixture_file("reference", "mimi-small", "config.json").read_text())
    cfg = MimiConfig.from_upstream(raw)
    assert cfg.to_upstream() == raw
    assert cfg.seanet.dimension == 64 and cfg.quantizer.n_q == 8 and cfg.transformer.num_layers == 2
    assert (cfg.hop_length, cfg.encoder_frame_rate, cfg.downsample_stride, cfg.frame_size) == (960, 25.0, 2, 1920)


def test_mimi_24khz_preset_is_the_real_codec(fixture_file) -> None:
    cfg = MimiConfig.mimi_24khz()
    up = cfg.to_upstream()
    # same layout as loaders._mimi_config
    raw = json.loads(fixture_file("reference", "mimi-small", "config.json").read_text())
    assert set(up) == set(raw)
    for key in ("seanet", "quantizer", "transformer"):
        assert set(up[key]) == set(raw[key]), key
    assert up["seanet"]["dimension"] == 512 and up["seanet"]["n_filters"] == 64
    assert up["seanet"]["ratios"] == [8, 6, 5, 4]
    assert up["quantizer"] == {
        "dimension": 256,
        "n_q": 32,
        "bins": 2048,
        "input_dimension": 512,
        "output_dimension": 512,
    }
    tr = up["transformer"]
    assert (tr["d_model"], tr["num_heads"], tr["num_layers"], tr["dim_feedforward"], tr["context"]) == (
        512,
        8,
        8,
        2048,
        250,
    )
    assert (tr["layer_scale"], tr["norm"], tr["gating"], tr["positional_embedding"]) == (
        0.01,
        "layer_norm",
        "none",
        "rope",
    )
    assert tr["conv_layout"] is True
    assert MimiConfig.from_upstream(up) == cfg
    assert MimiConfig() == cfg


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("seanet", "norm"), "weight_norm", "fold the weight norm"),
        (("seanet", "lstm"), 2, "Extra inputs"),
        (("quantizer", "input_dimension"), 32, "must equal seanet.dimension"),
        (("transformer", "output_dimensions"), [64, 64], "exactly one output"),
        (("frame_rate",), 10.0, "integer multiple"),
    ],
)
def test_config_rejects_inconsistent_dicts(fixture_file, path, value, message) -> None:
    raw = json.loads(fixture_file("reference", "mimi-small", "config.json").read_text())
    target = raw
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ValidationError, match=message):
        MimiConfig.from_upstream(raw)


def test_real_codec_on_meta_has_the_checkpoint_layout() -> None:
    """Section 3.2 of the reference digest: 318 tensors, 96.15 M values, the listed key shapes."""
    mimi = Mimi(MimiConfig.mimi_24khz(), device="meta")
    sd = mimi.state_dict()
    assert len(sd) == 318
    total = sum(v.numel() for v in sd.values())
    assert total == 96_151_393
    assert round(total / 1e6, 2) == 96.15
    assert mimi.num_codebooks == 32 and mimi.total_codebooks == 32 and mimi.cardinality == 2048
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    expected = {
        "encoder.model.0.conv.conv.weight": (64, 1, 7),
        "encoder.model.3.conv.conv.weight": (128, 64, 8),
        "encoder.model.6.conv.conv.weight": (256, 128, 10),
        "encoder.model.9.conv.conv.weight": (512, 256, 12),
        "encoder.model.12.conv.conv.weight": (1024, 512, 16),
        "encoder.model.14.conv.conv.weight": (512, 1024, 3),
        "encoder.model.10.block.1.conv.conv.weight": (256, 512, 3),
        "encoder.model.10.block.3.conv.conv.weight": (512, 256, 1),
        "decoder.model.0.conv.conv.weight": (1024, 512, 7),
        "decoder.model.14.conv.conv.weight": (1, 64, 3),
        "decoder.model.2.convtr.convtr.weight": (1024, 512, 16),
        "decoder.model.5.convtr.convtr.weight": (512, 256, 12),
        "decoder.model.8.convtr.convtr.weight": (256, 128, 10),
        "decoder.model.11.convtr.convtr.weight": (128, 64, 8),
        "encoder_transformer.transformer.layers.7.self_attn.in_proj_weight": (1536, 512),
        "decoder_transformer.transformer.layers.0.self_attn.out_proj.weight": (512, 512),
        "encoder_transformer.transformer.layers.3.linear1.weight": (2048, 512),
        "encoder_transformer.transformer.layers.3.linear2.weight": (512, 2048),
        "decoder_transformer.transformer.layers.5.norm2.bias": (512,),
        "decoder_transformer.transformer.layers.5.layer_scale_1.scale": (512,),
        "downsample.conv.conv.conv.weight": (512, 512, 4),
        "upsample.convtr.convtr.convtr.weight": (512, 1, 4),
        "quantizer.rvq_first.input_proj.weight": (256, 512, 1),
        "quantizer.rvq_rest.output_proj.weight": (512, 256, 1),
        "quantizer.rvq_first.vq.layers.0._codebook.embedding_sum": (2048, 256),
        "quantizer.rvq_rest.vq.layers.30._codebook.cluster_usage": (2048,),
        "quantizer.rvq_rest.vq.layers.30._codebook._initialized": (1,),
    }
    for key, shape in expected.items():
        assert shapes[key] == shape, key
    assert "quantizer.rvq_rest.vq.layers.31._codebook.embedding_sum" not in shapes
    assert "quantizer.rvq_first.vq.layers.1._codebook.embedding_sum" not in shapes
    assert not any(k.endswith("bias") for k in shapes if k.startswith(("downsample", "upsample", "quantizer")))
    assert not any("input_proj" in k or "output_projs" in k for k in shapes if "transformer" in k)


# ---------------------------------------------------------------------------------------------------------------
# Streaming convolutions
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kernel", "stride", "dilation"), [(7, 1, 1), (3, 1, 2), (8, 4, 1), (4, 2, 1), (1, 1, 1)])
@pytest.mark.parametrize("pad_mode", ["constant", "replicate"])
def test_streaming_conv_equals_whole_sequence(kernel: int, stride: int, dilation: int, pad_mode: str) -> None:
    torch.manual_seed(0)
    conv = StreamingConv1d(3, 5, kernel, stride=stride, dilation=dilation, pad_mode=pad_mode)
    x = torch.randn(2, 3, 12 * stride) + 1.0
    with torch.no_grad():
        whole = conv(x)
        state = conv.new_state(2)
        assert state.previous.shape == (2, 3, (kernel - 1) * dilation + 1 - stride)
        chunks = [conv(x[..., i : i + 2 * stride], state) for i in range(0, x.shape[-1], 2 * stride)]
    assert whole.shape == (2, 5, 12)
    torch.testing.assert_close(torch.cat(chunks, -1), whole, rtol=0, atol=1e-6)


def test_replicate_padding_repeats_the_first_sample() -> None:
    down = ConvDownsample1d(2, 4)
    x = torch.randn(1, 4, 6)
    with torch.no_grad():
        expected = torch.nn.functional.conv1d(
            torch.cat([x[..., :1].expand(1, 4, 2), x], -1), down.conv.conv.conv.weight, stride=2
        )
        torch.testing.assert_close(down(x), expected, rtol=0, atol=0)


@pytest.mark.parametrize(("kernel", "stride", "groups"), [(16, 8, 1), (4, 2, 4), (3, 3, 1)])
def test_streaming_conv_transpose_equals_whole_sequence(kernel: int, stride: int, groups: int) -> None:
    torch.manual_seed(1)
    convtr = StreamingConvTranspose1d(4, 4, kernel, stride=stride, groups=groups)
    x = torch.randn(2, 4, 9)
    with torch.no_grad():
        whole = convtr(x)
        state = convtr.new_state(2)
        chunks = [convtr(x[..., i : i + 1], state) for i in range(9)]
    assert whole.shape == (2, 4, 9 * stride)
    torch.testing.assert_close(torch.cat(chunks, -1), whole, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("kernel", "stride", "groups"), [(16, 8, 1), (4, 2, 4), (7, 3, 1), (3, 3, 1)])
def test_conv_transpose_input_history_state_equals_partial_sums(
    kernel: int, stride: int, groups: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The input-history form of the streaming state (created where the fused GPU kernel runs) gives the same
    output as the partial-sum form, with an ELU folded in, chunks of several lengths, and a per-row reset."""
    from cspan.core.modules import fused_conv

    torch.manual_seed(3)
    convtr = StreamingConvTranspose1d(4, 4, kernel, stride=stride, groups=groups)
    partial = convtr.new_state(2)
    assert partial.history is None
    monkeypatch.setattr(fused_conv, "history_states", lambda device, dtype, batch_size: True)
    history = convtr.new_state(2)
    assert history.history is not None and history.history.shape == (2, 4, -(-kernel // stride) - 1)
    with torch.no_grad():
        for i, steps in enumerate((1, 3, 2, 1)):
            if i == 2:
                partial.reset([1])
                history.reset([1])
            x = torch.randn(2, 4, steps)
            want = convtr(x, partial, activation=0.7)
            got = convtr(x, history, activation=0.7)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_seanet_folds_the_activation_and_residual_into_the_convs() -> None:
    """In streaming, the ELU before a conv and a residual block's skip are handed to the convs; the result is
    bit-identical to running the modules one by one."""
    from cspan.core.modules.seanet import SEANetResnetBlock

    torch.manual_seed(4)
    block = SEANetResnetBlock(8, kernel_sizes=[3, 1], dilations=[1, 1])
    x = torch.randn(1, 8, 12)
    with torch.no_grad():
        state = block.new_state(1)
        got = block(x, state)
        h = block.block[1](torch.nn.functional.elu(x), block.block[1].new_state(1))
        h = block.block[3](torch.nn.functional.elu(h), block.block[3].new_state(1))
    assert torch.equal(got, x + h)


def test_fused_conv_guards_fall_back_to_the_eager_path() -> None:
    """What decides between the fused kernel and the eager path is shape logic that runs anywhere: empty batches,
    wrong channel counts, a state of another batch size, a residual of another shape, a non-contiguous weight all
    go to the eager path (which raises its own error or broadcasts); a history without its counter is refused."""
    from cspan.core.modules import fused_conv

    assert not fused_conv.supported(0, 2, 8, 1)
    assert fused_conv.supported(1, 2, 512, 16) and not fused_conv.supported(2, 2, 512, 16)
    assert fused_conv.supported(8, 1920, 32, 1) and fused_conv.supported(8, 1920, 1, 7)
    assert not fused_conv.supported(1, 1920, 64, 3)
    x = torch.zeros(1, 8, 4)
    hist, first = torch.zeros(1, 8, 2), torch.ones(1, dtype=torch.bool)
    w = torch.zeros(6, 8, 3)
    assert fused_conv.fits(x, 8, w, hist, first, torch.zeros(1, 6, 4), (1, 6, 4))
    assert not fused_conv.fits(torch.zeros(1, 9, 4), 8, w, hist, first, None, None)
    assert not fused_conv.fits(torch.zeros(2, 8, 4), 8, w, hist, first, None, None)
    assert not fused_conv.fits(torch.zeros(0, 8, 4), 8, w, None, None, None, None)
    assert not fused_conv.fits(x, 8, w, hist, first, torch.zeros(1, 6, 1), (1, 6, 4))
    assert not fused_conv.fits(x, 8, w.transpose(0, 1).contiguous().transpose(0, 1), hist, first, None, None)
    assert not fused_conv.fits(x, 8, w, hist.double(), first, None, None)
    with pytest.raises(ValueError, match="counter"):
        fused_conv.conv1d(x, w, None, 1, 1, hist, None)


def test_conv_transpose_phase_weight_cache_follows_the_parameter() -> None:
    """The phase-weight copy is rebuilt when the parameter is replaced or modified in place, and works for
    weights created under inference mode (no version counter)."""
    from cspan.core.modules import fused_conv

    torch.manual_seed(5)
    convtr = StreamingConvTranspose1d(4, 3, 6, stride=2)
    first = convtr._phase_weight()
    assert torch.equal(first, fused_conv.phase_weight(convtr.convtr.convtr.weight.detach(), 2, False))
    assert convtr._phase_weight() is first
    with torch.no_grad():
        convtr.convtr.convtr.weight.mul_(2)
    assert torch.equal(convtr._phase_weight(), 2 * first)
    convtr.convtr.convtr.weight = torch.nn.Parameter(torch.ones(4, 3, 6))
    assert torch.equal(convtr._phase_weight(), fused_conv.phase_weight(torch.ones(4, 3, 6), 2, False))
    with torch.inference_mode():
        frozen = StreamingConvTranspose1d(4, 3, 6, stride=2)
        assert frozen._phase_weight().shape == (2 * 3, 4, 3)


def test_inplace_elu_is_not_folded_into_the_conv() -> None:
    """An in-place ELU overwrites the block input (and so the residual skip) in both the whole-sequence and the
    streaming call; folding it into the conv would change only the streaming one."""
    from cspan.core.modules.seanet import SEANetResnetBlock

    torch.manual_seed(6)
    block = SEANetResnetBlock(8, [3, 1], [1, 1], activation_params={"alpha": 1.0, "inplace": True})
    x = torch.randn(1, 8, 12)
    with torch.no_grad():
        whole = block(x.clone())
        streamed = block(x.clone(), block.new_state(1))
    assert torch.equal(streamed, whole)


def test_upsample_is_depthwise_without_bias() -> None:
    up = ConvTrUpsample1d(2, 6)
    assert up.convtr.convtr.convtr.weight.shape == (6, 1, 4)
    assert up.convtr.convtr.convtr.bias is None
    assert up.convtr.convtr.convtr.groups == 6


def test_conv_state_reset_rows_only() -> None:
    torch.manual_seed(2)
    conv = StreamingConv1d(2, 2, 5, pad_mode="replicate")
    x = torch.randn(2, 2, 8)
    with torch.no_grad():
        state = conv.new_state(2)
        conv(x, state)
        kept = state.previous[0].clone()
        state.reset([1])
        assert torch.equal(state.previous[0], kept)
        assert torch.equal(state.previous[1], torch.zeros_like(kept))
        assert state.first.tolist() == [False, True]
        y = conv(x, state)
    with torch.no_grad():
        torch.testing.assert_close(y[1:], conv(x[1:]), rtol=0, atol=1e-6)


def test_conv_rejects_lengths_not_multiple_of_stride() -> None:
    conv = StreamingConv1d(1, 1, 8, stride=4)
    with pytest.raises(ValueError, match="multiple of the stride 4"):
        conv(torch.zeros(1, 1, 10))


# ---------------------------------------------------------------------------------------------------------------
# Quantizer
# ---------------------------------------------------------------------------------------------------------------


def _quantizer(seed: int = 0) -> SplitResidualVectorQuantizer:
    cfg = MimiConfig.mimi_24khz().quantizer.model_copy(
        update={"dimension": 8, "n_q": 4, "bins": 40, "input_dimension": 6, "output_dimension": 6}
    )
    q = SplitResidualVectorQuantizer(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for rvq in (q.rvq_first, q.rvq_rest):
            rvq.input_proj.weight.copy_(torch.randn(rvq.input_proj.weight.shape, generator=g))
            rvq.output_proj.weight.copy_(torch.randn(rvq.output_proj.weight.shape, generator=g))
            for layer in rvq.vq.layers:
                cb = layer._codebook
                usage = torch.rand(cb.bins, generator=g) * 2 + 0.5
                cb.cluster_usage.copy_(usage)
                cb.embedding_sum.copy_(torch.randn(cb.bins, cb.dim, generator=g) * usage[:, None])
    return q


def test_centroids_divide_by_clamped_usage() -> None:
    cb = EuclideanCodebook(2, 3)
    with torch.no_grad():
        cb.embedding_sum.copy_(torch.tensor([[2.0, 4.0], [1.0, 1.0], [3e-6, 0.0]]))
        cb.cluster_usage.copy_(torch.tensor([2.0, 0.0, 1e-6]))
    torch.testing.assert_close(cb.embedding, torch.tensor([[1.0, 2.0], [1e5, 1e5], [0.3, 0.0]]))


def test_rvq_encode_is_residual_nearest_centroid_and_split() -> None:
    q = _quantizer()
    x = torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        codes = q.encode(x)
        assert codes.shape == (2, 4, 5) and codes.dtype == torch.int64
        # brute force in float64: both RVQs start from the same latent x, each through its own projection
        for rvq, rows in ((q.rvq_first, [0]), (q.rvq_rest, [1, 2, 3])):
            residual = torch.nn.functional.conv1d(x.double(), rvq.input_proj.weight.double())
            for level, row in enumerate(rows):
                emb = rvq.vq.layers[level]._codebook.embedding.double()
                d = ((residual.transpose(1, 2)[..., None, :] - emb) ** 2).sum(-1)  # [B, T, bins]
                assert torch.equal(d.argmin(-1), codes[:, row])
                residual = residual - emb[codes[:, row]].transpose(1, 2)
        # decode = output_proj_first(c0) + output_proj_rest(sum of acoustic centroids)
        first = q.rvq_first.vq.layers[0]._codebook.embedding[codes[:, 0]].transpose(1, 2)
        rest = sum(q.rvq_rest.vq.layers[k]._codebook.embedding[codes[:, k + 1]] for k in range(3)).transpose(1, 2)
        expected = torch.nn.functional.conv1d(first, q.rvq_first.output_proj.weight) + torch.nn.functional.conv1d(
            rest, q.rvq_rest.output_proj.weight
        )
        torch.testing.assert_close(q.decode(codes), expected, rtol=1e-5, atol=1e-5)


def test_nearest_centroid_ties_pick_the_first_index() -> None:
    cb = EuclideanCodebook(2, 30)
    with torch.no_grad():
        cb.embedding_sum.copy_(torch.randn(30, 2) + 10)
        cb.embedding_sum[4] = torch.tensor([1.0, 1.0])
        cb.embedding_sum[17] = torch.tensor([1.0, 1.0])
    assert cb.encode(torch.tensor([[1.0, 1.0], [1.1, 0.9]])).tolist() == [4, 4]


@pytest.mark.parametrize(("bins", "rows"), [(2048, 1), (2048, 4), (64, 3), (40, 30), (20, 3), (20, 40)])
def test_nearest_centroid_is_cdist_argmin_bit_for_bit(bins: int, rows: int) -> None:
    """The cached distance product gives torch.cdist's argmin exactly (its matrix-product form above 25 rows on
    either side, cdist itself below), near ties included."""
    g = torch.Generator().manual_seed(bins + rows)
    cb = EuclideanCodebook(8, bins)
    with torch.no_grad():
        cb.cluster_usage.copy_(torch.rand(bins, generator=g) * 2 + 0.5)
        cb.embedding_sum.copy_(torch.randn(bins, 8, generator=g))
        emb = cb.embedding_sum / cb.cluster_usage.clamp(min=1e-5)[:, None]
        for _ in range(20):
            x = torch.randn(rows, 8, generator=g)
            x[0] = (emb[1] + emb[2]) / 2  # equidistant from two centroids
            assert torch.equal(cb.encode(x), torch.cdist(x[None], emb[None])[0].argmin(-1))


def test_centroid_cache_follows_the_buffers() -> None:
    """The cached centroids are rebuilt when a buffer is modified in place or replaced (load_state_dict, .to)."""
    cb = EuclideanCodebook(2, 30)
    first = cb.embedding
    assert cb.embedding is first
    with torch.no_grad():
        cb.embedding_sum.copy_(torch.arange(60.0).view(30, 2))
    assert torch.equal(cb.embedding, torch.arange(60.0).view(30, 2))
    assert cb.encode(torch.tensor([[40.0, 41.0]])).tolist() == [20]
    cb.load_state_dict({**cb.state_dict(), "cluster_usage": torch.full((30,), 2.0)})
    assert torch.equal(cb.embedding, torch.arange(60.0).view(30, 2) / 2)
    cb.cluster_usage = torch.full((30,), 4.0)
    assert torch.equal(cb.embedding, torch.arange(60.0).view(30, 2) / 4)
    assert cb.encode(torch.tensor([[10.0, 10.25]])).tolist() == [20]


def test_set_num_codebooks_limits_encode() -> None:
    q = _quantizer()
    x = torch.randn(1, 6, 3)
    with torch.no_grad():
        full = q.encode(x)
        q.set_num_codebooks(2)
        assert q.num_codebooks == 2
        assert torch.equal(q.encode(x), full[:, :2])
        q.set_num_codebooks(1)
        assert torch.equal(q.encode(x), full[:, :1])
