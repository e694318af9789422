"""The page in a real browser: Debian's headless Chromium driven by Playwright, with a fake microphone playing a
WAV file, against a real ``cspan serve`` (tiny checkpoint, embedded transcriber). The page negotiates Ogg/Opus
(WebCodecs AudioEncoder/AudioDecoder, ``static/ogg-opus.js``).

Artifacts: ``test-artifacts/serve-page.png`` (a screenshot of the page mid-conversation; ``test-artifacts/`` at
the repository root is git-ignored) and the two downloads, saved next to it.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlencode

import numpy as np
import pytest
import soundfile as sf
from chromium import fake_microphone, open_page, page_errors, silent_microphone, wait_for_conversation

SPAN_TEXT = "The Riverside Library opens at ten on Sunday."


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_page_talks_in_headless_chromium(serve, fixture_file, repo_root: Path, tmp_path: Path) -> None:

    # the default 2 s queue bound: Stop plays at most that much queued audio through before the bye
    server = serve(asr="sphinx", router="none", max_sessions=1, max_queued_frames=25)
    mic = fake_microphone(fixture_file("audio", "question_weather_24k.wav"), tmp_path / "mic.wav")
    artifacts = repo_root / "test-artifacts"
    artifacts.mkdir(exist_ok=True)
    with open_page(mic, server.url, accept_downloads=True) as (page, console):
        hooks = json.dumps({"spans": [{"at": 2.0, "text": SPAN_TEXT}]})
        page.goto(server.url + "/?" + urlencode({"test": hooks}))
        assert page.evaluate("window.isSecureContext") is True
        assert page.is_hidden("#notice-insecure")
        # a locator, not wait_for_function: the page's CSP (script-src 'self') blocks the eval that its polling needs
        page.locator("#voice option").nth(1).wait_for(state="attached")
        assert page.input_value("#voice") == "tiny0"
        assert page.input_value("#timezone")  # prefilled from the browser
        page.fill("#name", "Ada")
        page.fill("#location", "London")

        page.click("#start")
        wait_for_conversation(page, SPAN_TEXT)  # ready, the user's transcript, the agent's words, the span
        assert page.inner_text("#spans li.span .tool") == "given"
        assert SPAN_TEXT in page.inner_text("#thread .bubble.span")
        user_text = page.inner_text("#thread .bubble.user.final .text")
        assert user_text.strip(), console
        page.screenshot(path=str(artifacts / "serve-page.png"), full_page=True)
        transport_text = page.inner_text("#transport")

        # the "behind real time" banner (audio_overflow) is about the live session: Stop clears it
        page.evaluate(
            "() => { const n = document.getElementById('notice'); n.textContent = 'behind';"
            " n.className = 'notice warn behind'; n.hidden = false; }"
        )
        page.click("#stop")
        page.wait_for_selector("#downloads:not([hidden])", timeout=60_000)
        assert page.is_hidden("#notice")
        with page.expect_download() as wav_download:
            page.click("#download-wav")
        with page.expect_download() as json_download:
            page.click("#download-json")
        wav_path = artifacts / "serve-page.wav"
        json_path = artifacts / "serve-page.json"
        wav_download.value.save_as(wav_path)
        json_download.value.save_as(json_path)
        assert wav_download.value.suggested_filename.startswith("contextspanning-")
        assert json_download.value.suggested_filename.endswith(".json")
        assert not page_errors(console), console

    info = sf.info(wav_path)
    assert (info.channels, info.samplerate, info.subtype) == (2, 24000, "PCM_16")
    audio, _ = sf.read(wav_path, dtype="float32")
    assert len(audio) % 1920 == 0 and len(audio) >= 20 * 1920
    assert np.abs(audio[:, 0]).max() > 0.05  # the microphone (the question) on the left
    assert np.isfinite(audio).all()

    record = json.loads(json_path.read_text())
    assert record["sample_rate"] == 24000
    assert record["seconds"] == pytest.approx(len(audio) / 24000)
    kinds = [e["type"] for e in record["events"]]
    assert kinds[0] == "ready" and kinds[-1] == "bye"
    assert "user_text" in kinds and "text" in kinds and "span" in kinds
    assert record["profile"]["name"] == "Ada" and record["profile"]["location"] == "London"
    assert any(t["speaker"] == "user" and t["text"] for t in record["turns"])
    assert any(t["speaker"] == "agent" and t["text"] for t in record["turns"])
    stats = record["stats"]
    assert stats["user_frames"] > 0 and stats["frames"] > 0
    assert stats["user_frames"] == stats["consumed_frames"] + stats["dropped_frames"]
    assert record["agent_text"]

    # Opus was negotiated (WebCodecs both ways) and the audio cost a few kB/s, not PCM's 96 kB/s each way
    ready = next(e for e in record["events"] if e["type"] == "ready")
    assert ready["codec"] == "opus" and ready["audio_formats"] == ["ogg-opus"]
    t = record["transport"]
    assert t["codec"] == "opus"  # the last page or two may still be in the decoder when the socket closes:
    assert stats["frames"] * 0.08 - 0.25 <= t["audio_seconds_received"] <= stats["frames"] * 0.08
    # bytes per second of audio carried (not of wall clock: this machine may run slower than real time)
    assert 1_000 < t["received_bytes_per_audio_s"] < 12_000, t  # the agent: about 4 kB/s of Ogg/Opus
    assert 1_000 < t["sent_bytes_per_audio_s"] < 12_000, t  # the microphone, encoded by the browser
    assert not [e for e in record["page_events"] if e["type"] == "codec_error"]
    assert transport_text.startswith("opus ")


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_page_counts_the_persona_in_code_points_as_the_server_does(serve, tmp_path: Path) -> None:
    """The server limits ``text_prompt`` to ``--max-text-prompt-chars`` code points (Python's ``len``); the page
    counted and cut UTF-16 code units (``String.length``, the textarea's ``maxlength``), so an emoji counted two and a
    persona the server accepts could not be typed. The page now counts, and cuts what is typed or pasted past the
    limit, in code points; a persona of the server's own that is over the limit may shrink, not grow."""

    server = serve(max_text_prompt_chars=10)
    with open_page(silent_microphone(tmp_path), server.url) as (page, console):
        page.goto(server.url + "/?codec=pcm")
        page.locator("#voice option").nth(1).wait_for(state="attached")
        prompt = page.locator("#text-prompt")

        prompt.fill("")
        prompt.press_sequentially("😀" * 6 + "abcdefgh")  # typed: stops at 10 characters
        assert page.input_value("#text-prompt") == "😀" * 6 + "abcd"
        assert page.inner_text("#prompt-count") == "(10/10)"
        prompt.fill("𠀀" * 12)  # pasted (CJK Extension B, outside the BMP): what fits is kept
        assert page.input_value("#text-prompt") == "𠀀" * 10
        assert page.inner_text("#prompt-count") == "(10/10)"
        prompt.press("Home")
        prompt.press_sequentially("x")  # nothing more fits, wherever the caret is
        assert page.input_value("#text-prompt") == "𠀀" * 10
        prompt.fill("😀😀 hi")
        assert page.inner_text("#prompt-count") == "(5/10)"
        prompt.fill("😀" * 10)

        page.click("#start")  # the server takes what the page allowed
        page.wait_for_selector("#status-dot.listening", timeout=120_000)
        (session,) = [s for s in server.hub.sessions if s.state == "live"]
        assert session._start.text_prompt == "😀" * 10
        page.click("#stop")
        page.wait_for_selector("#start:not([disabled])", timeout=60_000)
        assert not page_errors(console), console
