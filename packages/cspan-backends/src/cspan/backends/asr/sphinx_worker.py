"""A pocketsphinx decoding process (``python -m cspan.backends.asr.sphinx_worker``), driven by
:class:`cspan.backends.asr.sphinx_process.SphinxWorker` over its standard input and output.

Protocol (the module docstring of :mod:`cspan.backends.asr.sphinx_process` has it in full): one JSON line of settings
``{"model_dir": str | null, "options": {...}, "max_streams": n}``, answered by ``{"ready": true}`` once the decoder
is loaded; then requests (an 8-byte header ``<json bytes, sample bytes>``, the JSON, float32 little-endian samples),
each answered by one JSON line: whole clips (``decode``) and utterance streams (``feed``, ``partial``, ``finish``,
``close``), one :class:`~cspan.backends.asr.sphinx.SphinxUtterance` each, at most ``max_streams`` open (one more
closes the least recently used). The process ends at the end of its input. pocketsphinx holds Python's GIL while it
decodes; here that stops nothing else.
"""

from __future__ import annotations

import collections
import json
import struct
import sys
from typing import Any

import numpy as np


def main() -> int:
    from cspan.backends.asr.audio import AudioFormatError
    from cspan.backends.asr.base import Transcript
    from cspan.backends.asr.sphinx import SphinxDecoderPool, SphinxUtterance
    from cspan.backends.errors import TranscriberError

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer

    def answer(reply: dict[str, Any]) -> None:
        stdout.write(json.dumps(reply).encode() + b"\n")
        stdout.flush()

    def transcript(t: Transcript) -> dict[str, Any]:
        return {"text": t.text, "words": [[w.text, w.start_s, w.end_s] for w in t.words or []]}

    settings = json.loads(stdin.readline() or "{}")
    max_streams = max(1, int(settings.get("max_streams") or 1))
    model_dir, options = settings.get("model_dir"), settings.get("options") or None
    pool = SphinxDecoderPool(1, model_dir=model_dir, options=options)  # whole clips
    live = SphinxDecoderPool(max_streams, model_dir=model_dir, options=options)  # a decoder per open stream
    pool.warm()
    answer({"ready": True})
    streams: collections.OrderedDict[int, SphinxUtterance] = collections.OrderedDict()  # least recently used first

    def stream(message: dict[str, Any], *, open_it: bool = False) -> SphinxUtterance:
        key = int(message["id"])
        if key in streams:
            streams.move_to_end(key)
            return streams[key]
        if not open_it:
            raise TranscriberError(
                f"utterance stream {key} is not open (closed to make room: more than {max_streams} at once)",
                endpoint="pocketsphinx",
            )
        while len(streams) >= max_streams:
            streams.popitem(last=False)[1].close()
        streams[key] = SphinxUtterance(live, int(message["rate"]), clip_pool=pool)
        return streams[key]

    while header := stdin.read(8):
        if len(header) < 8:
            return 1
        head_n, data_n = struct.unpack("<II", header)
        head, data = stdin.read(head_n), stdin.read(data_n)
        if len(head) < head_n or len(data) < data_n:
            return 1
        pcm = np.frombuffer(data, dtype="<f4").astype(np.float32)
        try:
            message = json.loads(head)
            op = message.get("op")
            if op == "decode":
                answer(transcript(pool.decode(pcm, int(message["rate"]))))
            elif op == "feed":
                stream(message, open_it=True).feed(pcm)
                answer({"ok": True})
            elif op == "partial":
                answer(transcript(stream(message).partial()))
            elif op == "finish":
                utterance = stream(message)
                del streams[int(message["id"])]
                try:
                    answer(transcript(utterance.finish()))
                finally:
                    utterance.close()  # the live pass's closing passes, after the answer
            elif op == "close":
                utterance = streams.pop(int(message["id"]), None)
                if utterance is not None:
                    utterance.close()
                answer({"ok": True})
            else:
                answer({"error": f"unknown request {op!r}"})
        except (AudioFormatError, TranscriberError, KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, TranscriberError | AudioFormatError):
                answer({"error": str(exc)})
            else:
                answer({"error": f"malformed request: {type(exc).__name__}: {exc}"})
            for key in [key for key, utterance in streams.items() if utterance.closed]:
                del streams[key]  # failed: its decoder went back already
    return 0


if __name__ == "__main__":
    sys.exit(main())
