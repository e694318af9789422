"""``--device``: one parser (:func:`cspan.core.devices.parse_device`) for every command that runs torch. A name torch
does not know is a bad setting (exit 2), CUDA where this torch has none is one line (exit 1); never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cspan.core.cli import main
from cspan.core.devices import parse_device
from cspan.core.errors import CspanError, SettingsError

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")


def test_parse_device_values() -> None:
    assert parse_device("cpu") == torch.device("cpu")
    assert parse_device("cpu:0") == parse_device("cpu:1") == torch.device("cpu")  # no index: safetensors refuses one
    assert parse_device(None) == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("bogus", "tpu", "", "cuda:x"):
        with pytest.raises(SettingsError, match="not a device torch knows; use cpu, cuda or cuda:N"):
            parse_device(bad)
    with pytest.raises(SettingsError, match=r"^--device meta: cspan runs on the CPU or CUDA only"):
        parse_device("meta")


def test_cpu_with_an_index_loads(tiny_checkpoint_dir: Path) -> None:
    """`--device cpu:0` (a device torch accepts) failed the load with "LM weights file ..., tensor 'emb.0.weight':
    cannot be read (device cpu:0 is invalid); download or copy the file again": safetensors takes no CPU index."""
    from cspan.core.checkpoint import load_lm

    lm = load_lm(tiny_checkpoint_dir, device="cpu:0")
    assert lm.text_emb.weight.device == torch.device("cpu")


@NO_CUDA
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_cuda_without_cuda_is_one_line(name: str) -> None:
    with pytest.raises(CspanError) as err:
        parse_device(name)
    assert not isinstance(err.value, SettingsError)
    assert str(err.value) == (
        f"--device {name}: this torch has no CUDA device (torch {torch.__version__}); use --device cpu"
    )


@pytest.mark.parametrize(
    ("device", "code", "expect"),
    [
        ("bogus", 2, "--device bogus: not a device torch knows; use cpu, cuda or cuda:N"),
        pytest.param("cuda", 1, "--device cuda: this torch has no CUDA device", marks=NO_CUDA),
    ],
)
def test_voice_encode_refuses_a_bad_device_before_reading(device, code, expect, tmp_path: Path, capsys) -> None:
    """`cspan voice encode IN OUT --device cuda|bogus` gave torch's AssertionError / RuntimeError tracebacks."""
    out = tmp_path / "v.pt"
    argv = ["voice", "encode", str(tmp_path / "missing.wav"), str(out), "--checkpoint", str(tmp_path / "none")]
    assert main([*argv, "--device", device]) == code
    err = capsys.readouterr().err
    assert err == f"cspan voice encode: error: {expect}" + err.split(expect, 1)[1] and err.count("\n") == 1, err
    assert not out.exists()
