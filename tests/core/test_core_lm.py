"""LMModel against the reference fixtures (teacher-forced forward), LMConfig, parameter counts on meta."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from cspan.core import LMConfig, LMModel, LMOutput
from cspan.core.errors import CheckpointError

SHAPED = ["lm-moshi-shaped", "lm-personaplex-shaped"]


def _config(fixture_file, name: str) -> LMConfig:
    return LMConfig.from_upstream(json.loads(fixture_file("reference", name, "config.json").read_text()))


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Upstream ``moshi.utils.utils.cross_entropy`` then the test's mean over (batch, time): per position
    logsumexp - target logit in float32, 0 where masked. logits [B, K, T, C] -> [K]."""
    logits = logits.float()
    target_logit = logits.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    ce = torch.logsumexp(logits, dim=-1) - target_logit
    ce = torch.where(mask, ce, torch.zeros_like(ce))
    return ce.mean(dim=(0, 2))


def test_kyutai_tiny_model_matches_reference_cross_entropy(fixture_file) -> None:
    cfg = _config(fixture_file, "kyutai-test-lm")
    assert cfg.norm == "layer_norm" and cfg.gating == "none" and cfg.positional_embedding == "sin"
    model = LMModel(cfg, dtype=torch.float32).eval()
    model.load_state_dict(
        load_file(fixture_file("reference", "kyutai-test-lm", "test_lm_model.safetensors")), strict=True
    )
    codes = load_file(fixture_file("reference", "kyutai-test-lm", "test_lm_codes.safetensors"))["codes"]
    ref = load_file(fixture_file("reference", "kyutai-test-lm", "test_lm_out.safetensors"))
    with torch.no_grad():
        out = model(codes)
    assert isinstance(out, LMOutput)
    assert out.logits.shape == (3, 3, 7, 32) and out.text_logits.shape == (3, 1, 7, 48)
    assert torch.equal(out.mask, ref["mask"])
    assert torch.equal(out.text_mask, ref["text_mask"])
    assert out.mask.sum(dim=(0, 2)).tolist() == [18, 15, 9]  # valid lengths 6/5/3 = T - delay

    ce = _cross_entropy(out.logits, codes[:, 1:], out.mask)
    ce_ref = _cross_entropy(ref["logits"], codes[:, 1:], ref["mask"])
    assert ((ce - ce_ref).abs() / ce_ref).max().item() <= 1e-6
    text_ce = _cross_entropy(out.text_logits, codes[:, :1], out.text_mask)
    text_ce_ref = _cross_entropy(ref["text_logits"], codes[:, :1], ref["text_mask"])
    assert ((text_ce - text_ce_ref).abs() / text_ce_ref).max().item() <= 1e-6
    # and against the published values
    stored = json.loads(fixture_file("reference", "kyutai-test-lm", "reference_ce.json").read_text())
    assert torch.allclose(ce, torch.tensor(stored["audio_ce_per_codebook_from_test_lm_out"]), rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", SHAPED)
def test_shaped_forward_matches_reference(fixture_file, name: str) -> None:
    cfg = _config(fixture_file, name)
    model = LMModel(cfg, dtype=torch.float32).eval()
    model.load_state_dict(load_file(fixture_file("reference", name, "model.safetensors")), strict=True)
    codes = load_file(fixture_file("reference", name, "codes.safetensors"))["codes"]
    ref = load_file(fixture_file("reference", name, "out.safetensors"))
    with torch.no_grad():
        out = model(codes)
    assert out.logits.shape == ref["logits"].shape
    assert torch.equal(out.logits.isnan(), ref["logits"].isnan())
    assert torch.allclose(out.logits, ref["logits"], atol=5e-5, rtol=0, equal_nan=True)
    assert torch.allclose(out.text_logits, ref["text_logits"], atol=5e-5, rtol=0, equal_nan=True)
    assert torch.equal(out.mask, ref["mask"])
    assert torch.equal(out.text_mask, ref["text_mask"])
    ce = _cross_entropy(out.logits, codes[:, 1 : 1 + cfg.dep_q], out.mask)
    assert torch.allclose(ce, ref["ce"].mean(dim=(0, 2)), atol=1e-5, rtol=0)


def test_meta_build_then_assign_load(fixture_file) -> None:
    """The checkpoint loader's path: build on meta, load_state_dict(assign=True), then run."""
    name = "lm-moshi-shaped"
    cfg = _config(fixture_file, name)
    model = LMModel(cfg, device="meta", dtype=torch.float32)
    assert all(p.device.type == "meta" for p in model.parameters())
    model.load_state_dict(load_file(fixture_file("reference", name, "model.safetensors")), strict=True, assign=True)
    model.eval()
    codes = load_file(fixture_file("reference", name, "codes.safetensors"))["codes"]
    ref = load_file(fixture_file("reference", name, "out.safetensors"))
    with torch.no_grad():
        out = model(codes[:, :, :8])
        state = model.new_state(2)
    assert state.offset.device.type == "cpu" and state.transformer.cache.keys.dtype == torch.float32
    assert torch.allclose(out.text_logits, ref["text_logits"][:, :, :8], atol=5e-5, rtol=0)


def test_embed_order_and_zero_token(fixture_file) -> None:
    cfg = _config(fixture_file, "lm-moshi-shaped")
    model = LMModel(cfg, dtype=torch.float32)
    tokens = torch.randint(0, cfg.card, (2, 17, 3))
    tokens[:, 0] = torch.randint(0, cfg.text_card, (2, 3))
    tokens[0, 5, 1] = -1
    x = model.embed(tokens)
    expected = model.emb[0].weight[tokens[:, 1]]
    for k in range(1, 16):
        expected = expected + torch.where(
            tokens[:, k + 1, :, None] == -1, 0.0, model.emb[k].weight[tokens[:, k + 1].clamp(min=0)]
        )
    expected = expected + model.text_emb.weight[tokens[:, 0]]
    assert torch.equal(x, expected)
    only_zero = torch.full((1, 17, 1), -1)
    assert torch.count_nonzero(model.embed(only_zero)) == 0
    with pytest.raises(ValueError, match="tokens must be"):
        model.embed(tokens[:, :9])


def test_config_round_trip_and_upstream_quirks(fixture_file) -> None:
    raw = json.loads(fixture_file("reference", "lm-personaplex-shaped", "config.json").read_text())
    cfg = LMConfig.from_upstream(
        {**raw, "depformer_causal": True, "moshi_name": "model.safetensors", "demux_second_stream": False}
    )
    assert cfg.dim_feedforward == 264
    assert cfg.model_extra == {"moshi_name": "model.safetensors"}
    assert cfg.depformer_transformer_kwargs()["context"] is None
    assert cfg.depformer_transformer_kwargs()["weights_per_step"] == 16
    up = cfg.to_upstream()
    assert "depformer_causal" not in up and up["moshi_name"] == "model.safetensors"
    assert "dim_feedforward" not in up and "demux_second_text_stream" not in up
    assert {k: up[k] for k in raw if k != "depformer_causal"} == {k: v for k, v in raw.items()}
    assert LMConfig.from_upstream(up) == cfg

    kyutai = _config(fixture_file, "kyutai-test-lm")
    dep = kyutai.depformer_transformer_kwargs()
    assert dep["num_layers"] == 2 and dep["dim_feedforward"] == 16 and dep["gating"] == "silu"
    assert dep["positional_embedding"] == "sin" and dep["weights_per_step_schedule"] == [0, 1, 1]
    assert kyutai.depformer_in_count == 2
    assert LMConfig.from_upstream(kyutai.to_upstream()).depformer_transformer_kwargs() == dep

    with pytest.raises(ValidationError, match="delays"):
        LMConfig.from_upstream({**raw, "delays": [0, 1]})
    with pytest.raises(ValidationError, match="schedule"):
        LMConfig.from_upstream({**raw, "depformer_weights_per_step_schedule": [0, 1]})
    with pytest.raises(CheckpointError, match="conditioners"):
        LMModel(LMConfig.from_upstream({**raw, "conditioners": {"description": {"type": "lut"}}}), device="meta")


@pytest.mark.parametrize(
    ("preset", "dep_q", "params", "keys"),
    [("moshi_7b", 8, 7_687_729_152, 355), ("personaplex_7b", 16, 8_371_408_896, 475)],
)
def test_7b_presets_on_meta(preset: str, dep_q: int, params: int, keys: int) -> None:
    cfg = getattr(LMConfig, preset)()
    assert cfg.dep_q == dep_q and cfg.dim_feedforward == 16896
    model = LMModel(cfg, device="meta", dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == params
    sd = model.state_dict()
    assert len(sd) == keys
    assert sd["transformer.layers.0.self_attn.in_proj_weight"].shape == (12288, 4096)
    assert sd["transformer.layers.31.gating.linear_in.weight"].shape == (22528, 4096)
    assert sd["transformer.layers.0.gating.linear_out.weight"].shape == (4096, 11264)
    assert sd["depformer.layers.5.self_attn.in_proj_weight"].shape == (dep_q * 3072, 1024)
    assert sd["depformer.layers.5.self_attn.out_proj.weight"].shape == (dep_q * 1024, 1024)
    assert sd[f"depformer.layers.0.gating.{dep_q - 1}.linear_in.weight"].shape == (5632, 1024)
    assert sd["out_norm.alpha"].shape == (1, 1, 4096)
    assert sd[f"depformer_emb.{dep_q - 2}.weight"].shape == (2049, 1024)
    assert not any(k.endswith(".bias") for k in sd)


def test_depformer_projections_of_the_first_codebooks(fixture_file) -> None:
    """A frame that runs only the first codebooks (the served step: the agent's 8 of 16) projects only the
    depformer inputs they use, with the values of the full product."""
    cfg = _config(fixture_file, "lm-personaplex-shaped")
    model = LMModel(cfg, dtype=torch.float32)
    hidden = torch.randn(3, cfg.dim)
    full = model.depformer_projections(hidden)
    assert full.shape == (3, cfg.dep_q, cfg.depformer_dim)
    for k in range(cfg.dep_q):
        assert torch.allclose(full[:, k], model.depformer_in[k](hidden), atol=1e-5)
    for steps, used in ((8, 8), (1, 1), (0, 1), (cfg.dep_q, cfg.dep_q), (None, cfg.dep_q)):
        part = model.depformer_projections(hidden, steps)
        assert part.shape == (3, used, cfg.depformer_dim)
        assert torch.allclose(part, full[:, :used], atol=1e-6)
