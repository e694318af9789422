"""Fixtures shared by the core tests: a tiny checkpoint built once per test session, fixture LMs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Run the core tests with one intra-op thread: the models here are tiny, and on a shared 2-core machine
    OpenMP worker threads spinning against other processes make small ops 10-40x slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_checkpoint_dir: Path):
    """The tiny checkpoint loaded by ``load_checkpoint`` in float32 on the CPU (shared; engines do not modify it)."""
    from cspan.core.checkpoint import load_checkpoint

    return load_checkpoint(tiny_checkpoint_dir, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def reference_lm(fixtures_dir: Path) -> Callable[..., torch.nn.Module]:
    """``reference_lm("lm-moshi-shaped", context=16)`` -> the fixture's LMModel (float32, eval), with config
    fields overridden as given (the weights do not depend on ``context``)."""
    from safetensors.torch import load_file

    from cspan.core.config import LMConfig
    from cspan.core.lm import LMModel

    def load(name: str, **overrides) -> torch.nn.Module:
        folder = fixtures_dir / "reference" / name
        if not folder.is_dir():
            pytest.skip(f"fixture not found: {folder}")
        cfg = LMConfig.from_upstream(json.loads((folder / "config.json").read_text()))
        if overrides:
            cfg = cfg.model_copy(update=overrides)
        model = LMModel(cfg, dtype=torch.float32).eval()
        model.load_state_dict(load_file(folder / "model.safetensors"), strict=True)
        return model

    return load
