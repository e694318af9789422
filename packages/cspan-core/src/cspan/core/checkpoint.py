"""Checkpoint loading: Hub repo ids, local folders and files in the Kyutai / PersonaPlex / Context Spanning layouts.

Layouts (file names as in kyutai-labs/moshi ``moshi/models/loaders.py`` and NVIDIA/personaplex):

- a **base folder** (or Hub repo) holding ``model.safetensors`` (the LM), ``tokenizer-e351c8d8-checkpoint125.safetensors``
  (Mimi), ``tokenizer_spm_32k_3.model`` (SentencePiece) and optionally ``config.json`` (the LM keyword arguments,
  upstream format, plus an optional ``"mimi_config"`` entry for a non-standard codec) and ``voices/<name>.pt``;
- a **fine-tune** (mindlogic-ai/Context-Spanning ``contextspan/model/weights.py``): a ``*.pt`` file holding
  ``{"model": state_dict}`` loaded over a base (``._orig_mod.`` prefixes of ``torch.compile`` are stripped), possibly
  with unmerged LoRA adapters (``<name>.base.weight``, ``<name>.lora_A``, ``<name>.lora_B`` and a top-level
  ``{"lora": {"r", "alpha"}}``); its folder or repo may hold ``voices/<name>.pt`` = ``{"codes": LongTensor[8, P]}``.

Weights are checked against the model before anything is read (missing / unexpected keys, shapes), read one tensor
at a time, cast to the requested dtype and assigned into a model built on the ``meta`` device, so loading a 7B
never holds two copies of it. ``torch.load`` is only ever called with ``weights_only=True``
(:func:`cspan.core.torch_files.load_torch_file`).

This module imports torch lazily (inside functions) so that ``cspan --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import math
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import CONTEXT_SPANNING, PERSONAPLEX, PrefixLayout
from .errors import CheckpointError, validation_summary
from .torch_files import load_torch_file
from .voice import (
    ENV_VOICES,
    CheckpointVoices,
    VoicePrompt,
    env_voices,
    is_recording,
    is_torch_file,
    load_voice,
    load_voice_prompt,
    scan_voices,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    import sentencepiece
    import torch

    from .config import LMConfig, MimiConfig
    from .lm import LMModel
    from .mimi import Mimi
    from .reads import Read, Reads

log = logging.getLogger(__name__)

# --- file names and defaults ------------------------------------------------------------------------------------
LM_FILE = "model.safetensors"
"""LM weights in a base folder (``loaders.MOSHI_NAME``)."""
MIMI_FILE = "tokenizer-e351c8d8-checkpoint125.safetensors"
"""Mimi weights in a base folder (``loaders.MIMI_NAME``)."""
TOKENIZER_FILE = "tokenizer_spm_32k_3.model"
"""SentencePiece model in a base folder (``loaders.TEXT_TOKENIZER_NAME``)."""
CONFIG_FILE = "config.json"
VOICES_DIR = "voices"
VOICES_ARCHIVE = "voices.tgz"
"""PersonaPlex's voices in a base repo (``voices/NATF0.pt`` ...), extracted by :func:`extract_voices`."""
MOSHI_LORA_FILE = "lora.safetensors"
"""LoRA adapters as kyutai-labs/moshi-finetune saves them (next to a ``config.json`` with ``"lora": true``)."""
EXPORT_INFO = "export.json"
"""Written next to a fine-tune by ``cspan train``: the base it loads over and its prefix layout."""
PREFIX_LAYOUT_KEY = "prefix_layout"
"""Key of ``config.json`` / ``export.json`` naming the persona prefix layout (``context-spanning`` / ``personaplex``)."""

DEFAULT_BASE = "nvidia/personaplex-7b-v1"
"""Base repo of the released fine-tune."""
DEFAULT_REPO = "mindlogicinc/context-spanning-7b"
"""Repo of the released Context Spanning fine-tune."""
DEFAULT_FINE_TUNE_FILE = "context_spanning_7b.pt"
"""The fine-tune file inside :data:`DEFAULT_REPO`."""
DEFAULT_CHECKPOINT = DEFAULT_REPO
"""What :func:`load_checkpoint` loads when no source is given (and ``CSPAN_CHECKPOINT`` is unset)."""

ENV_CHECKPOINT = "CSPAN_CHECKPOINT"
ENV_BASE = "CSPAN_BASE"

NUM_VOICE_CODEBOOKS = 8
"""Codebook rows of a voice prompt (the agent's 8 Mimi codebooks)."""

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_PATTERNS = [
    CONFIG_FILE,
    LM_FILE,
    MIMI_FILE,
    TOKENIZER_FILE,
    "*.pt",
    f"{VOICES_DIR}/*.pt",
    VOICES_ARCHIVE,
    MOSHI_LORA_FILE,
    EXPORT_INFO,
]
_FIX_OFFLINE = (
    f"pass a local checkpoint folder instead (a folder holding {LM_FILE}, {MIMI_FILE} and {TOKENIZER_FILE}: "
    "--checkpoint DIR on the command line, load_checkpoint(DIR) in Python), or build a small random one with "
    "`cspan model tiny DIR`"
)

_FIX_BASE_OFFLINE = (
    f"this is the base of a fine-tune: pass a local copy of it (--base DIR or {ENV_BASE}, a folder holding "
    f"{LM_FILE}, {MIMI_FILE} and {TOKENIZER_FILE})"
)

# safetensors dtype name -> (bytes per element, torch dtype attribute)
_ST_DTYPES: dict[str, tuple[int, str]] = {
    "F64": (8, "float64"),
    "F32": (4, "float32"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"),
    "I64": (8, "int64"),
    "I32": (4, "int32"),
    "I16": (2, "int16"),
    "I8": (1, "int8"),
    "U8": (1, "uint8"),
    "U16": (2, "uint16"),
    "U32": (4, "uint32"),
    "U64": (8, "uint64"),
    "BOOL": (1, "bool"),
}
_MAX_HEADER = 100 * 1024 * 1024


# ---------------------------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Checkpoint:
    """Everything :func:`load_checkpoint` loads.

    Attributes:
        lm: the LM in eval mode, on the requested device and dtype.
        mimi: the codec (float32, eval mode) encoding 8 codebooks (``set_num_codebooks(8)``).
        tokenizer: the SentencePiece processor of the text stream.
        lm_config / mimi_config: the configurations the models were built from.
        archive_voices: voice name -> file of PersonaPlex's ``voices.tgz`` (extracted; ``NATF2`` ...), found by name
            like the others but never a default (they are PersonaPlex input embeddings: :func:`load_voice_prompt`).
        voices: voice prompt name -> file (``voices/<name>.pt``; ``$CSPAN_VOICES_DIR`` over the fine-tune's over the
            base's), load one with :func:`load_voice`.
        source: what was asked for (repo id, folder or file), as given.
        files: resolved paths by role: ``lm``, ``mimi``, ``tokenizer``, and where present ``config``, ``fine_tune``.
        fine_tune: the fine-tune loaded over the base (a ``.pt`` or moshi-finetune's ``lora.safetensors``), or None.
        lora: ``{"r", "alpha", "modules": [names]}`` when the fine-tune carries LoRA adapters kept unmerged (plus
            ``"format": "moshi"``, ``"scaling"`` and ``"merged"``: the adapters folded into the weights at load, for
            moshi-finetune's adapters), else None.
        prefix_layout: the persona prefix layout the model was trained with (:func:`resolve_prefix_layout`).
    """

    lm: LMModel
    mimi: Mimi
    tokenizer: sentencepiece.SentencePieceProcessor
    lm_config: LMConfig
    mimi_config: MimiConfig
    voices: dict[str, Path]
    source: str
    files: dict[str, Path] = field(default_factory=dict)
    fine_tune: Path | None = None
    lora: dict[str, Any] | None = None
    prefix_layout: PrefixLayout = CONTEXT_SPANNING
    archive_voices: dict[str, Path] = field(default_factory=dict)

    def load_voice(self, name_or_path: str | os.PathLike[str]) -> torch.Tensor:
        """Shorthand for :func:`cspan.core.voice.load_voice` with this checkpoint: LongTensor [8, P]."""
        return load_voice(name_or_path, self)

    def load_voice_prompt(self, name_or_path: str | os.PathLike[str]) -> VoicePrompt:
        """Shorthand for :func:`cspan.core.voice.load_voice_prompt` with this checkpoint (codes or embeddings)."""
        return load_voice_prompt(name_or_path, self)


@dataclass
class CheckpointFiles:
    """The files a source resolves to (nothing loaded yet).

    Attributes:
        source: the source as given.
        lm: LM safetensors of the base.
        mimi / tokenizer / config: the other base files (None where the folder lacks them).
        fine_tune: fine-tune ``.pt`` loaded over ``lm`` (None for a plain base).
        voices: voice prompt name -> file; the fine-tune folder's ``voices/`` win over the base's.
        base_dir: the base folder.
        personaplex: the base is NVIDIA PersonaPlex's (its repo id, or a folder holding its ``voices.tgz``).
        archive_voices: the voices of the base's ``voices.tgz`` (or of the ``voices/`` PersonaPlex extracted next to
            it), name -> file.
        fine_tune_config: moshi-finetune's ``config.json`` next to its ``lora.safetensors``, else None.
        layout: a ``prefix_layout`` recorded for this checkpoint (``config.json`` or ``export.json``), else None.
    """

    source: str
    lm: Path
    mimi: Path | None
    tokenizer: Path | None
    config: Path | None
    fine_tune: Path | None
    voices: dict[str, Path]
    base_dir: Path
    personaplex: bool = False
    archive_voices: dict[str, Path] = field(default_factory=dict)
    fine_tune_config: Path | None = None
    layout: str | None = None

    def as_dict(self) -> dict[str, Path]:
        """Role -> path for the files that exist (``lm``, ``mimi``, ``tokenizer``, ``config``, ``fine_tune``)."""
        out = {"lm": self.lm, "mimi": self.mimi, "tokenizer": self.tokenizer, "config": self.config}
        out["fine_tune"] = self.fine_tune
        return {k: v for k, v in out.items() if v is not None}

    def reads(self, flag: str = "--checkpoint", *, folders: bool = True) -> list[Read]:
        """Every file and folder loading this checkpoint reads, for :func:`cspan.core.reads.check_outputs` (no output
        may overwrite one): the LM, Mimi, tokenizer, ``config.json``, the fine-tune with its ``config.json`` or
        ``export.json``, ``voices.tgz``; and (``folders``) whole folders: the folder given as the checkpoint (or the
        Hub snapshot a repo id resolves to), the base's folder under a fine-tune, and each folder voices are scanned
        from. Without ``folders``: the model's files alone (what ``cspan voice encode`` reads)."""
        from .reads import Read

        out: list[Read] = []
        given = Path(self.source).expanduser()
        if folders and given.is_dir():
            out.append(Read(flag, given, f"the {flag} folder", folder=True))
        elif folders and not given.is_file():  # a Hub repo: its snapshot folder
            top = self.fine_tune.parent if self.fine_tune is not None else self.base_dir
            out.append(Read(flag, top, f"the {flag} folder (a Hub snapshot)", folder=True))
        if folders and self.fine_tune is not None:
            out.append(Read(flag, self.base_dir, f"the base checkpoint folder of {flag}", folder=True))
        roles: dict[str, Path | None] = {
            "LM weights": self.lm,
            "Mimi weights": self.mimi,
            "tokenizer": self.tokenizer,
            CONFIG_FILE: self.config,
            "fine-tune": self.fine_tune,
            "fine-tune config": self.fine_tune_config,
            VOICES_ARCHIVE: self.base_dir / VOICES_ARCHIVE,
        }
        if self.fine_tune is not None:
            roles[EXPORT_INFO] = self.fine_tune.parent / EXPORT_INFO
        for role, p in roles.items():
            if p is not None and p.is_file():
                whose = "base checkpoint" if self.fine_tune is not None and p.parent == self.base_dir else flag
                out.append(Read(flag, p, f"the {whose}'s {role}"))
        if folders:
            voice_dirs = {p.parent for p in (*self.voices.values(), *self.archive_voices.values())}
            out += [Read(flag, d, f"the {flag}'s voices folder", folder=True) for d in sorted(voice_dirs)]
        return out


# ---------------------------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------------------------


def _torch_dtype(dtype: Any) -> torch.dtype | None:
    """``None``, a ``torch.dtype`` or a name (``bf16``, ``bfloat16``, ``fp16``, ``float16``, ``fp32``, ``float32``)."""
    import torch

    if dtype is None:
        return dtype
    names = {
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
        "half": torch.float16,
        "fp32": torch.float32,
        "float32": torch.float32,
        "float": torch.float32,
    }
    key = str(dtype).lower().removeprefix("torch.")
    if key not in names:
        raise CheckpointError(f"dtype {dtype!r}: the model runs in bfloat16, float16 or float32")
    return names[key]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _hf_cache_dir() -> str | None:
    """The Hub cache folder from the environment at call time (``HF_HUB_CACHE``, else ``$HF_HOME/hub``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return None


def strip_compile_prefixes(state: dict[str, Any]) -> dict[str, Any]:
    """Remove ``torch.compile`` wrapper names from keys: ``a._orig_mod.b`` -> ``a.b``, ``_orig_mod.a`` -> ``a``."""
    out = {}
    for key, value in state.items():
        new = key
        while "._orig_mod." in new:
            new = new.replace("._orig_mod.", ".")
        while new.startswith("_orig_mod."):
            new = new[len("_orig_mod.") :]
        out[new] = value
    return out


def _fmt_keys(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


# ---------------------------------------------------------------------------------------------------------------
# Tensor sources: a safetensors file (header checked by hand) or a torch.load-ed state dict
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class SafetensorsHeader:
    """The parsed header of a safetensors file.

    Attributes:
        path: the file.
        tensors: key -> (dtype name as stored, e.g. ``"BF16"``; shape).
        metadata: the optional ``__metadata__`` string map.
        offsets: key -> (first, end) byte of its data in the file (checked to lie inside it).
    """

    path: Path
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    metadata: dict[str, str]
    offsets: dict[str, tuple[int, int]]

    def float_dtype(self) -> str | None:
        """The dtype name holding the most floating values, e.g. ``"BF16"`` (a few float32 norms in a bfloat16
        file do not make it float32); None if there is none."""
        counts: dict[str, int] = {}
        for name, shape in self.tensors.values():
            if name.startswith(("F", "BF")):
                counts[name] = counts.get(name, 0) + math.prod(shape)
        return max(sorted(counts), key=counts.__getitem__) if counts else None


def read_safetensors_header(path: str | os.PathLike[str], role: str = "checkpoint") -> SafetensorsHeader:
    """Read and validate the header of a safetensors file without reading any tensor data.

    Checks the 8-byte header length, the JSON header, every entry's dtype, shape and byte range, and that every
    tensor's bytes lie inside the file (a truncated download names the first tensor it cuts).

    Args:
        path: the ``.safetensors`` file.
        role: what the file is for (``"LM"``, ``"Mimi"``), used in messages.

    Raises:
        CheckpointError: missing file, truncated file, corrupt header or entry (names the file and the key).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{role} weights file {str(path)!r} does not exist; check the path or download it again")
    size = path.stat().st_size
    fix = "download or copy the file again"
    with path.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{role} weights file {str(path)!r} is truncated ({size} bytes, no header); {fix}")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER or n + 8 > size:
            raise CheckpointError(
                f"{role} weights file {str(path)!r} is truncated or not a safetensors file: header length {n} "
                f"does not fit in {size} bytes; {fix}"
            )
        try:
            header = json.loads(fh.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(
                f"{role} weights file {str(path)!r} has a corrupt header (not valid JSON: {exc}); {fix}"
            ) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{role} weights file {str(path)!r} has a corrupt header (not a JSON object); {fix}")
    data_size = size - 8 - n
    metadata = header.pop("__metadata__", None) or {}
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    offsets: dict[str, tuple[int, int]] = {}
    for key, entry in header.items():
        where = f"{role} weights file {str(path)!r}, tensor {key!r}"
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(s) for s in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{where}: corrupt header entry {entry!r}; {fix}") from None
        if dtype not in _ST_DTYPES:
            raise CheckpointError(f"{where}: unknown dtype {dtype!r} in the header; {fix}")
        want = math.prod(shape) * _ST_DTYPES[dtype][0]
        if not (isinstance(begin, int) and isinstance(end, int)) or begin < 0 or end - begin != want:
            raise CheckpointError(
                f"{where}: corrupt header entry (byte range {begin}..{end} for shape {list(shape)} {dtype}); {fix}"
            )
        if end > data_size:
            raise CheckpointError(
                f"{where}: the file is truncated (the tensor needs data bytes up to {end}, the file holds "
                f"{max(data_size, 0)}); {fix}"
            )
        tensors[key] = (dtype, shape)
        offsets[key] = (8 + n + begin, 8 + n + end)
    return SafetensorsHeader(path=path, tensors=tensors, metadata=dict(metadata), offsets=offsets)


FINGERPRINT_SAMPLE = 4096
"""Bytes of each tensor (or archive record) that :func:`weights_fingerprint` reads, from its start."""
_FINGERPRINT_SCHEME = b"cspan-weights-fingerprint/1\n"


def weights_fingerprint(path: str | os.PathLike[str], role: str = "checkpoint") -> str:
    """A cheap fingerprint of the weights in a file (64 hex digits of a SHA-256), by content, not by path: the same
    weights moved, copied or reached through a Hub cache give the same one; other weights (a fine-tune, another
    seed, a retrained export) another. Reads the header and :data:`FINGERPRINT_SAMPLE` bytes per tensor, so a
    7B file costs one small read per tensor, not a pass over its gigabytes.

    - ``.safetensors``: the header's tensor names, dtypes and shapes (sorted by name; not the byte offsets or the
      ``__metadata__``), then the first bytes of each tensor's data (a fine-tune changes nearly every tensor from
      its first values).
    - a ``torch.save`` zip (``.pt``): each record's name inside the archive (without the top folder, which torch
      names after the file), its size and CRC-32 as the zip directory stores them (so the data of every tensor
      counts), and its first bytes; torch's random per-save ``.data/serialization_id`` is left out, so the same
      weights saved again give the same fingerprint.
    - any other file (a legacy non-zip ``.pt``): the SHA-256 of all its bytes.

    Raises:
        CheckpointError: the file is missing, unreadable, or a safetensors file with a corrupt header (names it).
    """
    import hashlib
    import zipfile

    path = Path(path)
    digest = hashlib.sha256(_FINGERPRINT_SCHEME)
    try:
        if path.suffix == ".safetensors":
            header = read_safetensors_header(path, role)  # validated: every entry's bytes lie inside the file
            heads = {}
            with path.open("rb") as fh:
                for key, (begin, end) in sorted(header.offsets.items(), key=lambda kv: kv[1][0]):  # in file order
                    fh.seek(begin)
                    heads[key] = fh.read(min(FINGERPRINT_SAMPLE, end - begin))
            names = sorted(header.tensors)
            layout = [[k, header.tensors[k][0], list(header.tensors[k][1])] for k in names]
            digest.update(json.dumps(layout, separators=(",", ":")).encode("utf-8"))
            for key in names:
                digest.update(heads[key])
        elif zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as zf:
                records = {i.filename.partition("/")[2]: i for i in zf.infolist() if not i.is_dir()}
                for name in sorted(records):
                    if name == ".data/serialization_id":
                        continue
                    info = records[name]
                    digest.update(f"{name}\0{info.file_size}\0{info.CRC}\0".encode())
                    with zf.open(info) as fh:
                        digest.update(fh.read(FINGERPRINT_SAMPLE))
        else:
            with path.open("rb") as fh:
                while chunk := fh.read(1 << 20):
                    digest.update(chunk)
    except (OSError, zipfile.BadZipFile, ValueError) as exc:
        raise CheckpointError(
            f"{role} weights file {str(path)!r} cannot be read ({exc}); check the path or download it again"
        ) from None
    return digest.hexdigest()


class _Source:
    """One file of tensors: its key -> shape map, which keys hold floating values, and a per-key reader."""

    path: Path
    role: str
    shapes: dict[str, tuple[int, ...]]
    floating: dict[str, bool]

    def get(self, key: str) -> torch.Tensor:
        raise KeyError(key)

    def close(self) -> None:
        """Release the file (no-op where nothing is held)."""


class _SafetensorsSource(_Source):
    def __init__(self, path: Path, role: str, device: str = "cpu") -> None:
        self.path, self.role, self.device = Path(path), role, device
        self.header = read_safetensors_header(path, role)
        self.shapes = {k: v[1] for k, v in self.header.tensors.items()}
        self.floating = {k: v[0].startswith(("F", "BF")) for k, v in self.header.tensors.items()}
        self._handle: Any = None

    def get(self, key: str) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        try:
            if self._handle is None:
                self._handle = safe_open(str(self.path), framework="pt", device=self.device)
            return self._handle.get_tensor(key)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise CheckpointError(
                f"{self.role} weights file {str(self.path)!r}, tensor {key!r}: cannot be read ({exc}); "
                "download or copy the file again"
            ) from None

    def close(self) -> None:
        self._handle = None


class _DictSource(_Source):
    def __init__(self, path: Path, role: str, tensors: dict[str, torch.Tensor]) -> None:
        self.path, self.role, self.tensors = Path(path), role, tensors
        self.shapes = {k: tuple(v.shape) for k, v in tensors.items()}
        self.floating = {k: bool(v.is_floating_point()) for k, v in tensors.items()}

    def get(self, key: str) -> torch.Tensor:
        return self.tensors[key]


# ---------------------------------------------------------------------------------------------------------------
# Key checking and assignment
# ---------------------------------------------------------------------------------------------------------------


def _check_and_plan(
    expected: dict[str, tuple[int, ...]],
    sources: list[_Source],
    aliases: dict[str, str] | None = None,
    floating: dict[str, bool] | None = None,
) -> dict[str, tuple[_Source, str]]:
    """Map every expected key to (source, key in that source), checking names, shapes and dtype kinds.

    ``sources`` are in priority order (a fine-tune before its base). ``aliases`` maps an expected key to an
    alternative key that may stand for it in any source (a LoRA layer's ``x.base.weight`` <- the base's
    ``x.weight``). ``floating`` says which expected keys hold floating values (a float weight stored as an integer
    or boolean tensor is refused).

    Raises:
        CheckpointError: a key the model needs is in no source, a source has a key the model does not have, a
            shape differs, or a float weight is stored as integers / an integer buffer as floats (each names the
            file and the key).
    """
    aliases = aliases or {}
    plan: dict[str, tuple[_Source, str]] = {}
    missing = []
    for key in expected:
        for src in sources:
            if key in src.shapes:
                plan[key] = (src, key)
                break
            alt = aliases.get(key)
            if alt is not None and alt in src.shapes:
                plan[key] = (src, alt)
                break
        else:
            missing.append(key)
    if missing:
        files = " or ".join(repr(str(s.path)) for s in sources)
        raise CheckpointError(
            f"{sources[-1].role} weights: missing key(s) {_fmt_keys(missing)} in {files}; the file does not match "
            "the model config (wrong config.json, a different model, or an incomplete file)"
        )
    known = set(expected) | set(aliases.values())
    for src in sources:
        unexpected = sorted(k for k in src.shapes if k not in known)
        if unexpected:
            raise CheckpointError(
                f"{src.role} weights file {str(src.path)!r}: unexpected key(s) {_fmt_keys(unexpected)} that the model "
                "does not have; the file does not match the model config (check config.json / dep_q)"
            )
    for key, (src, skey) in plan.items():
        if tuple(src.shapes[skey]) != tuple(expected[key]):
            raise CheckpointError(
                f"{src.role} weights file {str(src.path)!r}, key {skey!r}: shape {list(src.shapes[skey])} but the "
                f"model expects {list(expected[key])}; the file does not match the model config"
            )
        want = None if floating is None else floating.get(key)
        if want is not None and src.floating.get(skey, want) != want:
            stored = "integer or boolean" if want else "floating"
            raise CheckpointError(
                f"{src.role} weights file {str(src.path)!r}, key {skey!r}: stored as {stored} values but the model "
                f"expects {'floating' if want else 'integer'} values; the file is corrupt or not this model's"
            )
    return plan


def _assign(
    module: torch.nn.Module,
    plan: dict[str, tuple[_Source, str]],
    device: str | torch.device,
    float_dtype: torch.dtype,
) -> None:
    """Read the planned tensors one at a time, casting floats to ``float_dtype`` and moving each to ``device`` right
    away (so at most one transient extra tensor exists besides the single loaded copy), assign them all into the
    meta-built ``module``, then check that nothing is left on ``meta``."""
    import torch

    state = {}
    finite: list[tuple[str, torch.Tensor]] = []
    for key, (src, skey) in plan.items():
        tensor = src.get(skey)
        state[key] = tensor.to(device=device, dtype=float_dtype if tensor.is_floating_point() else tensor.dtype)
        if state[key].is_floating_point() and state[key].numel():
            finite.append((key, torch.isfinite(state[key]).all()))  # on the device; read back once below
    if finite:
        flags = torch.stack([flag for _, flag in finite]).cpu().tolist()
        bad = [key for (key, _), ok in zip(finite, flags, strict=True) if not ok]
        if bad:
            files = sorted({str(plan[k][0].path) for k in bad})
            raise CheckpointError(
                f"{plan[bad[0]][0].role} weights file(s) {', '.join(repr(f) for f in files)}: key(s) "
                f"{_fmt_keys([plan[k][1] for k in bad])} hold NaN or infinite values; the file is corrupt or comes "
                "from a training run that diverged"
            )
    module.load_state_dict(state, strict=True, assign=True)
    del state
    left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.device.type == "meta"]
    if left:
        raise CheckpointError(
            f"{type(module).__name__} still has tensors without values after loading: {_fmt_keys(left)}; they are not "
            "part of its state dict, so the checkpoint cannot provide them"
        )


# ---------------------------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------------------------


def _read_json(path: Path, role: str = "config") -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{role} file {str(path)!r} does not exist") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{role} file {str(path)!r} is not valid JSON ({exc}); fix or delete it") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{role} file {str(path)!r} must hold a JSON object")
    return data


def _count_depformer_heads(keys: list[str]) -> int:
    """Number of ``linears.{i}`` output heads among state-dict keys (plain or LoRA-wrapped); 0 if none."""
    pattern = re.compile(r"^linears\.(\d+)\.(?:base\.)?weight$")
    idx = {int(m.group(1)) for k in keys if (m := pattern.match(k))}
    return max(idx) + 1 if idx else 0


def read_configs(config_path: Path | None, weight_keys: list[str] | None = None) -> tuple[LMConfig, MimiConfig]:
    """The LM and Mimi configurations of a checkpoint folder.

    ``config.json`` holds the LM keyword arguments in upstream format (meta keys such as ``moshi_name`` are kept
    as extras) and optionally ``"mimi_config"`` (a ``loaders._mimi_config``-shaped dict); without it the real
    24 kHz Mimi is assumed. Without a usable ``config.json`` the PersonaPlex 7B configuration is used, as
    NVIDIA/personaplex's loader does. ``dep_q`` is taken from the weights (the number of ``linears.{i}`` heads)
    when they disagree with the config, as the original Context Spanning loader infers it.

    Raises:
        CheckpointError: the config file is unreadable or invalid (names the file and the field).
    """
    data = None if config_path is None else _read_json(config_path)
    label = f"config file {str(config_path)!r}"
    return _configs_from_data(data, label, weight_keys)


def _configs_from_data(
    data: dict[str, Any] | None, label: str, weight_keys: list[str] | None
) -> tuple[LMConfig, MimiConfig]:
    """:func:`read_configs` on an already parsed ``config.json`` dict (None: no config)."""
    from pydantic import ValidationError

    from .config import LMConfig, MimiConfig

    mimi_cfg = MimiConfig.mimi_24khz()
    if data is None:
        lm_cfg = LMConfig.personaplex_7b()
    else:
        data = dict(data)
        mimi_dict = data.pop("mimi_config", None)
        if mimi_dict is not None:
            try:
                mimi_cfg = MimiConfig.from_upstream(mimi_dict)
            except ValidationError as exc:
                raise CheckpointError(f"{label}, key 'mimi_config': invalid: {validation_summary(exc)}") from None
        missing = [key for key in ("dim", "delays") if key not in data]
        if missing:
            log.warning(
                "%s has no LM keyword argument %s: using the PersonaPlex 7B configuration",
                label,
                " or ".join(repr(key) for key in missing),
            )
            lm_cfg = LMConfig.personaplex_7b()
        else:
            try:
                lm_cfg = LMConfig.from_upstream(data)
            except ValidationError as exc:
                raise CheckpointError(f"{label}: invalid LM config: {validation_summary(exc)}") from None
    heads = _count_depformer_heads(weight_keys or [])
    if heads and heads != lm_cfg.dep_q and heads <= lm_cfg.n_q:
        log.info("the weights have %d depformer heads, config dep_q is %d: using dep_q=%d", heads, lm_cfg.dep_q, heads)
        update = {**lm_cfg.model_dump(), "dep_q": heads}
        if lm_cfg.depformer_weights_per_step_schedule is not None:
            update.pop("depformer_weights_per_step_schedule")
        try:
            lm_cfg = LMConfig.model_validate(update)
        except ValidationError as exc:
            raise CheckpointError(
                f"cannot use dep_q={heads} found in the weights with this config: {validation_summary(exc)}"
            ) from None
    return lm_cfg, mimi_cfg


# ---------------------------------------------------------------------------------------------------------------
# Model loaders
# ---------------------------------------------------------------------------------------------------------------


def _read_fine_tune(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """Load a fine-tune ``.pt``: (state dict with compile prefixes stripped, LoRA spec or None).

    Raises:
        CheckpointError: unreadable file, no state dict inside, non-tensor values, LoRA keys without a valid
            top-level ``"lora": {"r", "alpha"}``.
    """
    import torch

    obj = load_torch_file(path, "fine-tune")
    if not isinstance(obj, dict):
        raise CheckpointError(
            f"fine-tune file {str(path)!r} holds a {type(obj).__name__}, expected a dict {{'model': state_dict}}"
        )
    state = obj.get("model", obj)
    if not isinstance(state, dict):
        raise CheckpointError(
            f"fine-tune file {str(path)!r}, key 'model': expected a state dict, got {type(state).__name__}"
        )
    if state is obj:  # a bare state dict: drop non-tensor top-level entries such as "lora" or "step"
        state = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"fine-tune file {str(path)!r}, key 'model': non-tensor entries {_fmt_keys(bad)}")
    state = strip_compile_prefixes(state)
    lora = None
    adapted = sorted(k[: -len(".lora_A")] for k in state if k.endswith(".lora_A"))
    if adapted:
        spec = obj.get("lora")
        if not isinstance(spec, dict) or "r" not in spec or "alpha" not in spec:
            raise CheckpointError(
                f"fine-tune file {str(path)!r} has LoRA keys (e.g. {adapted[0] + '.lora_A'!r}) but no top-level "
                "'lora': {'r': int, 'alpha': float} entry; save it with that entry"
            )
        try:
            r, alpha = int(spec["r"]), float(spec["alpha"])
        except (TypeError, ValueError):
            raise CheckpointError(f"fine-tune file {str(path)!r}, key 'lora': r and alpha must be numbers") from None
        if r < 1:
            raise CheckpointError(f"fine-tune file {str(path)!r}, key 'lora': r must be >= 1, got {r}")
        for name in adapted:
            if name + ".lora_B" not in state:
                raise CheckpointError(f"fine-tune file {str(path)!r}: key {name + '.lora_B'!r} missing for LoRA layer")
            a = state[name + ".lora_A"]
            if a.dim() != 2 or a.shape[0] != r:
                raise CheckpointError(
                    f"fine-tune file {str(path)!r}, key {name + '.lora_A'!r}: shape {list(a.shape)} does not have "
                    f"rank r={r} rows"
                )
        lora = {"r": r, "alpha": alpha, "modules": adapted}
    return state, lora


def _read_moshi_lora(path: Path, config: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """moshi-finetune's adapters: (weights other than adapters, e.g. embeddings trained with ``ft_embed``;
    ``{"r", "scaling", "adapters": {upstream module name: MoshiAdapter}}``).

    Raises:
        CheckpointError: bad config (``lora_rank``, ``lora_scaling``), unreadable file, an adapter without its
            ``lora_B`` / ``lora_A`` half, non-float adapters (each names the file and the key).
    """
    from .lora import MoshiAdapter

    data = _read_json(config)
    if data.get("lora") is False:
        raise CheckpointError(
            f"config file {str(config)!r} says 'lora': false, but {str(path)!r} holds LoRA adapters; use the "
            "config.json written with them"
        )
    rank, scaling = data.get("lora_rank"), data.get("lora_scaling")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise CheckpointError(f"config file {str(config)!r}, key 'lora_rank': expected an integer >= 1, got {rank!r}")
    if not isinstance(scaling, (int, float)) or isinstance(scaling, bool) or not math.isfinite(scaling):
        raise CheckpointError(
            f"config file {str(config)!r}, key 'lora_scaling': expected a finite number, got {scaling!r}"
        )
    src = _SafetensorsSource(path, "LoRA")
    try:
        tensors = {key: src.get(key) for key in src.shapes}
    finally:
        src.close()
    tensors = strip_compile_prefixes(
        {
            k.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", ""): v
            for k, v in tensors.items()
        }
    )
    halves: dict[str, dict[str, torch.Tensor]] = {}
    state: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        found = re.match(r"^(.+)\.(lora_A|lora_B)\.weight$", key)
        if found is None:
            state[key] = value
            continue
        if not value.is_floating_point():
            raise CheckpointError(f"LoRA file {str(path)!r}, key {key!r}: dtype {value.dtype}, expected floats")
        halves.setdefault(found.group(1), {})[found.group(2)] = value
    adapters = {}
    for name, pair in halves.items():
        for half in ("lora_A", "lora_B"):
            if half not in pair:
                raise CheckpointError(f"LoRA file {str(path)!r}: key {name + '.' + half + '.weight'!r} missing")
        adapters[name] = MoshiAdapter(
            f"LoRA file {str(path)!r}, key {name + '.lora_A.weight'!r}", pair["lora_A"], pair["lora_B"]
        )
    if not adapters:
        raise CheckpointError(f"LoRA file {str(path)!r} holds no '<module>.lora_A.weight' / '.lora_B.weight' key")
    return state, {"r": int(rank), "scaling": float(scaling), "adapters": adapters}


@contextlib.contextmanager
def _moshi_lora_errors(path: Path) -> Iterator[None]:
    """moshi-finetune adapters that do not fit the LM, as a :class:`CheckpointError` naming the file and the key."""
    try:
        yield
    except KeyError as exc:
        raise CheckpointError(f"LoRA file {str(path)!r}: layer {exc} does not exist in this LM") from None
    except (TypeError, ValueError) as exc:
        said = str(exc)  # an adapter's messages name the file and the key already
        raise CheckpointError(said if said.startswith("LoRA file ") else f"LoRA file {str(path)!r}: {said}") from None


def _apply_moshi_lora(lm: LMModel, moshi: dict[str, Any], path: Path, fuse: bool) -> dict[str, Any]:
    """Apply :func:`_read_moshi_lora`'s adapters; returns the :attr:`Checkpoint.lora` record."""
    from .lora import apply_moshi_lora

    with _moshi_lora_errors(path):
        kept, merged = apply_moshi_lora(lm, moshi["adapters"], moshi["r"], moshi["scaling"], fuse=fuse)
    lm.eval()
    r, scaling = moshi["r"], moshi["scaling"]
    return {"format": "moshi", "r": r, "alpha": scaling * r, "scaling": scaling, "modules": kept, "merged": merged}


def _build_lm(
    lm_cfg: LMConfig,
    base: _Source,
    fine_tune: _Source | None,
    lora: dict[str, Any] | None,
    device: str | torch.device,
    dtype: torch.dtype | None,
) -> LMModel:
    """Build the LM on meta, wrap LoRA layers, check every key and shape, then assign the weights."""
    import torch

    if dtype is None:
        stored = base.header.float_dtype() if isinstance(base, _SafetensorsSource) else None
        dtype = getattr(torch, _ST_DTYPES[stored][1]) if stored else torch.float32
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):  # float8 (exact in bfloat16) or float64
            dtype = torch.bfloat16 if dtype.itemsize == 1 else torch.float32
    model, plan = _plan_lm(lm_cfg, base, fine_tune, lora, dtype)
    try:
        _assign(model, plan, device, dtype)
    finally:
        base.close()
    model.eval()
    return model


def _plan_lm(
    lm_cfg: LMConfig,
    base: _Source,
    fine_tune: _Source | None,
    lora: dict[str, Any] | None,
    dtype: torch.dtype | None = None,
) -> tuple[LMModel, dict[str, tuple[_Source, str]]]:
    """The LM built on meta (LoRA layers wrapped) and its checked load plan (:func:`_check_and_plan`); reads headers
    only, so ``model info`` runs the same checks as a load.

    Raises:
        CheckpointError: the config cannot build a model, or the weights do not fit it (names file and key).
    """
    from .lm import LMModel
    from .lora import apply_lora

    try:
        model = LMModel(lm_cfg, device="meta", dtype=dtype)
    except CheckpointError:
        raise
    except (ValueError, TypeError, RuntimeError, OverflowError, IndexError, ZeroDivisionError) as exc:
        raise CheckpointError(
            f"the LM config cannot build a model ({type(exc).__name__}: {exc}); check config.json"
        ) from None
    aliases: dict[str, str] = {}
    if lora is not None:
        assert fine_tune is not None
        try:
            apply_lora(model, lora["modules"], lora["r"], lora["alpha"])
        except (KeyError, TypeError) as exc:
            raise CheckpointError(
                f"fine-tune file {str(fine_tune.path)!r}: LoRA layer {exc} is not a linear layer of this LM"
            ) from None
        for name in lora["modules"]:
            aliases[f"{name}.base.weight"] = f"{name}.weight"
            aliases[f"{name}.base.bias"] = f"{name}.bias"
    reference = model.state_dict()
    expected = {k: tuple(v.shape) for k, v in reference.items()}
    floating = {k: bool(v.is_floating_point()) for k, v in reference.items()}
    sources = [fine_tune, base] if fine_tune is not None else [base]
    return model, _check_and_plan(expected, sources, aliases, floating)


def load_lm(
    path_or_dir: str | os.PathLike[str],
    config: LMConfig | dict[str, Any] | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
) -> LMModel:
    """Load only the LM from a ``model.safetensors`` file or a folder holding one (no Mimi, no tokenizer needed).

    Args:
        path_or_dir: the safetensors file, or a folder with ``model.safetensors`` (and usually ``config.json``).
        config: the LM config (an :class:`LMConfig` or an upstream dict); default: the folder's ``config.json``,
            else the PersonaPlex 7B configuration (``dep_q`` from the weights).
        device: where the weights go.
        dtype: floating dtype of the weights (default: the stored dtype; float8 weights load as bfloat16).

    Returns:
        The LMModel in eval mode.

    Raises:
        CheckpointError: missing/corrupt file, missing or unexpected keys, shape mismatch (names file and key).
    """
    from .config import LMConfig

    path = Path(path_or_dir)
    lm_path = path / LM_FILE if path.is_dir() else path
    if not lm_path.exists():
        raise CheckpointError(
            f"LM weights file {str(lm_path)!r} does not exist; pass a {LM_FILE} file or a folder holding it"
        )
    base = _SafetensorsSource(lm_path, "LM", device=_load_device(device))
    if config is None:
        cfg_path = lm_path.parent / CONFIG_FILE
        lm_cfg, _ = read_configs(cfg_path if cfg_path.is_file() else None, list(base.shapes))
    elif isinstance(config, LMConfig):
        lm_cfg = config
    else:
        lm_cfg, _ = _configs_from_data(dict(config), "the given LM config", list(base.shapes))
    return _build_lm(lm_cfg, base, None, None, device, _torch_dtype(dtype))


def _load_device(device: str | torch.device) -> str:
    """The device string safetensors reads tensors onto (the target device itself: no extra CPU copy).

    Raises:
        CspanError: a device torch does not know or cspan does not run on, or CUDA this machine lacks
            (:func:`cspan.core.devices.parse_device`), one line instead of torch's assertion.
    """
    import torch

    from .devices import parse_device

    dev = parse_device(str(device), flag="device")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return str(dev)


def load_mimi(
    path: str | os.PathLike[str],
    config: MimiConfig | None = None,
    *,
    device: str | torch.device = "cpu",
    num_codebooks: int = NUM_VOICE_CODEBOOKS,
) -> Mimi:
    """Load the Mimi codec (float32, eval mode) from its safetensors file.

    Args:
        path: ``tokenizer-e351c8d8-checkpoint125.safetensors`` or an equivalent file.
        config: the codec configuration (default: the real 24 kHz Mimi).
        device: where the weights go.
        num_codebooks: codebooks produced by ``encode`` (8 for the LM).

    Raises:
        CheckpointError: missing/corrupt file, missing or unexpected keys, shape mismatch (names file and key).
    """
    import torch

    from .config import MimiConfig

    src = _SafetensorsSource(Path(path), "Mimi", device=_load_device(device))
    try:
        mimi, plan = _plan_mimi(config or MimiConfig.mimi_24khz(), src)
        _assign(mimi, plan, device, torch.float32)
    finally:
        src.close()
    mimi.eval()
    try:
        mimi.set_num_codebooks(num_codebooks)
    except ValueError as exc:
        raise CheckpointError(f"Mimi weights file {str(path)!r}: {exc}") from None
    return mimi


def _plan_mimi(cfg: MimiConfig, src: _Source) -> tuple[Mimi, dict[str, tuple[_Source, str]]]:
    """The Mimi built on meta and its checked load plan (:func:`_check_and_plan`); reads headers only, so ``model
    info`` runs the same checks as a load.

    Raises:
        CheckpointError: the codec config cannot build a model, or the weights do not fit it (names file and key).
    """
    import torch

    from .mimi import Mimi

    try:
        mimi = Mimi(cfg, device="meta", dtype=torch.float32)
    except (ValueError, TypeError, RuntimeError, OverflowError, IndexError, ZeroDivisionError) as exc:
        raise CheckpointError(
            f"Mimi weights file {str(src.path)!r}: its codec config cannot build a model ({type(exc).__name__}: "
            f"{exc}); check the 'mimi_config' of config.json"
        ) from None
    reference = mimi.state_dict()
    expected = {k: tuple(v.shape) for k, v in reference.items()}
    floating = {k: bool(v.is_floating_point()) for k, v in reference.items()}
    return mimi, _check_and_plan(expected, [src], floating=floating)


def _check_codec_card(mimi_cfg: MimiConfig, lm_cfg: LMConfig, path: Path) -> None:
    """Refuse a codec whose codebooks are not the LM's audio tokens (``path``: the Mimi weights file)."""
    if mimi_cfg.quantizer.bins != lm_cfg.card:
        raise CheckpointError(
            f"Mimi weights file {str(path)!r} has {mimi_cfg.quantizer.bins} bins per codebook but the LM's "
            f"card is {lm_cfg.card}; the codec and the LM do not belong together"
        )


def load_tokenizer(path: str | os.PathLike[str]) -> sentencepiece.SentencePieceProcessor:
    """Load a SentencePiece model file.

    Raises:
        CheckpointError: missing or unreadable file (names it).
    """
    import sentencepiece as spm

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"tokenizer file {str(path)!r} does not exist; check the path or download it again")
    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(str(path))
    except (OSError, RuntimeError) as exc:
        raise CheckpointError(
            f"tokenizer file {str(path)!r} is not a valid SentencePiece model ({exc}); download or copy it again"
        ) from None
    return sp


# ---------------------------------------------------------------------------------------------------------------
# Voices
# ---------------------------------------------------------------------------------------------------------------


def own_voices(files: CheckpointFiles) -> dict[str, Path]:
    """The checkpoint's own voices (``Checkpoint.voices``): its ``voices/`` with ``$CSPAN_VOICES_DIR`` over them."""
    return {**files.voices, **env_voices()}


def checkpoint_voices(files: CheckpointFiles, lm_config: LMConfig, mimi: Mimi | None = None) -> CheckpointVoices:
    """The voices of a checkpoint that is not loaded (``cspan prepare`` reads its Mimi and tokenizer only), to find
    and load them as a loaded checkpoint's (:func:`cspan.core.voice.choose_voice`, ``load_voice``...): the same
    names, sizes, prefix layout and, when given, the Mimi that encodes a recording."""
    return CheckpointVoices(
        voices=own_voices(files),
        archive_voices=dict(files.archive_voices),
        lm_config=lm_config,
        prefix_layout=resolve_prefix_layout(files),
        mimi=mimi,
    )


# ---------------------------------------------------------------------------------------------------------------
# Source resolution
# ---------------------------------------------------------------------------------------------------------------


def _hub_snapshot(
    repo_id: str,
    revision: str | None,
    patterns: list[str],
    what: str,
    fix: str = _FIX_OFFLINE,
    *,
    local: bool = False,
) -> Path:
    """Download (or find in the cache) the files of ``repo_id`` matching ``patterns``; returns the snapshot folder.

    Honours ``HF_HOME`` / ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` and ``HF_TOKEN`` as read at call time. ``fix`` is what
    the errors tell the user to do instead (a base's fix names ``--base``, not ``--checkpoint``). ``local``: the
    user named ``repo_id`` (not a default), which could as well be a mistyped relative path (``trunp/export``): the
    errors say first that no folder or file of that name exists in the current directory (the callers leave the
    default checkpoint and base out).

    Raises:
        CheckpointError: offline without a cached copy, unreachable Hub, unknown or gated repo or revision.
    """
    if local:
        try:
            return _hub_snapshot(repo_id, revision, patterns, what, fix)
        except CheckpointError as exc:
            raise CheckpointError(
                f"no folder or file {repo_id!r} exists in {Path.cwd()} (the current directory), and {exc}"
            ) from None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = _env_flag("HF_HUB_OFFLINE") or _HUB_CACHE_ONLY.get()
    rev = revision or "main"
    label = f"{what} {repo_id!r} (revision {rev})"
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=patterns,
            cache_dir=_hf_cache_dir(),
            local_files_only=offline,
        )
    except GatedRepoError:
        raise CheckpointError(
            f"{label} is gated: accept its licence on huggingface.co and set HF_TOKEN to a token of that account; "
            f"or {fix}"
        ) from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{label}: no such revision on the Hub; check --revision") from None
    except RepositoryNotFoundError:
        raise CheckpointError(
            f"{label} not found on the Hub (or it is private: set HF_TOKEN); check the name, or {fix}"
        ) from None
    except LocalEntryNotFoundError:
        cache = _hf_cache_dir() or "the default Hugging Face cache"
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached"
        raise CheckpointError(
            f"{label} is not in the Hugging Face cache ({cache}) and {why}; {fix}"
            + ("" if offline else "; behind a proxy or firewall, download it elsewhere and copy the folder")
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"cannot get {label} from the Hugging Face Hub ({exc}); if it is gated set HF_TOKEN, or {fix}"
        ) from None
    return Path(folder)


_HUB_CACHE_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("cspan_hub_cache_only", default=False)
"""Set by :func:`checkpoint_reads`: Hub sources are looked up in the cache only, never downloaded."""


def checkpoint_reads(
    source: str | os.PathLike[str] | None,
    *,
    base: str | os.PathLike[str] | None = None,
    flag: str = "--checkpoint",
    base_flag: str = "--base",
    folders: bool = True,
) -> Reads:
    """What loading ``source`` (over ``base``) reads, found without downloading or loading anything: the
    :meth:`CheckpointFiles.reads` of the files it resolves to (a Hub repo from the Hugging Face cache only) and,
    with ``folders``, the folder of ``$CSPAN_VOICES_DIR``. Where the files cannot be resolved so (a repo not cached
    yet, a broken folder: the load reports it), the local paths given: ``source`` and ``base`` as a file or (with
    ``folders``) a whole folder."""
    from .reads import Reads

    reads = Reads()
    token = _HUB_CACHE_ONLY.set(True)
    try:
        reads.extend(resolve_checkpoint(source, base=base).reads(flag, folders=folders))
    except (CheckpointError, OSError):
        for f, given in ((flag, source), (base_flag, base)):
            path = None if given is None else Path(given).expanduser()
            if path is not None and (path.is_file() or (folders and path.is_dir())):
                reads.file(f, path, f"the {f} {'folder' if path.is_dir() else 'file'}")
    finally:
        _HUB_CACHE_ONLY.reset(token)
    if folders:
        reads.folder(ENV_VOICES, os.environ.get(ENV_VOICES), f"the voices folder of ${ENV_VOICES}")
    return reads


def _is_repo_id(source: str) -> bool:
    return bool(_REPO_ID.match(source)) and not source.startswith((".", "/", "~"))


def _top_level_pt(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.pt") if p.is_file())


def _is_personaplex(source: str, folder: Path) -> bool:
    """NVIDIA PersonaPlex's base: its repo id (``nvidia/personaplex-*``, also in a Hugging Face cache path), or a
    folder holding its ``voices.tgz``."""
    text = source.lower().removeprefix("hf://")
    return (
        text.startswith("nvidia/personaplex")
        or "models--nvidia--personaplex" in str(folder).lower()
        or (folder / VOICES_ARCHIVE).is_file()
    )


def _recorded_layout(data: dict[str, Any], path: Path) -> str | None:
    """The ``prefix_layout`` of a ``config.json`` / ``export.json`` dict, checked (None when absent).

    Raises:
        CheckpointError: an unknown layout name (names the file).
    """
    value = data.get(PREFIX_LAYOUT_KEY)
    if value is None:
        return None
    try:
        return PrefixLayout.named(str(value)).name
    except ValueError as exc:
        raise CheckpointError(f"file {str(path)!r}, key {PREFIX_LAYOUT_KEY!r}: {exc}") from None


def _base_voices(folder: Path) -> tuple[dict[str, Path], dict[str, Path]]:
    """(the voices of a base folder's ``voices/``, the voices of its ``voices.tgz``). With an archive, a ``voices/``
    folder beside it is the one PersonaPlex's own code extracted there (so its voices are archive voices); otherwise
    the archive is extracted safely once (:func:`cspan.core.archive.extract_voices`)."""
    from .archive import extract_voices

    if not (folder / VOICES_ARCHIVE).is_file():
        return scan_voices(folder / VOICES_DIR), {}
    if (folder / VOICES_DIR).is_dir():
        return {}, scan_voices(folder / VOICES_DIR)
    return {}, scan_voices(extract_voices(folder / VOICES_ARCHIVE))


def _base_files(folder: Path, source: str, lm_override: Path | None = None) -> CheckpointFiles:
    """Files of a base folder; config.json's ``moshi_name``/``mimi_name``/``tokenizer_name`` override the names."""
    names = {"lm": LM_FILE, "mimi": MIMI_FILE, "tokenizer": TOKENIZER_FILE}
    config = folder / CONFIG_FILE
    layout = None
    if config.is_file():
        data = _read_json(config)
        for role, key in (("lm", "moshi_name"), ("mimi", "mimi_name"), ("tokenizer", "tokenizer_name")):
            value = data.get(key)
            if isinstance(value, str) and value and "/" not in value and (folder / value).is_file():
                names[role] = value
        layout = _recorded_layout(data, config)
    lm = lm_override or folder / names["lm"]
    mimi = folder / names["mimi"]
    tok = folder / names["tokenizer"]
    voices, archive_voices = _base_voices(folder)
    return CheckpointFiles(
        source=source,
        lm=lm,
        mimi=mimi if mimi.is_file() else None,
        tokenizer=tok if tok.is_file() else None,
        config=config if config.is_file() else None,
        fine_tune=None,
        voices=voices,
        archive_voices=archive_voices,
        base_dir=folder,
        personaplex=_is_personaplex(source, folder),
        layout=layout,
    )


def _resolve_base(base: str | os.PathLike[str] | None) -> CheckpointFiles:
    """The base of a fine-tune: ``base``, else ``$CSPAN_BASE``, else :data:`DEFAULT_BASE` (its main revision)."""
    chosen = str(base) if base is not None else os.environ.get(ENV_BASE) or DEFAULT_BASE
    path = Path(chosen).expanduser()
    if path.is_dir():
        if not (path / LM_FILE).is_file():
            raise CheckpointError(
                f"base folder {str(path)!r} has no {LM_FILE}; pass a base folder in the Kyutai/PersonaPlex layout "
                f"(--base DIR or {ENV_BASE})"
            )
        return _base_files(path, chosen)
    if path.exists() or not _is_repo_id(chosen):
        raise CheckpointError(
            f"base {chosen!r} is neither a folder nor a Hub repo id; pass --base DIR or set {ENV_BASE}"
        )
    folder = _hub_snapshot(chosen, None, _HUB_PATTERNS, "base repo", _FIX_BASE_OFFLINE, local=chosen != DEFAULT_BASE)
    if not (folder / LM_FILE).is_file():
        raise CheckpointError(f"base repo {chosen!r} has no {LM_FILE}; is it a Kyutai/PersonaPlex model repo?")
    return _base_files(folder, chosen)


def _lm_file(path: Path, source: str, base: str | os.PathLike[str] | None) -> CheckpointFiles:
    """An LM ``.safetensors`` file (upstream's ``--moshi-weight``): the other files come from its folder, and those
    the folder lacks (Mimi, tokenizer, ``config.json``) from ``base`` or ``$CSPAN_BASE`` where one is given."""
    files = _base_files(path.parent, source, lm_override=path)
    chosen = base if base is not None else os.environ.get(ENV_BASE)
    if not chosen or (files.mimi and files.tokenizer and files.config):
        return files
    other = _resolve_base(chosen)
    files.mimi = files.mimi or other.mimi
    files.tokenizer = files.tokenizer or other.tokenizer
    files.config = files.config or other.config
    files.voices = {**other.voices, **files.voices}
    files.archive_voices = files.archive_voices or other.archive_voices
    files.personaplex = files.personaplex or other.personaplex
    files.layout = files.layout or other.layout
    return files


def _export_info(fine_tune: Path) -> dict[str, Any]:
    """``export.json`` next to a fine-tune (written by ``cspan train``): ``{}`` when absent.

    Raises:
        CheckpointError: unreadable or not a JSON object.
    """
    info = fine_tune.parent / EXPORT_INFO
    if not info.is_file():
        return {}
    try:
        data = json.loads(info.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{info}: unreadable ({exc}); fix or delete it, or pass --base / {ENV_BASE}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{info}: must hold a JSON object; fix or delete it, or pass --base / {ENV_BASE}")
    return data


def _with_fine_tune(fine_tune: Path, source: str, base: str | os.PathLike[str] | None) -> CheckpointFiles:
    """A fine-tune over its base (a ``.pt``, or moshi-finetune's ``lora.safetensors`` with its ``config.json``); the
    fine-tune folder's voices take precedence over the base's.

    The base is ``base``, else ``$CSPAN_BASE``, else the one ``cspan train`` recorded in ``export.json`` next to
    the file, else :data:`DEFAULT_BASE`. The prefix layout is the one recorded for the fine-tune (``export.json``, or
    the ``config.json`` beside ``lora.safetensors``); a ``.pt`` without one is a Context Spanning fine-tune, adapters
    from moshi-finetune keep their base's layout.
    """
    info = _export_info(fine_tune)
    if base is None and not os.environ.get(ENV_BASE):
        recorded = info.get("base")
        base = str(recorded) if recorded else None
    files = _resolve_base(base)
    files.source = source
    files.fine_tune = fine_tune
    own = scan_voices(fine_tune.parent / VOICES_DIR)
    files.voices = {**files.voices, **own}
    layout = _recorded_layout(info, fine_tune.parent / EXPORT_INFO)
    if fine_tune.name == MOSHI_LORA_FILE:
        config = fine_tune.parent / CONFIG_FILE
        if not config.is_file():
            raise CheckpointError(
                f"LoRA adapters {str(fine_tune)!r} have no {CONFIG_FILE} beside them; moshi-finetune writes one with "
                "'lora_rank' and 'lora_scaling' (copy it next to the adapters)"
            )
        files.fine_tune_config = config
        layout = layout or _recorded_layout(_read_json(config), config) or files.layout
    files.layout = layout
    return files


def _folder_files(folder: Path, source: str, base: str | os.PathLike[str] | None) -> CheckpointFiles:
    """A base folder, or a fine-tune folder (one top-level ``*.pt``, or moshi-finetune's ``lora.safetensors``, over
    a base). A folder of LM weights that lacks Mimi, the tokenizer or ``config.json`` takes them from ``base`` or
    ``$CSPAN_BASE`` where one is given, as its ``model.safetensors`` given alone does."""
    if (folder / LM_FILE).is_file():
        if base is not None or os.environ.get(ENV_BASE):  # as for the LM file itself: the base fills what it lacks
            return _lm_file(folder / LM_FILE, source, base)
        return _base_files(folder, source)
    if (folder / MOSHI_LORA_FILE).is_file():
        return _with_fine_tune(folder / MOSHI_LORA_FILE, source, base)
    pts = _top_level_pt(folder)
    if len(pts) > 1:
        chosen = [p for p in pts if p.name == DEFAULT_FINE_TUNE_FILE]
        if not chosen:
            raise CheckpointError(
                f"folder {str(folder)!r} holds several fine-tune files ({', '.join(p.name for p in pts)}); pass one "
                "of them as the checkpoint"
            )
        pts = chosen
    if pts:
        return _with_fine_tune(pts[0], source, base)
    return _base_files(folder, source)  # reports the missing LM file at load time


def resolve_prefix_layout(files: CheckpointFiles) -> PrefixLayout:
    """The persona prefix layout of a checkpoint, decided once from its files.

    In order: the ``prefix_layout`` recorded for it (``config.json`` of the base or of moshi-finetune's adapters,
    ``export.json`` of a ``cspan train`` export); a Context Spanning fine-tune ``.pt`` -> Context Spanning; NVIDIA
    PersonaPlex's base (its repo id, or a folder with its ``voices.tgz``) and adapters over it -> PersonaPlex;
    anything else (Kyutai's Moshi, ``cspan model tiny``) -> Context Spanning.
    """
    if files.layout is not None:
        return PrefixLayout.named(files.layout)
    if files.fine_tune is not None and files.fine_tune.name != MOSHI_LORA_FILE:
        return CONTEXT_SPANNING
    return PERSONAPLEX if files.personaplex else CONTEXT_SPANNING


def resolve_checkpoint(
    source: str | os.PathLike[str] | None = None,
    *,
    revision: str | None = None,
    base: str | os.PathLike[str] | None = None,
    cache_only: bool = False,
) -> CheckpointFiles:
    """Find the files of a checkpoint source (downloading from the Hub where needed); loads nothing.

    Order: an existing file (``*.pt`` fine-tune over ``base``; ``*.safetensors`` LM weights whose folder holds the
    other files, or ``base`` those it lacks), an existing folder (base layout, or a fine-tune folder with one ``*.pt``), ``hf://owner/repo[/file]``,
    otherwise a Hub repo id ``owner/name``.

    Args:
        source: file, folder, ``hf://`` URL or repo id; default ``$CSPAN_CHECKPOINT`` or :data:`DEFAULT_CHECKPOINT`.
        revision: Hub revision (branch, tag or commit) of ``source``.
        base: base of a fine-tune (folder or repo id); default ``$CSPAN_BASE`` or :data:`DEFAULT_BASE`.
        cache_only: Hub repos (of ``source`` and of the base) are looked up in the Hugging Face cache only, never
            downloaded nor asked the Hub about (a repo not cached is a :class:`CheckpointError`).

    Raises:
        CheckpointError: nothing at that path, unsupported file type, Hub errors (offline, gated, not found).
    """
    if cache_only:
        token = _HUB_CACHE_ONLY.set(True)
        try:
            return resolve_checkpoint(source, revision=revision, base=base)
        finally:
            _HUB_CACHE_ONLY.reset(token)
    origin = ""  # where a source that was not passed came from, for the messages
    if source is None:
        source = os.environ.get(ENV_CHECKPOINT) or DEFAULT_CHECKPOINT
        origin = f" (from ${ENV_CHECKPOINT})" if os.environ.get(ENV_CHECKPOINT) else ""
    text = str(source)
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix in (".pt", ".pth"):
            return _with_fine_tune(path, text, base)
        if path.name == MOSHI_LORA_FILE:
            return _with_fine_tune(path, text, base)
        if path.suffix == ".safetensors":
            return _lm_file(path, text, base)
        raise CheckpointError(
            f"checkpoint file {text!r} has an unsupported type; pass a .pt fine-tune, an LM .safetensors file, or a "
            "checkpoint folder"
        )
    if path.is_dir():
        return _folder_files(path, text, base)
    if text.startswith("hf://"):
        parts = text[len("hf://") :].strip("/").split("/")
        if len(parts) < 2:
            raise CheckpointError(f"bad Hub URL {text!r}; use hf://owner/repo or hf://owner/repo/path/to/file.pt")
        repo_id, inner = "/".join(parts[:2]), "/".join(parts[2:])
        if not inner:
            return _repo_files(repo_id, text, revision, base)
        beside = [f"{inner.rpartition('/')[0]}/{name}".lstrip("/") for name in (CONFIG_FILE, EXPORT_INFO)]
        patterns = [inner, *beside, *_HUB_PATTERNS[:4], f"{VOICES_DIR}/*.pt", VOICES_ARCHIVE]
        folder = _hub_snapshot(repo_id, revision, patterns, "repo")
        target = folder / inner
        if not target.is_file():
            raise CheckpointError(f"repo {repo_id!r} has no file {inner!r} (revision {revision or 'main'})")
        files = resolve_checkpoint(target, base=base)
        files.source = text
        return files
    if _is_repo_id(text):
        return _repo_files(text, text, revision, base, named=text != DEFAULT_REPO)
    raise CheckpointError(
        f"checkpoint {text!r}{origin} does not exist: it is not a file, not a folder and not a Hub repo id (owner/name); "
        f"check the path, or {_FIX_OFFLINE}"
    )


def _repo_files(
    repo_id: str, source: str, revision: str | None, base: str | os.PathLike[str] | None, *, named: bool = False
) -> CheckpointFiles:
    """The files of Hub repo ``repo_id``; ``named``: the user wrote it as a bare ``owner/name``, which may as well
    be a mistyped local path (the errors say that none exists)."""
    patterns = list(_HUB_PATTERNS)
    if repo_id == DEFAULT_REPO:
        patterns = [CONFIG_FILE, DEFAULT_FINE_TUNE_FILE, f"{VOICES_DIR}/*.pt"]
    fix = f"check the path, or {_FIX_OFFLINE}" if named else _FIX_OFFLINE
    folder = _hub_snapshot(repo_id, revision, patterns, "checkpoint repo", fix, local=named)
    files = _folder_files(folder, source, base)
    return files


# ---------------------------------------------------------------------------------------------------------------
# The full load
# ---------------------------------------------------------------------------------------------------------------


def load_checkpoint(
    source: str | os.PathLike[str] | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    revision: str | None = None,
    base: str | os.PathLike[str] | None = None,
    fuse_lora: bool = False,
) -> Checkpoint:
    """Load the LM, Mimi, tokenizer and voice list of a checkpoint.

    ``source`` is a Hub repo id (``owner/name``, via ``huggingface_hub``, honouring ``HF_HOME``,
    ``HF_HUB_OFFLINE`` and ``HF_TOKEN``), ``hf://owner/repo/file``, a local folder or a file; see
    :func:`resolve_checkpoint` for the order. A fine-tune ``.pt`` is loaded over its base: keys it holds replace
    the base's, the others come from the base; LoRA adapters are kept unmerged (:class:`cspan.core.lora.LoRALinear`).
    moshi-finetune's ``lora.safetensors`` (with its ``config.json``) loads over its base the same way
    (:func:`cspan.core.lora.apply_moshi_lora`). The persona prefix layout is decided here, once
    (:func:`resolve_prefix_layout`).

    Args:
        source: what to load; default ``$CSPAN_CHECKPOINT`` or :data:`DEFAULT_CHECKPOINT` (the released
            Context Spanning 7B over ``nvidia/personaplex-7b-v1``).
        device: where the models go (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        dtype: LM floating dtype (``torch.bfloat16``, ``"float32"``...); default: the dtype most of the base
            LM weights are stored in (float8 weights load as bfloat16). Mimi is always float32.
        revision: Hub revision of ``source``.
        base: base of a fine-tune (folder or repo id); default ``$CSPAN_BASE`` or :data:`DEFAULT_BASE`.
        fuse_lora: fold LoRA adapters into the weights (plain linear layers, upstream's ``--fuse-lora``) instead of
            keeping them unmerged.

    Returns:
        A :class:`Checkpoint`.

    Raises:
        CheckpointError: a file is missing, truncated or corrupt; keys are missing or unexpected; a shape or dtype
            differs (each names the file and the key); a config that cannot build a model; the Hub cannot provide
            the files (the message says how to pass a local ``--checkpoint`` folder or build one with
            ``cspan model tiny``).
    """
    files = resolve_checkpoint(source, revision=revision, base=base)
    layout = resolve_prefix_layout(files)
    missing = [
        f"{role} file {name!r}"
        for role, name, got in (
            ("LM weights", files.lm.name, files.lm if files.lm.is_file() else None),
            ("Mimi weights", MIMI_FILE, files.mimi),
            ("tokenizer", TOKENIZER_FILE, files.tokenizer),
        )
        if got is None
    ]
    if missing:
        lm_only = files.lm.is_file() and files.fine_tune is None and Path(files.source).expanduser().exists()
        alone = (
            f"; for LM weights on their own (a file, or a folder of {LM_FILE} and {CONFIG_FILE}) pass --base DIR "
            f"(or {ENV_BASE}) holding the others"
            if lm_only
            else ""
        )
        raise CheckpointError(
            f"checkpoint folder {str(files.base_dir)!r} lacks {', '.join(missing)}; a full checkpoint needs "
            f"{LM_FILE}, {MIMI_FILE} and {TOKENIZER_FILE} (use load_lm() for the LM alone), or build one with "
            f"`cspan model tiny DIR`{alone}"
        )
    assert files.mimi is not None and files.tokenizer is not None
    target = _torch_dtype(dtype)
    base_src = _SafetensorsSource(files.lm, "LM", device=_load_device(device))
    ft_src: _Source | None = None
    lora = None
    moshi = None
    keys = list(base_src.shapes)
    if files.fine_tune is not None:
        if files.fine_tune.name == MOSHI_LORA_FILE:
            assert files.fine_tune_config is not None
            state, moshi = _read_moshi_lora(files.fine_tune, files.fine_tune_config)
        else:
            state, lora = _read_fine_tune(files.fine_tune)
        ft_src = _DictSource(files.fine_tune, "fine-tune", state)
        keys = keys + list(state)
    lm_cfg, mimi_cfg = read_configs(files.config, keys)
    lm = _build_lm(lm_cfg, base_src, ft_src, lora, device, target)
    del ft_src
    if moshi is not None:
        assert files.fine_tune is not None
        lora = _apply_moshi_lora(lm, moshi, files.fine_tune, fuse_lora)
    elif lora is not None and fuse_lora:
        from .lora import fuse_lora_layers

        lora = {**lora, "modules": [], "merged": fuse_lora_layers(lm)}
    mimi = load_mimi(files.mimi, mimi_cfg, device=device)
    _check_codec_card(mimi_cfg, lm_cfg, files.mimi)
    tokenizer = load_tokenizer(files.tokenizer)
    vocab = tokenizer.vocab_size()
    if vocab > lm_cfg.text_card:
        raise CheckpointError(
            f"tokenizer file {str(files.tokenizer)!r} has {vocab} pieces but the LM's text_card is "
            f"{lm_cfg.text_card}; the tokenizer does not belong to this LM"
        )
    voices = own_voices(files)
    return Checkpoint(
        lm=lm,
        mimi=mimi,
        tokenizer=tokenizer,
        lm_config=lm_cfg,
        mimi_config=mimi_cfg,
        voices=voices,
        source=files.source,
        files=files.as_dict(),
        fine_tune=files.fine_tune,
        lora=lora,
        prefix_layout=layout,
        archive_voices=dict(files.archive_voices),
    )


# ---------------------------------------------------------------------------------------------------------------
# Summary (`cspan model info`)
# ---------------------------------------------------------------------------------------------------------------


def describe_checkpoint(
    source: str | os.PathLike[str] | None = None,
    *,
    revision: str | None = None,
    base: str | os.PathLike[str] | None = None,
    load: bool = False,
) -> str:
    """A human-readable summary of a checkpoint (what ``cspan model info`` prints).

    Reads headers and configs only (a 7B is summarised in a second; the parameter count is the number of values
    in the LM weights, fine-tune included); with ``load=True`` the whole checkpoint is
    loaded on CPU as well, which checks every key and shape.

    Raises:
        CheckpointError: as :func:`resolve_checkpoint` and, with ``load``, :func:`load_checkpoint`.
    """
    from .constants import BOS, EOS, EPAD, PAD, RET, SPAN_CLOSE, SPAN_OPEN

    files = resolve_checkpoint(source, revision=revision, base=base)
    header = read_safetensors_header(files.lm, "LM")
    shapes = {k: v[1] for k, v in header.tensors.items()}
    lora = None
    moshi = None
    if files.fine_tune is not None and files.fine_tune.name == MOSHI_LORA_FILE:
        assert files.fine_tune_config is not None
        state, moshi = _read_moshi_lora(files.fine_tune, files.fine_tune_config)
        shapes.update({k: tuple(v.shape) for k, v in state.items()})
    elif files.fine_tune is not None:
        state, lora = _read_fine_tune(files.fine_tune)
        for name in (lora or {}).get("modules", []):
            shapes.pop(f"{name}.weight", None)
            shapes.pop(f"{name}.bias", None)
        shapes.update({k: tuple(v.shape) for k, v in state.items()})
    lm_cfg, mimi_cfg = read_configs(files.config, list(shapes))
    n_params = sum(math.prod(shape) for shape in shapes.values())
    stored = header.float_dtype()
    lines = [f"source: {files.source}", "files:"]
    lines += [f"  {role}: {path}" for role, path in files.as_dict().items()]
    lines += [
        "LM:",
        f"  dim {lm_cfg.dim}, {lm_cfg.num_layers} layers, {lm_cfg.num_heads} heads, context {lm_cfg.context}, "
        f"norm {lm_cfg.norm}, gating {lm_cfg.gating}, positional {lm_cfg.positional_embedding}",
        f"  depformer dim {lm_cfg.depformer_dim}, {lm_cfg.depformer_transformer_kwargs()['num_layers']} layers, "
        f"{lm_cfg.depformer_num_heads} heads",
        f"  n_q {lm_cfg.n_q}, dep_q {lm_cfg.dep_q}, card {lm_cfg.card}, text_card {lm_cfg.text_card}",
        f"  delays {lm_cfg.delays}",
        f"  parameters: {n_params:,}",
        f"  stored dtype: {_ST_DTYPES[stored][1] if stored else 'none'}"
        + (" (loads as bfloat16)" if stored and stored.startswith("F8") else ""),
    ]
    if lora is not None:
        lines.append(f"  LoRA: r {lora['r']}, alpha {lora['alpha']}, {len(lora['modules'])} layers (unmerged)")
    if moshi is not None:
        lines.append(
            f"  LoRA (moshi-finetune): r {moshi['r']}, scaling {moshi['scaling']}, {len(moshi['adapters'])} adapters"
        )
    lm_src = _SafetensorsSource(files.lm, "LM")
    ft = None if files.fine_tune is None else _DictSource(files.fine_tune, "fine-tune", state)

    def lm_check() -> None:
        model, _ = _plan_lm(lm_cfg, lm_src, ft, lora)
        if moshi is not None:  # the adapters' layers, rank and shapes, as the load applies them
            from .lora import check_moshi_lora

            assert files.fine_tune is not None
            with _moshi_lora_errors(files.fine_tune):
                check_moshi_lora(model, moshi["adapters"], moshi["r"])

    lines.append(f"  key check: {_key_check(lm_check)}")
    lines.append(f"  persona prefix layout: {resolve_prefix_layout(files).name}")
    lines += [
        "Mimi:",
        f"  sample rate {mimi_cfg.sample_rate} Hz, frame rate {mimi_cfg.frame_rate} Hz "
        f"({mimi_cfg.frame_size} samples per frame), n_q {mimi_cfg.quantizer.n_q} "
        f"(the LM uses {NUM_VOICE_CODEBOOKS}), bins {mimi_cfg.quantizer.bins}",
    ]
    mimi_file = files.mimi
    if mimi_file is not None:

        def mimi_check() -> None:
            _plan_mimi(mimi_cfg, _SafetensorsSource(mimi_file, "Mimi"))
            _check_codec_card(mimi_cfg, lm_cfg, mimi_file)

        lines.append(f"  key check: {_key_check(mimi_check)}")
    else:
        lines.append(f"  weights: missing ({MIMI_FILE})")
    if files.tokenizer is not None:
        sp = load_tokenizer(files.tokenizer)
        specials = [("EPAD", EPAD), ("BOS", BOS), ("EOS", EOS), ("PAD", PAD)]
        specials += [("<ret>", RET), ("span open", SPAN_OPEN), ("span close", SPAN_CLOSE)]
        lines.append(f"tokenizer: {sp.vocab_size()} pieces")
        lines += [f"  {i:>3} {name}: {sp.id_to_piece(i)!r}" for name, i in specials if i < sp.vocab_size()]
    else:
        lines.append(f"tokenizer: missing ({TOKENIZER_FILE})")
    voices = {**files.voices, **env_voices()}
    lines.append(f"voices: {len(voices) or 'none'}")
    lines += [f"  {name}: {_voice_kind(path)} ({path})" for name, path in sorted(voices.items())]
    if files.archive_voices:
        lines.append(f"voices of {VOICES_ARCHIVE}: {len(files.archive_voices)}")
        lines += [f"  {name}: {_voice_kind(path)} ({path})" for name, path in sorted(files.archive_voices.items())]
    if load:
        ckpt = load_checkpoint(source, revision=revision, base=base, device="cpu")
        lines.append(f"load check: ok ({type(ckpt.lm).__name__}, {type(ckpt.mimi).__name__} loaded on CPU)")
    return "\n".join(lines)


def _key_check(plan: Callable[[], object]) -> str:
    """What ``model info`` says of the keys and shapes that ``plan`` checks (:func:`_plan_lm`, :func:`_plan_mimi`):
    ``ok``, or why a load would refuse the weights (headers only: a summary must not look complete when loading
    would fail)."""
    try:
        plan()
    except CheckpointError as exc:
        return f"FAILED, loading would refuse these weights: {exc}"
    return "ok (every key and shape the config needs; --load reads the values too)"


def _voice_kind(path: Path) -> str:
    """What a voice file holds, for ``cspan model info``: ``codes, N frames``, ``PersonaPlex embeddings, E frames``,
    ``recording``, or why it cannot be read."""
    try:
        if is_recording(path):
            return "recording"
        if not is_torch_file(path):
            return "unreadable: named as a torch file but is not one (damaged or truncated?)"
        obj = load_torch_file(path, "voice")
    except (CheckpointError, OSError) as exc:
        return f"unreadable: {exc}"
    if isinstance(obj, dict) and hasattr(obj.get("codes"), "shape"):
        return f"codes, {obj['codes'].shape[-1]} frames"
    if isinstance(obj, dict) and hasattr(obj.get("embeddings"), "shape"):
        return f"PersonaPlex embeddings, {obj['embeddings'].shape[0]} frames"
    return "not a voice file"


__all__ = [
    "CONFIG_FILE",
    "DEFAULT_BASE",
    "DEFAULT_CHECKPOINT",
    "DEFAULT_FINE_TUNE_FILE",
    "DEFAULT_REPO",
    "FINGERPRINT_SAMPLE",
    "LM_FILE",
    "MIMI_FILE",
    "TOKENIZER_FILE",
    "Checkpoint",
    "CheckpointFiles",
    "SafetensorsHeader",
    "checkpoint_reads",
    "checkpoint_voices",
    "describe_checkpoint",
    "load_checkpoint",
    "load_lm",
    "load_mimi",
    "load_tokenizer",
    "load_voice",
    "load_voice_prompt",
    "own_voices",
    "read_configs",
    "read_safetensors_header",
    "resolve_checkpoint",
    "resolve_prefix_layout",
    "strip_compile_prefixes",
    "weights_fingerprint",
]
