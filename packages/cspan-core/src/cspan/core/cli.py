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
import contextlib
import difflib
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from importlib.metadata import PackageNotFoundError, entry_points, version
from typing import NoReturn

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


def version_text() -> str:
    """``cspan VERSION (DIST VERSION, ...)``: cspan-core's version and that of every distribution adding verbs."""
    try:
        core = version("cspan-core")
    except PackageNotFoundError:  # run from a source tree that was never installed
        core = "unknown"
    dists = {(ep.dist.name, ep.dist.version) for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.dist is not None}
    listed = ", ".join(f"{name} {ver}" for name, ver in sorted(dists))
    return f"cspan {core}" + (f" ({listed})" if listed else "")


class _VersionAction(argparse.Action):
    """``--version``: print :func:`version_text` on stdout and exit 0 (computed only when asked)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)  # type: ignore[arg-type]

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        print(version_text())
        parser.exit()


_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)$")
_MISSING_VALUE = re.compile(r"^argument (\S+): expected one argument$")
_UNRECOGNIZED = "unrecognized arguments: "
_AMBIGUOUS = re.compile(r"^ambiguous option: (\S+) could match ")
_NUMBER_LED = re.compile(r"^-(\.?\d|(inf|nan)(\W|$))", re.IGNORECASE)
"""A word that starts as a negative number does (``-1:hi``, ``-0.5s``, ``-inf:hi``)."""


class CspanParser(argparse.ArgumentParser):
    """The top-level parser: a mistyped choice (a verb, an action, a flag's value) is refused with the closest
    known one suggested (``invalid choice: 'infr' (choose from ...); did you mean 'infer'?``), and so is a mistyped
    flag, by the verb that received it (``unrecognized arguments: --outptu-text; did you mean '--output-text'?``).

    A word that starts with a minus and a digit is a flag's value, not an unknown flag: ``--span -1:hi`` reaches the
    flag's own check (``'-1:hi': expected SECONDS:TEXT with SECONDS a number >= 0``), where argparse, which takes only
    a bare negative number so, answered ``expected one argument``. Any other value that starts with ``-`` is written
    ``--flag=-value``, which that answer then says (``expected one argument; a value that starts with '-' is written
    --text-prompt=-hi``)."""

    _words: tuple[str, ...] = ()

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def,override]
        self._words = tuple(sys.argv[1:] if args is None else args)  # for error(): the word after a flag
        return super().parse_known_args(args, namespace)

    def _flag_suggestions(self, words: list[str]) -> str:
        """``"; did you mean '--output-text'?"`` for the unknown flags among ``words`` that are close to one of this
        parser's (``--outptu-text``, ``--outptu-text=x.json``), as a mistyped verb is answered; ``""`` if none is.
        A Moshi or PersonaPlex flag is answered by :meth:`_upstream_hints` instead, never with a look-alike
        (``--voice-prompt`` is not ``--text-prompt``)."""
        flags = {f.lstrip("-"): f for a in self._actions if a.help != argparse.SUPPRESS for f in a.option_strings}
        pairs = []
        for word in words:
            typed = word.split("=", 1)[0]
            if typed.startswith("-") and not _NUMBER_LED.match(typed) and not self._upstream_hints([typed]):
                close = difflib.get_close_matches(typed.lstrip("-"), flags, n=1)  # compared without their dashes
                if close:
                    pairs.append((typed, flags[close[0]]))
        said = self._upstream_hints(words)
        if len(pairs) == 1:
            return f"; did you mean {pairs[0][1]!r}?{said}"
        if pairs:
            return "; did you mean " + ", ".join(f"{flag!r} for {typed}" for typed, flag in pairs) + "?" + said
        return said

    def _upstream_hints(self, words: list[str]) -> str:
        """``"; --greedy is PersonaPlex's: here, --temp 0 --temp-text 0 (docs/COMING-FROM-MOSHI.md)"``: for each
        Moshi or PersonaPlex flag among ``words`` that this verb answers (:data:`cspan.core.upstream.UPSTREAM_FLAGS`),
        its counterpart and how to use it, or that it has none; ``""`` if there is no such flag."""
        from .upstream import UPSTREAM_DOC, upstream_hint, upstream_positional_hint

        options = set(self._option_string_actions)
        verb = self.prog.removeprefix("cspan").strip()
        hints = [upstream_hint(word.split("=", 1)[0], verb, options) for word in words if word.startswith("--")]
        hints.append(upstream_positional_hint(words, options))  # moshi.run_inference in.wav out.wav
        said = "".join(f"; {hint}" for hint in dict.fromkeys(h for h in hints if h is not None))
        return f"{said} ({UPSTREAM_DOC})" if said else ""

    def _parse_optional(self, arg_string: str):  # type: ignore[no-untyped-def]
        if _NUMBER_LED.match(arg_string) and not self._has_negative_number_optionals:
            return None  # a value (no flag of this parser looks like a number)
        return super()._parse_optional(arg_string)

    def error(self, message: str) -> NoReturn:
        match = _INVALID_CHOICE.search(message)
        if match:
            choices = [c.strip().strip("'") for c in match.group(2).split(",")]
            close = difflib.get_close_matches(match.group(1), choices, n=1)
            if close:
                message += f"; did you mean {close[0]!r}?"
        if message.startswith(_UNRECOGNIZED):
            message += self._flag_suggestions(message.removeprefix(_UNRECOGNIZED).split())
        match = _AMBIGUOUS.match(message)
        if match:  # an upstream flag that starts two of ours (Moshi's --ssl: --ssl-certfile, --ssl-keyfile)
            message += self._upstream_hints([match.group(1)])
        match = _MISSING_VALUE.match(message)
        if match:
            flags = match.group(1).split("/")
            after = [
                b
                for a, b in zip(self._words, self._words[1:], strict=False)
                if a in flags and b.startswith("-") and b.split("=")[0] not in self._option_string_actions
            ]
            if after:  # a value that looks like a flag, not a flag of this verb after a forgotten value
                message += f"; a value that starts with '-' is written {flags[-1]}={after[0]}"
        super().error(message)


class VerbParser(CspanParser):
    """A verb's parser (and its sub-verbs'): an argument it does not know is refused with the verb's own usage line
    (argparse leaves unknown arguments to the top-level parser, whose usage names no verb's flags)."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def,override]
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"{_UNRECOGNIZED}{' '.join(extras)}")
        return namespace, extras


def build_parser(commands: dict[str, Register] | None = None) -> argparse.ArgumentParser:
    """Build the top-level parser with one sub-parser per installed verb."""
    if commands is None:
        commands = discover_commands()
    parser = CspanParser(
        prog="cspan",
        description="Context Spanning: a full-duplex speech model that reads retrieved references as Context Spans.",
        epilog="Installed verbs come from the installed cspan-* distributions. `cspan VERB --help` for details.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    parser.add_argument(
        "--version", action=_VersionAction, help="print the version of cspan and of the packages adding verbs, and exit"
    )
    sub = parser.add_subparsers(dest="command", metavar="VERB", title="verbs", parser_class=VerbParser)
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
    _name_every_parser(parser)
    return parser


_PROG = "_cspan_prog"
"""The namespace attribute holding the command line's verb path (``cspan model tiny``) for messages."""


def _name_every_parser(parser: argparse.ArgumentParser) -> None:
    """Record each verb's and sub-verb's ``prog`` as a default of its own parser, so that the verb run names itself
    in its messages as argparse's own errors do (``cspan model tiny: error: ...``, not ``cspan model: ...``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.set_defaults(**{_PROG: sub.prog})
                _name_every_parser(sub)


def _is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` is one of the project's deliberate errors (its message says what and where).

    ``CspanError`` and the roots of the packages that cannot import ``cspan.core`` (``cspan.backends``'
    ``BackendError``, whose subclasses such as ``ContextDBError`` may reach a verb): any class of the exception's
    lineage defined in a ``cspan.*.errors`` module.
    """
    return any(cls.__module__.startswith("cspan.") and cls.__module__.endswith(".errors") for cls in type(exc).__mro__)


STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name))
"""Signals that stop a verb cleanly (exit ``128 + signal``, unfinished outputs removed): a kill, a closed terminal
(SIGHUP; ``cspan serve`` takes SIGHUP over to reload its token file), Ctrl-\\ (SIGQUIT). SIGINT is Python's
``KeyboardInterrupt`` (130)."""


Handler = Callable[[int, object], object]


@contextlib.contextmanager
def stop_handlers_replaced(replace: Callable[[Handler], Handler]) -> Iterator[dict[int, Handler]]:
    """For the block, the Python handler of Ctrl-C and of each of :data:`STOP_SIGNALS` replaced by
    ``replace(handler)``; restored after. Yields the replaced handlers by signal. Only handlers that are Python
    functions are replaced, and only in the main thread (elsewhere the block just runs, nothing replaced)."""
    previous: dict[int, Handler] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, *STOP_SIGNALS):
            handler = signal.getsignal(signum)
            if callable(handler):
                signal.signal(signum, replace(handler))  # type: ignore[arg-type]
                previous[signum] = handler
    try:
        yield previous
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]


def _raise_terminated(signum: int, _frame: object) -> None:
    from cspan.core.errors import Terminated

    raise Terminated(signum)


class _GuardedStdout:
    """``sys.stdout`` while ``cspan`` runs: a write or flush that finds its reader gone (a ``BrokenPipeError``:
    ``cspan db export bob | head``) points file descriptor 1 at the null device, so that nothing written later nor
    the flush at exit fails again, and raises :class:`~cspan.core.errors.StdoutClosed` in the main thread (which
    stops the verb quietly; elsewhere the ``BrokenPipeError`` itself, a thread cannot stop the process). Python's
    recipe (the ``signal`` module's note on SIGPIPE), in one place for every verb, not SIGPIPE's default action,
    which would also kill ``cspan serve`` when a client's socket closes. Everything else is the stream's own."""

    def __init__(self, stream: object) -> None:
        self._stream = stream

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)

    def _closed(self) -> NoReturn:
        from cspan.core.errors import StdoutClosed

        with contextlib.suppress(OSError, ValueError, AttributeError):  # no descriptor (captured): nothing to point
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())  # type: ignore[attr-defined]
            os.close(devnull)
        if threading.current_thread() is threading.main_thread():
            raise StdoutClosed
        raise BrokenPipeError(32, "standard output's reader went away")

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)  # type: ignore[attr-defined]
        except BrokenPipeError:
            self._closed()

    def writelines(self, lines: object) -> None:
        try:
            self._stream.writelines(lines)  # type: ignore[attr-defined]
        except BrokenPipeError:
            self._closed()

    def flush(self) -> None:
        try:
            self._stream.flush()  # type: ignore[attr-defined]
        except BrokenPipeError:
            self._closed()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``cspan`` console script; returns the process exit status.

    Standard output's reader going away (``cspan db export bob | head``) ends any verb quietly, as it ends a standard
    tool: no message, exit status 141 (``128 + SIGPIPE``; see :class:`_GuardedStdout`).

    Before the verb runs, each ``CSPAN_*`` variable of the environment that no installed verb reads is warned about
    (:mod:`cspan.core.environment`).

    Errors are one line on stderr (a message of several lines, such as a library's cause quoted in it, is joined
    into one): the project's own errors (exit status 1, or their ``exit_code``: 2 for a bad setting), an
    ``OSError`` (the file and the cause: permission denied, no space left on device), an interrupt (130) or
    SIGTERM, SIGHUP, SIGQUIT (``128 + signal``; raised as :class:`~cspan.core.errors.Terminated` so that cleanup
    runs and unfinished outputs are removed). ``-v`` adds the traceback of an ``OSError``.
    """
    from cspan.core.errors import StdoutClosed

    stdout = sys.stdout
    sys.stdout = guarded = _GuardedStdout(stdout)  # type: ignore[assignment]
    try:
        try:
            return _main(argv)
        finally:  # what is still buffered is written now, where a closed pipe is caught, not at exit
            sys.stdout.flush()
    except StdoutClosed as exc:
        return int(exc.code)  # type: ignore[arg-type]
    finally:
        if sys.stdout is guarded:
            sys.stdout = stdout


def _main(argv: Sequence[str] | None) -> int:
    try:
        parser = build_parser()  # imports every installed verb: the first half second or so
        args = parser.parse_args(argv)
    except KeyboardInterrupt:  # Ctrl-C before the verb runs: the verb's own line and status, not a traceback
        print("cspan: interrupted", file=sys.stderr)
        return 130
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler = getattr(args, "handler", None)
    if handler is None:
        # A verb with sub-verbs (``cspan model``) and none given.
        parser.parse_args([*(argv if argv is not None else sys.argv[1:]), "--help"])
        return 2
    from cspan.core.environment import warn_unknown_env
    from cspan.core.errors import StdoutClosed, Terminated, describe_os_error, one_line
    from cspan.core.settings import settings_models

    # A misspelled CSPAN_* variable would be ignored without a word: warn, naming the closest known one (known to any
    # installed verb: one environment file may serve several).
    warn_unknown_env(os.environ, settings_models(parser), argv=argv if argv is not None else sys.argv[1:])
    prog = getattr(args, _PROG, f"cspan {args.command}")

    previous: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            previous[signum] = signal.signal(signum, _raise_terminated)
    try:
        return int(handler(args) or 0)
    except StdoutClosed:
        raise
    except Terminated as exc:
        print(f"{prog}: terminated by signal {exc.signum}", file=sys.stderr)
        return int(exc.code or 143)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if _is_user_error(exc):
            print(f"{prog}: error: {one_line(str(exc))}", file=sys.stderr)
            return int(getattr(exc, "exit_code", 1))
        if isinstance(exc, OSError):
            logging.getLogger(__name__).info("traceback of the error below", exc_info=True)
            print(f"{prog}: error: {one_line(describe_os_error(exc))}", file=sys.stderr)
            return 1
        raise
    finally:
        for signum, handler_before in previous.items():
            signal.signal(signum, handler_before)  # type: ignore[arg-type]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
