"""The user docs as a user follows them: every ``cspan VERB --flag`` of their command examples is a flag of that verb,
and every relative link between them leads to a file (and heading) that exists."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from cspan.core.cli import build_parser

DOCS = [
    "README.md",
    "docs/ARCHITECTURE.md",
    "docs/BACKENDS.md",
    "docs/BENCH.md",
    "docs/COMING-FROM-MOSHI.md",
    "docs/ENGINE.md",
    "docs/OPERATORS.md",
    "docs/OUTPUT.md",
    "docs/PROTOCOL.md",
    "docs/TRAINING.md",
]


def _verbs(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], set[str]]:
    """Every verb path (``("bench", "latency")``) -> its option strings."""
    out: dict[tuple[str, ...], set[str]] = {}
    options = {opt for action in parser._actions for opt in action.option_strings}
    out[path] = options
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.update(_verbs(sub, (*path, name)))
    return out


def _command_lines(text: str) -> list[str]:
    """The shell commands of the fenced code blocks (continuations joined, comments and prompts dropped)."""
    blocks: list[str] = []
    language: str | None = None  # inside a fenced block: its language
    for line in text.splitlines():
        if line.startswith("```"):
            if language is None:
                language = line[3:].strip()
                blocks.append("")
            else:
                language = None
        elif language in ("", "bash", "sh", "shell", "console"):
            blocks[-1] += line + "\n"
    lines: list[str] = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = re.split(r"\s#|^#", line, maxsplit=1)[0]
            lines += [part for part in re.split(r"&&|;|\s\|\|?\s", line) if part.strip()]
    return lines


def _documented_invocations(text: str) -> list[tuple[list[str], str]]:
    """``(words after cspan, the line)`` for each cspan invocation of the code blocks."""
    found = []
    for line in _command_lines(text):
        m = re.search(r"(?:\bcspan\)?|main\.py|-m cspan\.core\.cli)\s+(.*)$", line)
        if m:
            found.append((m.group(1).split(), line.strip()))
    return found


@pytest.mark.parametrize("doc", DOCS)
def test_documented_flags_exist(repo_root: Path, doc: str) -> None:
    verbs = _verbs(build_parser())
    problems = []
    for words, line in _documented_invocations((repo_root / doc).read_text()):
        path: tuple[str, ...] = ()
        for word in words:
            if (*path, word) not in verbs:
                break
            path = (*path, word)
        if not path:
            continue  # an illustration such as `cspan VERB ...`
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", " ".join(words)):
            if flag not in verbs[path]:
                problems.append(f"`cspan {' '.join(path)}` has no {flag}: {line}")
    assert not problems, f"{doc}:\n" + "\n".join(problems)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file."""
    out = set()
    for heading in re.findall(r"^#+ (.*)$", path.read_text(), re.M):
        out.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_lead_somewhere(repo_root: Path, doc: str) -> None:
    source = repo_root / doc
    problems = []
    for link in re.findall(r"\]\(([^)\s]+)\)", source.read_text()):
        if re.match(r"[a-z]+:", link):
            continue
        target_name, _, anchor = link.partition("#")
        target = (source.parent / target_name).resolve() if target_name else source
        if not target.exists():
            problems.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            problems.append(f"{link}: no such heading")
    assert not problems, f"{doc}: " + "; ".join(problems)


def test_the_directly_read_variables_are_the_documented_ones(repo_root: Path) -> None:
    """docs/OPERATORS.md's "Environment variables" table names exactly ``cspan.core.environment.DIRECT_ENV``."""
    from cspan.core.environment import DIRECT_ENV

    text = (repo_root / "docs/OPERATORS.md").read_text()
    section = text.split("\n## Environment variables\n", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("| `CSPAN_")]
    documented = {name for line in table for name in re.findall(r"`(CSPAN_\w+)`", line.split(" | ")[0])}
    assert documented == set(DIRECT_ENV), (
        f"in the docs only: {sorted(documented - set(DIRECT_ENV))}; in DIRECT_ENV only: "
        f"{sorted(set(DIRECT_ENV) - documented)}"
    )
