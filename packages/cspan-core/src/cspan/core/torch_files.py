"""Reading ``torch.save`` files (fine-tunes, voice prompts) safely: the one ``torch.load`` of the checkpoint and voice
loaders.

``torch.load`` is only ever called with ``weights_only=True``, so a file that holds Python objects other than tensors,
dicts, lists, strings and numbers is refused instead of run; every failure is a :class:`CheckpointError` that names
the file and what it is for. This module imports torch lazily (inside the function) so that ``cspan --help`` stays
fast.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

from .errors import CheckpointError


def load_torch_file(path: Path, role: str) -> Any:
    """``torch.load(weights_only=True)`` on CPU, memory-mapped where the file format allows it."""
    import pickle

    import torch

    if not path.is_file():
        raise CheckpointError(f"{role} file {str(path)!r} does not exist; check the path or download it again")
    fix = "download or copy it again"

    def refused(exc: Exception) -> CheckpointError:
        text = str(exc)
        # "Unsupported global: GLOBAL argparse.Namespace ..." or, for a blocked module (os.system in a malicious
        # file), "Trying to load unsupported GLOBAL posix.system whose module posix is blocked"
        found = re.search(r"unsupported (?:global: )?GLOBAL ([\w.]+)", text, re.IGNORECASE)
        reason = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)  # torch's own words, after its advice
        if found:
            detail = f"it needs {found.group(1)}"
        elif reason:
            detail = reason.group(1).strip().rstrip(".")
        else:  # never torch's first line: it advises turning the weights-only guard off
            lines = [line.strip() for line in text.splitlines() if line.strip() and "weights_only" not in line]
            detail = lines[0].rstrip(".") if lines else "unpickling failed"
        return CheckpointError(
            f"{role} file {str(path)!r} holds Python objects that weights_only loading refuses ({detail}); re-save "
            "it with only tensors, dicts, lists, strings and numbers"
        )

    def load(**kwargs: Any) -> Any:
        with warnings.catch_warnings():  # torch warns about the pickle protocol of files it is about to refuse
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True, **kwargs)

    try:
        return load(mmap=True)
    except pickle.UnpicklingError as exc:
        raise refused(exc) from None
    except Exception:
        pass  # not mmap-able (legacy format) or corrupt: retry without mmap for a precise answer
    try:
        return load()
    except pickle.UnpicklingError as exc:
        raise refused(exc) from None
    except Exception as exc:  # any other failure of the unpickler means the file is not what it claims to be
        first = (str(exc).strip().splitlines() or [""])[0]
        raise CheckpointError(
            f"{role} file {str(path)!r} is truncated or corrupt, or not a torch file ({type(exc).__name__}: {first}); "
            f"{fix}"
        ) from None


__all__ = ["load_torch_file"]
