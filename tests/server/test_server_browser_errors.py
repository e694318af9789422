"""The page when a conversation cannot start, in Debian's headless Chromium (Playwright) against a real ``cspan
serve`` on the tiny checkpoint: a ``?token=`` that no WebSocket can carry, a start the server refuses (a timezone
it does not know), and a server whose own persona is longer than what a client may send. Each says why at once and
gives Start back; none waits for the server's idle timeout (the page used to sit in "connecting" until then, and
then said "no audio for a while"). And a conversation the server ends (shutting down) says so, a start refused
because the user's one conversation runs elsewhere (``--max-sessions-per-user``) keeps the server's reason (the close
that follows used to replace it with "All conversation slots are busy"), and a server that is gone is named as the
cause (not the microphone)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from chromium import open_page, page_errors, silent_microphone

TOKEN = "browser-token-0123"


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_page_says_why_a_conversation_did_not_start(serve, tmp_path: Path) -> None:

    persona = "You are a patient assistant who answers questions about the library's opening hours."
    server = serve(text_prompt=persona, max_text_prompt_chars=40, token=TOKEN, max_sessions=2, max_sessions_per_user=1)
    with open_page(silent_microphone(tmp_path), server.url) as (page, console):
        # 1. a token with a space: `new WebSocket` throws; the page said nothing and kept Start disabled
        page.goto(server.url + "/?codec=pcm&token=not%20a%20token")
        page.locator("#voice option").nth(1).wait_for(state="attached")
        page.click("#start")
        page.wait_for_selector("#status-dot.error", timeout=10_000)
        assert "check the ?token= in the address" in page.inner_text("#notice")
        assert page.is_enabled("#start") and page.is_disabled("#stop")

        # 2. a start the server refuses (invalid_message): the reason, at once, and Start again
        page.goto(server.url + f"/?codec=pcm&token={TOKEN}")
        page.locator("#voice option").nth(1).wait_for(state="attached")
        # the server's persona is longer than a client may send: the page shows it and leaves it to the server
        assert page.input_value("#text-prompt") == persona
        page.fill("#timezone", "Mars/Olympus")
        page.dispatch_event("#timezone", "change")
        assert page.evaluate("localStorage.getItem('cspan.tz')") is None  # a zone no one knows is not kept
        page.click("#start")
        page.wait_for_selector("#status-dot.error", timeout=10_000)  # the idle timeout is 60 s
        text = page.inner_text("#notice")
        assert "did not start the conversation" in text and "unknown IANA timezone 'Mars/Olympus'" in text, text
        assert page.is_visible("#notice") and page.is_enabled("#start") and page.is_disabled("#stop")
        page.wait_for_timeout(500)
        assert server.hub.free_slots() == 2 and not server.hub.sessions

        # 3. a good timezone: the conversation starts with the server's own persona, too long to be sent back
        page.fill("#timezone", "Europe/London")
        page.dispatch_event("#timezone", "change")
        assert page.evaluate("localStorage.getItem('cspan.tz')") == "Europe/London"
        page.click("#start")
        page.wait_for_selector("#status-dot.listening", timeout=120_000)
        assert page.is_hidden("#notice")
        (session,) = [s for s in server.hub.sessions if s.state == "live"]
        assert session._start.text_prompt == persona
        page.click("#stop")
        page.wait_for_selector("#start:not([disabled])", timeout=60_000)
        assert page.is_hidden("#notice")  # a conversation the user stopped: nothing to say

        # 4. the server shuts down mid-conversation (bye "shutdown", close 1001): the page used to go idle silently
        page.click("#start")
        page.wait_for_selector("#status-dot.listening", timeout=120_000)
        loop = server.hub._task.get_loop()
        asyncio.run_coroutine_threadsafe(server.hub.end_all("shutdown"), loop).result(timeout=30)
        page.wait_for_selector("#start:not([disabled])", timeout=30_000)
        assert page.is_visible("#notice") and "the server is shutting down" in page.inner_text("#notice")
        assert not page_errors(console), console

        # 4b. this user's one conversation runs elsewhere: busy, and the page keeps the server's reason
        from websockets.sync.client import connect

        with connect(f"{server.ws_url}?token={TOKEN}") as other:
            other.send(json.dumps({"type": "start"}))
            while not (isinstance(m := other.recv(timeout=120), str) and json.loads(m)["type"] == "ready"):
                pass
            page.click("#start")
            page.wait_for_selector("#notice:has-text('--max-sessions-per-user')", timeout=30_000)
            page.wait_for_selector("#start:not([disabled])", timeout=30_000)
            page.wait_for_timeout(500)  # the close (1013) that follows the busy message
            text = page.inner_text("#notice")
            assert (
                "this user's conversations reached this server's limit per user (1," in text
                and "slots are busy" not in text
            ), text

        # 4c. a token the server knows but that may not hold conversations (an admin-only token): its reason (the
        # page used to say "open the page as ...?token=", which the user had done)
        page.route_web_socket(
            "**/ws*", lambda ws: ws.close(code=4401, reason="unauthorized: the token lacks the session scope")
        )
        page.click("#start")
        page.wait_for_selector("#notice:has-text('lacks the session scope')", timeout=30_000)
        text = page.inner_text("#notice")
        assert text == "The server refused the token: the token lacks the session scope.", text
        page.wait_for_selector("#start:not([disabled])", timeout=30_000)

        # 5. the server is gone: Start said "Microphone or audio setup failed: ... (Network error)"
        server.stop()
        page.click("#start")
        page.wait_for_selector("#status-dot.error", timeout=30_000)
        text = page.inner_text("#notice")
        assert text.startswith("Cannot reach the server") and "Microphone" not in text, text
        assert page.is_enabled("#start")
