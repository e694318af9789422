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
- a page sphn cannot decode is reported (naming the codec when its header packet names one: Vorbis, FLAC ...; such a
  stream is named once per decoder, its later pages dropped without a report) and sphn starts over (it decodes a
  stream joined mid-way).

Reports come back with the samples that did decode, so the caller can queue those and then say what was wrong
(:class:`~cspan.server.session.ClientError` ``bad_audio``); the session goes on.
"""

from __future__ import annotations

import zlib

import numpy as np

from cspan.core.constants import FRAME_SIZE, SAMPLE_RATE

OGG_CAPTURE = b"OggS"
"""The first four bytes of every Ogg page."""
_HEADER = 27
"""Bytes of an Ogg page header before its segment table."""


_BIT_REVERSED = bytes(int(f"{i:08b}"[::-1], 2) for i in range(256))
"""Byte -> the byte with its bits in reverse order (``bytes.translate`` table)."""
MAX_REPORTED_PROBLEMS = 3
"""A ``bad_audio`` report names this many problems of a message and counts the rest."""
_OTHER_CODECS = (
    (b"\x01vorbis", "Vorbis"),
    (b"\x03vorbis", "Vorbis"),
    (b"\x05vorbis", "Vorbis"),
    (b"Speex   ", "Speex"),
    (b"\x7fFLAC", "FLAC"),
    (b"\x80theora", "Theora"),
)
"""Header packets (RFC 7845 section 5 lists the Ogg mappings) that name a codec other than Opus."""


_MAX_FOREIGN_STREAMS = 16
"""Serial numbers of other codecs' streams a decoder remembers (so their audio pages are known as theirs and not
reported again)."""


def _codec_named(page: bytes) -> str | None:
    """The codec a page's first packet names, when it is another codec's header packet."""
    payload = page[_HEADER + page[26] :]
    return next((codec for magic, codec in _OTHER_CODECS if payload.startswith(magic)), None)


def ogg_crc(page: bytes | bytearray) -> int:
    """The Ogg page checksum (CRC-32, polynomial 0x04C11DB7, not reflected, initial 0; RFC 3533 section 6) of
    ``page`` with its checksum field (bytes 22..25) taken as zero.

    Computed by zlib (C): zlib's CRC-32 is the same polynomial reflected (0xEDB88320), so the Ogg CRC of the data
    is the bit-reversed zlib CRC (initial register 0, no final xor) of the data with each byte's bits reversed.
    """
    data = bytes(page[:22]) + b"\0\0\0\0" + bytes(page[26:])
    reflected = zlib.crc32(data.translate(_BIT_REVERSED), 0xFFFFFFFF) ^ 0xFFFFFFFF
    return int.from_bytes(reflected.to_bytes(4, "little").translate(_BIT_REVERSED), "big")


class OggOpusDecoder:
    """Ogg/Opus bytes from a client -> float32 PCM at 24 kHz (any number of samples per call).

    The cost of :meth:`decode` grows with the bytes given (about 70 us per 80 ms page on one core, CRC and page
    parsing in C or one pass over the pages): callers decode large messages off the event loop. At most one
    incomplete page (65 307 bytes) is kept between calls.
    """

    def __init__(self) -> None:
        import sphn

        self._sphn = sphn
        self._reader = sphn.OpusStreamReader(SAMPLE_RATE)
        self._buf = bytearray()
        self._foreign: dict[int, str] = {}  # serial number -> codec of other codecs' streams seen

    def decode(self, data: bytes) -> tuple[np.ndarray, str | None]:
        """``(samples, problem)``: the samples of the complete good pages so far (often 0 for a header page, 1920
        for a page of 80 ms), and what was wrong with the rest (None when nothing was; the first
        :data:`MAX_REPORTED_PROBLEMS` problems and a count of all, so its size does not grow with the input)."""
        buf = self._buf
        buf += data
        out: list[np.ndarray] = []
        problems: list[str] = []
        count = said = 0  # problems found; of them, those the report names
        n = len(buf)
        pos = 0
        while pos < n:
            head = bytes(buf[pos : pos + 4])
            if head != OGG_CAPTURE[: len(head)]:
                skip = buf.find(OGG_CAPTURE, pos + 1)
                end = n if skip < 0 else skip
                if skip < 0:  # keep a partial capture pattern at the end: the next message may complete it
                    end = next((n - k for k in (3, 2, 1) if n - k > pos and buf[n - k :] == OGG_CAPTURE[:k]), n)
                count += 1
                if len(problems) < MAX_REPORTED_PROBLEMS:
                    problems.append(f"{end - pos} bytes that are not an Ogg page were dropped")
                    said += 1
                pos = end
                continue
            if n - pos < _HEADER or n - pos < _HEADER + buf[pos + 26]:
                break
            segments = buf[pos + 26]
            size = _HEADER + segments + sum(buf[pos + _HEADER : pos + _HEADER + segments])
            if n - pos < size:
                break
            page = bytes(buf[pos : pos + size])
            pos += size
            if ogg_crc(page) != int.from_bytes(page[22:26], "little"):
                count += 1
                if len(problems) < MAX_REPORTED_PROBLEMS:
                    number = int.from_bytes(page[18:22], "little")
                    problems.append(f"a corrupt Ogg page (checksum mismatch, page {number})")
                    said += 1
                continue
            try:
                out.append(np.asarray(self._reader.append_bytes(page), dtype=np.float32).reshape(-1))
            except Exception as exc:  # sphn raises ValueError; its state is unusable afterwards
                self._reader = self._sphn.OpusStreamReader(SAMPLE_RATE)
                serial = int.from_bytes(page[14:18], "little")
                if serial in self._foreign:  # a stream of another codec, named already (in this message or before)
                    continue
                count += 1
                codec = _codec_named(page)
                if codec is not None and len(self._foreign) < _MAX_FOREIGN_STREAMS:
                    self._foreign[serial] = codec
                why = (
                    f"Ogg pages of a {codec} stream, not Opus (encode the audio as Opus, or offer 'pcm' and send PCM)"
                    if codec is not None
                    else f"an Ogg page that is not Opus audio ({str(exc)[:200]})"
                )
                if why in problems:  # another stream of the same codec: named once
                    said += 1
                elif len(problems) < MAX_REPORTED_PROBLEMS:
                    problems.append(why)
                    said += 1
        del buf[:pos]
        pcm = np.concatenate(out) if out else np.zeros(0, dtype=np.float32)
        problem = None
        if count:
            problem = "audio is not a valid Ogg/Opus stream: " + "; ".join(problems)
            if count > said:
                problem += f" (and {count - said} more problems in this message)"
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
