"""``cspan model ...``: checkpoint utilities (registered through the ``cspan.commands`` entry point)."""

from __future__ import annotations

import argparse


def model_command(parser: argparse.ArgumentParser) -> None:
    """Model utilities: build a tiny random checkpoint in the released layout, inspect a checkpoint."""
    from cspan.core.checkpoint import register_model_actions  # light: torch is imported by the handlers only

    sub = parser.add_subparsers(dest="model_command", metavar="ACTION", title="actions")
    sub.required = True
    register_model_actions(sub)
