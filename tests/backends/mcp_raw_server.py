"""A stdio MCP server written by hand (no SDK), so that a test decides every byte it sends.

Run as ``python tests/backends/mcp_raw_server.py``. Tools (each takes ``n: int``):

- ``big``: answers ``n`` bytes of text in one message, its ``id`` last (as the TypeScript SDK orders the keys);
- ``big_id_first``: the same with ``id`` first (as the Python SDK orders them);
- ``big_no_id``: ``n`` bytes of a notification that answers nothing, then the answer;
- ``junk``: a line that is not JSON-RPC, then the answer;
- ``echo``: answers ``"echo n"``;
- ``noise``: writes to stderr a line with ANSI escapes and control characters, a line of 1 MiB and ``n`` lines
  ``spam <i>``, then answers ``"echo n"`` (a client that does not read stderr as it comes blocks it);
- ``crash``: writes ``dying words`` (no newline) to stderr and exits without answering;
- ``cut_emoji``: answers ``"cut \\ud83d"`` plus ``n`` laptops, as JavaScript's ``JSON.stringify`` writes a string cut
  between the two halves of an emoji (a lone surrogate escape), then the whole pairs escaped too.
"""

from __future__ import annotations

import json
import sys

TOOLS = ["big", "big_id_first", "big_no_id", "junk", "echo", "noise", "crash", "cut_emoji"]
NOISE = b"\x1b[31mred alert\x1b[0m \x1b]0;pwned\x07 bell\x07 nul\x00 end\rFAKE\n"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}}


def send(data: bytes) -> None:
    sys.stdout.buffer.write(data + b"\n")
    sys.stdout.buffer.flush()


def text_result(text: str) -> dict:
    return {"content": [{"type": "text", "text": text}], "isError": False}


def main() -> None:
    for raw in sys.stdin.buffer:
        msg = json.loads(raw)
        method, rid = msg.get("method"), msg.get("id")
        if rid is None:
            continue  # a notification
        if method == "initialize":
            result = {
                "protocolVersion": msg["params"]["protocolVersion"],
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "raw", "version": "1"},
            }
        elif method == "tools/list":
            result = {
                "tools": [{"name": t, "inputSchema": SCHEMA, "annotations": {"readOnlyHint": True}} for t in TOOLS]
            }
        elif method == "tools/call":
            name, n = msg["params"]["name"], int(msg["params"].get("arguments", {}).get("n", 0))
            if name == "big":
                body = json.dumps(text_result("B" * n)).encode()
                send(b'{"result": ' + body + b', "jsonrpc": "2.0", "id": ' + json.dumps(rid).encode() + b"}")
                continue
            if name == "big_id_first":
                body = json.dumps(text_result("B" * n)).encode()
                send(b'{"jsonrpc": "2.0", "id": ' + json.dumps(rid).encode() + b', "result": ' + body + b"}")
                continue
            if name == "cut_emoji":
                text = b'"cut \\ud83d' + b" \\ud83d\\udcbb" * n + b' end"'
                body = b'{"content": [{"type": "text", "text": ' + text + b'}], "isError": false}'
                send(b'{"jsonrpc": "2.0", "id": ' + json.dumps(rid).encode() + b', "result": ' + body + b"}")
                continue
            if name == "big_no_id":
                send(b'{"jsonrpc": "2.0", "method": "notifications/message", "params": {"data": "' + b"N" * n + b'"}}')
            if name == "junk":
                send(b"this is not json-rpc \x00\xff")
            if name == "noise":
                sys.stderr.buffer.write(NOISE + b"L" * (1 << 20) + b"\n")
                sys.stderr.buffer.write(b"".join(b"spam %d\n" % i for i in range(n)))
                sys.stderr.buffer.flush()
            if name == "crash":
                sys.stderr.buffer.write(b"dying words")
                sys.stderr.buffer.flush()
                sys.exit(1)
            result = text_result(f"echo {n}")
        else:
            result = {}
        send(json.dumps({"jsonrpc": "2.0", "id": rid, "result": result}).encode())


if __name__ == "__main__":
    main()
