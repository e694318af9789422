"""Wire cost of ``cspan serve``'s protocols: bytes per second per session, and the CPU cost of Ogg/Opus per frame.

A benchmark, not a test: it starts a real ``cspan serve`` (uvicorn on 127.0.0.1, the given or a tiny checkpoint on
the CPU, no backends), then for each protocol opens one session, streams a recording at real-time pace, and counts
the WebSocket payload bytes each way (client side) against the seconds of audio they carried and the wall clock:

- ``ws-pcm``: ``/ws`` with float32 PCM frames both ways (the fallback);
- ``ws-opus``: ``/ws`` with Ogg/Opus both ways (``start.codecs = ["opus"]``; sphn on the client side, as the page's
  WebCodecs would send it);
- ``moshi``: ``/api/chat`` (0x01 Ogg/Opus both ways, 0x02 text, 0x04 metadata), as ``moshi.client`` speaks it;
- ``realtime-pcm16`` / ``realtime-g711``: ``/v1/realtime`` (the OpenAI Realtime API: base64 audio in JSON events,
  pcm16 at 24 kHz or G.711 u-law at 8 kHz; the agent's audio is sent only inside responses, its silence is not).

Then it times Ogg/Opus encode + decode of one 80 ms frame with sphn (what the server does per session per frame:
encode the agent's frame, decode the user's), in CPU time (``time.process_time``) over many frames of speech.

Usage::

    python scripts/bench_wire.py [--checkpoint DIR] [--seconds 10] [--out wire.json]

Prints a Markdown table and writes the JSON. Timings on a shared machine are noisy; bytes per second of audio are not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
FRAME = 1920
RATE = 24000


def speech(seconds: float) -> list[np.ndarray]:
    """The fixture question, repeated with pauses, as frames of 1920 samples (a synthetic tone when absent)."""
    from cspan.core.audio import iter_frames

    path = REPO.parent / "shared" / "fixtures" / "audio" / "question_weather_24k.wav"
    if path.is_file():
        one = list(iter_frames(path)) + [np.zeros(FRAME, np.float32)] * 12
    else:
        t = np.arange(RATE * 3) / RATE
        x = (0.2 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 3 * t))).astype(np.float32)
        one = [x[k : k + FRAME] for k in range(0, len(x) - FRAME + 1, FRAME)]
    n = int(seconds * RATE / FRAME)
    return [one[k % len(one)] for k in range(n)]


class Server:
    """``cspan serve`` on a free port of 127.0.0.1 in a background thread."""

    def __init__(self, checkpoint: Path, max_sessions: int) -> None:
        import torch

        from cspan.core.checkpoint import load_checkpoint
        from cspan.server.serve import ServeSettings, create_app, make_server, uvicorn_config

        self.settings = ServeSettings(
            asr="none", router="none", max_sessions=max_sessions, max_queued_frames=250, text_prompt="You help."
        )
        ckpt = load_checkpoint(checkpoint, device=torch.device("cpu"), dtype=torch.float32)
        self.app = create_app(self.settings, checkpoint=ckpt)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = make_server(uvicorn_config(self.app, self.settings, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


class Tally:
    def __init__(self) -> None:
        self.sent = 0
        self.received = 0
        self.audio_sent_s = 0.0
        self.audio_received_s = 0.0
        self.t0 = 0.0
        self.t1 = 0.0

    def result(self, name: str) -> dict[str, Any]:
        wall = self.t1 - self.t0
        return {
            "protocol": name,
            "wall_s": round(wall, 2),
            "audio_sent_s": round(self.audio_sent_s, 2),
            "audio_received_s": round(self.audio_received_s, 2),
            "bytes_sent": self.sent,
            "bytes_received": self.received,
            "sent_bytes_per_audio_s": round(self.sent / self.audio_sent_s) if self.audio_sent_s else None,
            "received_bytes_per_audio_s": round(self.received / self.audio_received_s)
            if self.audio_received_s
            else None,
            "received_bytes_per_wall_s": round(self.received / wall) if wall else None,
        }


async def paced(frames: list[np.ndarray], send: Any) -> None:
    t0 = time.monotonic()
    for k, frame in enumerate(frames):
        await send(frame)
        delay = t0 + (k + 1) * 0.08 - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


async def run_ws(port: int, frames: list[np.ndarray], codec: str) -> dict[str, Any]:
    import sphn
    import websockets

    tally = Tally()
    writer, reader = sphn.OpusStreamWriter(RATE), sphn.OpusStreamReader(RATE)
    async with websockets.connect(f"ws://127.0.0.1:{port}/ws", max_size=None) as ws:
        start = {"type": "start", "codecs": [codec]}
        await ws.send(json.dumps(start))
        tally.sent += len(json.dumps(start))
        while True:
            msg = await ws.recv()
            tally.received += len(msg)
            if isinstance(msg, str) and json.loads(msg)["type"] == "ready":
                break
        tally.t0 = time.monotonic()

        async def send(frame: np.ndarray) -> None:
            data = writer.append_pcm(frame) if codec == "opus" else frame.astype("<f4").tobytes()
            await ws.send(data)
            tally.sent += len(data)
            tally.audio_sent_s += FRAME / RATE

        async def receive() -> None:
            async for msg in ws:
                tally.received += len(msg) if isinstance(msg, bytes) else len(msg.encode())
                if isinstance(msg, bytes):
                    n = reader.append_bytes(msg).size if codec == "opus" else len(msg) // 4
                    tally.audio_received_s += n / RATE
                elif json.loads(msg)["type"] == "bye":
                    return

        receiver = asyncio.ensure_future(receive())
        await paced(frames, send)
        await ws.send(json.dumps({"type": "stop"}))
        await receiver
        tally.t1 = time.monotonic()
    return tally.result(f"ws-{codec}")


async def run_moshi(port: int, frames: list[np.ndarray]) -> dict[str, Any]:
    import sphn
    import websockets

    tally = Tally()
    writer, reader = sphn.OpusStreamWriter(RATE), sphn.OpusStreamReader(RATE)
    async with websockets.connect(f"ws://127.0.0.1:{port}/api/chat", max_size=None) as ws:
        while True:
            msg = await ws.recv()
            tally.received += len(msg)
            if msg[:1] == b"\x00":
                break
        tally.t0 = time.monotonic()

        async def send(frame: np.ndarray) -> None:
            data = b"\x01" + writer.append_pcm(frame)
            await ws.send(data)
            tally.sent += len(data)
            tally.audio_sent_s += FRAME / RATE

        async def receive() -> None:
            async for msg in ws:
                tally.received += len(msg)
                if msg[:1] == b"\x01":
                    tally.audio_received_s += reader.append_bytes(msg[1:]).size / RATE

        receiver = asyncio.ensure_future(receive())
        await paced(frames, send)
        await asyncio.sleep(1.0)  # the agent frames of the last queued audio
        receiver.cancel()
        tally.t1 = time.monotonic()
    return tally.result("moshi")


async def run_realtime(port: int, frames: list[np.ndarray], fmt: str) -> dict[str, Any]:
    import base64

    import websockets

    from cspan.server.realtime_audio import FORMAT_RATES, OutputAudio

    tally = Tally()
    encoder, rate = OutputAudio(fmt), FORMAT_RATES[fmt]  # type: ignore[arg-type]
    width = 2 if fmt == "pcm16" else 1
    async with websockets.connect(f"ws://127.0.0.1:{port}/v1/realtime?model=cspan", max_size=None) as ws:
        update = json.dumps(
            {"type": "session.update", "session": {"input_audio_format": fmt, "output_audio_format": fmt}}
        )
        await ws.send(update)
        tally.sent += len(update)
        while True:
            msg = await ws.recv()
            tally.received += len(msg)
            if json.loads(msg)["type"] == "session.updated":
                break
        tally.t0 = time.monotonic()

        async def send(frame: np.ndarray) -> None:
            event = json.dumps(
                {"type": "input_audio_buffer.append", "audio": base64.b64encode(encoder.encode(frame)).decode()}
            )
            await ws.send(event)
            tally.sent += len(event)
            tally.audio_sent_s += FRAME / RATE

        async def receive() -> None:
            async for msg in ws:
                tally.received += len(msg.encode()) if isinstance(msg, str) else len(msg)
                event = json.loads(msg)
                if event["type"] in ("response.output_audio.delta", "response.audio.delta"):
                    tally.audio_received_s += len(base64.b64decode(event["delta"])) / width / rate

        receiver = asyncio.ensure_future(receive())
        await paced(frames, send)
        await asyncio.sleep(1.0)  # the agent frames of the last queued audio
        receiver.cancel()
        tally.t1 = time.monotonic()
    return tally.result("realtime-" + ("pcm16" if fmt == "pcm16" else "g711"))


def opus_cpu(frames: list[np.ndarray], repeat: int = 3) -> dict[str, Any]:
    """CPU time of sphn Ogg/Opus encode + decode per 80 ms frame (best of ``repeat`` passes)."""
    import sphn

    best_enc = best_dec = float("inf")
    for _ in range(repeat):
        writer, reader = sphn.OpusStreamWriter(RATE), sphn.OpusStreamReader(RATE)
        t0 = time.process_time()
        pages = [writer.append_pcm(f) for f in frames]
        t1 = time.process_time()
        for p in pages:
            reader.append_bytes(p)
        t2 = time.process_time()
        best_enc = min(best_enc, (t1 - t0) / len(frames))
        best_dec = min(best_dec, (t2 - t1) / len(frames))
    total = best_enc + best_dec
    return {
        "frames": len(frames),
        "encode_ms_per_frame": round(best_enc * 1000, 3),
        "decode_ms_per_frame": round(best_dec * 1000, 3),
        "encode_decode_ms_per_frame": round(total * 1000, 3),
        "share_of_80ms_frame": round(total / 0.08, 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=None, help="checkpoint folder (default: a tiny one)")
    parser.add_argument("--seconds", type=float, default=10.0, help="audio streamed per protocol")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()

    frames = speech(args.seconds)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint
        if checkpoint is None:
            checkpoint = Path(tmp) / "tiny"
            cmd = [sys.executable, "-m", "cspan.core.cli", "model", "tiny", str(checkpoint), "--seed", "0"]
            subprocess.run(cmd, check=True, capture_output=True)
        with Server(checkpoint, max_sessions=1) as server:
            sessions = []
            for name in ("ws-pcm", "ws-opus", "moshi", "realtime-pcm16", "realtime-g711"):
                if name == "moshi":
                    sessions.append(asyncio.run(run_moshi(server.port, frames)))
                elif name.startswith("realtime"):
                    fmt = "pcm16" if name.endswith("pcm16") else "g711_ulaw"
                    sessions.append(asyncio.run(run_realtime(server.port, frames, fmt)))
                else:
                    sessions.append(asyncio.run(run_ws(server.port, frames, name.split("-")[1])))
            import httpx

            metrics = httpx.get(f"http://127.0.0.1:{server.port}/metrics").text
    cpu = opus_cpu(speech(60.0))
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": " ".join(filter(None, [platform.machine(), _cpu_name()])) + f", {_cores()} cores",
        "python": platform.python_version(),
        "seconds_streamed": args.seconds,
        "sessions": sessions,
        "opus_cpu": cpu,
        "server_wire_bytes": [line for line in metrics.splitlines() if line.startswith("cspan_wire_bytes_total")],
    }
    print("| protocol | sent B/s of audio | received B/s of audio | received B/s wall clock |")
    print("|---|---:|---:|---:|")
    for s in sessions:
        print(
            f"| {s['protocol']} | {s['sent_bytes_per_audio_s']} | {s['received_bytes_per_audio_s']} | "
            f"{s['received_bytes_per_wall_s']} |"
        )
    print(
        f"\nOgg/Opus per 80 ms frame (sphn, CPU time): encode {cpu['encode_ms_per_frame']} ms + decode "
        f"{cpu['decode_ms_per_frame']} ms = {cpu['encode_decode_ms_per_frame']} ms "
        f"({100 * cpu['share_of_80ms_frame']:.2f} % of a frame)"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


if __name__ == "__main__":
    sys.exit(main())
