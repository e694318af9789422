"""Training sequences: persona prefix + dialogue in delayed coordinates, Context Span blocks spliced after ``<ret>``.

Layout (``docs/TRAINING.md`` has a diagram). A prepared dialogue is ``X`` [K, T] undelayed frames (row 0 the agent's
text, rows 1..8 the agent's Mimi codes, rows 9..16 the user's) and its persona prefix ``Pf`` [K, P]
(:func:`cspan.core.prefix.build_persona_prefix`, the function the engine's ``set_persona`` uses). Then:

1. ``Y = [Pf | X]`` (N = P + T frames) and ``G = delay_tokens(Y, delays, initial, length=N + 1)``: the delayed
   sequence the temporal transformer reads, position p holding ``Y[k, p - 1 - delay_k]`` (the streaming engine's
   coordinates, :mod:`cspan.core.streams`).
2. Inputs ``G[:, :-1]``, targets ``G[:, 1:]`` (position i predicts the column at i + 1), and a target mask that is
   False for every entry belonging to a prefix frame (or to no frame).
3. For each span (``<ret>`` at dialogue frame r, deadline frame D), a delay d is drawn by :func:`sample_rag_delay`
   and the block goes before dialogue frame ``f = r + max(1, d)``, i.e. before delayed position ``c = P + f + 1``
   -- exactly where ``DuplexEngine.inject_span`` puts it when the reference arrives between the call that
   returned frame ``f - 1`` and the next one. The block is :func:`cspan.core.span.span_block` of the reference ids;
   it is inserted with :func:`cspan.core.span.splice_block` into the inputs (before position c) AND into the targets
   (before target index c), and :func:`cspan.core.span.splice_mask` marks its n columns as no target. Splicing the
   targets at the same index means the position just before the block (c - 1) keeps its original target ``G[c]``
   (the column after the block): at inference that column is sampled at the call before the block is read. The
   last block position predicts nothing (the engine samples nothing from the block). Spans are spliced from the
   last to the first so that earlier positions stay valid.
4. A random window of at most ``context`` positions is cut (never starting inside a block).

Every random choice of sample ``g`` (which dialogue, span delays, crop) comes from a generator seeded by
``(seed, g)``, so a sample depends only on its global index: runs with different world sizes or batch splits see
the same samples, and a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cspan.core.constants import FRAME_RATE, SILENCE_TOKENS, SINE_TOKENS
from cspan.core.span import span_block, splice_block, splice_mask
from cspan.core.streams import delay_tokens

from .errors import DataError

MANIFEST_FILE = "manifest.jsonl"
DATASET_FILE = "dataset.json"
DATASET_FORMAT = "cspan-train/1"


# ---------------------------------------------------------------------------------------------------------------
# Records of a prepared dataset
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpanRecord:
    """One grounded agent turn of a prepared dialogue.

    Attributes:
        ret_frame: dialogue frame (12.5 Hz, 0 = first frame of the audio) whose text token is ``<ret>``.
        deadline_frame: the latest frame the block may be placed before: the first token frame of the body word
            minus 2, so that the EPAD before the body word and the word itself are predicted after the block.
        ids: the block's text ids ``[12] + spm(reference) + [13]``.
        reference: the reference text.
        turn: index of the turn in the dialogue file.
        tool, arguments: the tool call that produced the reference (metadata).
        truncated: the ids were cut to ``max_span_frames``.
    """

    ret_frame: int
    deadline_frame: int
    ids: tuple[int, ...]
    reference: str
    turn: int
    tool: str | None = None
    arguments: dict[str, Any] | None = None
    truncated: bool = False

    @property
    def lead(self) -> int:
        """Frames available between ``<ret>`` and the deadline (at least 1)."""
        return max(1, self.deadline_frame - self.ret_frame)

    def to_json(self) -> dict[str, Any]:
        return {
            "ret_frame": self.ret_frame,
            "deadline_frame": self.deadline_frame,
            "ids": list(self.ids),
            "reference": self.reference,
            "turn": self.turn,
            "tool": self.tool,
            "arguments": self.arguments,
            "truncated": self.truncated,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SpanRecord:
        return cls(
            ret_frame=int(data["ret_frame"]),
            deadline_frame=int(data["deadline_frame"]),
            ids=tuple(int(i) for i in data["ids"]),
            reference=str(data.get("reference", "")),
            turn=int(data.get("turn", -1)),
            tool=data.get("tool"),
            arguments=data.get("arguments"),
            truncated=bool(data.get("truncated", False)),
        )


@dataclass(frozen=True)
class DialogueRecord:
    """One line of ``manifest.jsonl``: where a prepared dialogue lives and its spans.

    Attributes:
        name: the dialogue's file stem.
        shard: the shard file (relative to the dataset folder) holding ``{name}/codes`` [K, T] and
            ``{name}/prefix`` [K, P].
        frames: T.
        prefix_frames: P.
        spans: the grounded turns.
        extra: the rest of the manifest line (source files, duration, alignment statistics).
    """

    name: str
    shard: str
    frames: int
    prefix_frames: int
    spans: tuple[SpanRecord, ...]
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shard": self.shard,
            "frames": self.frames,
            "prefix_frames": self.prefix_frames,
            "spans": [s.to_json() for s in self.spans],
            **self.extra,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DialogueRecord:
        known = {"name", "shard", "frames", "prefix_frames", "spans"}
        return cls(
            name=str(data["name"]),
            shard=str(data["shard"]),
            frames=int(data["frames"]),
            prefix_frames=int(data["prefix_frames"]),
            spans=tuple(SpanRecord.from_json(s) for s in data.get("spans", [])),
            extra={k: v for k, v in data.items() if k not in known},
        )


def read_manifest(path: str | Path) -> list[DialogueRecord]:
    """Read ``manifest.jsonl`` (one :class:`DialogueRecord` per line; a later line for a name replaces an earlier
    one; a torn last line from an interrupted write is ignored).

    Raises:
        DataError: a line in the middle is not valid JSON or lacks a field (names the file and the line).
    """
    path = Path(path)
    records: dict[str, DialogueRecord] = {}
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = DialogueRecord.from_json(json.loads(line))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            if i == len(lines) - 1:
                break  # torn last line of an interrupted run: that dialogue is prepared again
            raise DataError(f"manifest {str(path)!r}, line {i + 1}: invalid record ({exc}); delete the line") from None
        records[rec.name] = rec
    return list(records.values())


SAFETENSORS_HEADER_MAX = 100 << 20
"""The longest safetensors JSON header read (safetensors' own limit is 100 MB)."""


def shard_problem(path: Path, records: Sequence[DialogueRecord]) -> str | None:
    """What is wrong with the shard file ``path`` that should hold ``records``' tensors, or None when nothing is.

    Reads the safetensors header only (no tensor data): the file exists, its header parses, its size is the header's
    plus the tensors' bytes (a truncated or padded file is caught), and it holds ``{name}/codes`` [K, frames] and
    ``{name}/prefix`` [K, prefix_frames] of every record with the manifest's sizes.
    """
    import struct

    if not path.is_file():
        return "missing"
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return f"damaged ({size} bytes, no safetensors header)"
            (n,) = struct.unpack("<Q", head)
            if n > min(SAFETENSORS_HEADER_MAX, size - 8):
                return f"damaged (its header claims {n} bytes, the file has {size})"
            header = json.loads(fh.read(n))
    except OSError as exc:
        from cspan.core.errors import os_error_cause

        return f"unreadable ({os_error_cause(exc)})"
    except (UnicodeDecodeError, json.JSONDecodeError):
        return "damaged (its safetensors header is not valid JSON)"
    if not isinstance(header, dict):
        return "damaged (its safetensors header is not a JSON object)"
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        return "damaged (its safetensors header lacks tensor offsets)"
    if size != 8 + n + end:
        return f"damaged ({size} bytes where its header describes {8 + n + end}: truncated or overwritten)"
    for rec in records:
        for key, frames in ((f"{rec.name}/codes", rec.frames), (f"{rec.name}/prefix", rec.prefix_frames)):
            entry = header.get(key)
            shape = entry.get("shape") if isinstance(entry, dict) else None
            if not isinstance(shape, list) or len(shape) != 2 or shape[1] != frames:
                return (
                    f"damaged (tensor {key!r} is {'missing' if entry is None else f'of shape {shape}'}; the "
                    f"manifest says [K, {frames}])"
                )
    return None


def shard_problems(root: Path, records: Sequence[DialogueRecord]) -> dict[str, str]:
    """``{shard: problem}`` of the shards ``records`` name that are missing or damaged (:func:`shard_problem`)."""
    by_shard: dict[str, list[DialogueRecord]] = {}
    for rec in records:
        by_shard.setdefault(rec.shard, []).append(rec)
    problems = {}
    for shard, recs in sorted(by_shard.items()):
        problem = shard_problem(root / shard, recs)
        if problem is not None:
            problems[shard] = problem
    return problems


class PreparedDataset:
    """A folder written by ``cspan prepare``: ``dataset.json``, ``manifest.jsonl`` and ``shards/*.safetensors``.

    Args:
        root: the folder.

    Raises:
        DataError: no manifest, an empty one, an unknown format, or a shard listed but missing.
    """

    def __init__(self, root: str | Path) -> None:
        from safetensors import safe_open

        self.root = Path(root)
        info_path = self.root / DATASET_FILE
        if not info_path.is_file():
            raise DataError(
                f"{str(self.root)!r} is not a prepared dataset (no {DATASET_FILE}); run `cspan prepare --in-dir DIR "
                f"--out-dir {self.root}` first"
            )
        try:
            self.info: dict[str, Any] = json.loads(info_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise DataError(f"{str(info_path)!r}: unreadable ({exc}); run `cspan prepare` again") from None
        if self.info.get("format") != DATASET_FORMAT:
            raise DataError(
                f"{str(info_path)!r}: format {self.info.get('format')!r}, expected {DATASET_FORMAT!r}; prepare the "
                "data again with this version"
            )
        self.records = sorted(read_manifest(self.root / MANIFEST_FILE), key=lambda r: r.name)
        if not self.records:
            raise DataError(
                f"{str(self.root)!r}: the manifest lists no prepared dialogue; check `cspan prepare`'s report "
                "(errors.jsonl) and its --in-dir"
            )
        problems = shard_problems(self.root, self.records)
        if problems:
            shard, problem = next(iter(problems.items()))
            names = [r.name for r in self.records if r.shard == shard]
            more = f" (and {len(problems) - 1} other shard(s))" if len(problems) > 1 else ""
            raise DataError(
                f"shard {str(self.root / shard)!r} is {problem}{more}; it holds dialogue(s) "
                f"{', '.join(names[:5])}{', ...' if len(names) > 5 else ''}: run `cspan prepare` again into "
                f"{str(self.root)!r} with the same --in-dir (it re-encodes them)"
            )
        self._open = safe_open
        self._handles: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.records)

    def load(self, index: int) -> tuple[torch.Tensor, torch.Tensor, DialogueRecord]:
        """(codes [K, T] long, prefix [K, P] long, record) of dialogue ``index`` (sorted by name)."""
        rec = self.records[index]
        try:
            handle = self._handles.get(rec.shard)
            if handle is None:
                handle = self._open(str(self.root / rec.shard), framework="pt", device="cpu")
                self._handles[rec.shard] = handle
            codes = handle.get_tensor(f"{rec.name}/codes").long()
            prefix = handle.get_tensor(f"{rec.name}/prefix").long()
        except Exception as exc:  # changed under a running job: safetensors' SafetensorError, OSError
            raise DataError(
                f"shard {str(self.root / rec.shard)!r} cannot be read ({type(exc).__name__}: {exc}); run `cspan "
                f"prepare` again into {str(self.root)!r} with the same --in-dir (it re-encodes it)"
            ) from None
        return codes, prefix, rec


# ---------------------------------------------------------------------------------------------------------------
# The MoshiRAG delay sampler
# ---------------------------------------------------------------------------------------------------------------


def sample_rag_delay(
    lead: int,
    rng: np.random.Generator,
    *,
    frame_rate: float = FRAME_RATE,
    start_delay_s: float = 1.0,
    end_gap_s: float = 1.0,
    random_sampling_proba: float = 0.2,
) -> int:
    """Frames between ``<ret>`` and the Context Span block: the MoshiRAG retrieval-delay distribution.

    Source: MoshiRAG (Chien et al., arXiv 2604.12928, section 3.2, Eq. 3; config
    ``rag_time_sampling_params = {start_delay: 1.0, end_gap: 1.0, random_sampling_proba: 0.2}``), as used by the
    original Context Spanning ``finetune.sample_rag_delay``. With ``d_lead`` the lead in seconds and
    ``p ~ U(0, 1)``::

        d ~ U(0, d_lead)                         if d_lead < start_delay + end_gap (2 s) or p < 0.2
        d ~ U(start_delay, d_lead - end_gap)     otherwise

    so most blocks arrive at least 1 s after ``<ret>`` and at least 1 s before the body. In frames: uniform
    integers, ``[0, lead]`` in the first case, ``[ceil(1.0 * 12.5), floor(lead - 1.0 * 12.5)]`` in the second (the
    first case again when that range is empty). ``p`` is always drawn, so the number of draws does not depend on
    the branch.

    Args:
        lead: frames from ``<ret>`` to the deadline (``deadline_frame - ret_frame``); values < 1 count as 1.
        rng: the sample's generator.
        frame_rate: frames per second.

    Returns:
        d in ``[0, lead]`` (the caller places the block ``max(1, d)`` frames after ``<ret>``).
    """
    lead = max(1, int(lead))
    p = rng.random()
    lead_s = lead / frame_rate
    if lead_s < start_delay_s + end_gap_s or p < random_sampling_proba:
        d = int(rng.integers(0, lead, endpoint=True))
    else:
        lo = math.ceil(start_delay_s * frame_rate)
        hi = math.floor(lead - end_gap_s * frame_rate)
        d = int(rng.integers(lo, hi, endpoint=True)) if lo <= hi else int(rng.integers(0, lead, endpoint=True))
    return min(d, lead)


# ---------------------------------------------------------------------------------------------------------------
# Sequence assembly
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class TrainingSequence:
    """One training example in delayed coordinates.

    Attributes:
        inputs: [K, L] long, the columns the temporal transformer reads (position i = ``inputs[:, i]``).
        targets: [K, L] long, what position i predicts (text row 0, audio rows 1..; the depformer is teacher-forced
            with this column).
        mask: [K, L] bool, True where ``targets`` is a training target (False on prefix frames, span blocks,
            entries of no frame, padding).
        blocks: (first input position, n) of each spliced block, in increasing order.
        prefix_positions: inputs that belong to the persona prefix (positions ``0 .. prefix_positions - 1``).
        offset: the uncropped position of ``inputs[:, 0]``.
        dialogue: the record's name ("" when built by hand).
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    blocks: list[tuple[int, int]]
    prefix_positions: int
    offset: int = 0
    dialogue: str = ""

    @property
    def length(self) -> int:
        """L, the number of positions."""
        return int(self.inputs.shape[-1])


def frame_target_mask(num_frames: int, first_frame: int, delays: Sequence[int], length: int) -> torch.Tensor:
    """[K, length] bool: target index i (= delayed position i + 1) of row k is a target iff its frame
    ``i - delays[k]`` lies in ``[first_frame, num_frames)``."""
    idx = torch.arange(length)[None, :] - torch.tensor(list(delays))[:, None]  # frame of target i, row k
    return (idx >= first_frame) & (idx < num_frames)


def assemble_sequence(
    codes: torch.Tensor,
    prefix: torch.Tensor,
    spans: Sequence[tuple[int, Sequence[int]]],
    delays: Sequence[int],
    initial_tokens: Sequence[int],
    *,
    agent_placeholder: Sequence[int] = SILENCE_TOKENS,
    user_placeholder: Sequence[int] = SINE_TOKENS,
) -> TrainingSequence:
    """Build the full (uncropped) training sequence of one dialogue (steps 1-3 of the module docstring).

    Args:
        codes: [K, T] long undelayed dialogue frames.
        prefix: [K, P] long undelayed persona-prefix frames (P may be 0).
        spans: (f, ids) per block: the block goes before dialogue frame f (0 <= f < T) with text ids ``ids``.
        delays: K per-row delays.
        initial_tokens: K initial ids.
        agent_placeholder, user_placeholder: the block's audio codes (as the engine's ``inject_span``).

    Returns:
        :class:`TrainingSequence` with ``L = P + T + sum(n)`` positions.

    Raises:
        ValueError: row counts differ, or a block frame is outside the dialogue.
    """
    K, T = codes.shape
    if prefix.shape[0] != K:
        raise ValueError(f"prefix has {prefix.shape[0]} rows, codes have {K}")
    P = prefix.shape[1]
    frames = torch.cat([prefix.long(), codes.long()], dim=1)  # Y [K, N]
    N = P + T
    seq = delay_tokens(frames, list(delays), list(initial_tokens), length=N + 1)  # G [K, N + 1]
    targets = seq[:, 1:]  # target index i = what position i predicts
    mask = frame_target_mask(N, P, delays, N)
    placed: list[tuple[int, int]] = []
    for f, ids in sorted(spans, key=lambda s: s[0], reverse=True):
        if not 0 <= f < T:
            raise ValueError(f"a Context Span block before dialogue frame {f} is outside the dialogue (T = {T})")
        block = span_block(
            list(ids), num_streams=K, agent_placeholder=agent_placeholder, user_placeholder=user_placeholder
        )
        c = P + f + 1  # the delayed position the block goes before (the engine's pending position)
        n = block.shape[-1]
        seq = splice_block(seq, c, block)
        targets = splice_block(targets, c, block)  # position c - 1 keeps its target G[c]; block columns follow
        mask = splice_mask(mask, c, n)
        placed = [(p + n, m) for p, m in placed]
        placed.append((c, n))
    placed.sort()
    return TrainingSequence(inputs=seq[:, :-1], targets=targets, mask=mask, blocks=placed, prefix_positions=P + 1)


def crop_sequence(seq: TrainingSequence, context: int, rng: np.random.Generator) -> TrainingSequence:
    """A window of at most ``context`` positions, its start uniform over the valid starts and moved to the end of
    a block (or, when the window would then run past the end, to the block's start) when it falls inside one: a
    window never starts in the middle of a Context Span.

    Raises:
        ValueError: ``context < 2``.
    """
    if context < 2:
        raise ValueError(f"context must be at least 2 positions, got {context}")
    L = seq.length
    if context >= L:
        return seq
    start = int(rng.integers(0, L - context, endpoint=True))
    for first, n in seq.blocks:
        if first < start < first + n:
            start = first + n if first + n <= L - context else first
    end = start + context
    blocks = [(p - start, n) for p, n in seq.blocks if p >= start and p + n <= end]
    return TrainingSequence(
        inputs=seq.inputs[:, start:end],
        targets=seq.targets[:, start:end],
        mask=seq.mask[:, start:end],
        blocks=blocks,
        prefix_positions=max(0, seq.prefix_positions - start),
        offset=seq.offset + start,
        dialogue=seq.dialogue,
    )


@dataclass(frozen=True)
class SamplerConfig:
    """How samples are drawn (all randomness is a function of ``(seed, global index)``).

    Attributes:
        seed: the run's seed.
        context: the longest window in positions.
        start_delay_s, end_gap_s, random_sampling_proba: :func:`sample_rag_delay`'s parameters.
    """

    seed: int = 0
    context: int = 3000
    start_delay_s: float = 1.0
    end_gap_s: float = 1.0
    random_sampling_proba: float = 0.2


class SequenceSampler:
    """Sample ``g`` of a run: dialogue ``perm_e[g mod D]`` (a fresh permutation per epoch ``e = g // D``), its span
    delays, its crop.

    Args:
        dataset: the prepared dataset.
        delays, initial_tokens: the model's.
        config: :class:`SamplerConfig`.
    """

    def __init__(
        self,
        dataset: PreparedDataset,
        delays: Sequence[int],
        initial_tokens: Sequence[int],
        config: SamplerConfig,
    ) -> None:
        self.dataset = dataset
        self.delays = list(delays)
        self.initial_tokens = list(initial_tokens)
        self.config = config

    @lru_cache(maxsize=4)  # noqa: B019 - a handful of epochs, the sampler lives as long as the run
    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.config.seed, 0x5EED, epoch]).permutation(len(self.dataset))

    def dialogue_index(self, g: int) -> int:
        """Index (into the dataset) of the dialogue of sample ``g``."""
        D = len(self.dataset)
        return int(self._permutation(g // D)[g % D])

    def block_frames(self, record: DialogueRecord, rng: np.random.Generator) -> list[tuple[int, Sequence[int]]]:
        """(f, ids) per span: ``f = ret_frame + max(1, sample_rag_delay(lead))``, clamped to the dialogue."""
        out = []
        cfg = self.config
        for span in record.spans:
            d = sample_rag_delay(
                span.lead,
                rng,
                start_delay_s=cfg.start_delay_s,
                end_gap_s=cfg.end_gap_s,
                random_sampling_proba=cfg.random_sampling_proba,
            )
            f = min(span.ret_frame + max(1, d), record.frames - 1)
            if f > span.ret_frame:
                out.append((f, span.ids))
        return out

    def sample(self, g: int) -> TrainingSequence:
        """The training sequence of global sample index ``g`` (deterministic)."""
        rng = np.random.default_rng([self.config.seed, int(g)])
        codes, prefix, record = self.dataset.load(self.dialogue_index(g))
        seq = assemble_sequence(codes, prefix, self.block_frames(record, rng), self.delays, self.initial_tokens)
        seq.dialogue = record.name
        return crop_sequence(seq, self.config.context, rng)


def collate(seqs: Sequence[TrainingSequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad to the longest sequence: inputs and targets with -1 (zero embedding), mask with False.

    Returns:
        (inputs [B, K, L], targets [B, K, L], mask [B, K, L] bool).
    """
    L = max(s.length for s in seqs)
    K = seqs[0].inputs.shape[0]
    B = len(seqs)
    inputs = torch.full((B, K, L), -1, dtype=torch.long)
    targets = torch.full((B, K, L), -1, dtype=torch.long)
    mask = torch.zeros((B, K, L), dtype=torch.bool)
    for b, s in enumerate(seqs):
        n = s.length
        inputs[b, :, :n] = s.inputs
        targets[b, :, :n] = s.targets
        mask[b, :, :n] = s.mask
    return inputs, targets, mask


__all__ = [
    "DATASET_FILE",
    "DATASET_FORMAT",
    "MANIFEST_FILE",
    "DialogueRecord",
    "PreparedDataset",
    "SamplerConfig",
    "SequenceSampler",
    "SpanRecord",
    "TrainingSequence",
    "assemble_sequence",
    "collate",
    "crop_sequence",
    "frame_target_mask",
    "read_manifest",
    "sample_rag_delay",
]
