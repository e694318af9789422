"""Fine-tune `.pt` files over a base (compile prefixes, partial state dicts), unmerged LoRA, voices of the fine-tune,
and Hub resolution from an offline cache (HF_HOME, HF_HUB_OFFLINE, CSPAN_BASE, the default checkpoint)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cspan.core.checkpoint import DEFAULT_FINE_TUNE_FILE, DEFAULT_REPO, LM_FILE, load_checkpoint, load_lm
from cspan.core.errors import CheckpointError
from cspan.core.lora import LoRALinear

LORA_LAYERS = [
    "transformer.layers.0.gating.linear_in",
    "transformer.layers.1.self_attn.out_proj",
    "depformer.layers.1.gating.3.linear_out",
    "depformer_in.2",
    "linears.5",
    "text_linear",
]


def _codes(cfg, seed: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, cfg.card, (2, cfg.n_q + 1, 6), generator=gen)
    codes[:, 0] = torch.randint(0, cfg.text_card, (2, 6), generator=gen)
    return codes


def _forward(lm, codes):
    with torch.no_grad():
        out = lm(codes)
    return out.logits.nan_to_num(), out.text_logits


def _fake_hub_repo(hf_home: Path, repo_id: str, files: dict[str, Path], revision: str = "main") -> Path:
    """Lay out ``repo_id`` in a Hugging Face cache under ``hf_home`` as the hub library does (refs + snapshot)."""
    commit = (repo_id.replace("/", "") * 40)[:40].encode().hex()[:40]
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for rel, src in files.items():
        (snapshot / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, snapshot / rel)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot


def test_full_fine_tune_over_base(tiny_checkpoint_dir: Path, tmp_path: Path) -> None:
    base = load_file(tiny_checkpoint_dir / LM_FILE)
    new_head = torch.randn_like(base["text_linear.weight"])
    new_gate = torch.randn_like(base["transformer.layers.0.gating.linear_in.weight"])
    ft_dir = tmp_path / "ft"
    (ft_dir / "voices").mkdir(parents=True)
    state = {
        "_orig_mod.text_linear.weight": new_head.to(torch.bfloat16),
        "transformer._orig_mod.layers.0.gating.linear_in.weight": new_gate,
    }
    torch.save({"model": state, "step": 5938}, ft_dir / DEFAULT_FINE_TUNE_FILE)
    torch.save({"codes": torch.zeros(8, 3, dtype=torch.long)}, ft_dir / "voices" / "ftvoice.pt")

    for source in (ft_dir, ft_dir / DEFAULT_FINE_TUNE_FILE):
        ckpt = load_checkpoint(source, base=tiny_checkpoint_dir)
        assert ckpt.fine_tune == ft_dir / DEFAULT_FINE_TUNE_FILE and ckpt.lora is None
        assert ckpt.files["fine_tune"] == ft_dir / DEFAULT_FINE_TUNE_FILE
        lm = ckpt.lm
        assert lm.dtype == torch.float32  # the base's stored dtype; the bf16 fine-tune tensor is cast
        torch.testing.assert_close(lm.text_linear.weight, new_head.to(torch.bfloat16).float(), rtol=0, atol=0)
        assert torch.equal(lm.transformer.layers[0].gating.linear_in.weight, new_gate)
        assert torch.equal(lm.linears[0].weight, base["linears.0.weight"])
        assert sorted(ckpt.voices) == ["ftvoice", "tiny0", "tiny1"]
        assert ckpt.load_voice("ftvoice").shape == (8, 3)


def test_fine_tune_base_from_env(tiny_checkpoint_dir: Path, tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "ft.pt"
    torch.save({"model": {}}, path)
    monkeypatch.setenv("CSPAN_BASE", str(tiny_checkpoint_dir))
    ckpt = load_checkpoint(path)
    assert ckpt.files["lm"] == tiny_checkpoint_dir / LM_FILE


def test_fine_tune_unexpected_key_named(tiny_checkpoint_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "ft.pt"
    torch.save({"model": {"text_linear.weight": torch.zeros(1000, 64), "head.bias": torch.zeros(3)}}, path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, base=tiny_checkpoint_dir)
    assert str(path) in str(err.value) and "'head.bias'" in str(err.value)


def test_fine_tune_wrong_shape_named(tiny_checkpoint_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "ft.pt"
    torch.save({"model": {"_orig_mod.out_norm.alpha": torch.ones(1, 1, 32)}}, path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, base=tiny_checkpoint_dir)
    assert str(path) in str(err.value) and "'out_norm.alpha'" in str(err.value) and "[1, 1, 32]" in str(err.value)


def _lora_state(base: dict[str, torch.Tensor], r: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for i, name in enumerate(LORA_LAYERS):
        weight = base[f"{name}.weight"]
        out_f, in_f = weight.shape
        prefix = f"_orig_mod.{name}" if i % 2 else name
        if i != 2:  # layer 2 takes its base weight from the base checkpoint
            state[f"{prefix}.base.weight"] = weight + 0.01 * torch.randn(weight.shape, generator=gen)
        state[f"{prefix}.lora_A"] = 0.1 * torch.randn(r, in_f, generator=gen)
        state[f"{prefix}.lora_B"] = 0.1 * torch.randn(out_f, r, generator=gen)
    return state


def test_lora_kept_unmerged_and_equals_merged_weights(tiny_checkpoint_dir: Path, tmp_path: Path) -> None:
    r, alpha = 4, 8.0
    base = load_file(tiny_checkpoint_dir / LM_FILE)
    state = _lora_state(base, r)
    path = tmp_path / "lora.pt"
    torch.save({"model": state, "lora": {"r": r, "alpha": alpha}}, path)

    ckpt = load_checkpoint(path, base=tiny_checkpoint_dir)
    assert ckpt.lora == {"r": r, "alpha": alpha, "modules": sorted(LORA_LAYERS)}
    stripped = {k.removeprefix("_orig_mod."): v for k, v in state.items()}
    merged_sd = dict(base)
    for name in LORA_LAYERS:
        module = ckpt.lm.get_submodule(name)
        assert isinstance(module, LoRALinear) and module.r == r
        base_w = stripped.get(f"{name}.base.weight", base[f"{name}.weight"])
        assert torch.equal(module.base.weight, base_w)
        assert torch.equal(module.lora_A, stripped[f"{name}.lora_A"])
        merged = base_w + (stripped[f"{name}.lora_B"] @ stripped[f"{name}.lora_A"]) * (alpha / r)
        torch.testing.assert_close(module.weight, merged, rtol=0, atol=1e-6)
        merged_sd[f"{name}.weight"] = merged
    keys = set(ckpt.lm.state_dict())
    assert "text_linear.base.weight" in keys and "text_linear.lora_B" in keys and "text_linear.weight" not in keys

    merged_dir = tmp_path / "merged"
    merged_dir.mkdir()
    from safetensors.torch import save_file

    save_file(merged_sd, merged_dir / LM_FILE)
    shutil.copyfile(tiny_checkpoint_dir / "config.json", merged_dir / "config.json")
    reference = load_lm(merged_dir)
    codes = _codes(ckpt.lm_config)
    got, want = _forward(ckpt.lm, codes), _forward(reference, codes)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)
    assert (got[1] - _forward(load_lm(tiny_checkpoint_dir), codes)[1]).abs().max() > 1e-3  # adapters matter


def test_lora_without_spec_names_file_and_key(tiny_checkpoint_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "lora.pt"
    torch.save({"model": _lora_state(load_file(tiny_checkpoint_dir / LM_FILE), r=2)}, path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, base=tiny_checkpoint_dir)
    message = str(err.value)
    assert str(path) in message and ".lora_A'" in message and "'lora'" in message


def test_lora_on_non_linear_named(tiny_checkpoint_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "lora.pt"
    state = {"out_norm.lora_A": torch.zeros(2, 64), "out_norm.lora_B": torch.zeros(64, 2)}
    torch.save({"model": state, "lora": {"r": 2, "alpha": 2}}, path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, base=tiny_checkpoint_dir)
    assert str(path) in str(err.value) and "out_norm" in str(err.value)


def test_bfloat16_load(tiny_checkpoint_dir: Path) -> None:
    ckpt = load_checkpoint(tiny_checkpoint_dir, dtype=torch.bfloat16)
    assert {p.dtype for p in ckpt.lm.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in ckpt.mimi.parameters()} == {torch.float32}
    assert not any(p.device.type == "meta" for p in [*ckpt.lm.parameters(), *ckpt.mimi.buffers()])


def test_hub_repo_from_offline_cache(tiny_checkpoint_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """Repo ids resolve through the Hugging Face cache under HF_HOME with HF_HUB_OFFLINE=1 (no network)."""
    hf_home = tmp_path / "hf"
    files = {str(p.relative_to(tiny_checkpoint_dir)): p for p in tiny_checkpoint_dir.rglob("*") if p.is_file()}
    snapshot = _fake_hub_repo(hf_home, "acme/tiny-base", files)
    ft = tmp_path / DEFAULT_FINE_TUNE_FILE
    head = torch.randn(1000, 64)
    torch.save({"model": {"text_linear.weight": head}}, ft)
    voice = tmp_path / "v.pt"
    torch.save({"codes": torch.ones(8, 2, dtype=torch.long)}, voice)
    _fake_hub_repo(hf_home, DEFAULT_REPO, {DEFAULT_FINE_TUNE_FILE: ft, "voices/main.pt": voice})
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("CSPAN_CHECKPOINT", raising=False)

    ckpt = load_checkpoint("acme/tiny-base")
    assert ckpt.files["lm"] == snapshot / LM_FILE and ckpt.source == "acme/tiny-base"
    assert sorted(ckpt.voices) == ["tiny0", "tiny1"]

    single = load_checkpoint("hf://acme/tiny-base/model.safetensors")
    assert single.files["lm"] == snapshot / LM_FILE

    monkeypatch.setenv("CSPAN_BASE", "acme/tiny-base")
    default = load_checkpoint()  # the released layout: fine-tune repo over the base repo
    assert default.source == DEFAULT_REPO and default.fine_tune.name == DEFAULT_FINE_TUNE_FILE
    assert torch.equal(default.lm.text_linear.weight, head)
    assert sorted(default.voices) == ["main", "tiny0", "tiny1"]

    with pytest.raises(CheckpointError) as err:
        load_checkpoint("acme/tiny-base", revision="v2")
    assert "v2" in str(err.value) and "HF_HUB_OFFLINE" in str(err.value)
