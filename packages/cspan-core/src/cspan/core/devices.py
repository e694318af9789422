"""``--device``: the one parser of a device flag, for every command that runs torch (``infer``, ``serve``,
``bench``, ``prepare``, ``train``, ``voice encode``).

A name torch does not know (``bogus``, ``tpu``) or one cspan does not run on (``meta``, ``mps``) is a bad setting
(:class:`~cspan.core.errors.SettingsError`, exit status 2); CUDA asked for where this torch has no CUDA device, or a
CUDA index past the machine's devices, is a :class:`~cspan.core.errors.CspanError` (exit status 1): the setting is
well formed, the machine lacks it. Either way one line, before any model loads, instead of torch's
``AssertionError: Torch not compiled with CUDA enabled`` or ``RuntimeError: Expected one of cpu, cuda, ...``
traceback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import CspanError, SettingsError

if TYPE_CHECKING:
    import torch

DEVICE_TYPES = ("cpu", "cuda")
"""The device types cspan runs on."""


def parse_device(name: str | None, *, flag: str = "--device", cuda_index: int | None = None) -> torch.device:
    """The torch device that ``name`` (a ``--device`` value) names, checked against this machine.

    Args:
        name: ``cpu``, ``cuda``, ``cuda:N``; None: CUDA when this torch has a device, else the CPU. ``cpu:N`` is the
            CPU (``torch.device("cpu")``, no index).
        flag: the flag (or variable) named in messages.
        cuda_index: the index given to a bare ``cuda`` (and to the default), e.g. ``LOCAL_RANK`` under torchrun;
            None leaves it bare.

    Raises:
        SettingsError: ``name`` is not a device torch knows, or not one cspan runs on (exit status 2).
        CspanError: CUDA asked for where this torch has none, or ``cuda:N`` past the machine's devices.
    """
    import torch

    if name is None:
        if not torch.cuda.is_available():
            return torch.device("cpu")
        name = "cuda"
    hint = "use cpu, cuda or cuda:N"
    shown = name if name and name == name.strip() else repr(name)
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise SettingsError(f"{flag} {shown}: not a device torch knows; {hint}") from None
    if device.type not in DEVICE_TYPES:
        raise SettingsError(f"{flag} {shown}: cspan runs on the CPU or CUDA only; {hint}")
    if device.type != "cuda":  # torch reads cpu:N as the one CPU; safetensors refuses an index ("cpu:0 is invalid")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise CspanError(f"{flag} {name}: this torch has no CUDA device (torch {torch.__version__}); use {flag} cpu")
    if device.index is None and cuda_index is not None:
        device = torch.device("cuda", cuda_index)
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise CspanError(
            f"{flag} {name}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1}); choose one of them"
        )
    return device


def default_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype a model runs in on ``device`` when none is asked for: bfloat16 on CUDA (the released weights'),
    float32 on the CPU."""
    import torch

    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def pick_device(name: str | None, *, flag: str = "--device") -> tuple[torch.device, torch.dtype]:
    """``(device, dtype)`` of a ``--device`` value: :func:`parse_device` (CUDA when available, else the CPU) and
    :func:`default_dtype`.

    Raises:
        SettingsError, CspanError: as :func:`parse_device`.
    """
    device = parse_device(name or None, flag=flag)
    return device, default_dtype(device)


__all__ = ["DEVICE_TYPES", "default_dtype", "parse_device", "pick_device"]
