"""``cspan`` run in this process on one intra-op thread (the tiny checkpoint's runs take no longer, and the test
process's own thread count is restored after)."""

from __future__ import annotations

import torch

from cspan.core.cli import main


def run_cspan(*args: str) -> int:
    """``cspan ARGS`` in this process; returns its exit status."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return main(list(args))
    finally:
        torch.set_num_threads(threads)
