"""Fixtures of the training tests: a tiny checkpoint, dialogues spoken by espeak-ng, and their prepared dataset.

Each word is synthesised on its own (``espeak-ng --stdout``), trimmed to its voiced samples and placed at a chosen
offset, so every word's start and end time is exact. The stereo file is written at espeak-ng's own 22050 Hz (the
prepare step resamples it to 24 kHz).
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ESPEAK_RATE = 22050


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``cspan model tiny`` checkpoint (dep_q 16, seed 0), written by the command's own function in this process."""
    from cspan.core.tiny import build_tiny_checkpoint

    out = tmp_path_factory.mktemp("train-tiny") / "tiny"
    return build_tiny_checkpoint(out, dep_q=16, seed=0)


_cache: dict[str, np.ndarray] = {}


def speak(word: str) -> np.ndarray:
    """espeak-ng's rendering of one word at 22050 Hz, trimmed to its samples above -60 dBFS."""
    import soundfile as sf

    if word not in _cache:
        proc = subprocess.run(["espeak-ng", "--stdout", "-s", "190", word], capture_output=True, check=True, timeout=60)
        data, rate = sf.read(io.BytesIO(proc.stdout), dtype="float32")
        assert rate == ESPEAK_RATE
        loud = np.nonzero(np.abs(data) > 1e-3)[0]
        _cache[word] = data[loud[0] : loud[-1] + 1] if len(loud) else data
    return _cache[word]


def synthesise(turns: list[dict[str, Any]], *, tail_s: float = 0.5) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """Render turns ``{"speaker", "text", "at": seconds, ...extra}`` into stereo audio [S, 2] (left user, right
    agent) and the dialogue's ``turns`` with exact word times (60 ms between words)."""
    placed = []
    end = 0.0
    for turn in turns:
        t = float(turn["at"])
        words = []
        for w in turn["text"].split():
            pcm = speak(w)
            words.append({"word": w, "start": round(t, 4), "end": round(t + len(pcm) / ESPEAK_RATE, 4), "pcm": pcm})
            t += len(pcm) / ESPEAK_RATE + 0.06
        end = max(end, t)
        placed.append((turn, words))
    audio = np.zeros((int((end + tail_s) * ESPEAK_RATE) + 1, 2), dtype=np.float32)
    out_turns = []
    for turn, words in placed:
        ch = 0 if turn["speaker"] == "user" else 1
        for w in words:
            i = round(w["start"] * ESPEAK_RATE)
            audio[i : i + len(w["pcm"]), ch] += w.pop("pcm")
        entry = {k: v for k, v in turn.items() if k not in ("text", "at")}
        entry["words"] = words
        out_turns.append(entry)
    return audio, out_turns


def write_dialogue(folder: Path, name: str, turns: list[dict[str, Any]], **fields: Any) -> Path:
    """Write ``NAME.json`` + ``NAME.wav`` (stereo, 22050 Hz, 16-bit) into ``folder``; returns the JSON path."""
    import soundfile as sf

    audio, out_turns = synthesise(turns)
    folder.mkdir(parents=True, exist_ok=True)
    sf.write(str(folder / f"{name}.wav"), audio, ESPEAK_RATE, subtype="PCM_16")
    path = folder / f"{name}.json"
    path.write_text(json.dumps({**fields, "turns": out_turns}, indent=1), encoding="utf-8")
    return path


GROUNDED = [
    {"speaker": "user", "text": "when does the silver spoon cafe open tomorrow", "at": 0.2},
    {
        "speaker": "agent",
        "text": "let me check that for you one moment please the cafe opens at seven thirty",
        "at": 2.6,
        "ret": True,
        "reference": "The Silver Spoon Cafe opens at seven thirty AM tomorrow.",
        "tool": "lookup_hours",
        "arguments": {"place": "Silver Spoon Cafe"},
        "body_word": 9,
    },
]
CHAT = [
    {"speaker": "user", "text": "hello there how are you today", "at": 0.3},
    {"speaker": "agent", "text": "i am fine thank you and you", "at": 2.0},
    {"speaker": "user", "text": "very well thanks", "at": 3.9},
]
WEATHER = [
    {"speaker": "user", "text": "is it going to rain in sydney", "at": 0.2},
    {
        "speaker": "agent",
        "text": "good question let me look it up light rain is expected this evening",
        "at": 2.1,
        "ret": True,
        "reference": "Sydney: light rain expected this evening, 14 degrees.",
        "tool": "weather",
        "arguments": {"city": "Sydney"},
    },
]


@pytest.fixture(scope="session")
def espeak_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three good dialogues (two grounded) and two bad ones (a schema error, a missing audio file)."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (.ci/run installs it)")
    folder = tmp_path_factory.mktemp("dialogues")
    write_dialogue(folder, "cafe", GROUNDED, persona="You are Ada, a helpful park ranger.")
    write_dialogue(folder, "chat", CHAT)
    write_dialogue(
        folder,
        "weather",
        WEATHER,
        persona="You are Ada, a weather assistant.",
        voice="tiny0",
        profile={"name": "Priya", "city": "Sydney"},
    )
    bad = write_dialogue(folder, "bad_field", CHAT)
    data = json.loads(bad.read_text())
    data["turns"][0]["ret"] = True  # ret on a user turn
    data["turns"][0]["reference"] = "x"
    bad.write_text(json.dumps(data))
    lonely = write_dialogue(folder, "no_audio", CHAT)
    lonely.with_suffix(".wav").unlink()
    return folder


@pytest.fixture(scope="session")
def chat_dialogue() -> Callable[..., Path]:
    """``chat_dialogue(folder, name, **fields)``: a short spoken chat (:data:`CHAT`) with ``fields`` (``voice``,
    ``persona``...) as ``NAME.json`` + ``NAME.wav`` in ``folder``; returns the JSON path (needs espeak-ng)."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (.ci/run installs it)")

    def write(folder: Path, name: str, **fields: Any) -> Path:
        return write_dialogue(folder, name, CHAT, **fields)

    return write


@pytest.fixture(scope="session")
def prepared_dir(tmp_path_factory: pytest.TempPathFactory, espeak_dir: Path, tiny_dir: Path) -> Path:
    """``cspan prepare`` of :func:`espeak_dir` with the tiny checkpoint (CPU, 2 workers, 2 dialogues per batch)."""
    from cspan.core.cli import main

    out = tmp_path_factory.mktemp("prepared") / "data"
    argv = ["prepare", "--in-dir", str(espeak_dir), "--out-dir", str(out), "--checkpoint", str(tiny_dir)]
    argv += ["--device", "cpu", "--workers", "2", "--batch-size", "2", "--shard-size", "2", "--quiet"]
    assert main(argv) == 0
    return out


@pytest.fixture(scope="session")
def run_cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run ``python -m cspan.core.cli ARGS`` in a subprocess; fails the test with its output on error."""

    def run(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        import os

        cmd = [sys.executable, "-m", "cspan.core.cli", *args]
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        return proc

    return run
