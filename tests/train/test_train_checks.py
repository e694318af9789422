"""Issue 22 items 8 and 10 and issue 17's LoRA export: ``export.json`` records the resolved base; ``cspan prepare``
refuses to resume into a dataset of another codec / tokenizer / prefix layout; ``cspan train`` refuses another
checkpoint's codes; ``--export-format moshi`` writes moshi-finetune's layout, which loads as the cspan export does."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from in_process import run_cspan as _run

from cspan.core.checkpoint import load_checkpoint
from cspan.core.files import default_mode

pytestmark = pytest.mark.slow

COMMON = ["--context", "120", "--lr", "3e-3", "--log-every", "5", "--keep-checkpoints", "0", "--seed", "7"]
ONE_STEP = ["--steps", "2", "--batch-size", "1", "--accum", "1"]


@pytest.fixture(scope="module")
def other_codec(tmp_path_factory, tiny_dir: Path) -> Path:
    """The tiny checkpoint with another seed's Mimi (same card, same tokenizer): other codes for the same audio."""
    from cspan.core.tiny import build_tiny_checkpoint

    folder = build_tiny_checkpoint(tmp_path_factory.mktemp("other") / "tiny-seed1", seed=1)
    for name in ("model.safetensors", "tokenizer_spm_32k_3.model", "config.json"):
        shutil.copyfile(tiny_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory, tiny_dir: Path, fixture_file) -> Path:
    folder = tmp_path_factory.mktemp("othertok") / "tiny"
    shutil.copytree(tiny_dir, folder)
    shutil.copyfile(
        fixture_file("reference", "personaplex-prefix", "tokenizer.model"), folder / "tokenizer_spm_32k_3.model"
    )
    return folder


@pytest.fixture(scope="module")
def other_layout(tmp_path_factory, tiny_dir: Path) -> Path:
    folder = tmp_path_factory.mktemp("otherlayout") / "tiny"
    shutil.copytree(tiny_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "prefix_layout": "personaplex"}))
    return folder


def test_dataset_records_codec_and_layout(prepared_dir: Path) -> None:
    info = json.loads((prepared_dir / "dataset.json").read_text())
    assert len(info["codec_sha256"]) == 64 and info["prefix_layout"] == "context-spanning"
    shards = list((prepared_dir / "shards").iterdir())  # ordinary permissions, not mkstemp's 0600
    assert shards and {p.stat().st_mode & 0o777 for p in shards} == {default_mode()}


@pytest.mark.parametrize(
    ("which", "expect"),
    [("other_codec", "another codec"), ("other_tokenizer", "another tokenizer"), ("other_layout", "prefix layout")],
)
def test_prepare_refuses_to_resume_with_another_checkpoint(
    request, which: str, expect: str, prepared_dir: Path, espeak_dir: Path, tmp_path: Path, capsys
) -> None:
    other = request.getfixturevalue(which)
    out = tmp_path / "data"
    shutil.copytree(prepared_dir, out)
    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    argv = ["prepare", "--in-dir", str(espeak_dir), "--out-dir", str(out), "--checkpoint", str(other)]
    assert _run(*argv, "--device", "cpu", "--quiet") == 2  # a settings mismatch, as --persona's (TRAINING.md)
    err = capsys.readouterr().err
    assert expect in err and str(out) in err and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing changed


@pytest.mark.parametrize(("which", "expect"), [("other_codec", "another codec"), ("other_tokenizer", "tokenizer")])
def test_train_refuses_another_checkpoints_codes(request, which: str, expect: str, prepared_dir, tmp_path, capsys):
    other = request.getfixturevalue(which)
    out = tmp_path / "run"
    argv = ["train", "--data-dir", str(prepared_dir), "--out-dir", str(out), "--checkpoint", str(other), *COMMON]
    assert _run(*argv, *ONE_STEP) == 2  # a setting that does not fit the dataset, as prepare's (TRAINING.md)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"--checkpoint {str(other)!r} does not fit --data-dir {str(prepared_dir)!r}, prepared from " in err
    assert expect in err and "cspan prepare --checkpoint" in err
    assert not out.exists()  # nothing written


def test_a_context_no_longer_than_a_span_block_is_refused(prepared_dir: Path, tiny_dir: Path, tmp_path, capsys):
    """A --context that a Context Span block fills (prepare keeps blocks up to --max-span-frames, 600 by default) made
    crops that hold nothing but the block: steps printed 'loss 0.0000 ... grad 0' and AdamW still moved the weights
    on its momentum. Now one line naming --context, --max-span-frames and the dialogue, before anything is written."""
    records = [json.loads(line) for line in (prepared_dir / "manifest.jsonl").read_text().splitlines()]
    n, name = max((len(s["ids"]), r["name"]) for r in records for s in r["spans"])
    out = tmp_path / "run"
    argv = ["train", "--data-dir", str(prepared_dir), "--out-dir", str(out), "--checkpoint", str(tiny_dir)]
    assert _run(*argv, *ONE_STEP, "--context", str(n)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"--context {n} does not hold the longest Context Span block of --data-dir {str(prepared_dir)!r}" in err
    assert f"({n} positions, dialogue {name!r})" in err and "--max-span-frames" in err
    assert not out.exists()  # nothing written


@pytest.mark.parametrize("spelling", ["{name}", "./{name}", "sub/../{name}"])
def test_export_records_the_resolved_base(
    spelling: str, prepared_dir: Path, tiny_dir: Path, tmp_path: Path, monkeypatch
):
    """A relative --checkpoint is stored resolved: the export loads from any working directory."""
    (tiny_dir.parent / "sub").mkdir(exist_ok=True)
    monkeypatch.chdir(tiny_dir.parent)
    out = tmp_path / "run"
    checkpoint = spelling.format(name=tiny_dir.name)
    argv = ["train", "--data-dir", str(prepared_dir), "--out-dir", str(out), "--checkpoint", checkpoint, *COMMON]
    assert _run(*argv, *ONE_STEP, "--lora-rank", "2") == 0
    info = json.loads((out / "export" / "export.json").read_text())
    assert info["base"] == str(tiny_dir.resolve()) and os.path.isabs(info["base_files"]["lm"])
    assert info["prefix_layout"] == "context-spanning" and info["format"] == "cspan"
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CSPAN_BASE", raising=False)
    ckpt = load_checkpoint(out / "export", dtype=torch.float32)
    assert ckpt.files["lm"].parent.resolve() == tiny_dir.resolve() and ckpt.lora is not None


def test_a_finished_lora_run_is_not_re_exported_over_another_base(
    prepared_dir: Path, tiny_dir: Path, tmp_path: Path, capsys
) -> None:
    """A LoRA run over base A, rerun once finished with --checkpoint B (same Mimi and tokenizer, other LM weights),
    exited 0 and rewrote export.json naming B as the base of adapters trained over A. The base's weights are part
    of what a resume compares (by content): one line naming --checkpoint, exit 2, nothing rewritten. Training over a
    fine-tune records its fine-tune file too, and a fine-tune retrained at the same path is refused the same way."""
    from cspan.core.tiny import build_tiny_checkpoint

    other = build_tiny_checkpoint(tmp_path / "b", seed=1)
    for name in ("tokenizer-e351c8d8-checkpoint125.safetensors", "tokenizer_spm_32k_3.model", "config.json"):
        shutil.copyfile(tiny_dir / name, other / name)
    out = tmp_path / "run"
    argv = ["train", "--data-dir", str(prepared_dir), "--out-dir", str(out), *COMMON, *ONE_STEP, "--lora-rank", "2"]
    assert _run(*argv, "--checkpoint", str(tiny_dir)) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert _run(*argv, "--checkpoint", str(other)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "--checkpoint (its weights, fingerprint) lm " in err and f"--checkpoint {str(tiny_dir)!r}" in err, err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert json.loads((out / "export" / "export.json").read_text())["base"] == str(tiny_dir.resolve())
    # over the fine-tune just exported: the record names both files; the export rewritten with other adapters (a
    # retrained fine-tune at the same path) is refused, the same file copied elsewhere resumes
    fine = tmp_path / "fine"
    shutil.copytree(out / "export", fine)
    more = tmp_path / "more"
    argv = ["train", "--data-dir", str(prepared_dir), "--out-dir", str(more), *COMMON, "--base", str(tiny_dir)]
    steps = ["--steps", "3", "--batch-size", "1", "--accum", "1", "--lora-rank", "2"]
    assert _run(*argv, *steps, "--checkpoint", str(fine), "--stop-at", "1") == 0
    recorded = json.loads((more / "train_config.json").read_text())["checkpoint_weights"]
    assert recorded.startswith("lm ") and ", fine-tune " in recorded
    assert recorded.split(", ")[0] == json.loads((out / "train_config.json").read_text())["checkpoint_weights"]
    copy = tmp_path / "fine-copy"
    shutil.copytree(fine, copy)
    payload = torch.load(fine / "context_spanning.pt", map_location="cpu", weights_only=True)
    payload["model"] = {k: v + 0.01 for k, v in payload["model"].items()}
    torch.save(payload, fine / "context_spanning.pt")
    capsys.readouterr()
    assert _run(*argv, *steps, "--checkpoint", str(fine)) == 2
    err = capsys.readouterr().err
    assert f"--checkpoint (its weights, fingerprint) {recorded} (now {recorded.split(', ')[0]}, fine-tune " in err
    assert _run(*argv, *steps, "--checkpoint", str(copy), "--stop-at", "2") == 0
    assert "resuming from" in capsys.readouterr().err


def test_moshi_export_loads_like_the_cspan_export(prepared_dir: Path, tiny_dir: Path, tmp_path: Path, capsys) -> None:
    args = ["--data-dir", str(prepared_dir), "--checkpoint", str(tiny_dir), *COMMON, *ONE_STEP]
    lora = [
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--lora-targets",
        "transformer.layers.*,depformer.layers.0.*,linears.1",
    ]
    assert _run("train", "--out-dir", str(tmp_path / "a"), *args, *lora) == 0
    assert _run("train", "--out-dir", str(tmp_path / "b"), *args, *lora, "--export-format", "moshi") == 0
    export = tmp_path / "b" / "export"
    assert sorted(p.name for p in export.iterdir() if p.is_file()) == ["config.json", "export.json", "lora.safetensors"]
    assert (export / "lora.safetensors").stat().st_mode & 0o777 == default_mode()  # safetensors writes 0600
    config = json.loads((export / "config.json").read_text())
    assert config["lora"] is True and config["lora_rank"] == 4 and config["lora_scaling"] == 2.0
    from safetensors.torch import load_file

    keys = set(load_file(export / "lora.safetensors"))
    assert "depformer.layers.0.self_attn.out_projs.15.lora_A.weight" in keys  # per-step out_proj -> 16 adapters
    assert "transformer.layers.0.self_attn.out_projs.0.lora_B.weight" in keys and "linears.1.lora_A.weight" in keys
    cspan = load_checkpoint(tmp_path / "a" / "export", dtype=torch.float32)
    moshi = load_checkpoint(export, dtype=torch.float32)
    fused = load_checkpoint(export, dtype=torch.float32, fuse_lora=True)
    assert moshi.lora["format"] == "moshi" and cspan.prefix_layout == moshi.prefix_layout
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 1000, (1, 17, 6), generator=gen)
    with torch.no_grad():
        outs = [m.lm(codes) for m in (cspan, moshi, fused)]
    for other in outs[1:]:
        torch.testing.assert_close(other.text_logits, outs[0].text_logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(other.logits.nan_to_num(), outs[0].logits.nan_to_num(), atol=1e-5, rtol=0)
    # Exported again in the other format (a finished run, rerun): the other format's files go, so the folder loads
    # what export.json says (lora.safetensors was loaded over a newer context_spanning.pt)
    assert _run("train", "--out-dir", str(tmp_path / "b"), *args, *lora, "--export-dtype", "bfloat16") == 0
    assert sorted(p.name for p in export.iterdir() if p.is_file()) == ["context_spanning.pt", "export.json"]
    again = load_checkpoint(export, dtype=torch.float32)
    assert again.files["fine_tune"].name == "context_spanning.pt" and "format" not in again.lora
    assert torch.load(export / "context_spanning.pt")["model"]["linears.1.lora_A"].dtype == torch.bfloat16
    assert _run("train", "--out-dir", str(tmp_path / "b"), *args, *lora, "--export-format", "moshi") == 0
    assert sorted(p.name for p in export.iterdir() if p.is_file()) == ["config.json", "export.json", "lora.safetensors"]
    # the moshi format needs adapters: a bad setting (exit status 2)
    assert _run("train", "--out-dir", str(tmp_path / "c"), *args, "--export-format", "moshi") == 2
    assert "--lora-rank" in capsys.readouterr().err
    # Moshi's own loader (``moshi.server --lora-weight lora.safetensors --config-path config.json``) loads it: it
    # wraps every linear of its LMModel, so the layers these --lora-targets leave out and the attention input
    # projections (never adapted here) come as zero adapters, and config.json holds no key LMModel does not take
    assert "prefix_layout" not in json.loads((export / "config.json").read_text())
    keys = set(load_file(export / "lora.safetensors"))
    for name in (
        "transformer.layers.1.self_attn.in_projs.0",
        "depformer.layers.1.self_attn.in_projs.15",
        "text_linear",
    ):
        assert f"{name}.lora_A.weight" in keys and f"{name}.lora_B.weight" in keys
    loaders = pytest.importorskip("moshi.models.loaders", reason="pip install --no-deps moshi==0.2.13 (see noxfile)")
    info = loaders.CheckpointInfo.from_hf_repo(
        "kyutai/not-downloaded",
        moshi_weights=tiny_dir / "model.safetensors",
        mimi_weights=tiny_dir / "tokenizer-e351c8d8-checkpoint125.safetensors",
        tokenizer=tiny_dir / "tokenizer_spm_32k_3.model",
        config_path=export / "config.json",
        lora_weights=export / "lora.safetensors",
    )
    for fuse in (False, True):
        upstream = info.get_moshi(device="cpu", dtype=torch.float32, fuse_lora=fuse)
        with torch.no_grad():
            out = upstream(codes)
        torch.testing.assert_close(out.text_logits, outs[0].text_logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(out.logits.nan_to_num(), outs[0].logits.nan_to_num(), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("flags", "expect"),
    [
        (["--lr", "nan"], "--lr must be a finite number, got nan"),
        (["--lr", "inf"], "--lr must be a finite number, got inf"),
        (["--lr", "-1"], "--lr must be > 0, got -1"),
        (["--lr-depformer", "0"], "--lr-depformer must be > 0"),
        (["--w-ret", "inf"], "--w-ret must be a finite number"),
        (["--w-acoustic", "-0.1"], "--w-acoustic must be >= 0"),
        (["--weight-decay", "nan"], "--weight-decay must be a finite number"),
        (["--clip", "inf"], "--clip must be a finite number"),
        (["--context", "100000000"], "--context must be <= 1000000 positions"),
        (["--random-delay-proba", "2"], "--random-delay-proba must be in [0, 1], got 2"),
        (["--random-delay-proba", "nan"], "--random-delay-proba must be a finite number"),
        (["--warmup-steps", "-10"], "--warmup-steps must be >= 0, got -10"),
        (["--start-delay-s", "-1"], "--start-delay-s must be >= 0"),
        (["--keep-checkpoints", "-1"], "--keep-checkpoints must be >= 0"),
        (["--fsdp"], "--fsdp shards the model over the processes that torchrun starts"),
        (["--clip", "0"], "--clip must be > 0, got 0.0"),
        (["--context", "0"], "--context must be >= 2 positions, got 0"),
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
        (["--lora-rank", "-1"], "--lora-rank must be >= 0, got -1"),
        (["--stop-at", "0"], "--stop-at must be in [1, --steps], got 0"),
        (["--out-dir", "FILE"], "--out-dir 'FILE' is a file; give a folder (a new one, or a run to resume)"),
        (
            ["--data-dir", "data", "--out-dir", "data/run"],
            "--out-dir data/run: lies inside the --data-dir folder data, which the run reads; write the output "
            "outside it",
        ),
        (
            ["--data-dir", "data", "--out-dir", "run/../data"],
            "--out-dir run/../data: is the --data-dir folder (data), ",
        ),
        (["--data-dir", "link", "--out-dir", "data/x"], "--out-dir data/x: lies inside the --data-dir folder link, "),
    ],
)
def test_train_numeric_flags_are_refused_before_anything_loads(flags, expect, tmp_path, capsys, monkeypatch) -> None:
    """Issue 22 (F10): `--lr nan` trained and exported NaN weights with exit 0; inf, negative and out-of-range values
    were accepted or gave tracebacks; `--fsdp` outside torchrun ran as one process. Each is one line before the
    checkpoint or the data is read (neither exists here), as a bad setting: exit status 2 (range checks gave 1). An
    --out-dir equal to the --data-dir or inside it (after symlinks and '..') wrote the checkpoints and the export into
    the dataset: refused as the bench runners refuse --out inside --data."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)
    Path("FILE").write_text("not a folder")
    Path("link").symlink_to("data")
    argv = ["train", "--data-dir", str(tmp_path / "none"), "--out-dir", str(tmp_path / "run")]
    assert _run(*argv, "--checkpoint", str(tmp_path / "missing"), *flags) == 2
    err = capsys.readouterr().err
    assert err == f"cspan train: error: {expect}" + err.split(expect, 1)[1] and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_a_diverging_run_stops_and_never_exports_nan(
    prepared_dir: Path, tiny_dir: Path, tmp_path: Path, capsys
) -> None:
    """Issue 22 (F10): a learning rate that blows the weights up stops with a clear error at the first non-finite
    gradient, before the update, and nothing is exported."""
    out = tmp_path / "run"
    argv = ["train", "--data-dir", str(prepared_dir), "--out-dir", str(out), "--checkpoint", str(tiny_dir)]
    flags = ["--context", "120", "--lr", "1e30", "--warmup-steps", "0", "--clip", "1e30", "--steps", "4"]
    assert _run(*argv, *flags, "--batch-size", "1", "--accum", "1", "--keep-checkpoints", "0") == 1
    err = capsys.readouterr().err
    assert "the loss diverged (gradient norm" in err or "the weights hold NaN or inf" in err, err
    assert "Traceback" not in err and "nothing" in err
    assert not (out / "export").exists()
    for ckpt in (out / "checkpoints").glob("step_*"):  # any checkpoint kept holds finite weights only
        from cspan.train.train import read_train_state

        assert all(torch.isfinite(t).all() for k, t in read_train_state(ckpt).items() if k.startswith("model."))


@pytest.mark.parametrize(
    ("device", "code", "expect"),
    [
        ("bogus", 2, "--device bogus: not a device torch knows; use cpu, cuda or cuda:N"),
        ("meta", 2, "--device meta: cspan runs on the CPU or CUDA only"),
        pytest.param(
            "cuda",
            1,
            "--device cuda: this torch has no CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA"),
        ),
    ],
)
@pytest.mark.parametrize("verb", ["prepare", "train"])
def test_a_bad_device_is_one_line_before_anything_is_written(
    verb, device, code, expect, espeak_dir: Path, tiny_dir: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """`cspan prepare|train --device cuda|bogus` gave tracebacks (AssertionError 'Torch not compiled with CUDA
    enabled', AttributeError _cuda_setDevice, RuntimeError 'Expected one of cpu, cuda...'); now one line through
    cspan.core.devices.parse_device, exit 2 for a name torch does not know, 1 for CUDA where there is none."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "out"
    if verb == "prepare":
        argv = ["prepare", "--in-dir", str(espeak_dir), "--out-dir", str(out), "--quiet"]
    else:
        argv = ["train", "--data-dir", str(tmp_path / "none"), "--out-dir", str(out), *ONE_STEP]
    assert _run(*argv, "--checkpoint", str(tiny_dir), "--device", device) == code
    err = capsys.readouterr().err
    assert err == f"cspan {verb}: error: {expect}" + err.split(expect, 1)[1] and err.count("\n") == 1, err
    assert not out.exists()


@pytest.mark.parametrize("where", ["dcp", "trainer.pt"])
def test_ctrl_c_while_a_checkpoint_is_saved_is_an_interrupt(
    where: str, prepared_dir: Path, tiny_dir: Path, tmp_path: Path, capsys, monkeypatch, request
) -> None:
    """Ctrl-C during a checkpoint's save printed a traceback (DCP's CheckpointException wrapping the
    KeyboardInterrupt, torch.save's RuntimeError 'unexpected pos') and exited 1, leaving `.step_NNNNNNNN.tmp`. A real
    SIGINT is sent to this process in the middle of the second save (while DCP writes, or while torch.save writes
    trainer.pt): the run ends as any interrupted one, 'interrupted' and 130, the first checkpoint whole, no temporary
    folder, and the same command resumes from it."""
    import signal

    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    # Ctrl-C as an interactive shell delivers it: a runner started in the background inherits SIGINT ignored, and
    # Python then installs no KeyboardInterrupt handler
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    calls = {"n": 0}

    def interrupt_on_second_save() -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGINT)

    if where == "dcp":
        real_write = FileSystemWriter.write_data

        def write_data(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            interrupt_on_second_save()
            return real_write(self, *args, **kwargs)

        monkeypatch.setattr(FileSystemWriter, "write_data", write_data)
    else:
        import cspan.train.train as train_module

        real_save = torch.save

        def save(obj, f, *args, **kwargs):  # type: ignore[no-untyped-def]
            if str(f).endswith("trainer.pt"):
                interrupt_on_second_save()
            return real_save(obj, f, *args, **kwargs)

        monkeypatch.setattr(train_module.torch, "save", save)
    out = tmp_path / "run"
    argv = ["train", "--data-dir", str(prepared_dir), "--out-dir", str(out), "--checkpoint", str(tiny_dir)]
    argv += [*COMMON, "--steps", "3", "--batch-size", "1", "--accum", "1", "--ckpt-every", "1"]
    assert _run(*argv) == 130
    err = capsys.readouterr().err
    assert err.endswith("cspan train: interrupted\n") and "Traceback" not in err, err
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000001"]  # no .step_00000002.tmp
    assert (checkpoints / "step_00000001" / "COMPLETE").is_file() and not (out / "export").exists()
    monkeypatch.undo()
    assert _run(*argv) == 0
    err = capsys.readouterr().err
    assert "resuming from" in err and "(step 1 of 3)" in err and (out / "export" / "context_spanning.pt").is_file()


def test_read_train_state_takes_a_path_as_a_string(tmp_path: Path) -> None:
    """docs/TRAINING.md's ``read_train_state(folder)`` takes a folder given as a string, as a user types it (a str
    once raised TypeError instead of naming the folder)."""
    from cspan.train.errors import TrainError
    from cspan.train.train import read_train_state

    with pytest.raises(TrainError, match=r"no \.metadata"):
        read_train_state(str(tmp_path))
