""" "Use my voice" on the page, in Debian's headless Chromium (Playwright) with a fake microphone playing
``greeting_24k.wav``, against a real ``cspan serve`` on the tiny checkpoint: 12 s recorded from the microphone, a
2-30 s file uploaded (the voice the server reads is the one ``--voice greeting_24k.wav`` gives), a file the browser
cannot read (sent as it is, refused by the server: the conversation starts with the voice chosen before), and a
file too short (refused in the page)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import torch
from chromium import open_page, page_errors, silent_microphone


def _live_session(server: Any) -> Any:
    (session,) = [s for s in server.hub.sessions if s.state in ("live", "stopping")]
    return session


def _talk_and_stop(page: Any) -> None:
    page.wait_for_selector("#status-dot.listening", timeout=120_000)
    page.wait_for_timeout(1000)  # a second of conversation
    page.click("#stop")
    page.wait_for_selector("#start:not([disabled])", timeout=60_000)


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_page_clones_the_users_voice(serve, tiny_checkpoint, fixture_file, tmp_path: Path) -> None:

    server = serve(asr="none", router="none", max_sessions=1)
    greeting = fixture_file("audio", "greeting_24k.wav")
    speech, rate = sf.read(greeting, dtype="float32")
    mic = tmp_path / "mic.wav"  # the fake microphone loops it
    sf.write(mic, np.concatenate([speech, np.zeros(rate // 2, dtype=np.float32)]), rate, subtype="PCM_16")
    short = tmp_path / "short.wav"
    sf.write(short, speech[:rate], rate, subtype="PCM_16")
    unreadable = tmp_path / "voice.wav"
    unreadable.write_bytes(b"RIFF this is not a wave file at all" * 20)
    with open_page(mic, server.url) as (page, console):
        page.goto(server.url + "/?codec=pcm")
        # a locator, not wait_for_function: the page's CSP (script-src 'self') blocks the eval that its polling needs
        page.locator("#voice option").nth(1).wait_for(state="attached")
        assert page.input_value("#voice") == "tiny0"
        assert page.get_attribute("label[for=voice-file]", "title") == "A recording of 2 to 30 s of your speech"

        # 1. 12 s from the microphone
        page.click("#record-voice")
        page.locator("#voice-status", has_text="Your voice is ready").wait_for(timeout=60_000)
        assert "My voice (recorded, 12.0 s)" in page.inner_text("#voice")
        page.click("#start")
        page.wait_for_selector("#status-dot.listening", timeout=120_000)
        session = _live_session(server)
        assert session.recorded_voice.name.startswith("recording-")
        assert session.recorded_voice.prompt.codes.shape == (8, 150)  # 12 s at 12.5 frames per second
        assert session._start.voice is session.recorded_voice
        assert "The server took your voice (12.0 s, 150 frames)" in page.inner_text("#voice-status")
        _talk_and_stop(page)

        # 2. a file: the browser decodes it, the server reads the very samples `--voice greeting.wav` reads
        page.set_input_files("#voice-file", str(short))
        page.locator("#voice-status.bad").wait_for()
        assert "is 1.0 s long; a voice needs 2 to 30 s" in page.inner_text("#voice-status")
        with page.expect_file_chooser() as chooser:  # the upload button works from the keyboard too
            page.focus("label[for=voice-file]")
            page.keyboard.press("Enter")
        chooser.value.set_files(str(greeting))
        page.locator("#voice-status", has_text="Your voice is ready").wait_for()
        page.click("#start")
        page.wait_for_selector("#status-dot.listening", timeout=120_000)
        session = _live_session(server)
        expected = tiny_checkpoint.load_voice_prompt(greeting).codes
        assert torch.equal(session.recorded_voice.prompt.codes, expected)
        assert session.conversation is not None and session._start.voice.name == session.recorded_voice.name
        page.click("#record-voice")  # not during a conversation: its persona is read already
        assert "record it after Stop" in page.inner_text("#voice-status.bad")
        _talk_and_stop(page)

        # 3. a file the browser cannot read: sent as it is, refused by the server, the voice before is used
        page.set_input_files("#voice-file", str(unreadable))
        page.locator("#voice-status", has_text="sent as it is").wait_for()
        page.click("#start")
        page.wait_for_selector("#status-dot.listening", timeout=120_000)
        session = _live_session(server)
        assert session.recorded_voice is None and session._start.voice.name == "tiny0"
        assert page.is_visible("#notice")  # not hidden by ready: the conversation runs without the recording
        assert "Your recording was not used" in page.inner_text("#notice")
        assert "cannot decode audio" in page.inner_text("#voice-status")
        # the refused recording is out of the list, the voice before selected (it was sent again at every Start)
        assert page.input_value("#voice") == "tiny0" and "My voice" not in page.inner_text("#voice")
        _talk_and_stop(page)

        # 4. "(no voice prompt)" chosen before: a refused recording falls back to it, not to the default voice
        page.select_option("#voice", "")
        page.set_input_files("#voice-file", str(unreadable))
        page.locator("#voice-status", has_text="sent as it is").wait_for()
        page.click("#start")
        page.wait_for_selector("#status-dot.listening", timeout=120_000)
        session = _live_session(server)
        assert session.recorded_voice is None and session._start.voice is None
        assert "the conversation starts with no voice prompt" in page.inner_text("#notice")
        _talk_and_stop(page)
        assert not page_errors(console), console


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_page_sends_a_voice_within_a_small_message_limit(serve, tiny_checkpoint, fixture_file, tmp_path: Path) -> None:
    """With ``--max-message-kib 16`` the page sent the recording in 64 KiB pieces: each was refused (``too_large``),
    the upload never completed and the page sat in "Sending your voice…" until the idle timeout. It now cuts the
    recording to ``/info``'s ``max_message_bytes``."""
    import httpx

    server = serve(asr="none", router="none", max_sessions=1, max_message_kib=16)
    assert httpx.get(server.url + "/info").json()["max_message_bytes"] == 16 * 1024
    greeting = fixture_file("audio", "greeting_24k.wav")  # 3.6 s: a 175 kB WAV at 24 kHz, 11 pieces
    with open_page(silent_microphone(tmp_path), server.url) as (page, console):
        page.goto(server.url + "/?codec=pcm")
        page.locator("#voice option").nth(1).wait_for(state="attached")
        page.set_input_files("#voice-file", str(greeting))
        page.locator("#voice-status", has_text="Your voice is ready").wait_for()
        page.click("#start")
        page.wait_for_selector("#status-dot.listening", timeout=30_000)  # the idle timeout is 60 s
        session = _live_session(server)
        assert torch.equal(session.recorded_voice.prompt.codes, tiny_checkpoint.load_voice_prompt(greeting).codes)
        assert "The server took your voice" in page.inner_text("#voice-status")
        assert page.is_hidden("#notice"), page.inner_text("#notice")
        _talk_and_stop(page)
        assert not page_errors(console), console
