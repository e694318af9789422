"""A minimal OpenAI-compatible chat server for launcher tests: GET /v1/models, POST /v1/chat/completions.

Run as ``python fake_openai_router.py --port N``; answers every chat request with one direct answer.
"""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def _json(self, payload: dict, status: int = 200) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path.partition("?")[0].rstrip("/") == "/v1/models":  # a query (?api-version=...) is ignored
            self._json({"object": "list", "data": [{"id": "fake-router", "object": "model"}]})
        else:
            self._json({"error": "not found"}, 404)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        self.rfile.read(length)
        content = json.dumps({"answer": "The Riverside Library opens at ten on Sunday."})
        self._json(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "model": "fake-router",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
                ],
            }
        )

    def log_message(self, *args: object) -> None:
        pass


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
