"""A scripted OpenAI-compatible chat server for router tests: FastAPI served by uvicorn in a thread on 127.0.0.1.

Each POST to ``/v1/chat/completions`` records the request (body and headers) and answers with the next scripted
step:

- ``{"tool": name, "arguments": {...} | "raw json"}``: a ``tool_calls`` reply;
- ``{"content": "..."}``: a plain assistant message;
- ``{"status": 500, "body": "..."}``: an HTTP error;
- ``{"raw": "..."}``: a 200 reply whose body is the given text (not JSON);
- ``{"sleep": s, "then": step}``: wait ``s`` seconds, then answer with ``step`` (default an empty message).

With ``reject_tools = True`` a request carrying ``tools`` gets HTTP 400 (what vLLM answers when it has no tool
parser), without consuming a step.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response


class StubLLM:
    """Scripted chat-completions server; ``url`` is its base URL, ``requests`` what it received."""

    def __init__(self) -> None:
        self.script: list[dict[str, Any]] = []
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.reject_tools = False
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self._chat)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self) -> StubLLM:
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("stub LLM server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def reset(self, *script: dict[str, Any]) -> None:
        self.script = list(script)
        self.requests.clear()
        self.headers.clear()
        self.reject_tools = False

    def system_prompts(self) -> list[str]:
        return [r["messages"][0]["content"] for r in self.requests]

    def user_messages(self) -> list[str]:
        return [r["messages"][-1]["content"] for r in self.requests]

    async def _chat(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if self.reject_tools and "tools" in body:
            return JSONResponse(
                {"error": {"message": '"auto" tool choice requires --enable-auto-tool-choice'}}, status_code=400
            )
        step = self.script.pop(0) if self.script else {"content": ""}
        if "sleep" in step:
            # a late reply must not consume a later test's script: it answers with its own "then" step
            await asyncio.sleep(step["sleep"])
            step = step.get("then", {"content": ""})
        if "status" in step:
            return PlainTextResponse(step.get("body", "server error"), status_code=step["status"])
        if "raw" in step:
            return PlainTextResponse(step["raw"], status_code=200)
        message: dict[str, Any] = {"role": "assistant", "content": step.get("content")}
        if "tool" in step:
            arguments = step.get("arguments", {})
            message["content"] = None
            message["tool_calls"] = [
                {
                    "id": f"call_{len(self.requests)}",
                    "type": "function",
                    "function": {
                        "name": step["tool"],
                        "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                    },
                }
            ]
        return JSONResponse(
            {
                "id": f"chatcmpl-{len(self.requests)}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", ""),
                "choices": [
                    {"index": 0, "message": message, "finish_reason": "tool_calls" if "tool" in step else "stop"}
                ],
            }
        )
