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


def _upstream_rows(text: str) -> list[tuple[str, str, str]]:
    """``(verb, upstream cell, our cell)`` for each row of COMING-FROM-MOSHI.md's tables that map flags: the live
    server's table to ``serve``, the others to ``infer`` (moshi-finetune's table holds config keys, not flags)."""
    rows = []
    section = ""
    for line in text.splitlines():
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        elif line.startswith("| ") and not line.startswith("|---") and section != "Fine-tuning":
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            if len(cells) == 2 and cells[0] not in ("upstream",) and not cells[1].startswith("`cspan "):
                rows.append(("serve" if section == "Live conversations" else "infer", cells[0], cells[1]))
    return rows


def test_the_upstream_flags_the_cli_answers_are_the_documented_ones(repo_root: Path) -> None:
    """docs/COMING-FROM-MOSHI.md's tables and ``cspan.core.upstream.UPSTREAM_FLAGS`` (what ``cspan VERB --greedy``
    answers) say the same: each upstream flag of the tables is a flag of ours or a declared one, answered by the
    verb, and the row names its counterpart; every declared flag is in a table."""
    from cspan.core.upstream import UPSTREAM_FLAGS

    verbs = _verbs(build_parser())
    rows = _upstream_rows((repo_root / "docs/COMING-FROM-MOSHI.md").read_text())
    assert len(rows) > 20
    problems, seen = [], set()
    for verb, upstream, ours in rows:
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*", upstream):
            if flag in verbs[(verb,)]:
                continue  # the same flag here
            entry = UPSTREAM_FLAGS.get(flag)
            if entry is None or not entry.answers(verb, verbs[(verb,)]):
                problems.append(f"{flag} ({verb}): not in UPSTREAM_FLAGS for `cspan {verb}`")
                continue
            seen.add(flag)
            named = re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*|\bCSPAN_\w+", entry.use or "")
            missing = [n for n in named if n not in ours]
            if missing:
                problems.append(f"{flag}: the row `{ours}` does not name {missing}, which the CLI gives")
    assert not problems, "\n".join(problems)
    assert set(UPSTREAM_FLAGS) - seen == set(), "declared but in no table of docs/COMING-FROM-MOSHI.md"
