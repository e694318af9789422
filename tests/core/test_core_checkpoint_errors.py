"""Bad checkpoints raise CheckpointError naming the file and the key: missing files, truncated / corrupt
safetensors, missing / unexpected keys, wrong shapes, bad voices, unsafe pickles, offline Hub."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cspan.core.checkpoint import (
    LM_FILE,
    MIMI_FILE,
    TOKENIZER_FILE,
    load_checkpoint,
    load_voice,
    read_safetensors_header,
)
from cspan.core.errors import CheckpointError
from cspan.core.voice import load_voice_prompt


@pytest.fixture
def tiny_copy(tiny_checkpoint_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the session's tiny checkpoint that a test may damage."""
    return Path(shutil.copytree(tiny_checkpoint_dir, tmp_path / "ckpt"))


def _error(source, **kwargs) -> str:
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(source, **kwargs)
    return str(err.value)


def _rewrite(path: Path, edit) -> None:
    state = load_file(path)
    edit(state)
    save_file(state, path, metadata={"format": "pt"})


@pytest.mark.parametrize("name", [LM_FILE, MIMI_FILE, TOKENIZER_FILE])
def test_missing_file_named(tiny_copy: Path, name: str) -> None:
    (tiny_copy / name).unlink()
    message = _error(tiny_copy)
    assert name in message and str(tiny_copy) in message


def test_missing_source_path() -> None:
    message = _error("./no/such/checkpoint_dir")
    assert "no/such/checkpoint_dir" in message and "does not exist" in message and "cspan model tiny" in message


def test_truncated_lm_names_file_and_tensor(tiny_copy: Path) -> None:
    path = tiny_copy / LM_FILE
    header = read_safetensors_header(path)
    data = path.read_bytes()
    cut = len(data) // 2
    path.write_bytes(data[:cut])
    # the first tensor (in file order) whose bytes lie past the cut
    raw_len = int.from_bytes(data[:8], "little")
    entries = json.loads(data[8 : 8 + raw_len])
    entries.pop("__metadata__", None)
    available = cut - 8 - raw_len
    first_cut = next(k for k, e in entries.items() if e["data_offsets"][1] > available)
    assert first_cut in header.tensors
    message = _error(tiny_copy)
    assert str(path) in message and "truncated" in message and repr(first_cut) in message


def test_corrupt_header_names_file(tiny_copy: Path) -> None:
    path = tiny_copy / MIMI_FILE
    data = bytearray(path.read_bytes())
    data[8:40] = b"\x00garbage garbage garbage garbage"[:32]
    path.write_bytes(bytes(data))
    message = _error(tiny_copy)
    assert str(path) in message and "header" in message


def test_tiny_file_is_not_safetensors(tiny_copy: Path) -> None:
    (tiny_copy / LM_FILE).write_bytes(b"abc")
    message = _error(tiny_copy)
    assert str(tiny_copy / LM_FILE) in message and "truncated" in message


def test_missing_key_named(tiny_copy: Path) -> None:
    _rewrite(tiny_copy / LM_FILE, lambda sd: sd.pop("out_norm.alpha"))
    message = _error(tiny_copy)
    assert "'out_norm.alpha'" in message and str(tiny_copy / LM_FILE) in message and "missing" in message


def test_unexpected_key_named(tiny_copy: Path) -> None:
    _rewrite(tiny_copy / LM_FILE, lambda sd: sd.__setitem__("extra_head.weight", torch.zeros(2, 2)))
    message = _error(tiny_copy)
    assert "'extra_head.weight'" in message and str(tiny_copy / LM_FILE) in message and "unexpected" in message


def test_wrong_shape_named(tiny_copy: Path) -> None:
    _rewrite(tiny_copy / LM_FILE, lambda sd: sd.__setitem__("text_linear.weight", torch.zeros(999, 64)))
    message = _error(tiny_copy)
    assert "'text_linear.weight'" in message and str(tiny_copy / LM_FILE) in message
    assert "[999, 64]" in message and "[1000, 64]" in message


def test_mimi_missing_key_named(tiny_copy: Path) -> None:
    key = "quantizer.rvq_rest.vq.layers.3._codebook.embedding_sum"
    _rewrite(tiny_copy / MIMI_FILE, lambda sd: sd.pop(key))
    message = _error(tiny_copy)
    assert repr(key) in message and str(tiny_copy / MIMI_FILE) in message


def test_corrupt_tokenizer_named(tiny_copy: Path) -> None:
    (tiny_copy / TOKENIZER_FILE).write_bytes(b"not a sentencepiece model")
    message = _error(tiny_copy)
    assert str(tiny_copy / TOKENIZER_FILE) in message


def test_bad_config_named(tiny_copy: Path) -> None:
    cfg = json.loads((tiny_copy / "config.json").read_text())
    cfg["delays"] = [0, 1]
    (tiny_copy / "config.json").write_text(json.dumps(cfg))
    message = _error(tiny_copy)
    assert "config.json" in message and "delays" in message


@pytest.mark.parametrize(
    ("file", "key", "dtype"),
    [
        (LM_FILE, "text_linear.weight", torch.int32),
        (LM_FILE, "transformer.layers.0.norm1.alpha", torch.bool),
        (LM_FILE, "emb.3.weight", torch.int64),
        (LM_FILE, "depformer.layers.1.self_attn.in_proj_weight", torch.uint8),
        (MIMI_FILE, "quantizer.rvq_first.vq.layers.0._codebook.embedding_sum", torch.int32),
        (MIMI_FILE, "encoder.model.0.conv.conv.weight", torch.bool),
    ],
)
def test_float_weight_stored_as_integers_named(tiny_copy: Path, file: str, key: str, dtype) -> None:
    """Issue 22 item 6: a float weight stored as I32 / BOOL / I64 / U8 is a CheckpointError naming file and key."""
    _rewrite(tiny_copy / file, lambda sd: sd.__setitem__(key, sd[key].to(dtype)))
    message = _error(tiny_copy)
    assert repr(key) in message and str(tiny_copy / file) in message and "integer or boolean" in message


@pytest.mark.parametrize(
    ("patch", "expect"),
    [
        ({"num_layers": 10**9}, "num_layers"),
        ({"dim": 10**12}, "dim"),
        ({"card": 10**15}, "card"),
        ({"hidden_scale": float("inf")}, "hidden_scale"),
        ({"delays": [10**6] * 17}, "delays"),
        ({"delays": "zero"}, "delays"),
        ({"context": -1}, "context"),
        ({"num_heads": 0}, "num_heads"),
        ({"depformer_dim_feedforward": [1, 2]}, "dim_feedforward"),
        ({"depformer_weights_per_step_schedule": [99] * 16}, "schedule"),
        ({"mimi_config": {"sample_rate": 0}}, "mimi_config"),
        ({"mimi_config": {"seanet": {"ratios": [10**6]}}}, "mimi_config"),
        ({"dim": 48}, "shape"),  # plausible but not these weights
    ],
)
def test_absurd_config_named(tiny_copy: Path, patch: dict, expect: str) -> None:
    """Issue 22 item 6: an absurd config.json is a CheckpointError naming the file (no model is built from it)."""
    cfg = json.loads((tiny_copy / "config.json").read_text())
    (tiny_copy / "config.json").write_text(json.dumps({**cfg, **patch}))
    message = _error(tiny_copy)
    assert expect in message and ("config.json" in message or LM_FILE in message)


@pytest.mark.parametrize(
    ("content", "expect"),
    [
        ({"code": torch.zeros(8, 5, dtype=torch.long)}, "'codes' missing"),
        ({"codes": torch.zeros(8, 5)}, "integer dtype"),
        ({"codes": torch.zeros(7, 5, dtype=torch.long)}, "[7, 5]"),
        ({"codes": torch.full((8, 5), 2048, dtype=torch.long)}, "[0, 2048)"),
        ({"codes": torch.full((8, 5), -3, dtype=torch.long)}, "[-3, -3]"),
    ],
)
def test_bad_voice_named(tiny_checkpoint, tmp_path: Path, content, expect: str) -> None:
    path = tmp_path / "bad_voice.pt"
    torch.save(content, path)
    with pytest.raises(CheckpointError) as err:
        load_voice(path, tiny_checkpoint)
    assert str(path) in str(err.value) and expect in str(err.value) and "codes" in str(err.value)


def test_unknown_voice_lists_known(tiny_checkpoint) -> None:
    with pytest.raises(CheckpointError, match="tiny0, tiny1"):
        load_voice("nobody", tiny_checkpoint)


def test_voices_dir_env(tiny_checkpoint, tmp_path: Path, monkeypatch) -> None:
    torch.save({"codes": torch.arange(16).view(8, 2)}, tmp_path / "extra.pt")
    monkeypatch.setenv("CSPAN_VOICES_DIR", str(tmp_path))
    assert load_voice("extra", tiny_checkpoint).tolist()[0] == [0, 1]


def test_unsafe_pickle_refused(tmp_path: Path, tiny_checkpoint_dir: Path) -> None:
    """A fine-tune holding arbitrary Python objects is refused (weights_only=True), naming the file."""
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "args": argparse.Namespace(lr=1.0)}, path)
    message = _error(path, base=tiny_checkpoint_dir)
    assert str(path) in message and "weights_only" in message


def test_truncated_fine_tune_named(tmp_path: Path, tiny_checkpoint_dir: Path) -> None:
    path = tmp_path / "ft.pt"
    torch.save({"model": {"text_linear.weight": torch.zeros(1000, 64)}}, path)
    path.write_bytes(path.read_bytes()[:200])
    message = _error(path, base=tiny_checkpoint_dir)
    assert str(path) in message and ("truncated or corrupt" in message or "weights_only" in message)


def test_offline_without_cache_explains_fix(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("CSPAN_CHECKPOINT", raising=False)
    message = _error(None)  # the default released checkpoint
    assert "mindlogicinc/context-spanning-7b" in message and "HF_HUB_OFFLINE" in message
    assert "--checkpoint DIR" in message and "cspan model tiny DIR" in message
    assert str(tmp_path / "hf-home") in message
    assert message.startswith("checkpoint repo"), message  # the default is a repo, never a mistyped path
    message = _error("someone/some-model")
    assert "someone/some-model" in message and "cspan model tiny DIR" in message


@pytest.mark.parametrize(
    ("extra", "why"),
    [({}, "the Hub could not be reached"), ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set")],
    ids=["unreachable", "offline"],
)
def test_a_mistyped_two_part_path_says_no_such_folder_exists(
    tiny_checkpoint_dir: Path, tmp_path: Path, extra: dict[str, str], why: str
) -> None:
    """``--checkpoint trunp/export`` (meant: ``trump/export``, a folder) was reported as a Hugging Face Hub problem
    only; ``./nope`` and ``nope/nope/nope`` said "does not exist". The message now says both: no such folder or file
    here, and the Hub lookup that failed. The same for ``--base``."""
    import numpy as np
    import soundfile as sf

    (tmp_path / "trump").mkdir()
    sf.write(tmp_path / "q.wav", (0.1 * np.sin(np.arange(24000) / 10)).astype("float32"), 24000)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "CSPAN_"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_ETAG_TIMEOUT="2",
               HF_HUB_DOWNLOAD_TIMEOUT="2", **extra)  # fmt: skip

    def cspan(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "cspan.core.cli", *args], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip

    io = ["--db", ":memory:", "--input-wav", "q.wav", "--output-wav", "o.wav", "--quiet"]
    done = cspan("infer", "--checkpoint", "trunp/export", *io)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(
        f"cspan infer: error: no folder or file 'trunp/export' exists in {tmp_path} (the current directory), and "
        f"checkpoint repo 'trunp/export' (revision main) is not in the Hugging Face cache ({tmp_path / 'hf' / 'hub'}) "
        f"and {why}; check the path, or pass a local checkpoint folder instead"
    ), done.stderr
    fine_tune = tmp_path / "ft"
    fine_tune.mkdir()
    torch.save({}, fine_tune / "x.pt")
    done = cspan("infer", "--checkpoint", "ft/x.pt", "--base", "trunp/base", *io)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith(
        f"cspan infer: error: no folder or file 'trunp/base' exists in {tmp_path} (the current directory), and "
        f"base repo 'trunp/base' (revision main) is not in the Hugging Face cache"
    ), done.stderr
    done = cspan("model", "info", str(tiny_checkpoint_dir))  # a real folder still loads, Hub or not
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("how", ["all", "one"])
def test_non_finite_weights_refused_at_load(tiny_copy: Path, how: str) -> None:
    """Issue 22 (F19): a checkpoint whose tensors were all NaN ran with exit 0; one NaN / inf is refused too."""
    key = "transformer.layers.0.self_attn.in_proj_weight"

    def poison(sd: dict) -> None:
        for k, v in sd.items():
            if v.is_floating_point() and (how == "all" or k == key):
                v[...] = float("nan") if how == "all" else v
        if how == "one":
            sd[key][0, 3] = float("inf")

    _rewrite(tiny_copy / LM_FILE, poison)
    message = _error(tiny_copy)
    assert str(tiny_copy / LM_FILE) in message and "NaN or infinite values" in message and "\n" not in message
    assert repr(key) in message if how == "one" else "more" in message


def test_config_errors_and_pickle_refusals_are_one_line(tiny_copy: Path, tmp_path: Path, recwarn) -> None:
    """Issue 22 (F18): an invalid config.json gave pydantic's multi-line dump with help URLs; a pickle refusal came
    after a torch UserWarning and quoted torch's advice to load the file unsafely."""
    import pickle

    cfg = json.loads((tiny_copy / "config.json").read_text())
    (tiny_copy / "config.json").write_text(json.dumps({**cfg, "dim": "abc", "num_heads": -3}))
    message = _error(tiny_copy)
    assert "\n" not in message and "errors.pydantic.dev" not in message, message
    assert "dim: Input should be a valid integer" in message and "(got 'abc')" in message
    assert "num_heads: Input should be greater than or equal to 1 (got -3)" in message

    evil = tmp_path / "evil.pt"  # protocol 4 with an opcode the weights-only unpickler does not know
    evil.write_bytes(pickle.dumps({"model": {}, "x": frozenset([1])}, protocol=4))
    message = _error(evil, base=tiny_copy)
    assert "\n" not in message and "weights_only` set to `False`" not in message and str(evil) in message
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


class _RunsACommand:
    """What a malicious voice file pickles: unpickling it would run a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_voice_file_that_would_run_code_is_refused_in_one_safe_line(tiny_checkpoint, tmp_path: Path) -> None:
    """A ``.pt`` voice whose pickle calls ``os.system`` is never unpickled; torch 2.13 words that refusal
    "Trying to load unsupported GLOBAL posix.system whose module posix is blocked" (not "Unsupported global: ..."),
    and the message quoted torch's first line instead: its advice to re-run with ``weights_only`` set to False."""
    marker = tmp_path / "ran"
    evil = tmp_path / "voice.pt"
    torch.save({"codes": _RunsACommand(marker)}, evil)
    with pytest.raises(CheckpointError) as info:
        load_voice_prompt(evil, tiny_checkpoint)
    message = str(info.value)
    assert not marker.exists()
    assert "\n" not in message and "weights_only` set to `False`" not in message, message
    assert str(evil) in message and "it needs posix.system" in message, message


def test_a_config_without_delays_names_what_it_lacks(tiny_copy: Path, caplog) -> None:
    """Issue 22 (final trial): a config.json with "dim" but no "delays" falls back to the 7B configuration with a
    warning naming the missing key (it said "has no LM keyword arguments (dim, delays)" though dim was there)."""
    from cspan.core.checkpoint import read_configs

    cfg = json.loads((tiny_copy / "config.json").read_text())
    del cfg["delays"]
    (tiny_copy / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level("WARNING", logger="cspan.core.checkpoint"):
        lm_cfg, _ = read_configs(tiny_copy / "config.json")
    assert lm_cfg.dim == 4096  # the PersonaPlex 7B configuration
    assert f"config file {str(tiny_copy / 'config.json')!r} has no LM keyword argument 'delays': using" in caplog.text


@pytest.mark.parametrize(
    ("edit", "want"),
    [
        (lambda s: s.update({k: v.to(torch.float8_e4m3fn) for k, v in s.items() if v.is_floating_point()}), "bfloat16"),
        (
            lambda s: s.update({k: v.half() for k, v in s.items() if k.endswith(".alpha") or k < "depformer.layers.1"}),
            "float32",
        ),
    ],
    ids=["float8-loads-as-bfloat16", "few-float16-norms-stay-float32"],
)
def test_default_dtype_is_a_runnable_dtype_of_most_weights(tiny_copy: Path, edit, want: str) -> None:
    _rewrite(tiny_copy / LM_FILE, edit)
    assert next(load_checkpoint(tiny_copy).lm.parameters()).dtype == getattr(torch, want)


def test_model_info_says_when_a_load_would_refuse_the_weights(tiny_copy: Path) -> None:
    from cspan.core.checkpoint import describe_checkpoint

    assert "key check: ok" in describe_checkpoint(tiny_copy)
    _rewrite(tiny_copy / LM_FILE, lambda s: s.pop("out_norm.alpha"))
    text = describe_checkpoint(tiny_copy)  # headers only, yet not a summary that looks complete
    assert "key check: FAILED" in text and "'out_norm.alpha'" in text and str(tiny_copy / LM_FILE) in text
    done = subprocess.run(
        [sys.executable, "-m", "cspan.core.cli", "model", "info", str(tiny_copy)], capture_output=True, text=True
    )
    assert done.returncode == 1 and "key check: FAILED" in done.stdout  # a script sees it, not only a reader
    assert done.stderr == "cspan model info: error: these weights would not load (see the key check above)\n"


def _mimi_check(text: str) -> str:
    return text.split("\nMimi:\n", 1)[1].splitlines()[1]


def test_model_info_checks_the_mimi_weights_too(tiny_copy: Path) -> None:
    """A truncated or foreign Mimi file was summarised as a loadable checkpoint (exit 0): only the LM was checked."""
    from cspan.core.checkpoint import describe_checkpoint

    mimi = tiny_copy / MIMI_FILE
    assert _mimi_check(describe_checkpoint(tiny_copy)).startswith("  key check: ok")
    data = mimi.read_bytes()
    header = int.from_bytes(data[:8], "little")
    _rewrite(mimi, lambda s: s.pop("decoder_transformer.transformer.layers.0.norm1.weight"))
    line = _mimi_check(describe_checkpoint(tiny_copy))
    assert line.startswith("  key check: FAILED, loading would refuse these weights: Mimi weights: missing key(s) ")
    assert "'decoder_transformer.transformer.layers.0.norm1.weight'" in line and str(mimi) in line
    mimi.write_bytes(data[:1000])  # an interrupted download
    done = subprocess.run(
        [sys.executable, "-m", "cspan.core.cli", "model", "info", str(tiny_copy)], capture_output=True, text=True
    )
    assert done.returncode == 1, done.stdout
    assert _mimi_check(done.stdout) == (
        f"  key check: FAILED, loading would refuse these weights: Mimi weights file {str(mimi)!r} is truncated or "
        f"not a safetensors file: header length {header} does not fit in 1000 bytes; download or copy the file again"
    )
    mimi.unlink()
    assert _mimi_check(describe_checkpoint(tiny_copy)) == f"  weights: missing ({MIMI_FILE})"
