"""The single ``cspan`` console script.

Every installed distribution adds its verbs through the entry-point group ``cspan.commands``. An entry point
names a callable ``register(parser: argparse.ArgumentParser) -> None`` that adds the verb's arguments and sets
``parser.set_defaults(handler=fn)`` where ``fn(args) -> int`` runs it. The first line of the callable's docstring
is the verb's one-line help. Heavy imports (torch, FastAPI, ...) belong inside ``fn`` so that ``cspan --help``
stays fast.

An entry point may instead name a settings model: a ``pydantic_settings.BaseSettings`` subclass with a method
``run(self) -> int``. Its flags, environment variables and settings file are then generated from the model (see
:mod:`cspan.core.settings`), so packages that cannot import ``cspan.core`` (``cspan.backends``) declare their
settings once too. The model's docstring's first line is the verb's help.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points

ENTRY_POINT_GROUP = "cspan.commands"

Register = Callable[[argparse.ArgumentParser], None]


def discover_commands() -> dict[str, Register]:
    """Load the registered verbs, sorted by name.

    A verb whose entry point cannot be loaded (a broken optional install) is skipped with a warning on stderr,
    so that one broken plugin never takes the whole command line down.
    """
    commands: dict[str, Register] = {}
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if ep.name in commands:
            continue
        try:
            commands[ep.name] = ep.load()
        except Exception as exc:
            print(f"cspan: warning: command {ep.name!r} ({ep.value}) failed to load: {exc}", file=sys.stderr)
    return commands


def _is_settings_command(register: object) -> bool:
    from pydantic_settings import BaseSettings

    return (
        isinstance(register, type) and issubclass(register, BaseSettings) and callable(getattr(register, "run", None))
    )


def _run_settings(args: argparse.Namespace) -> int:
    from .settings import settings_from_args

    return int(settings_from_args(args).run() or 0)


def _summary(register: Register) -> str:
    doc = (register.__doc__ or "").strip()
    return doc.splitlines()[0] if doc else ""


def build_parser(commands: dict[str, Register] | None = None) -> argparse.ArgumentParser:
    """Build the top-level parser with one sub-parser per installed verb."""
    if commands is None:
        commands = discover_commands()
    parser = argparse.ArgumentParser(
        prog="cspan",
        description="Context Spanning: a full-duplex speech model that reads retrieved references as Context Spans.",
        epilog="Installed verbs come from the installed cspan-* distributions. `cspan VERB --help` for details.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", metavar="VERB", title="verbs")
    sub.required = True
    for name, register in commands.items():
        summary = _summary(register)
        verb = sub.add_parser(
            name, help=summary, description=summary, formatter_class=argparse.ArgumentDefaultsHelpFormatter
        )
        if _is_settings_command(register):
            from .settings import add_settings_arguments

            verb.formatter_class = argparse.HelpFormatter  # the generated help already shows defaults
            add_settings_arguments(verb, register)  # type: ignore[arg-type]
            verb.set_defaults(handler=_run_settings)
        else:
            register(verb)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``cspan`` console script; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler = getattr(args, "handler", None)
    if handler is None:
        # A verb with sub-verbs (``cspan model``) and none given.
        parser.parse_args([*(argv if argv is not None else sys.argv[1:]), "--help"])
        return 2
    from cspan.core.errors import CspanError

    try:
        return int(handler(args) or 0)
    except CspanError as exc:
        print(f"cspan {args.command}: error: {exc}", file=sys.stderr)
        return int(getattr(exc, "exit_code", 1))
    except KeyboardInterrupt:
        print(f"cspan {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
