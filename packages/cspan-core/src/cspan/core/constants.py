"""Fixed ids, placeholder codes and frame sizes shared by the engine, the span layout, training and the server.

Sources: the text special ids are those of Moshi's SentencePiece vocabulary (kyutai-labs/moshi,
``moshi/models/lm.py`` and the servers, which hide ids 0 and 3); ``SILENCE_TOKENS`` / ``SINE_TOKENS`` are the
constants of NVIDIA/personaplex ``moshi/models/lm.py`` (Mimi codes of a silent frame and of a 440 Hz sine
frame); ``RET``, ``SPAN_OPEN`` and ``SPAN_CLOSE`` are the ids the released Context Spanning checkpoint was
fine-tuned with (see ``docs/ENGINE.md``).
"""

from __future__ import annotations

# --- text ids -----------------------------------------------------------------------------------------------
EPAD: int = 0
"""End of padding: the text token emitted right before a word starts."""
BOS: int = 1
EOS: int = 2
PAD: int = 3
"""Text padding (``existing_text_padding_id``); also the text of voice and silence frames of the persona prefix."""
RET: int = 4
"""``<ret>``: the model asks for a reference (retrieval trigger)."""
SPAN_OPEN: int = 12
"""First text token of a Context Span block."""
SPAN_CLOSE: int = 13
"""Last text token of a Context Span block."""

# --- grid markers -------------------------------------------------------------------------------------------
ZERO_TOKEN: int = -1
"""Input id whose embedding is an all-zero vector (upstream ``ScaledEmbedding``)."""
UNGENERATED: int = -2
"""Marks a grid entry that is not known yet (to be sampled), as upstream ``LMGen``'s token cache does."""

# --- placeholder audio codes (8 Mimi codebooks) -------------------------------------------------------------
SILENCE_TOKENS: tuple[int, ...] = (948, 243, 1178, 546, 1736, 1030, 1978, 2008)
"""Mimi codes of a silent frame: the agent rows of persona text/silence frames and of a Context Span block."""
SINE_TOKENS: tuple[int, ...] = (430, 1268, 381, 1611, 1095, 1495, 56, 472)
"""Mimi codes of a 440 Hz sine frame: the user rows of every persona prefix frame and of a Context Span block."""

# --- audio framing ------------------------------------------------------------------------------------------
SAMPLE_RATE: int = 24000
"""Hz, of every PCM buffer the engine takes and returns."""
FRAME_RATE: float = 12.5
"""Frames per second (one frame = 80 ms)."""
FRAME_SIZE: int = 1920
"""PCM samples per frame (``SAMPLE_RATE / FRAME_RATE``)."""
FRAME_S: float = 1.0 / FRAME_RATE
"""Seconds per frame (0.08)."""
FRAME_MS: float = 1000.0 / FRAME_RATE
"""Milliseconds per frame (80): the budget a frame's work (a span's prefill and the step) must fit in."""
NUM_CODEBOOKS: int = 8
"""Mimi codebooks per speaker stream used by the LM."""

# --- sampling defaults (upstream LMGen / PersonaPlex) -------------------------------------------------------
DEFAULT_TEMP: float = 0.8
DEFAULT_TOP_K: int = 250
DEFAULT_TEMP_TEXT: float = 0.7
DEFAULT_TOP_K_TEXT: int = 25
MIN_TEMPERATURE: float = 1e-3
"""Lowest positive sampling temperature (smaller ones overflow ``logits / temperature``); 0 means greedy."""
MAX_TEMPERATURE: float = 10.0
"""Highest sampling temperature accepted (beyond about 2 the output is noise already)."""
MAX_SEED: int = 2**63 - 1
"""The largest sampling seed: seeds are 0 .. 2**63 - 1, a non-negative int64 (what the device holds and
``torch.Generator.manual_seed`` keeps)."""
MAX_TOP_K: int = 500
"""Largest top-k a session may ask for below the vocabulary size (0, or the vocabulary size or more, keeps every
token): the engine's batched sampler takes one top-k of this size per row and masks each row at its own k."""

# --- Context Span ---------------------------------------------------------------------------------------------
DEFAULT_MAX_SPAN_FRAMES: int = 600
"""Longest Context Span block (in columns / positions, including the two markers) before it is truncated."""
SERVE_MAX_BLOCK_COLUMNS: int = 640
"""The servers' budget of Context Span columns per step (``DuplexEngine(max_block_columns=)``; the library's
default is no budget): one longest span, or two of the 256-column mean length, per 80 ms frame; a frame where more
arrive reads the rest in the next frames instead of doubling its own time (docs/PERFORMANCE.md, capacity)."""

# --- the conversation loop's limits (``--listen-s``, ``--span-deadline-s`` of infer, serve and the bench runners) ---
MAX_LISTEN_S: float = 60.0
"""Longest ASR window when no utterance transcript is usable (seconds)."""
MAX_SPAN_DEADLINE_S: float = 600.0
"""Longest deadline of a reference after its ``<ret>`` (seconds): a slow backend on a slow machine (tests on a loaded
CPU) still fits."""

__all__ = [
    "BOS",
    "DEFAULT_MAX_SPAN_FRAMES",
    "DEFAULT_TEMP",
    "DEFAULT_TEMP_TEXT",
    "DEFAULT_TOP_K",
    "DEFAULT_TOP_K_TEXT",
    "EOS",
    "EPAD",
    "FRAME_MS",
    "FRAME_RATE",
    "FRAME_S",
    "FRAME_SIZE",
    "MAX_LISTEN_S",
    "MAX_SEED",
    "MAX_SPAN_DEADLINE_S",
    "MAX_TEMPERATURE",
    "MAX_TOP_K",
    "MIN_TEMPERATURE",
    "NUM_CODEBOOKS",
    "PAD",
    "RET",
    "SAMPLE_RATE",
    "SERVE_MAX_BLOCK_COLUMNS",
    "SILENCE_TOKENS",
    "SINE_TOKENS",
    "SPAN_CLOSE",
    "SPAN_OPEN",
    "UNGENERATED",
    "ZERO_TOKEN",
]
