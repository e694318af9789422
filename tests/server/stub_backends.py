"""A real HTTP backend for ``cspan infer`` tests: an OpenAI-compatible router and a ``/transcribe`` ASR server.

It runs in a thread of the test process (``http.server``), answers every GET (the start-up check that a URL
answers), ``POST .../chat/completions`` with a fixed reply (or an HTTP error) and ``POST /transcribe`` with a fixed
transcript, each after a configurable wall-clock delay: what a slow or loaded backend looks like to the client.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class StubBackend:
    """``with StubBackend(reply="...", delay_s=1.0) as b: b.url`` (``http://127.0.0.1:PORT``).

    Args:
        reply: the router's answer (the chat message content).
        transcript: what ``/transcribe`` returns.
        delay_s: wall-clock seconds before each POST is answered.
        chat_status: HTTP status of chat completions (500: a failing router).
    """

    def __init__(
        self,
        *,
        reply: str = "The weather in London is cloudy with light rain and 14 degrees.",
        transcript: str = "what is the weather in london today",
        delay_s: float = 0.0,
        chat_status: int = 200,
    ) -> None:
        self.reply, self.transcript, self.delay_s, self.chat_status = reply, transcript, delay_s, chat_status
        self.posts: list[str] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._send(200, {"ok": True})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                stub.posts.append(self.path)
                time.sleep(stub.delay_s)
                if self.path.endswith("/transcribe"):
                    self._send(200, {"text": stub.transcript})
                elif stub.chat_status != 200:
                    self._send(stub.chat_status, {"error": {"message": "the stub router is failing on purpose"}})
                else:
                    self._send(200, {"choices": [{"message": {"role": "assistant", "content": stub.reply}}]})

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> StubBackend:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
