"""LoRA adapters in kyutai-labs/moshi-finetune's layout (``lora.safetensors`` + ``config.json`` with ``lora_rank`` and
``lora_scaling``) loaded over their base: kept unmerged or fused, equal outputs; errors name the file and the key."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cspan.core.checkpoint import describe_checkpoint, load_checkpoint
from cspan.core.errors import CheckpointError
from cspan.core.lora import LoRALinear

RANK, SCALING = 4, 2.0
# upstream module name -> our weight (dotted), row block of n_sets (None: whole)
TARGETS = {
    "transformer.layers.0.self_attn.in_projs.0": ("transformer.layers.0.self_attn.in_proj_weight", None),
    "transformer.layers.1.self_attn.out_projs.0": ("transformer.layers.1.self_attn.out_proj.weight", None),
    "transformer.layers.0.gating.linear_in": ("transformer.layers.0.gating.linear_in.weight", None),
    "transformer.layers.1.gating.linear_out": ("transformer.layers.1.gating.linear_out.weight", None),
    "depformer.layers.0.self_attn.in_projs.3": ("depformer.layers.0.self_attn.in_proj_weight", 3),
    "depformer.layers.1.self_attn.out_projs.5": ("depformer.layers.1.self_attn.out_proj.weight", 5),
    "depformer.layers.1.gating.2.linear_out": ("depformer.layers.1.gating.2.linear_out.weight", None),
    "depformer_in.4": ("depformer_in.4.weight", None),
    "linears.7": ("linears.7.weight", None),
    "text_linear": ("text_linear.weight", None),
}


def _adapters(base_state: dict[str, torch.Tensor], n_sets: int = 16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    out = {}
    for name, (ours, block) in TARGETS.items():
        weight = base_state[ours]
        rows = weight.shape[0] // (n_sets if block is not None else 1)
        out[f"{name}.lora_A.weight"] = torch.randn(RANK, weight.shape[1], generator=gen) * 0.05
        out[f"{name}.lora_B.weight"] = torch.randn(rows, RANK, generator=gen) * 0.05
    # older files stack the per-set adapters of an attention projection: in_proj [n * r, in] / [n * out, r]
    weight = base_state["depformer.layers.1.self_attn.in_proj_weight"]
    out["depformer.layers.1.self_attn.in_proj.lora_A.weight"] = torch.randn(
        n_sets * RANK, weight.shape[1], generator=gen
    )
    out["depformer.layers.1.self_attn.in_proj.lora_B.weight"] = torch.randn(weight.shape[0], RANK, generator=gen) * 0.01
    out["emb.3.weight"] = torch.randn(*base_state["emb.3.weight"].shape, generator=gen)  # ft_embed: a full weight
    return out


@pytest.fixture(scope="module")
def lora_dir(tiny_checkpoint_dir: Path, tmp_path_factory) -> Path:
    from safetensors.torch import load_file

    folder = tmp_path_factory.mktemp("moshi-lora") / "checkpoint_000100" / "consolidated"
    folder.mkdir(parents=True)
    base_state = load_file(tiny_checkpoint_dir / "model.safetensors")
    save_file(_adapters(base_state), folder / "lora.safetensors")
    config = json.loads((tiny_checkpoint_dir / "config.json").read_text())
    config.update(lora=True, lora_rank=RANK, lora_scaling=SCALING)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _codes(cfg, seed: int = 4) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, cfg.card, (2, cfg.n_q + 1, 7), generator=gen)
    codes[:, 0] = torch.randint(0, cfg.text_card, (2, 7), generator=gen)
    return codes


@torch.no_grad()
def test_unmerged_and_fused_give_equal_outputs(lora_dir: Path, tiny_checkpoint_dir: Path) -> None:
    unmerged = load_checkpoint(lora_dir, base=tiny_checkpoint_dir, dtype=torch.float32)
    fused = load_checkpoint(
        lora_dir / "lora.safetensors", base=tiny_checkpoint_dir, dtype=torch.float32, fuse_lora=True
    )
    assert unmerged.lora["format"] == "moshi" and unmerged.lora["r"] == RANK and unmerged.lora["scaling"] == SCALING
    kept = set(unmerged.lora["modules"])
    assert kept == {
        "transformer.layers.1.self_attn.out_proj",
        "transformer.layers.0.gating.linear_in",
        "transformer.layers.1.gating.linear_out",
        "depformer.layers.1.gating.2.linear_out",
        "depformer_in.4",
        "linears.7",
        "text_linear",
    }
    for name in kept:
        assert isinstance(unmerged.lm.get_submodule(name), LoRALinear)
    assert not any(isinstance(m, LoRALinear) for m in fused.lm.modules())
    a, b = unmerged.lm(_codes(unmerged.lm_config)), fused.lm(_codes(fused.lm_config))
    torch.testing.assert_close(a.logits.nan_to_num(), b.logits.nan_to_num(), atol=1e-5, rtol=0)
    torch.testing.assert_close(a.text_logits, b.text_logits, atol=1e-5, rtol=0)
    base = load_checkpoint(tiny_checkpoint_dir, dtype=torch.float32)
    assert (a.text_logits - base.lm(_codes(base.lm_config)).text_logits).abs().max() > 1e-3  # the adapters act


@torch.no_grad()
def test_fused_weights_are_upstream_merge(lora_dir: Path, tiny_checkpoint_dir: Path) -> None:
    """W + scaling * B @ A on the right row block (upstream's ``replace_lora_with_linear``)."""
    from safetensors.torch import load_file

    base = load_file(tiny_checkpoint_dir / "model.safetensors")
    adapters = load_file(lora_dir / "lora.safetensors")
    fused = dict(load_checkpoint(lora_dir, base=tiny_checkpoint_dir, fuse_lora=True).lm.state_dict())
    for name, (ours, block) in TARGETS.items():
        want = base[ours].clone()
        delta = SCALING * adapters[f"{name}.lora_B.weight"] @ adapters[f"{name}.lora_A.weight"]
        rows = delta.shape[0]
        span = slice(None) if block is None else slice(block * rows, (block + 1) * rows)
        want[span] += delta
        torch.testing.assert_close(fused[ours], want, atol=1e-6, rtol=0)
    w = base["depformer.layers.1.self_attn.in_proj_weight"].clone()
    A = adapters["depformer.layers.1.self_attn.in_proj.lora_A.weight"].view(16, RANK, -1)
    B = adapters["depformer.layers.1.self_attn.in_proj.lora_B.weight"].view(16, -1, RANK)
    want = w + SCALING * torch.cat([B[i] @ A[i] for i in range(16)])
    torch.testing.assert_close(fused["depformer.layers.1.self_attn.in_proj_weight"], want, atol=1e-6, rtol=0)
    assert torch.equal(fused["emb.3.weight"], adapters["emb.3.weight"])


def _broken(lora_dir: Path, tmp_path: Path, edit_state=None, edit_config=None) -> Path:
    from safetensors.torch import load_file

    folder = tmp_path / "broken"
    shutil.copytree(lora_dir, folder)
    if edit_state is not None:
        state = load_file(folder / "lora.safetensors")
        edit_state(state)
        save_file(state, folder / "lora.safetensors")
    if edit_config is not None:
        config = json.loads((folder / "config.json").read_text())
        edit_config(config)
        (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("edit_state", "edit_config", "expect"),
    [
        (lambda s: s.pop("linears.7.lora_B.weight"), None, "'linears.7.lora_B.weight' missing"),
        (
            lambda s: s.update(
                {
                    "nowhere.lora_A.weight": s["linears.7.lora_A.weight"].clone(),
                    "nowhere.lora_B.weight": s["linears.7.lora_B.weight"].clone(),
                }
            ),
            None,
            "layer 'nowhere'",
        ),
        (lambda s: s.update({"text_linear.lora_B.weight": torch.zeros(5, RANK)}), None, "text_linear"),
        (lambda s: s.update({"linears.7.lora_A.weight": torch.zeros(RANK, 64, dtype=torch.int32)}), None, "floats"),
        (None, lambda c: c.pop("lora_rank"), "'lora_rank'"),
        (None, lambda c: c.update(lora_scaling="2"), "'lora_scaling'"),
        (None, lambda c: c.update(lora_rank=8), "rank 8"),
        (None, lambda c: c.update(lora=False), "'lora': false"),
    ],
)
def test_bad_adapters_are_named(lora_dir, tiny_checkpoint_dir, tmp_path, edit_state, edit_config, expect) -> None:
    folder = _broken(lora_dir, tmp_path, edit_state, edit_config)
    with pytest.raises(CheckpointError, match=expect) as err:
        load_checkpoint(folder, base=tiny_checkpoint_dir)
    assert str(folder) in str(err.value)
    assert str(err.value).count("LoRA file") <= 1, str(err.value)  # the file named once
    # `cspan model info` (headers only) says the same: refused while reading, or in the LM's key check
    try:
        summary = describe_checkpoint(folder, base=tiny_checkpoint_dir)
    except CheckpointError as exc:
        assert re.search(expect, str(exc))
    else:
        lm_check = summary.split("\nMimi:")[0].split("  key check: ")[1]
        assert lm_check.startswith("FAILED, loading would refuse these weights: ") and re.search(expect, lm_check)


def test_model_info_checks_the_adapters(lora_dir: Path, tiny_checkpoint_dir: Path, tmp_path: Path, capsys) -> None:
    """``cspan model info`` checks moshi-finetune adapters against the LM as a load applies them (headers only): a
    rank that the tensors do not have is a failed key check and exit status 1, good adapters are ``ok``."""
    from cspan.core.cli import main

    assert main(["model", "info", str(lora_dir), "--base", str(tiny_checkpoint_dir)]) == 0
    out = capsys.readouterr().out
    lm = out.split("\nMimi:")[0]
    assert "LoRA (moshi-finetune): r 4, scaling 2.0" in lm and "  key check: ok" in lm
    folder = _broken(lora_dir, tmp_path, None, lambda c: c.update(lora_rank=8))
    assert main(["model", "info", str(folder), "--base", str(tiny_checkpoint_dir)]) == 1
    captured = capsys.readouterr()
    lm = captured.out.split("\nMimi:")[0]
    assert "  key check: FAILED, loading would refuse these weights: LoRA file " in lm and "not rank 8" in lm
    assert "these weights would not load" in captured.err


def test_adapters_without_config_are_refused(lora_dir: Path, tiny_checkpoint_dir: Path, tmp_path: Path) -> None:
    folder = _broken(lora_dir, tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"no config\.json beside them"):
        load_checkpoint(folder, base=tiny_checkpoint_dir)


def test_a_base_not_in_the_cache_names_the_base_flag(lora_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """Offline, with the default base (PersonaPlex's repo) absent from the Hugging Face cache, the error is about
    the base: its fix is ``--base DIR`` / ``CSPAN_BASE``, not the fine-tune's ``--checkpoint``."""
    monkeypatch.delenv("CSPAN_BASE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(lora_dir)
    message = str(err.value)
    assert message.startswith("base repo 'nvidia/personaplex-7b-v1'") and "HF_HUB_OFFLINE is set" in message
    assert "--base DIR or CSPAN_BASE" in message and "--checkpoint DIR" not in message, message
