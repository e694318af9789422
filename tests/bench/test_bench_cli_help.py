"""`cspan bench ... --help`: every flag that has a default says which, with its real value."""

from __future__ import annotations

import argparse

NO_DEFAULT = (None, False, [], "", argparse.SUPPRESS)


def _options_with_a_default(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(verb path, action, its help as rendered) of every flag under ``parser`` whose default is a value."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options_with_a_default(sub, (*path, name))
        elif action.option_strings and action.help != argparse.SUPPRESS and action.default not in NO_DEFAULT:
            yield path, action, parser._get_formatter()._expand_help(action) if action.help else ""


def test_every_bench_flag_with_a_default_shows_it_in_its_help() -> None:
    """`cspan bench latency --help` showed no default for --n, --iters, --warmup, --kv-dtype..., `capacity` none
    for --batch-size (no help at all), --frames, --span-length..., and the runners none for --temp, --seed,
    --span-deadline-s (10 s there, 2.5 s in `cspan infer`)."""
    from cspan.core.cli import build_parser

    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    checked = 0
    for path, action, shown in _options_with_a_default(bench):
        default = action.default
        if isinstance(default, list | tuple):
            text = " ".join(map(str, default))
        elif isinstance(default, float):
            text = f"{default:g}"
        else:
            text = str(default)
        where = f"cspan bench {' '.join(path)} {action.option_strings[-1]}"
        assert "default" in shown and text in shown, f"{where}: {shown!r} does not show its default {text}"
        checked += 1
    assert checked > 50
