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


def _asr_helps(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(verb path, rendered help on one line) of every ``--asr`` flag under ``parser``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _asr_helps(sub, (*path, name))
        elif "--asr" in action.option_strings:
            yield path, " ".join(parser._get_formatter()._expand_help(action).split())


def test_the_asr_help_says_which_server_a_url_means() -> None:
    """`cspan bench fdb-v1 score --asr http://host:port` (no /v1) is a POST /transcribe server, with /v1 an
    OpenAI-compatible one; the help said only "an OpenAI-style URL". It now says both, and that is what the URL
    picks."""
    from cspan.backends.asr import HTTPTranscriber, OpenAITranscriber
    from cspan.bench.transcribe import make_transcriber
    from cspan.core.cli import build_parser

    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    helps = dict(_asr_helps(bench))
    assert ("fdb-v1", "score") in helps and ("fdb-v1", "run") in helps
    for path, shown in helps.items():
        where = f"cspan bench {' '.join(path)} --asr"
        assert "a URL with a /v1 path segment (http://host:port/v1)" in shown, f"{where}: {shown!r}"
        assert "OpenAI-compatible /v1/audio/transcriptions endpoint" in shown, f"{where}: {shown!r}"
        assert "(http://host:port, without /v1) for a POST /transcribe server" in shown, f"{where}: {shown!r}"
    plain = make_transcriber("http://127.0.0.1:18700")
    assert isinstance(plain, HTTPTranscriber) and plain.endpoint == "http://127.0.0.1:18700/transcribe"
    for url in ("http://127.0.0.1:18700/v1", "openai+http://127.0.0.1:18700"):
        openai = make_transcriber(url)
        assert isinstance(openai, OpenAITranscriber)
        assert openai.endpoint == "http://127.0.0.1:18700/v1/audio/transcriptions"
