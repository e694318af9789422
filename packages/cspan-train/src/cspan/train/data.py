"""``cspan prepare``: dialogue files (JSON + stereo audio) -> Mimi codes, aligned text, spans, shards and a manifest.

For each ``NAME.json`` in ``--in-dir`` (format: :mod:`cspan.train.schema`) with ``NAME.wav`` (or ``.flac`` /
``.ogg``) next to it:

1. validate the JSON; read the audio (stereo, left = user, right = agent, any sample rate), resample both channels
   to 24 kHz (soxr);
2. encode both channels with Mimi, several dialogues per batch (``Mimi.encode`` is causal, so right-padding a
   shorter dialogue does not change its codes), keeping 8 codebooks: ``T = ceil(samples / 1920)`` frames;
3. write the agent's words into the text row at 12.5 Hz (:func:`align_text`, the convention of Moshi's training
   data: ``docs/TRAINING.md``), put ``<ret>`` (4) on the frame before each grounded turn's first token and record
   the span (reference ids ``[12] + spm(reference) + [13]``, ``<ret>`` frame, deadline frame);
4. lay out the persona prefix frames with :func:`cspan.core.prefix.build_persona_prefix` (the engine's
   ``set_persona`` layout: voice frames, the ``<system> ... <system>`` prompt with the profile's name and city);
5. append ``{NAME}/codes`` [17, T] and ``{NAME}/prefix`` [17, P] to the current shard
   (``shards/shard-00000.safetensors``, int16 where the ids fit) and, once the shard is written, one line per
   dialogue to ``manifest.jsonl``.

Resumable: dialogues already in the manifest are skipped, so an interrupted run continues where it stopped; a
shard of the manifest that is missing or damaged (its safetensors header, its size or its tensors do not match) is
reported and its dialogues are encoded again, and so is a dialogue whose JSON file changed since it was prepared
(its sha256 is not the manifest's ``json_sha256``). A bad
dialogue (invalid JSON field, missing or mono audio, words after the end of the audio...) is reported on stderr
and in ``errors.jsonl`` with its file and field, and skipped; the others are prepared.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cspan.core.constants import EPAD, FRAME_RATE, FRAME_SIZE, NUM_CODEBOOKS, PAD, RET, SAMPLE_RATE
from cspan.core.errors import CspanError, SettingsError

from .dataset import (
    DATASET_FILE,
    DATASET_FORMAT,
    MANIFEST_FILE,
    DialogueRecord,
    SpanRecord,
    read_manifest,
    shard_problems,
)
from .errors import DataError, DatasetMismatchError
from .schema import Dialogue, load_dialogue

log = logging.getLogger(__name__)

AUDIO_SUFFIXES = (".wav", ".flac", ".ogg")
ERRORS_FILE = "errors.jsonl"
SHARDS_DIR = "shards"
_SHARD_RE = re.compile(r"^shard-(\d+)\.safetensors$")


# ---------------------------------------------------------------------------------------------------------------
# Text alignment
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class AlignedText:
    """The text row of one dialogue.

    Attributes:
        tokens: [T] ids (PAD, EPAD, word tokens).
        first_frame: per word (in the order given), the frame of its first token, or None when it has no token or
            did not fit before the end of the audio.
        dropped: tokens that did not fit before the end of the audio.
    """

    tokens: list[int]
    first_frame: list[int | None]
    dropped: int


def align_text(
    words: Sequence[tuple[Sequence[int], float]],
    num_frames: int,
    *,
    frame_rate: float = FRAME_RATE,
    pad: int = PAD,
    epad: int = EPAD,
) -> AlignedText:
    """Place word tokens on 12.5 Hz frames (the convention of Moshi's training data).

    Source: kyutai-labs/moshi-finetune ``finetune/data/interleaver.py`` (``Interleaver.build_token_stream``):

    - a word starting at ``start`` seconds becomes available at frame ``floor(start * frame_rate)``;
    - tokens are written one per frame, in order, from that frame on; a word whose frame is still taken by the
      previous word's tokens waits (its tokens are queued, never dropped, unlike the original Context Spanning
      ``prepare`` which dropped colliding tokens);
    - every other frame is PAD (3);
    - the frame just before a word's first token becomes EPAD (0) when it is PAD, so the model announces each word
      one frame ahead;
    - tokens still queued at the end of the audio are dropped and counted.

    Args:
        words: (token ids, start in seconds) per word, in time order.
        num_frames: T.
        frame_rate: frames per second.

    Returns:
        :class:`AlignedText`.
    """
    tokens = [pad] * num_frames
    first: list[int | None] = [None] * len(words)
    order = sorted(range(len(words)), key=lambda i: (words[i][1], i))
    queue: deque[tuple[int, int, bool]] = deque()  # (token, word index, is first token)
    nxt = 0
    for t in range(num_frames):
        while nxt < len(order) and math.floor(words[order[nxt]][1] * frame_rate) <= t:
            wi = order[nxt]
            for j, tok in enumerate(words[wi][0]):
                queue.append((int(tok), wi, j == 0))
            nxt += 1
        if queue:
            tok, wi, is_first = queue.popleft()
            if is_first:
                first[wi] = t
                if t > 0 and tokens[t - 1] == pad:
                    tokens[t - 1] = epad
            tokens[t] = tok
    dropped = len(queue) + sum(len(words[order[i]][0]) for i in range(nxt, len(order)))
    return AlignedText(tokens=tokens, first_frame=first, dropped=dropped)


def build_text_row(
    dialogue: Dialogue,
    tokenizer: Any,
    num_frames: int,
    *,
    max_span_frames: int | None = None,
    where: str = "dialogue",
) -> tuple[torch.Tensor, list[SpanRecord], dict[str, int]]:
    """The agent's text row with ``<ret>`` placed, and the span records of the grounded turns.

    ``<ret>`` goes on the frame before the first token of the grounded turn's first word (replacing what is there,
    normally the EPAD; MoshiRAG section 3.2 and the original ``prepare``). The deadline is the first-token frame of
    the turn's ``body_word`` minus 2 (at least the frame after ``<ret>``).

    Args:
        dialogue: the validated dialogue.
        tokenizer: SentencePiece processor (``encode(str) -> list[int]``).
        num_frames: T.
        max_span_frames: longest block (None: no limit).
        where: file name for messages.

    Returns:
        (text [T] long, spans, stats ``{"text_tokens", "dropped_tokens", "ret_overwrote"}``).

    Raises:
        DataError: a grounded turn whose first word has no frame before it, or whose words fall after the audio.
    """
    from cspan.core.span import ContextSpan
    from cspan.core.text import encode_text

    words: list[tuple[list[int], float]] = []
    index: dict[tuple[int, int], int] = {}
    for ti, turn in enumerate(dialogue.turns):
        if turn.speaker != "agent":
            continue
        for wi, word in enumerate(turn.words):
            index[(ti, wi)] = len(words)
            words.append((encode_text(tokenizer, word.word.strip()), word.start))
    aligned = align_text(words, num_frames)
    tokens = list(aligned.tokens)
    spans: list[SpanRecord] = []
    overwrote = 0
    for ti, turn in enumerate(dialogue.turns):
        if not turn.ret:
            continue
        frames = [aligned.first_frame[index[(ti, wi)]] for wi in range(len(turn.words))]
        placed = [f for f in frames if f is not None]
        if not placed:
            raise DataError(
                f"dialogue file {where!r}, field turns[{ti}].words: no word of this grounded turn could be placed "
                "before the end of the audio; check the word times"
            )
        ret_frame = placed[0] - 1
        if ret_frame < 0:
            raise DataError(
                f"dialogue file {where!r}, field turns[{ti}].words[0].start: the grounded turn starts in the first "
                "frame, so there is no frame for <ret> before it; start the turn at least 0.08 s into the audio"
            )
        if tokens[ret_frame] not in (PAD, EPAD):
            overwrote += 1
        tokens[ret_frame] = RET
        body = next((f for f in frames[turn.body_index :] if f is not None), placed[-1])
        deadline = max(ret_frame + 1, body - 2)
        assert turn.reference is not None
        ids, truncated = ContextSpan(turn.reference).encode(tokenizer, max_span_frames)
        spans.append(
            SpanRecord(
                ret_frame=ret_frame,
                deadline_frame=deadline,
                ids=tuple(ids),
                reference=turn.reference,
                turn=ti,
                tool=turn.tool,
                arguments=turn.arguments,
                truncated=truncated,
            )
        )
    stats = {
        "text_tokens": sum(len(w[0]) for w in words) - aligned.dropped,
        "dropped_tokens": aligned.dropped,
        "ret_overwrote": overwrote,
    }
    return torch.tensor(tokens, dtype=torch.long), spans, stats


# ---------------------------------------------------------------------------------------------------------------
# Loading one dialogue (worker threads)
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class LoadedDialogue:
    """A validated dialogue with its audio at 24 kHz, ready to be encoded.

    Attributes:
        name: the file stem.
        json_path, audio_path: the source files.
        user, agent: [S] float32 PCM at 24 kHz.
        text: [T] long text row; spans: its grounded turns; prefix: [17, P] long persona prefix frames.
        extra: manifest fields (sources, duration, statistics).
    """

    name: str
    json_path: Path
    audio_path: Path
    user: np.ndarray
    agent: np.ndarray
    text: torch.Tensor
    spans: list[SpanRecord]
    prefix: torch.Tensor
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_frames(self) -> int:
        """T = ceil(samples / 1920)."""
        return int(self.text.shape[0])


def find_audio(json_path: Path) -> Path:
    """The audio file next to ``NAME.json`` (``NAME.wav``, ``.flac`` or ``.ogg``).

    Raises:
        DataError: none exists.
    """
    for suffix in AUDIO_SUFFIXES:
        candidate = json_path.with_suffix(suffix)
        if candidate.is_file():
            return candidate
    raise DataError(
        f"dialogue file {str(json_path)!r}: no audio next to it ({', '.join(json_path.stem + s for s in AUDIO_SUFFIXES)}); "
        "add the stereo recording (left user, right agent)"
    )


def read_stereo(path: Path) -> tuple[np.ndarray, np.ndarray, int, float]:
    """(user [S], agent [S]) float32 at 24 kHz, the native rate and the duration in seconds.

    NaN or infinite samples are read as silence and counted in a warning (:func:`cspan.core.audio.sanitize_pcm`,
    the rule of every surface that takes audio).

    Raises:
        DataError: unreadable, a sample rate outside 1 kHz..768 kHz, empty or not stereo.
    """
    import soundfile as sf

    from cspan.core.audio import check_sample_rate, decode_error_cause, resample, sanitize_pcm
    from cspan.core.errors import AudioInputError

    try:
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, OSError) as exc:
        raise DataError(
            f"audio file {str(path)!r}: cannot be decoded ({decode_error_cause(exc)}); give a WAV, FLAC or OGG file"
        ) from None
    try:
        check_sample_rate(int(rate), f"audio file {str(path)!r}")
    except AudioInputError as exc:
        raise DataError(str(exc)) from None
    if data.shape[0] == 0:
        raise DataError(f"audio file {str(path)!r}: holds no samples")
    if data.shape[1] != 2:
        raise DataError(
            f"audio file {str(path)!r}: has {data.shape[1]} channel(s); a training dialogue is stereo with the user "
            "on the left channel and the agent on the right"
        )
    data, nonfinite = sanitize_pcm(data)
    if nonfinite:
        log.warning("audio file %r: %d NaN or infinite samples read as silence", str(path), nonfinite)
    user = resample(np.ascontiguousarray(data[:, 0]), int(rate), SAMPLE_RATE)
    agent = resample(np.ascontiguousarray(data[:, 1]), int(rate), SAMPLE_RATE)
    return user, agent, int(rate), data.shape[0] / float(rate)


def _check_times(dialogue: Dialogue, duration_s: float, where: str) -> None:
    tolerance = 1.0 / FRAME_RATE
    for ti, turn in enumerate(dialogue.turns):
        for wi, word in enumerate(turn.words):
            if word.start >= duration_s:
                raise DataError(
                    f"dialogue file {where!r}, field turns[{ti}].words[{wi}].start: {word.start} s is after the end "
                    f"of the audio ({duration_s:.3f} s); fix the word times or the audio"
                )
            if word.end > duration_s + tolerance:
                raise DataError(
                    f"dialogue file {where!r}, field turns[{ti}].words[{wi}].end: {word.end} s is after the end of "
                    f"the audio ({duration_s:.3f} s); fix the word times or the audio"
                )


class VoiceResolver:
    """The voice prompts of the dialogues: a file relative to the dialogue's folder, else a voice name of the
    checkpoint found as every verb finds ``--voice`` (:func:`cspan.core.voice.known_voice`: its ``voices/``,
    PersonaPlex's ``voices.tgz``, ``$CSPAN_VOICES_DIR``; ``NAME.pt`` too), read as Mimi codes, what the dataset
    holds (:func:`cspan.core.voice.load_voice`: a codes file, a recording encoded with the checkpoint's Mimi; a
    PersonaPlex embedding voice only with its recording beside it).

    Args:
        checkpoint: the checkpoint's voices (:func:`cspan.core.checkpoint.checkpoint_voices`, with its Mimi).
    """

    def __init__(self, checkpoint: Any) -> None:
        import threading

        self.checkpoint = checkpoint
        self._cache: dict[Path, torch.Tensor] = {}
        self._lock = threading.Lock()  # load_one runs on worker threads: each voice is read (encoded) once

    def codes(self, voice: str, json_path: Path) -> torch.Tensor:
        """[8, N] long codes of ``voice``.

        Raises:
            DataError: unknown voice, bad file, or a voice without codes (names the dialogue file and the ``voice``
                field).
        """
        path = self.find(voice, json_path.parent / voice)
        if path is None:
            raise DataError(
                f"dialogue file {str(json_path)!r}, field voice: {voice!r} is neither a file next to the dialogue nor "
                f"a voice of the checkpoint (known: {self.known()})"
            )
        try:
            return self.load(path)
        except CspanError as exc:
            raise DataError(f"dialogue file {str(json_path)!r}, field voice: {exc}") from None

    def find(self, voice: str, *files: Path) -> Path | None:
        """The first of ``files`` that exists (resolved), else the checkpoint's voice named ``voice``, else None."""
        from cspan.core.voice import known_voice

        return next((f.resolve() for f in files if f.is_file()), None) or known_voice(voice, self.checkpoint)

    def is_named(self, voice: str, path: Path) -> bool:
        """``path`` is the checkpoint's voice named ``voice`` (not a file given by its path)."""
        from cspan.core.voice import known_voice

        return known_voice(voice, self.checkpoint) == path

    def known(self) -> str:
        """The checkpoint's voice names, for messages."""
        from cspan.core.voice import known_voices

        return ", ".join(sorted(known_voices(self.checkpoint))) or "none"

    def load(self, path: Path) -> torch.Tensor:
        """[8, N] long codes of the voice file ``path`` (cached).

        Raises:
            CspanError: the file is not a voice, or a PersonaPlex embedding voice without codes (names it and what
                to do).
        """
        from cspan.core.voice import load_voice

        with self._lock:
            if path not in self._cache:
                self._cache[path] = load_voice(path, self.checkpoint, needed_by="training")
            return self._cache[path]


@dataclass(frozen=True)
class PrepareOptions:
    """Options of one ``cspan prepare`` run.

    Attributes:
        max_span_frames: longest Context Span block (ids with the markers); longer references are truncated.
        default_persona: persona text for dialogues without one (None: no text prompt).
        default_voice: voice for dialogues without one (None: no voice prompt).
        prefix_layout: the persona prefix layout (the checkpoint's: ``Checkpoint.prefix_layout``).
        window: the model's attention window in positions (its ``context``; None: unbounded): a persona prefix may
            take at most half of it (:meth:`cspan.core.prefix.PersonaPrefix.too_long_for`, the rule of ``infer``).
    """

    max_span_frames: int = 600
    default_persona: str | None = None
    default_voice: str | None = None
    prefix_layout: str = "context-spanning"
    window: int | None = None


MIN_SPAN_FRAMES = 3
"""The shortest Context Span block: ``<span>`` (12), one token, ``</span>`` (13)."""

RECORDED_OPTIONS = (
    ("max_span_frames", "--max-span-frames"),
    ("default_persona", "--persona"),
    ("default_voice", "--voice"),
)
"""Options that change the encoded data (dataset.json key, flag): a resumed run must keep them."""


def load_one(json_path: Path, tokenizer: Any, voices: VoiceResolver, options: PrepareOptions) -> LoadedDialogue:
    """Validate, read and align one dialogue (no Mimi yet); thread-safe.

    Raises:
        DataError / AudioInputError: the dialogue is bad (names the file and the field).
    """
    from cspan.core.config import PrefixLayout
    from cspan.core.prefix import build_persona_prefix

    where = str(json_path)
    dialogue = load_dialogue(json_path)
    audio_path = find_audio(json_path)
    user, agent, rate, duration = read_stereo(audio_path)
    _check_times(dialogue, duration, where)
    num_frames = max(1, -(-len(user) // FRAME_SIZE))
    text, spans, stats = build_text_row(
        dialogue, tokenizer, num_frames, max_span_frames=options.max_span_frames, where=where
    )
    voice_name = dialogue.voice if dialogue.voice is not None else options.default_voice
    voice = voices.codes(voice_name, json_path) if voice_name else None
    persona = dialogue.persona if dialogue.persona is not None else options.default_persona
    profile = dialogue.profile
    prefix = build_persona_prefix(
        tokenizer,
        persona,
        voice,
        layout=PrefixLayout.named(options.prefix_layout),
        user_name=profile.name if profile else None,
        user_city=profile.city if profile else None,
    )
    too_long = prefix.too_long_for(options.window, characters=len(persona or ""))
    if too_long is not None:
        field_name = "persona" if dialogue.persona is not None else "persona (from --persona)"
        raise DataError(f"dialogue file {where!r}, field {field_name}: {too_long}; shorten it")
    extra = {
        "json": str(json_path),
        "audio": str(audio_path),
        "json_sha256": hashlib.sha256(json_path.read_bytes()).hexdigest(),
        "sample_rate": rate,
        "duration_s": round(duration, 4),
        "persona": prefix.text,
        "voice": voice_name,
        "voice_frames": prefix.voice_frames,
        **stats,
    }
    return LoadedDialogue(
        name=json_path.stem,
        json_path=json_path,
        audio_path=audio_path,
        user=user,
        agent=agent,
        text=text,
        spans=spans,
        prefix=prefix.frames,
        extra=extra,
    )


# ---------------------------------------------------------------------------------------------------------------
# Encoding and shards
# ---------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def encode_batch(mimi: Any, batch: Sequence[LoadedDialogue], device: torch.device) -> list[torch.Tensor]:
    """Mimi-encode the two channels of several dialogues in one batch.

    Returns:
        Per dialogue, codes [17, T] long (text row, agent codebooks 0..7, user codebooks 0..7) on the CPU.
    """
    longest = max(len(d.user) for d in batch)
    pcm = torch.zeros(2 * len(batch), 1, longest, dtype=torch.float32)
    for i, d in enumerate(batch):
        pcm[2 * i, 0, : len(d.user)] = torch.from_numpy(d.user)
        pcm[2 * i + 1, 0, : len(d.agent)] = torch.from_numpy(d.agent)
    codes = mimi.encode(pcm.to(device))[:, :NUM_CODEBOOKS].cpu()  # [2n, 8, T_max]
    out = []
    for i, d in enumerate(batch):
        T = d.num_frames
        user, agent = codes[2 * i, :, :T], codes[2 * i + 1, :, :T]
        out.append(torch.cat([d.text[None, :T], agent, user], dim=0).long())
    return out


def _compact(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0 or (int(t.min()) >= -(2**15) and int(t.max()) < 2**15):
        return t.to(torch.int16).contiguous()
    return t.to(torch.int32).contiguous()


class ShardWriter:
    """Collects prepared dialogues and writes them as safetensors shards, then their manifest lines.

    Args:
        root: the output folder.
        shard_size: dialogues per shard.
    """

    def __init__(self, root: Path, shard_size: int) -> None:
        self.root = root
        self.shard_size = max(1, int(shard_size))
        (root / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
        used = [int(m.group(1)) for p in (root / SHARDS_DIR).iterdir() if (m := _SHARD_RE.match(p.name))]
        self.next_index = max(used, default=-1) + 1
        self.tensors: dict[str, torch.Tensor] = {}
        self.records: list[DialogueRecord] = []

    def add(self, loaded: LoadedDialogue, codes: torch.Tensor) -> None:
        """Queue one dialogue; writes the shard when it is full."""
        shard = f"{SHARDS_DIR}/shard-{self.next_index:05d}.safetensors"
        self.tensors[f"{loaded.name}/codes"] = _compact(codes)
        self.tensors[f"{loaded.name}/prefix"] = _compact(loaded.prefix)
        self.records.append(
            DialogueRecord(
                name=loaded.name,
                shard=shard,
                frames=int(codes.shape[1]),
                prefix_frames=int(loaded.prefix.shape[1]),
                spans=tuple(loaded.spans),
                extra=loaded.extra,
            )
        )
        if len(self.records) >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        """Write the pending shard (atomically) and append its dialogues to the manifest."""
        if not self.records:
            return
        from safetensors.torch import save_file

        from cspan.core.files import atomic_file

        with atomic_file(self.root / self.records[0].shard) as tmp:  # published with ordinary permissions
            save_file(self.tensors, str(tmp), metadata={"format": DATASET_FORMAT})
        with (self.root / MANIFEST_FILE).open("a", encoding="utf-8") as fh:
            for rec in self.records:
                fh.write(json.dumps(rec.to_json(), ensure_ascii=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        self.tensors, self.records = {}, []
        self.next_index += 1


# ---------------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class PrepareSummary:
    """What a ``cspan prepare`` run did.

    Attributes:
        prepared: dialogues encoded by this run.
        skipped: dialogues already in the manifest and unchanged since (a resumed run).
        failed: (file, message) of each bad dialogue.
        out_dir: the dataset folder.
        changed: of ``prepared``, the dialogues of the manifest whose JSON file changed since they were prepared
            (one whose new file is bad is in ``failed`` instead; either way its old data left the dataset).
    """

    prepared: int
    skipped: int
    failed: list[tuple[str, str]]
    out_dir: Path
    changed: int = 0


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes (read in 1 MiB chunks)."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def codec_fingerprint(mimi_file: Path, mimi_config: Any) -> str:
    """What decides a dataset's codes: the sha256 of the Mimi weights file and of its configuration (JSON)."""
    config = json.dumps(mimi_config.to_upstream(), sort_keys=True)
    return hashlib.sha256(f"{file_sha256(mimi_file)}:{config}".encode()).hexdigest()


def _shown(value: Any) -> str:
    """A setting's value in a message: ``none`` for None, a long text cut to 60 characters."""
    if value is None:
        return "none (not given)"
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_defaults(options: PrepareOptions, voices: VoiceResolver, tokenizer: Any, in_dir: Path) -> PrepareOptions:
    """Check ``--voice`` and ``--persona`` once, before any dialogue (they apply to many): the voice is a file (from
    the working folder or ``--in-dir``) or a voice of the checkpoint, and readable; the persona with that voice fits
    half the attention window. Returns the options with a voice file's path made absolute.

    Raises:
        SettingsError: naming the flag (exit status 2).
    """
    from dataclasses import replace

    from cspan.core.config import PrefixLayout
    from cspan.core.prefix import build_persona_prefix

    voice, codes = options.default_voice, None
    if voice is not None:
        path = voices.find(voice, Path(voice).expanduser(), in_dir / voice)
        if path is None:
            raise SettingsError(
                f"--voice {voice!r}: neither a voice file nor a voice of the checkpoint (known: {voices.known()})"
            )
        if not voices.is_named(voice, path):  # a file: recorded by its absolute path
            voice = str(path)
        try:
            codes = voices.load(path)
        except CspanError as exc:
            raise SettingsError(f"--voice {options.default_voice!r}: {exc}") from None
        options = replace(options, default_voice=voice)
    if options.default_persona is not None or codes is not None:
        prefix = build_persona_prefix(
            tokenizer, options.default_persona, codes, layout=PrefixLayout.named(options.prefix_layout)
        )
        too_long = prefix.too_long_for(options.window, characters=len(options.default_persona or ""))
        if too_long is not None:
            raise SettingsError(f"--persona: {too_long}; shorten it")
    return options


def _write_dataset_info(out_dir: Path, info: dict[str, Any]) -> None:
    """Write ``dataset.json``; a folder prepared before is resumed only with the same tokenizer, codec and prefix
    layout (older folders without the codec fingerprint: the same codebooks and card).

    Raises:
        DatasetMismatchError: the folder was prepared with another tokenizer, codec or layout (names
            ``--checkpoint`` and both), or with other :data:`RECORDED_OPTIONS` (names the flag and both values); a
            :class:`DataError` and a :class:`~cspan.core.errors.SettingsError` (exit status 2).
    """
    path = out_dir / DATASET_FILE
    if path.is_file():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            old = {}
        if not isinstance(old, dict):
            old = {}
        fix = "prepare into a new --out-dir, or delete the old one"
        flag = f"--checkpoint {info['checkpoint']!r}"  # the tokenizer, the codec and the layout are the checkpoint's
        if old.get("tokenizer_sha256") not in (None, info["tokenizer_sha256"]):
            raise DatasetMismatchError(
                f"{flag}: {str(out_dir)!r} was prepared with another tokenizer (sha256 {old.get('tokenizer_sha256')}); "
                f"{fix}"
            )
        if old.get("num_codebooks") not in (None, info["num_codebooks"]) or old.get("card") not in (None, info["card"]):
            raise DatasetMismatchError(f"{flag}: {str(out_dir)!r} was prepared with another codec; {fix}")
        if old.get("codec_sha256") not in (None, info["codec_sha256"]):
            raise DatasetMismatchError(
                f"{flag}: {str(out_dir)!r} was prepared with another codec (Mimi of {old.get('checkpoint')!r}, "
                f"fingerprint {str(old.get('codec_sha256'))[:12]}; this checkpoint's is {info['codec_sha256'][:12]}): "
                f"its codes would mix two codecs; {fix}"
            )
        if old.get("prefix_layout", info["prefix_layout"]) != info["prefix_layout"]:
            raise DatasetMismatchError(
                f"{flag}: {str(out_dir)!r} was prepared with the {old.get('prefix_layout')!r} persona prefix layout, "
                f"this checkpoint uses {info['prefix_layout']!r}; {fix}"
            )
        for key, flag in RECORDED_OPTIONS:
            if key in old and old[key] != info[key]:
                raise DatasetMismatchError(
                    f"{flag} {_shown(info[key])}: {str(out_dir)!r} was prepared with {flag} {_shown(old[key])}, and "
                    f"its dialogues must all be encoded alike; resume with that value, or {fix}"
                )
    path.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


def _check_shards(out_dir: Path, inputs: set[str]) -> list[DialogueRecord]:
    """The manifest's records whose shard is there and whole (:func:`cspan.train.dataset.shard_problems`).

    The records of a missing or damaged shard are dropped from the manifest (rewritten atomically) and the damaged
    file removed, so that their dialogues are encoded again into a new shard; each such shard is reported on stderr.
    """
    from cspan.core.files import write_text_atomic

    records = read_manifest(out_dir / MANIFEST_FILE)
    problems = shard_problems(out_dir, records)
    if not problems:
        return records
    for shard, problem in problems.items():
        names = [r.name for r in records if r.shard == shard]
        lost = [n for n in names if n not in inputs]
        note = (
            f"cspan prepare: shard {str(out_dir / shard)!r} is {problem}: encoding its {len(names)} dialogue(s) again"
        )
        if lost:
            note += f"; {len(lost)} of them ({', '.join(lost[:5])}) are not in --in-dir and leave the dataset"
        print(note, file=sys.stderr)
    kept = [r for r in records if r.shard not in problems]
    write_text_atomic(
        out_dir / MANIFEST_FILE, "".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in kept)
    )
    for shard, problem in problems.items():
        if problem.startswith("damaged"):  # unusable: a new shard replaces it
            (out_dir / shard).unlink(missing_ok=True)
    return kept


def _drop_changed(out_dir: Path, records: list[DialogueRecord], paths: Sequence[Path]) -> list[DialogueRecord]:
    """The ``records`` whose dialogue file among ``paths`` changed since it was prepared (its sha256 is not
    the recorded ``json_sha256``; an unreadable file counts as changed), after dropping them from the manifest
    (rewritten atomically) so that they are prepared again; a record without ``json_sha256`` counts as unchanged.
    Their old tensors stay in their shard, unreferenced."""
    from cspan.core.files import write_text_atomic

    by_name = {p.stem: p for p in paths}
    changed = []
    for rec in records:
        recorded, path = rec.extra.get("json_sha256"), by_name.get(rec.name)
        if recorded is None or path is None:
            continue
        try:
            same = file_sha256(path) == recorded
        except OSError:
            same = False
        if not same:
            changed.append(rec)
    if changed:
        names = {r.name for r in changed}
        kept = [r for r in records if r.name not in names]
        write_text_atomic(
            out_dir / MANIFEST_FILE, "".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in kept)
        )
        shown = ", ".join(f"{r.name}.json" for r in changed[:5]) + (", ..." if len(changed) > 5 else "")
        print(
            f"cspan prepare: {len(changed)} dialogue(s) changed since they were prepared ({shown}): preparing them "
            "again",
            file=sys.stderr,
        )
    return changed


def iter_loaded(
    paths: Sequence[Path], load: Any, workers: int
) -> Iterator[tuple[Path, LoadedDialogue | None, str | None]]:
    """Load dialogues on ``workers`` threads (bounded look-ahead), yielding ``(path, loaded, error)`` in order."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        window = max(2, 2 * workers)
        pending: deque[tuple[Path, Future[LoadedDialogue]]] = deque()
        it = iter(paths)
        for p in it:
            pending.append((p, pool.submit(load, p)))
            if len(pending) >= window:
                break
        while pending:
            path, fut = pending.popleft()
            nxt = next(it, None)
            if nxt is not None:
                pending.append((nxt, pool.submit(load, nxt)))
            try:
                yield path, fut.result(), None
            except CspanError as exc:
                yield path, None, str(exc)
            except Exception as exc:  # a bad file must never stop the run: report it with its type
                yield path, None, f"dialogue file {str(path)!r}: {type(exc).__name__}: {exc}"


def run_prepare(
    in_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    checkpoint: str | None = None,
    base: str | None = None,
    workers: int = 4,
    device: str | None = None,
    batch_size: int = 8,
    shard_size: int = 64,
    options: PrepareOptions | None = None,
    progress: bool = True,
) -> PrepareSummary:
    """Prepare every dialogue of ``in_dir`` into ``out_dir`` (see the module docstring).

    Args:
        in_dir: folder of ``NAME.json`` + ``NAME.wav`` pairs (not recursive).
        out_dir: the dataset folder (created; an existing one is resumed).
        checkpoint: the checkpoint whose Mimi, tokenizer and voices are used (its LM is not loaded).
        base: base of a fine-tune checkpoint.
        workers: threads that read, validate, resample and align dialogues.
        device: where Mimi runs (default CUDA when available).
        batch_size: dialogues per Mimi batch.
        shard_size: dialogues per shard.
        options: :class:`PrepareOptions`.
        progress: show a progress bar on stderr.

    Returns:
        :class:`PrepareSummary`.

    Raises:
        DataError: ``in_dir`` has no dialogue. DatasetMismatchError: ``out_dir`` was prepared with another tokenizer,
            codec, prefix layout or recorded option (exit status 2).
        SettingsError: ``out_dir`` is or lies inside ``in_dir`` or a folder of the checkpoint, or is a file the run
            reads (:func:`cspan.core.reads.check_outputs`).
        CheckpointError: the checkpoint lacks Mimi or the tokenizer.
    """
    from dataclasses import replace

    from cspan.core.checkpoint import (
        checkpoint_reads,
        checkpoint_voices,
        load_mimi,
        load_tokenizer,
        read_configs,
        resolve_checkpoint,
        resolve_prefix_layout,
    )
    from cspan.core.devices import parse_device
    from cspan.core.errors import CheckpointError
    from cspan.core.reads import Reads, check_outputs

    options = options or PrepareOptions()
    dev = parse_device(device or None)  # before anything is read or created
    if options.max_span_frames < MIN_SPAN_FRAMES:
        raise SettingsError(
            f"--max-span-frames {options.max_span_frames}: must be at least {MIN_SPAN_FRAMES} (a Context Span block "
            "holds <span>, at least one token and </span>)"
        )
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise SettingsError(f"--out-dir {str(out_dir)!r} is a file; give a folder (a new one, or one to resume)")
    if not in_dir.is_dir():
        raise DataError(f"--in-dir {str(in_dir)!r} is not a folder; give the folder of NAME.json + NAME.wav pairs")
    paths = sorted(p for p in in_dir.glob("*.json") if p.is_file())
    if not paths:
        manifests = sorted(p.name for p in in_dir.glob("*.jsonl") if p.is_file())
        also = (
            f"; {manifests[0]} is a list of files (moshi-finetune's data.jsonl?), which cspan prepare does not read: "
            "give the folder of the dialogues themselves"
            if manifests
            else ""
        )
        raise DataError(f"--in-dir {str(in_dir)!r} holds no *.json dialogue file (format: docs/TRAINING.md){also}")
    reads = Reads().folder("--in-dir", in_dir).extend(checkpoint_reads(checkpoint, base=base))
    if options.default_voice and Path(options.default_voice).expanduser().is_file():
        reads.file("--voice", options.default_voice)
    check_outputs({}, reads, folders={"--out-dir": out_dir})  # the dataset never goes among what it is made from

    files = resolve_checkpoint(checkpoint, base=base)
    if files.mimi is None or files.tokenizer is None:
        raise CheckpointError(
            f"checkpoint {files.source!r} lacks the Mimi weights or the tokenizer that `cspan prepare` needs; pass a "
            "checkpoint folder in the released layout (--checkpoint DIR)"
        )
    lm_cfg, mimi_cfg = read_configs(files.config, [])
    layout = resolve_prefix_layout(files)
    options = replace(options, prefix_layout=layout.name, window=lm_cfg.context)
    tokenizer = load_tokenizer(files.tokenizer)
    mimi = load_mimi(files.mimi, mimi_cfg, device=dev)
    voices = VoiceResolver(checkpoint_voices(files, lm_cfg, mimi))  # a recording as a voice is encoded with it
    options = _check_defaults(options, voices, tokenizer, in_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_dataset_info(
        out_dir,
        {
            "format": DATASET_FORMAT,
            "frame_rate": FRAME_RATE,
            "num_codebooks": NUM_CODEBOOKS,
            "card": int(mimi.cardinality),
            "text_vocab": int(tokenizer.vocab_size()),
            "tokenizer_sha256": file_sha256(files.tokenizer),
            "codec_sha256": codec_fingerprint(files.mimi, mimi_cfg),
            "prefix_layout": layout.name,
            "checkpoint": str(files.source),
            "max_span_frames": options.max_span_frames,
            "default_persona": options.default_persona,
            "default_voice": options.default_voice,
        },
    )

    records = _check_shards(out_dir, {p.stem for p in paths})
    changed = _drop_changed(out_dir, records, paths)
    done = {r.name for r in records} - {r.name for r in changed}
    todo = [p for p in paths if p.stem not in done]
    skipped = len(paths) - len(todo)
    if skipped:
        print(f"cspan prepare: resuming, {skipped} of {len(paths)} dialogues are already prepared", file=sys.stderr)
    writer = ShardWriter(out_dir, shard_size)
    failed: list[tuple[str, str]] = []
    prepared = 0
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(todo), unit="dialogue", desc="prepare", file=sys.stderr)

    def load(path: Path) -> LoadedDialogue:
        return load_one(path, tokenizer, voices, options)

    batch: list[LoadedDialogue] = []

    def encode_pending() -> None:
        nonlocal prepared
        if not batch:
            return
        for loaded, codes in zip(batch, encode_batch(mimi, batch, dev), strict=True):
            writer.add(loaded, codes)
            prepared += 1
        if bar is not None:
            bar.update(len(batch))
        batch.clear()

    try:
        for path, loaded, error in iter_loaded(todo, load, workers):
            if loaded is None:
                assert error is not None
                failed.append((str(path), error))
                message = f"cspan prepare: skipped {path.name}: {error}"
                if bar is not None:
                    bar.write(message, file=sys.stderr)
                    bar.update(1)
                else:
                    print(message, file=sys.stderr)
                continue
            batch.append(loaded)
            if len(batch) >= batch_size:
                encode_pending()
        encode_pending()
        writer.flush()
    finally:
        if bar is not None:
            bar.close()
    with (out_dir / ERRORS_FILE).open("w", encoding="utf-8") as fh:
        for path_s, message in failed:
            fh.write(json.dumps({"file": path_s, "error": message}, ensure_ascii=False) + "\n")
    again = {r.name for r in changed} - {Path(f).stem for f, _ in failed}
    return PrepareSummary(prepared=prepared, skipped=skipped, failed=failed, out_dir=out_dir, changed=len(again))


__all__ = [
    "AlignedText",
    "LoadedDialogue",
    "PrepareOptions",
    "PrepareSummary",
    "ShardWriter",
    "align_text",
    "build_text_row",
    "encode_batch",
    "find_audio",
    "load_one",
    "read_stereo",
    "run_prepare",
]
