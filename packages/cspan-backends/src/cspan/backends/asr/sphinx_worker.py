"""A pocketsphinx decoding process (``python -m cspan.backends.asr.sphinx_worker``), driven by
:class:`cspan.backends.asr.sphinx.SphinxWorker` over its standard input and output.

Protocol: one JSON line ``{"model_dir": str | null, "options": {...}}``, answered by ``{"ready": true}`` once the
decoder is loaded; then per clip an 8-byte header (samples, sample rate: uint32 little endian) and the float32 little
endian samples, answered by one JSON line ``{"text": ..., "words": [[word, start_s, end_s], ...]}`` or
``{"error": ...}``. The process ends at the end of its input. pocketsphinx holds Python's GIL while it decodes; here
that stops nothing else.
"""

from __future__ import annotations

import json
import struct
import sys

import numpy as np


def main() -> int:
    from cspan.backends.asr.audio import AudioFormatError
    from cspan.backends.asr.sphinx import SphinxDecoderPool
    from cspan.backends.errors import TranscriberError

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer

    def answer(reply: dict) -> None:
        stdout.write(json.dumps(reply).encode() + b"\n")
        stdout.flush()

    settings = json.loads(stdin.readline() or "{}")
    pool = SphinxDecoderPool(1, model_dir=settings.get("model_dir"), options=settings.get("options") or None)
    pool.warm()
    answer({"ready": True})
    while header := stdin.read(8):
        if len(header) < 8:
            return 1
        samples, sample_rate = struct.unpack("<II", header)
        data = stdin.read(4 * samples)
        if len(data) < 4 * samples:
            return 1
        pcm = np.frombuffer(data, dtype="<f4").astype(np.float32)
        try:
            t = pool.decode(pcm, sample_rate)
        except (AudioFormatError, TranscriberError) as exc:
            answer({"error": str(exc)})
            continue
        answer({"text": t.text, "words": [[w.text, w.start_s, w.end_s] for w in t.words]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
