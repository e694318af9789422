"""Debian's headless Chromium as the browser tests launch it (Playwright), with a WAV file as the microphone."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"


def chromium_args(mic: Path) -> list[str]:
    """Flags for a headless Chromium whose microphone plays ``mic`` in a loop (permission granted, autoplay on)."""
    return [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={mic}",
        "--autoplay-policy=no-user-gesture-required",
    ]


def silent_microphone(folder: Path) -> Path:
    """A second of 16-bit silence at 24 kHz, as the microphone of a test that does not speak."""
    out = folder / "mic.wav"
    sf.write(out, np.zeros(24000, dtype=np.float32), 24000, subtype="PCM_16")
    return out


@contextlib.contextmanager
def open_page(mic: Path, origin: str, **context_options: Any) -> Iterator[tuple[Any, list[str]]]:
    """A page of a headless Chromium whose microphone plays ``mic``, the microphone granted to ``origin``
    (``context_options``: Playwright's ``new_context`` options); yields it with the list its console messages
    (``"error: ..."``) and uncaught errors (``"pageerror: ..."``) go to. The browser is closed after."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=chromium_args(mic))
        try:
            context = browser.new_context(**context_options)
            context.grant_permissions(["microphone"], origin=origin)
            page = context.new_page()
            console: list[str] = []
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
            yield page, console
        finally:
            browser.close()


def page_errors(console: list[str]) -> list[str]:
    """The errors among :func:`open_page`'s console lines."""
    return [c for c in console if c.startswith(("pageerror", "error"))]


def fake_microphone(source: Path, out: Path) -> Path:
    """The question with silence around it, as the 16-bit WAV Chromium's fake capture device plays (in a loop):
    the pause after each repetition ends the utterance, so the server sends a final transcript."""
    speech, rate = sf.read(source, dtype="float32")
    silence = np.zeros(rate, dtype=np.float32)
    sf.write(out, np.concatenate([silence, speech, silence, silence, silence]), rate, subtype="PCM_16")
    return out


def wait_until(page: Any, expression: str, timeout_s: float) -> None:
    """Polls a JavaScript expression from here, one `page.evaluate` at a time.

    Not `page.wait_for_function`: its in-page polling re-runs an eval, which the page's CSP
    (script-src 'self') refuses after the first call.
    """
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"not true within {timeout_s} s: {expression}"
        page.wait_for_timeout(100)


def wait_for_conversation(page: Any, span_text: str) -> None:
    """After Start: the page is listening (the server's ready), shows the user's final transcript and the agent's
    words, and lists a Context Span holding ``span_text``."""
    page.wait_for_selector("#status-dot.listening", timeout=120_000)
    page.wait_for_selector("#thread .bubble.user.final", timeout=180_000)
    wait_until(
        page,
        "[...document.querySelectorAll('#thread .bubble.agent .text')].some(e => e.textContent.length > 0)",
        60.0,
    )
    page.wait_for_selector("#spans li.span", timeout=60_000)
    assert span_text in page.inner_text("#spans li.span")
