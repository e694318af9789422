"""``cspan model ...``: checkpoint utilities (registered through the ``cspan.commands`` entry point)."""

from __future__ import annotations

import argparse


def model_command(parser: argparse.ArgumentParser) -> None:
    """Model utilities: build a tiny random checkpoint in the released layout, inspect a checkpoint."""
    sub = parser.add_subparsers(dest="model_command", metavar="ACTION", title="actions")
    sub.required = True
    # Actions are added by the checkpoint module once it exists; see cspan.core.checkpoint.
    try:
        from cspan.core.checkpoint import register_model_actions
    except ImportError:  # during bootstrap the checkpoint module may be absent
        return
    register_model_actions(sub)
