"""``cspan train`` end to end on the tiny checkpoint (CPU): loss, export -> ``cspan infer``, exact resumption, LoRA,
``torchrun`` DDP and FSDP2 against a single process."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from cspan.core.checkpoint import load_checkpoint
from cspan.core.lora import LoRALinear
from cspan.train.train import read_train_state

pytestmark = pytest.mark.slow

COMMON = ["--context", "160", "--lr", "3e-3", "--log-every", "5", "--keep-checkpoints", "0", "--seed", "7"]


def _train(*args: str) -> None:
    """``cspan train ARGS`` in this process (saves a torch start-up per run; torchrun runs are subprocesses), on one
    CPU thread: the tiny model gains nothing from more, and busy CI machines lose a lot to thread contention."""
    from cspan.core.cli import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(list(args)) == 0
    finally:
        torch.set_num_threads(threads)


def _train_args(data: Path, out: Path, tiny: Path, *extra: str) -> list[str]:
    return ["train", "--data-dir", str(data), "--out-dir", str(out), "--checkpoint", str(tiny), *COMMON, *extra]


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _state(out: Path, step: int, part: str) -> dict[str, torch.Tensor]:
    """``part`` (``model`` or ``optimizer``) of the training checkpoint of ``step``, keys without the prefix."""
    state = read_train_state(out / "checkpoints" / f"step_{step:08d}")
    return {k.removeprefix(part + "."): v for k, v in state.items() if k.startswith(part + ".")}


def _model(out: Path, step: int) -> dict[str, torch.Tensor]:
    return _state(out, step, "model")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, prepared_dir: Path, tiny_dir: Path) -> Path:
    """30 steps of full fine-tuning, batch 2, a checkpoint every 10 steps."""
    out = tmp_path_factory.mktemp("run") / "full"
    args = _train_args(prepared_dir, out, tiny_dir, "--steps", "30", "--batch-size", "2", "--accum", "1")
    _train(*args, "--ckpt-every", "10")
    return out


def test_loss_goes_down_and_export_loads_in_infer(
    trained: Path, tiny_dir: Path, espeak_dir: Path, tmp_path: Path, run_cli: Callable
) -> None:
    import soundfile as sf

    losses = _losses(trained)
    assert len(losses) == 30
    assert np.mean(losses[-5:]) < 0.75 * np.mean(losses[:5]), losses
    export = trained / "export"
    payload = torch.load(export / "context_spanning.pt", map_location="cpu", weights_only=True)
    assert "lora" not in payload
    final = {k.removeprefix("lm."): v for k, v in _model(trained, 30).items()}
    assert set(payload["model"]) == set(final)
    assert all(torch.equal(payload["model"][k], final[k]) for k in final)
    assert sorted(p.name for p in (export / "voices").iterdir()) == ["tiny0.pt", "tiny1.pt"]
    # the export loads over its base, with the trained weights
    ckpt = load_checkpoint(export, base=tiny_dir, device="cpu", dtype=torch.float32)
    assert torch.equal(ckpt.lm.text_linear.weight, final["text_linear.weight"])
    base = load_checkpoint(tiny_dir, device="cpu", dtype=torch.float32)
    assert not torch.equal(base.lm.text_linear.weight, final["text_linear.weight"])
    # and `cspan infer` runs it: the base recorded in export.json is found without --base or CSPAN_BASE
    assert json.loads((export / "export.json").read_text())["base"] == str(tiny_dir)
    pcm, rate = sf.read(str(espeak_dir / "chat.wav"), dtype="float32")
    sf.write(str(tmp_path / "in.wav"), pcm[:rate, 0], rate)
    out_json = tmp_path / "out.json"
    run_cli(
        "infer", "--checkpoint", str(export), "--input-wav", str(tmp_path / "in.wav"),
        "--output-wav", str(tmp_path / "out.wav"), "--output-text", str(out_json),
        "--asr", "none", "--router", "none", "--lead-silence", "0", "--tail-silence", "0.2", "--device", "cpu",
        "--quiet",
    )  # fmt: skip
    record = json.loads(out_json.read_text())
    assert record["checkpoint"]["files"]["fine_tune"].endswith("context_spanning.pt")
    assert sf.info(str(tmp_path / "out.wav")).channels == 2


def test_each_step_records_the_rate_of_the_schedule(trained: Path) -> None:
    """--lr 3e-3, --lr-depformer its default 2 x, 30 steps, the default warm-up of 5 % (2 steps), --min-lr-ratio 0.1:
    half the peak on step 1, the peak on step 2 (the warm-up's end), then down to exactly 0.1 x the peak on step 30."""
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    lr = {r["step"]: (r["lr"], r["lr_depformer"]) for r in records}
    assert lr[1] == (3e-3 * 0.5, 6e-3 * 0.5)
    assert lr[2] == (3e-3, 6e-3)
    assert lr[30] == (3e-3 * 0.1, 6e-3 * 0.1)
    assert all(lr[s][0] > lr[s + 1][0] for s in range(2, 30))


def test_stop_and_resume_is_exact(trained: Path, prepared_dir: Path, tiny_dir: Path, tmp_path: Path, capsys) -> None:
    from cspan.core.cli import main

    out = tmp_path / "resumed"
    args = _train_args(prepared_dir, out, tiny_dir, "--steps", "30", "--batch-size", "2", "--accum", "1")
    args += ["--ckpt-every", "10"]
    _train(*args, "--stop-at", "10")
    assert not (out / "export").exists() and len(_losses(out)) == 10
    capsys.readouterr()
    # the same command again ("rerun to resume") trained step 11 and stopped there, past --stop-at 10: now nothing
    _train(*args, "--stop-at", "10")
    err = capsys.readouterr().err
    assert "already at step 10 (--stop-at 10)" in err and len(_losses(out)) == 10
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000010"]
    _train(*args, "--stop-at", "20")
    err = capsys.readouterr().err
    assert "resuming from" in err and "step 10 of 30" in err
    assert _losses(out) == _losses(trained)[:20]
    a, b = _model(trained, 20), _model(out, 20)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    oa, ob = _state(trained, 20, "optimizer"), _state(out, 20, "optimizer")
    assert set(oa) == set(ob) and any(k.endswith(".exp_avg_sq") for k in oa)
    assert all(torch.equal(oa[k], ob[k]) for k in oa)
    # --stop-at may change on resume; train_config.json holds the options of the invocation that ran last
    config = json.loads((out / "train_config.json").read_text())
    assert config["stop_at"] == 20 and config["clip"] == 1.0 and config["weights"]["ret"] == 5.0
    # options that change the samples cannot be changed on resume
    assert main([a if a != "7" else "8" for a in args]) == 2  # fails before training: no thread setting needed
    err = capsys.readouterr().err
    assert f"--out-dir {str(out)!r} holds a run trained with other settings (checkpoint step_00000020): " in err
    assert "--seed 7 (now 8); resume with the recorded values, or start over in a new --out-dir" in err


@pytest.mark.parametrize(
    ("flags", "expect"),
    [
        (
            ["--w-ret", "1", "--w-acoustic", "1", "--clip", "100"],
            "--clip 1.0 (now 100.0), --w-ret 5.0 (now 1.0), --w-acoustic 0.02 (now 1.0)",
        ),
        (["--w-text", "2", "--w-pad", "1", "--w-semantic", "0.5"], "--w-text 1.0 (now 2.0), --w-pad 0.5 (now 1.0)"),
        (["--lr-depformer", "1e-3", "--min-lr-ratio", "0"], "--lr-depformer 0.006 (now 0.001), --min-lr-ratio 0.1"),
        (["--warmup-steps", "3", "--steps", "5"], "--steps 4 (now 5), --warmup-steps 1 (now 3)"),
        (["--start-delay-s", "0.5", "--end-gap-s", "2"], "--start-delay-s 1.0 (now 0.5), --end-gap-s 1.0 (now 2.0)"),
        (["--random-delay-proba", "1"], "--random-delay-proba 0.2 (now 1.0)"),
        (["--accum", "2"], "global batch (--batch-size x --accum x processes) 1 (now 2); it was written by 1"),
    ],
)
def test_resuming_with_other_optimisation_settings_is_refused(
    flags, expect, prepared_dir: Path, tiny_dir: Path, tmp_path: Path, capsys
) -> None:
    """Resuming with other loss weights, --clip or delay sampler settings was accepted (only the seed, batch,
    context, LoRA, learning rates, schedule and weight decay were compared): the run went on with a loss it was not
    started with and train_config.json still claimed the first values. Every option that changes the samples or the
    optimisation is now compared: one line naming each flag with its recorded and its new value, exit 2, before the
    model loads, and nothing in the run changes."""
    from cspan.core.cli import main

    out = tmp_path / "run"
    args = _train_args(prepared_dir, out, tiny_dir, "--steps", "4", "--batch-size", "1", "--accum", "1")
    _train(*args, "--stop-at", "1")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main([*args, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cspan train: error: --out-dir {str(out)!r} holds a run trained with other settings ("), err
    assert expect in err and err.count("\n") == 1, err
    assert err.rstrip().endswith(f"start over in a new --out-dir (or delete {str(out)!r})"), err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_resuming_on_another_dataset_is_refused_and_on_a_moved_one_goes_on(
    prepared_dir: Path, tiny_dir: Path, tmp_path: Path, capsys
) -> None:
    """A resume with a --data-dir holding other dialogues (here one fewer) was accepted and trained on other
    samples; the checkpoint records the dataset's fingerprint (its manifest records without shard or source paths),
    so the same dataset copied elsewhere resumes and another one is refused like any other changed setting."""
    import shutil

    from cspan.core.cli import main

    out = tmp_path / "run"
    extra = ["--steps", "3", "--batch-size", "1", "--accum", "1"]
    _train(*_train_args(prepared_dir, out, tiny_dir, *extra), "--stop-at", "1")
    moved, fewer = tmp_path / "moved", tmp_path / "fewer"
    shutil.copytree(prepared_dir, moved)
    shutil.copytree(prepared_dir, fewer)
    lines = (fewer / "manifest.jsonl").read_text().splitlines(keepends=True)
    assert len(lines) > 1
    (fewer / "manifest.jsonl").write_text("".join(lines[:-1]))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(_train_args(fewer, out, tiny_dir, *extra)) == 2
    err = capsys.readouterr().err
    assert "holds a run trained with other settings" in err and "--data-dir (its prepared dialogues, sha256) " in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    _train(*_train_args(moved, out, tiny_dir, *extra), "--stop-at", "2")
    assert "resuming from" in capsys.readouterr().err


def test_resuming_over_other_weights_at_the_same_path_is_refused_and_over_moved_ones_goes_on(
    prepared_dir: Path, tiny_dir: Path, tmp_path: Path, capsys
) -> None:
    """A resume compared the --checkpoint path, not the weights: other LM weights at the first run's path (same Mimi
    and tokenizer) trained on with exit 0. The record holds the weights' content fingerprint (checkpoint_weights):
    other weights at the same path are refused like any changed setting, before the model loads; the same weights in
    another folder resume; a checkpoint recorded before the key existed is not refused."""
    import re
    import shutil

    from cspan.core.cli import main
    from cspan.core.tiny import build_tiny_checkpoint
    from cspan.train.train import checkpoint_weights

    base = tmp_path / "base"
    shutil.copytree(tiny_dir, base)
    out = tmp_path / "run"
    extra = ["--steps", "4", "--batch-size", "1", "--accum", "1"]
    _train(*_train_args(prepared_dir, out, base, *extra), "--stop-at", "1")
    first = out / "checkpoints" / "step_00000001" / "COMPLETE"
    recorded = json.loads(first.read_text())["config"]["checkpoint_weights"]
    assert re.fullmatch(r"lm [0-9a-f]{16}", recorded) and recorded == checkpoint_weights(tiny_dir / "model.safetensors")
    assert json.loads((out / "train_config.json").read_text())["checkpoint_weights"] == recorded
    # other weights where the first ones were (another seed's LM; Mimi, tokenizer and config unchanged)
    moved = tmp_path / "moved"
    shutil.copytree(base, moved)
    seed1 = build_tiny_checkpoint(tmp_path / "seed1", seed=1)
    shutil.copyfile(seed1 / "model.safetensors", base / "model.safetensors")
    now = checkpoint_weights(base / "model.safetensors")
    assert now != recorded
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(_train_args(prepared_dir, out, base, *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cspan train: error: --out-dir {str(out)!r} holds a run trained with other settings ("), err
    assert f"--checkpoint (its weights, fingerprint) {recorded} (now {now})" in err and err.count("\n") == 1, err
    assert f"trained over the weights --checkpoint {str(base)!r} held then" in err, err
    assert "resuming from" not in err and "Traceback" not in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    # the first weights in another folder: the run goes on
    _train(*_train_args(prepared_dir, out, moved, *extra), "--stop-at", "2")
    assert "resuming from" in capsys.readouterr().err
    # a checkpoint written before the weights were recorded resumes (nothing to compare), and records them from then
    second = out / "checkpoints" / "step_00000002" / "COMPLETE"
    meta = json.loads(second.read_text())
    assert meta["config"].pop("checkpoint_weights") == recorded
    second.write_text(json.dumps(meta))
    _train(*_train_args(prepared_dir, out, base, *extra), "--stop-at", "3")
    assert "resuming from" in capsys.readouterr().err
    third = json.loads((out / "checkpoints" / "step_00000003" / "COMPLETE").read_text())
    assert third["config"]["checkpoint_weights"] == now


def test_lora_adapters_export_in_the_loader_layout(prepared_dir: Path, tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "lora"
    args = _train_args(prepared_dir, out, tiny_dir, "--steps", "4", "--batch-size", "1", "--accum", "1")
    _train(*args, "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "transformer.layers.*,linears.0")
    payload = torch.load(out / "export" / "context_spanning.pt", map_location="cpu", weights_only=True)
    assert payload["lora"] == {"r": 4, "alpha": 8.0}
    keys = sorted(payload["model"])
    assert keys and all(k.endswith((".lora_A", ".lora_B")) for k in keys)
    names = sorted({k.rsplit(".", 1)[0] for k in keys})
    assert "linears.0" in names and "transformer.layers.0.self_attn.out_proj" in names
    assert payload["model"]["linears.0.lora_A"].shape == (4, 32)
    assert payload["model"]["linears.0.lora_B"].shape == (2048, 4)
    assert float(payload["model"]["linears.0.lora_B"].abs().sum()) > 0  # trained away from zero
    ckpt = load_checkpoint(out / "export", base=tiny_dir, device="cpu", dtype=torch.float32)
    assert ckpt.lora is not None and sorted(ckpt.lora["modules"]) == names
    layer = ckpt.lm.get_submodule("linears.0")
    assert isinstance(layer, LoRALinear) and layer.r == 4 and layer.alpha == 8.0
    assert torch.equal(layer.lora_B, payload["model"]["linears.0.lora_B"])
    base = load_checkpoint(tiny_dir, device="cpu", dtype=torch.float32)
    assert torch.equal(layer.base.weight, base.lm.linears[0].weight)  # the frozen base is the base's
    trained = _model(out, 4)
    assert all(k.endswith((".lora_A", ".lora_B")) for k in trained)  # only adapters are trainable
    # continuing a LoRA fine-tune trains its adapters; its export then carries every weight (it loads over the base)
    more = tmp_path / "lora-more"
    args = _train_args(prepared_dir, more, out / "export", "--steps", "1", "--batch-size", "1", "--accum", "1")
    _train(*args, "--base", str(tiny_dir), "--lora-rank", "4", "--lora-alpha", "8")
    payload = torch.load(more / "export" / "context_spanning.pt", map_location="cpu", weights_only=True)
    assert payload["lora"] == {"r": 4, "alpha": 8.0}
    assert {"linears.0.base.weight", "linears.0.lora_A", "text_linear.weight"} <= set(payload["model"])
    again = load_checkpoint(more / "export", base=tiny_dir, device="cpu", dtype=torch.float32)
    assert again.lora is not None and sorted(again.lora["modules"]) == names


def _torchrun(nproc: int, args: list[str], timeout: float = 600) -> None:
    import os
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += ["-m", "cspan.core.cli", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"


def test_torchrun_two_processes_equal_one_with_twice_the_batch(
    prepared_dir: Path, tiny_dir: Path, tmp_path: Path
) -> None:
    steps = ["--steps", "2", "--accum", "2", "--ckpt-every", "2"]
    single = tmp_path / "single"
    _train(*_train_args(prepared_dir, single, tiny_dir, *steps, "--batch-size", "2"))
    ddp = tmp_path / "ddp"
    _torchrun(2, _train_args(prepared_dir, ddp, tiny_dir, *steps, "--batch-size", "1"))
    np.testing.assert_allclose(_losses(ddp), _losses(single), rtol=2e-5)
    a, b = _model(single, 2), _model(ddp, 2)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
    # FSDP2 (fully_shard) on gloo: same curve, and its export loads
    fsdp = tmp_path / "fsdp"
    _torchrun(2, _train_args(prepared_dir, fsdp, tiny_dir, *steps, "--batch-size", "1", "--fsdp"))
    np.testing.assert_allclose(_losses(fsdp), _losses(single), rtol=2e-5)
    c = _model(fsdp, 2)
    for k in a:
        torch.testing.assert_close(c[k], a[k], rtol=1e-4, atol=1e-5)
    ckpt = load_checkpoint(fsdp / "export", base=tiny_dir, device="cpu", dtype=torch.float32)
    torch.testing.assert_close(ckpt.lm.text_linear.weight, a["lm.text_linear.weight"], rtol=1e-4, atol=1e-5)
