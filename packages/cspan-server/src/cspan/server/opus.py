"""Ogg/Opus audio on the wire, through Kyutai's ``sphn`` (the library upstream Moshi uses for the same job).

One :class:`OggOpusDecoder` and one :class:`OggOpusEncoder` per connection and direction: each is a stream (an Ogg
logical stream whose first pages carry the ``OpusHead`` and ``OpusTags`` headers), 24 kHz mono. The encoder turns
every 80 ms agent frame into the Ogg page that completes it (about 330 bytes at sphn's default bitrate, against 7680
bytes of float32 PCM). The decoder takes Ogg bytes in any chunking (a page per message, several pages, part of one):
it cuts them into pages, checks each page's CRC (RFC 3533; sphn decodes a damaged page as noise rather than
refusing it) and hands the good pages to sphn. So:

- a lost page is skipped (its samples are missing; Opus streams do not need every page);
- a corrupt page (CRC mismatch) is dropped and reported;
- bytes that are not Ogg (another codec, garbage) are dropped up to the next ``OggS`` and reported;
- a page sphn cannot decode is reported and sphn starts over (it decodes a stream joined mid-way).

Reports come back with the samples that did decode, so the caller can queue those and then say what was wrong
(:class:`~cspan.server.session.ClientError` ``bad_audio``); the session goes on.
"""

from __future__ import annotations

import numpy as np

from cspan.core.constants import FRAME_SIZE, SAMPLE_RATE

OGG_CAPTURE = b"OggS"
"""The first four bytes of every Ogg page."""
_HEADER = 27
"""Bytes of an Ogg page header before its segment table."""


def _crc_table() -> list[int]:
    table = []
    for i in range(256):
        r = i << 24
        for _ in range(8):
            r = ((r << 1) ^ 0x04C11DB7) if r & 0x80000000 else (r << 1)
        table.append(r & 0xFFFFFFFF)
    return table


_CRC = _crc_table()


def ogg_crc(page: bytes | bytearray) -> int:
    """The Ogg page checksum (CRC-32, polynomial 0x04C11DB7, not reflected, initial 0; RFC 3533 section 6) of
    ``page`` with its checksum field (bytes 22..25) taken as zero."""
    crc = 0
    table = _CRC
    for i, b in enumerate(page):
        if 22 <= i < 26:
            b = 0
        crc = ((crc << 8) & 0xFFFFFFFF) ^ table[((crc >> 24) ^ b) & 0xFF]
    return crc


class OggOpusDecoder:
    """Ogg/Opus bytes from a client -> float32 PCM at 24 kHz (any number of samples per call)."""

    def __init__(self) -> None:
        import sphn

        self._sphn = sphn
        self._reader = sphn.OpusStreamReader(SAMPLE_RATE)
        self._buf = bytearray()

    def decode(self, data: bytes) -> tuple[np.ndarray, str | None]:
        """``(samples, problem)``: the samples of the complete good pages so far (often 0 for a header page, 1920
        for a page of 80 ms), and what was wrong with the rest (None when nothing was)."""
        self._buf += data
        out: list[np.ndarray] = []
        problems: list[str] = []
        buf = self._buf
        while buf:
            if buf[:4] != OGG_CAPTURE[: len(buf[:4])]:
                skip = buf.find(OGG_CAPTURE, 1)
                skipped = len(buf) if skip < 0 else skip
                problems.append(f"{skipped} bytes that are not an Ogg page were dropped")
                del buf[:skipped]
                continue
            if len(buf) < _HEADER or len(buf) < _HEADER + buf[26]:
                break
            size = _HEADER + buf[26] + sum(buf[_HEADER : _HEADER + buf[26]])
            if len(buf) < size:
                break
            page = bytes(buf[:size])
            del buf[:size]
            if ogg_crc(page) != int.from_bytes(page[22:26], "little"):
                problems.append(f"a corrupt Ogg page (checksum mismatch, page {int.from_bytes(page[18:22], 'little')})")
                continue
            try:
                out.append(np.asarray(self._reader.append_bytes(page), dtype=np.float32).reshape(-1))
            except Exception as exc:  # sphn raises ValueError; its state is unusable afterwards
                self._reader = self._sphn.OpusStreamReader(SAMPLE_RATE)
                problems.append(f"an Ogg page that is not Opus audio ({exc})")
        pcm = np.concatenate(out) if out else np.zeros(0, dtype=np.float32)
        problem = None
        if problems:
            problem = "audio is not a valid Ogg/Opus stream: " + "; ".join(problems)
        return pcm, problem


class OggOpusEncoder:
    """80 ms agent frames -> Ogg/Opus bytes at 24 kHz (the first call's bytes begin with the stream headers)."""

    def __init__(self) -> None:
        import sphn

        self._writer = sphn.OpusStreamWriter(SAMPLE_RATE)

    def encode(self, pcm: np.ndarray) -> bytes:
        """The Ogg bytes for one frame (float32 ``[1920]``); may be empty while the encoder buffers."""
        frame = np.ascontiguousarray(pcm, dtype=np.float32).reshape(-1)
        if frame.shape != (FRAME_SIZE,):
            raise ValueError(f"OggOpusEncoder.encode: expected {FRAME_SIZE} samples, got {frame.shape}")
        return bytes(self._writer.append_pcm(frame))


__all__ = ["OGG_CAPTURE", "OggOpusDecoder", "OggOpusEncoder", "ogg_crc"]
