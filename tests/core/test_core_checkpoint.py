"""`cspan model tiny` -> load_checkpoint round trip, deterministic files, tokenizer ids, voices, `cspan model info`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cspan.core.checkpoint import (
    CONFIG_FILE,
    LM_FILE,
    MIMI_FILE,
    TOKENIZER_FILE,
    describe_checkpoint,
    load_checkpoint,
    load_lm,
    load_voice,
)
from cspan.core.errors import CheckpointError
from cspan.core.tiny import TINY_VOICES, build_tiny_checkpoint, make_tiny_models

LAYOUT = [LM_FILE, MIMI_FILE, TOKENIZER_FILE, CONFIG_FILE, "README.md", "voices/tiny0.pt", "voices/tiny1.pt"]


def _fixed_codes(lm_cfg, seed: int = 7) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, lm_cfg.card, (2, lm_cfg.n_q + 1, 9), generator=gen)
    codes[:, 0] = torch.randint(0, lm_cfg.text_card, (2, 9), generator=gen)
    codes[0, 3, 2] = -1  # a zero token
    return codes


def _fixed_pcm(seed: int = 11, frames: int = 4) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(frames * 1920) / 24000
    return (0.3 * torch.sin(2 * torch.pi * 180 * t) + 0.05 * torch.randn(frames * 1920, generator=gen)).view(1, 1, -1)


def _outputs(lm, mimi, lm_cfg) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        out = lm(_fixed_codes(lm_cfg))
        codes = mimi.encode(_fixed_pcm())
        pcm = mimi.decode(codes)
    return {
        "logits": out.logits.nan_to_num(nan=123.0),
        "mask": out.mask,
        "text_logits": out.text_logits.nan_to_num(nan=123.0),
        "codes": codes,
        "pcm": pcm,
    }


def _tree_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_tiny_layout_and_config(tiny_checkpoint_dir: Path) -> None:
    for name in LAYOUT:
        assert (tiny_checkpoint_dir / name).is_file(), name
    cfg = json.loads((tiny_checkpoint_dir / CONFIG_FILE).read_text())
    assert cfg["dep_q"] == 16 and cfg["n_q"] == 16 and cfg["card"] == 2048 and cfg["text_card"] == 1000
    assert cfg["delays"] == [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]
    assert (cfg["norm"], cfg["gating"], cfg["positional_embedding"]) == ("rms_norm_f32", "silu", "rope")
    assert cfg["depformer_multi_linear"] and cfg["depformer_weights_per_step"] and cfg["context"] == 3000
    mimi = cfg["mimi_config"]
    assert (mimi["sample_rate"], mimi["frame_rate"], mimi["seanet"]["ratios"]) == (24000, 12.5, [8, 6, 5, 4])
    assert mimi["quantizer"]["bins"] == 2048


def test_cli_tiny_round_trip_gives_identical_outputs(tiny_checkpoint_dir: Path, tiny_checkpoint) -> None:
    """The folder the CLI wrote (seed 0) loads into models whose outputs equal the in-memory build's exactly."""
    ref = make_tiny_models(dep_q=16, seed=0)
    ckpt = tiny_checkpoint
    meta_keys = {"moshi_name", "mimi_name", "tokenizer_name"}  # file names in config.json, kept as extras
    assert ckpt.lm_config.model_dump(exclude=meta_keys) == ref.lm_config.model_dump()
    assert ckpt.mimi_config == ref.mimi_config
    assert not ckpt.lm.training and not ckpt.mimi.training
    assert ckpt.lm.dtype == torch.float32 and ckpt.mimi.num_codebooks == 8
    got, want = _outputs(ckpt.lm, ckpt.mimi, ckpt.lm_config), _outputs(ref.lm, ref.mimi, ref.lm_config)
    assert got["codes"].shape == (1, 8, 4) and got["pcm"].shape == (1, 1, 4 * 1920)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    for name, codes in ref.voices.items():
        assert torch.equal(load_voice(name, ckpt), codes)


def test_tiny_files_are_deterministic(tiny_checkpoint_dir: Path, tmp_path: Path) -> None:
    """An in-process build with the same seed writes byte-identical files to the CLI's; another seed differs."""
    same = build_tiny_checkpoint(tmp_path / "same", dep_q=16, seed=0)
    assert _tree_bytes(same) == _tree_bytes(tiny_checkpoint_dir)
    other = build_tiny_checkpoint(tmp_path / "other", dep_q=8, seed=1)
    assert (other / LM_FILE).read_bytes() != (same / LM_FILE).read_bytes()
    assert (other / TOKENIZER_FILE).read_bytes() == (same / TOKENIZER_FILE).read_bytes()  # corpus-only
    ckpt = load_checkpoint(other)
    assert ckpt.lm_config.dep_q == 8 and len(ckpt.lm.linears) == 8


def test_tiny_refuses_non_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(CheckpointError, match="not empty"):
        build_tiny_checkpoint(tmp_path)


def test_tokenizer_special_and_byte_ids(tiny_checkpoint) -> None:
    sp = tiny_checkpoint.tokenizer
    assert sp.vocab_size() == tiny_checkpoint.lm_config.text_card == 1000
    assert [sp.id_to_piece(i) for i in range(4)] == ["<unk>", "<s>", "</s>", "<pad>"]
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, 1, 2, 3)
    assert [sp.id_to_piece(i) for i in (4, 12, 13)] == ["<0x00>", "<0x08>", "<0x09>"]
    assert sp.id_to_piece(259) == "<0xFF>"
    text = "What is the weather in London? About 12 euros, Zürich."
    assert sp.decode(sp.encode(text)) == text
    assert "▁London" in sp.encode("the weather in London", out_type=str)


def test_voices_are_mimi_codes(tiny_checkpoint) -> None:
    assert sorted(tiny_checkpoint.voices) == sorted(TINY_VOICES)
    for name, (frames, _, _) in TINY_VOICES.items():
        codes = tiny_checkpoint.load_voice(name)
        assert codes.dtype == torch.long and codes.shape == (8, frames)
        assert int(codes.min()) >= 0 and int(codes.max()) < 2048
        assert len(set(codes[0].tolist())) > 1  # encoded audio, not a constant
    raw = torch.load(tiny_checkpoint.voices["tiny0"], weights_only=True)
    assert set(raw) == {"codes"}


def test_lm_only_folder_loads_with_load_lm(fixture_file) -> None:
    folder = fixture_file("reference", "lm-personaplex-shaped")
    from safetensors.torch import load_file

    lm = load_lm(folder)
    assert lm.dep_q == 16 and not lm.training
    codes = load_file(folder / "codes.safetensors")["codes"]
    ref = load_file(folder / "out.safetensors")
    with torch.no_grad():
        out = lm(codes)
    mask = ref["text_mask"][..., None].expand_as(out.text_logits)
    torch.testing.assert_close(out.text_logits[mask], ref["text_logits"][mask], rtol=0, atol=5e-5)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(folder)
    assert MIMI_FILE in str(err.value) and TOKENIZER_FILE in str(err.value) and "load_lm" in str(err.value)


def test_load_lm_single_file_and_dtype(fixture_file) -> None:
    lm = load_lm(fixture_file("reference", "lm-moshi-shaped", "model.safetensors"), dtype="bfloat16")
    assert lm.dep_q == 8 and lm.dtype == torch.bfloat16
    assert lm.out_norm.alpha.dtype == torch.bfloat16


def test_model_info_cli(tiny_checkpoint_dir: Path) -> None:
    text = describe_checkpoint(tiny_checkpoint_dir)
    n_params = sum(p.numel() for p in make_tiny_models(16, 0).lm.parameters())
    assert f"parameters: {n_params:,}" in text
    assert "dep_q 16" in text and "stored dtype: float32" in text and "24000 Hz" in text and "12.5 Hz" in text
    assert "4 <ret>: '<0x00>'" in text and "12 span open: '<0x08>'" in text and "tiny0" in text
    proc = subprocess.run(
        [sys.executable, "-m", "cspan.core.cli", "model", "info", str(tiny_checkpoint_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == text
    missing = subprocess.run(
        [sys.executable, "-m", "cspan.core.cli", "model", "info", str(tiny_checkpoint_dir / "nope")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert missing.returncode == 1 and "does not exist" in missing.stderr and "nope" in missing.stderr


def test_lm_file_alone_takes_the_other_files_from_base(tiny_checkpoint_dir: Path, tmp_path: Path) -> None:
    """``--checkpoint mine.safetensors --base DIR`` (upstream's --moshi-weight over --hf-repo)."""
    lm = tmp_path / "my weights" / "mine.safetensors"
    lm.parent.mkdir()
    shutil.copyfile(tiny_checkpoint_dir / LM_FILE, lm)
    with pytest.raises(CheckpointError, match="pass --base DIR"):
        load_checkpoint(lm)
    ckpt = load_checkpoint(lm, base=tiny_checkpoint_dir)
    assert ckpt.files["lm"] == lm and ckpt.files["mimi"] == tiny_checkpoint_dir / MIMI_FILE
    assert ckpt.files["tokenizer"] == tiny_checkpoint_dir / TOKENIZER_FILE and sorted(ckpt.voices) == ["tiny0", "tiny1"]
    assert f"lm: {lm}" in describe_checkpoint(lm, base=tiny_checkpoint_dir)


def test_a_folder_of_lm_weights_takes_the_other_files_from_base(
    tiny_checkpoint_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """A folder of ``model.safetensors`` + ``config.json`` only (the LM of Kyutai's or PersonaPlex's layout, copied
    alone) with ``--base DIR``: the base was ignored ("lacks Mimi weights file ...", no word of --base) while the
    same folder's ``model.safetensors`` took the others from it. Now both take them from the base."""
    monkeypatch.delenv("CSPAN_BASE", raising=False)
    folder = tmp_path / "lm only"
    folder.mkdir()
    for name in (LM_FILE, "config.json"):
        shutil.copyfile(tiny_checkpoint_dir / name, folder / name)
    with pytest.raises(CheckpointError, match=r"lacks Mimi weights file .*pass --base DIR \(or CSPAN_BASE\)"):
        load_checkpoint(folder)
    ckpt = load_checkpoint(folder, base=tiny_checkpoint_dir)
    assert ckpt.files["lm"] == folder / LM_FILE and ckpt.files["config"] == folder / "config.json"
    assert ckpt.files["mimi"] == tiny_checkpoint_dir / MIMI_FILE and ckpt.files["tokenizer"] == (
        tiny_checkpoint_dir / TOKENIZER_FILE
    )
    monkeypatch.setenv("CSPAN_BASE", str(tiny_checkpoint_dir))
    assert load_checkpoint(folder).files["mimi"] == tiny_checkpoint_dir / MIMI_FILE
    # a complete folder keeps its own files whatever the base
    assert load_checkpoint(tiny_checkpoint_dir, base=folder).files["lm"] == tiny_checkpoint_dir / LM_FILE


def test_weights_fingerprint_is_by_content_not_by_path(tiny_checkpoint_dir: Path, tmp_path: Path) -> None:
    """The content fingerprint that a training resume and a bench resume key compare (weights_fingerprint): the same
    weights moved or renamed give the same value, another seed's, or one changed value, another; it reads the
    header and 4 KiB per tensor (the torch.save zip's CRC-32s cover the rest of a .pt)."""
    import struct

    from cspan.core.checkpoint import FINGERPRINT_SAMPLE, read_safetensors_header, weights_fingerprint

    lm = tiny_checkpoint_dir / LM_FILE
    first = weights_fingerprint(lm)
    assert len(first) == 64 and int(first, 16) >= 0
    moved = tmp_path / "elsewhere" / "renamed.safetensors"
    moved.parent.mkdir()
    shutil.copyfile(lm, moved)
    assert weights_fingerprint(moved) == first
    other = build_tiny_checkpoint(tmp_path / "seed1", seed=1)
    assert weights_fingerprint(other / LM_FILE) != first
    # one byte inside the first 4 KiB of one tensor's data
    data = bytearray(lm.read_bytes())
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    header = json.loads(bytes(data[8 : 8 + n]))
    key = sorted(read_safetensors_header(lm).tensors)[-1]
    begin, end = header[key]["data_offsets"]
    assert end - begin > 8
    data[8 + n + begin + min(FINGERPRINT_SAMPLE, end - begin) - 1] ^= 0xFF
    changed = tmp_path / "changed.safetensors"
    changed.write_bytes(bytes(data))
    assert weights_fingerprint(changed) != first
    # a torch.save fine-tune: the same weights saved again (another file name, another serialization id) are the
    # same; one value changed past the first 4 KiB of its tensor is another (its record's CRC-32)
    state = {"model": {"a.weight": torch.randn(64, 64), "b.weight": torch.randn(8)}}
    torch.save(state, tmp_path / "one.pt")
    torch.save(state, tmp_path / "two.pt")
    assert weights_fingerprint(tmp_path / "one.pt") == weights_fingerprint(tmp_path / "two.pt")
    state["model"]["a.weight"][-1, -1] += 1.0
    torch.save(state, tmp_path / "three.pt")
    assert weights_fingerprint(tmp_path / "three.pt") != weights_fingerprint(tmp_path / "one.pt")
    # a broken file is a CheckpointError naming it
    (tmp_path / "cut.safetensors").write_bytes(lm.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"cut\.safetensors"):
        weights_fingerprint(tmp_path / "cut.safetensors")
    with pytest.raises(CheckpointError, match=r"missing\.pt"):
        weights_fingerprint(tmp_path / "missing.pt")


def test_resolve_checkpoint_cache_only_never_asks_the_hub(tmp_path: Path, monkeypatch) -> None:
    from cspan.core.checkpoint import resolve_checkpoint

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(CheckpointError, match="is not in the Hugging Face cache"):
        resolve_checkpoint("nobody-here/no-such-model", cache_only=True)
