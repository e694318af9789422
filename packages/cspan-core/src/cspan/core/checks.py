"""Checks of what callers hand the engine's public methods.

Each check raises a TypeError or ValueError that names the method and the argument, before anything is queued or
changed: a bad input found by the step itself would fail every session's step and lose what was queued with it.
Values of device tensors are never read here (that would make the caller wait for the running step); host tensors
are checked value by value.
"""

from __future__ import annotations

import operator

import numpy as np
import torch

from .constants import FRAME_SIZE, MAX_SEED, SILENCE_TOKENS, SINE_TOKENS, ZERO_TOKEN
from .errors import CheckpointError, SpanError


def as_index(value: object) -> int | None:
    """``value`` as an int when it is an integer (numpy's and torch's too, through ``operator.index``; not a bool),
    else None: a session index, a seed."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_session(i: object, batch_size: int, where: str) -> int:
    """Session ``i`` as an int (numpy's and torch's integers too), else a TypeError / IndexError naming ``where``
    (the method)."""
    index = as_index(i)
    if index is None:
        raise TypeError(f"{where}: a session is an int index, got {type(i).__name__} {i!r}")
    if not 0 <= index < batch_size:
        raise IndexError(f"{where}: session {index} is outside 0..{batch_size - 1} (engine batch_size {batch_size})")
    return index


def check_seed(seed: object, where: str, span: int = 1) -> int | None:
    """``seed`` (None, or an int with ``seed + span - 1`` in 0 .. :data:`MAX_SEED`), else a ValueError / TypeError
    naming ``where``: a seed the device cannot hold would fail only at the next step, after the restart was queued."""
    if seed is None:
        return None
    value = as_index(seed)
    if value is None:
        raise TypeError(f"{where}: a seed is an int or None, got {type(seed).__name__} {seed!r}")
    if not 0 <= value <= MAX_SEED - (span - 1):
        top = "2**63 - 1" if span == 1 else f"2**63 - {span} (seed + i for {span} sessions)"
        raise ValueError(f"{where}: seed {value} is outside 0 .. {top}")
    return value


def check_engine_options(batch_size: object, max_span_frames: object, max_block_columns: object) -> None:
    """The engine's sizes: ``batch_size`` >= 1, ``max_span_frames`` >= 3 (12, one token, 13), ``max_block_columns``
    >= 1 or None; ints, else TypeError (a bool is no size)."""
    sizes = (("batch_size", batch_size), ("max_span_frames", max_span_frames), ("max_block_columns", max_block_columns))
    for name, value in sizes:
        if (value is not None or name != "max_block_columns") and (
            isinstance(value, bool) or not isinstance(value, int)
        ):
            raise TypeError(f"DuplexEngine: {name} must be an int, got {value!r}")
    if batch_size < 1:  # type: ignore[operator]
        raise ValueError(f"DuplexEngine: batch_size must be >= 1, got {batch_size}")
    if max_block_columns is not None and max_block_columns < 1:  # type: ignore[operator]
        raise ValueError(f"DuplexEngine: max_block_columns must be >= 1 or None, got {max_block_columns}")
    if max_span_frames < 3:  # type: ignore[operator]
        raise SpanError(f"max_span_frames is {max_span_frames}; it must be at least 3 (12, one token, 13)")


def check_placeholders(placeholders: dict[str, object], num_codebooks: int, card: int) -> dict[str, tuple[int, ...]]:
    """The engine's ``agent_placeholder`` and ``user_placeholder`` (name -> value) as tuples of Python ints: each
    ``num_codebooks`` Mimi codes in 0 .. ``card`` - 1, else a TypeError / ValueError naming the argument. A code out
    of range was accepted and failed only at the first ``set_persona`` ("frames[1, 20] = 99999 is outside -1 ..
    2048"), or at the first span block; the agent's is also what Mimi decodes for a frame without agent codes.

    Raises:
        TypeError, ValueError: a placeholder that is not ``num_codebooks`` int codes in range. CheckpointError: the
            default placeholders (PersonaPlex's silence and sine frames, codes of the released 2048-code Mimi) on a
            model whose codec has fewer codes.
    """
    out = {}
    for name, value in placeholders.items():
        if (value is SILENCE_TOKENS or value is SINE_TOKENS) and max(value) >= card:
            frame = "silence" if value is SILENCE_TOKENS else "440 Hz sine"
            raise CheckpointError(
                f"DuplexEngine: this model's audio streams have {card} codes, but the default {name} (PersonaPlex's "
                f"{frame} frame) is codes of the released 2048-code Mimi; pass agent_placeholder and "
                "user_placeholder in this codec's codes"
            )
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            raise TypeError(
                f"DuplexEngine: {name} is a sequence of {num_codebooks} Mimi codes, got {type(value).__name__}"
            )
        codes = []
        for j, code in enumerate(value):  # type: ignore[attr-defined]
            index = as_index(code)
            if index is None:
                raise TypeError(f"DuplexEngine: {name}[{j}] is {type(code).__name__} {code!r}; Mimi codes are ints")
            if not 0 <= index < card:
                raise ValueError(
                    f"DuplexEngine: {name}[{j}] = {index} is outside 0 .. {card - 1} (the model's Mimi codes)"
                )
            codes.append(index)
        if len(codes) != num_codebooks:
            raise ValueError(
                f"DuplexEngine: {name} must hold {num_codebooks} Mimi codes (one per codebook of the model), got "
                f"{len(codes)}"
            )
        out[name] = tuple(codes)
    return out


def check_switches(switches: dict[str, object], optional: tuple[str, ...] = ()) -> None:
    """The engine's on/off arguments (name -> value): True or False (numpy's bools too), or None for those named in
    ``optional`` (None: decided by the device); else a TypeError naming the argument (``predict_user="no"`` read as
    True, ``cuda_graphs="no"`` as a request for CUDA graphs)."""
    for name, value in switches.items():
        if value is None and name in optional:
            continue
        if not isinstance(value, (bool, np.bool_)):
            allowed = "True, False or None" if name in optional else "True or False"
            raise TypeError(f"DuplexEngine: {name} is {allowed}, got {type(value).__name__} {value!r}")


def check_tensor(where: str, t: object) -> torch.Tensor:
    """``t`` if it is a dense torch.Tensor with data (TypeError naming ``where`` otherwise): a sparse or a meta
    tensor passes the shape and dtype checks but fails inside the step, after the queued work was taken."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided or t.is_meta:
        kind = "a meta" if t.is_meta else f"a {t.layout}"
        raise TypeError(f"{where} must be a dense tensor with data, got {kind} tensor")
    return t


def is_integer(t: torch.Tensor) -> bool:
    """Whether ``t`` holds integers (token ids, codes): not a float, complex or bool tensor."""
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def check_tokens(where: str, tokens: torch.Tensor | None, low: int, highs: list[int]) -> None:
    """``tokens`` [B, len(highs)] (or None; a dense tensor: :func:`check_tensor`): an integer tensor, else a
    ValueError naming ``where``; on the CPU also column j in ``low`` (-2: "sample") or 0 .. highs[j] - 1 (the rows its
    embedding table has). A device tensor's values are not read: that would make every step wait for the GPU."""
    if tokens is None:
        return
    if not is_integer(tokens):
        raise ValueError(f"{where} must be an integer (long) tensor, got {tokens.dtype}")
    if tokens.device.type != "cpu" or not tokens.numel():
        return
    bad = (tokens >= torch.tensor(highs)) | ((tokens < 0) & (tokens != low))
    if bool(bad.any()):
        row, col = (int(v) for v in bad.nonzero()[0])
        allowed = f"0 .. {highs[col] - 1}" + (" or -2 (sample)" if low == -2 else "")
        raise ValueError(f"{where}[{row}, {col}] = {int(tokens[row, col])} is outside {allowed}")


def check_step_codes(
    user_codes: torch.Tensor | None,
    forced: torch.Tensor | None,
    batch_size: int,
    highs: list[int],
    no_user_codes: str | None,
) -> None:
    """``DuplexEngine.step_tokens``'s inputs: ``user_codes`` [B, C] and ``forced`` [B, K] integer tensors (or None)
    with each stream's ids below ``highs`` (K = len(highs): the text row, then C agent and C user rows; forced may
    hold -2, "sample"). ``no_user_codes``: why this engine cannot step without user codes, from "with ..." or
    "for ..." on (None: it can)."""
    B, K = batch_size, len(highs)
    C = (K - 1) // 2
    for where, t in (("step_tokens: user_codes", user_codes), ("step_tokens: forced", forced)):
        if t is not None:
            check_tensor(where, t)
    if user_codes is None and no_user_codes is not None:
        raise ValueError(f"step_tokens: user_codes [{B}, {C}] are required {no_user_codes}")
    if user_codes is not None and tuple(user_codes.shape) != (B, C):
        raise ValueError(f"step_tokens: user_codes must be [{B}, {C}], got {tuple(user_codes.shape)}")
    if forced is not None and tuple(forced.shape) != (B, K):
        raise ValueError(f"step_tokens: forced must be [{B}, {K}], got {tuple(forced.shape)}")
    check_tokens("step_tokens: user_codes", user_codes, 0, highs[1 + C :])
    check_tokens("step_tokens: forced", forced, -2, highs)


def user_codes_needed(dep_q: int, n_q: int, predict_user: bool) -> str | None:
    """Why every ``step_tokens`` call must bring user codes, to follow "user_codes are required" (None: the
    depformer samples the user rows of a call without them)."""
    if dep_q < n_q:
        return (
            f"for this model: its depformer predicts only {dep_q} of {n_q} audio streams, so the user rows cannot "
            "be sampled"
        )
    if not predict_user:
        return (
            "with predict_user=False: the engine skips the depformer's user-stream predictions, so a call without "
            "user codes would feed the skipped entries; build the engine with predict_user=True to let the model "
            "predict the user"
        )
    return None


def check_frame_pcm(user_pcm: object, batch_size: int) -> torch.Tensor:
    """``DuplexEngine.step``'s input as [B, 1920] (a [B, 1, 1920] tensor is read as its channel): a dense float
    tensor, else TypeError / ValueError."""
    if not isinstance(user_pcm, torch.Tensor) or not user_pcm.is_floating_point():
        got = f"a {user_pcm.dtype} tensor" if isinstance(user_pcm, torch.Tensor) else type(user_pcm).__name__
        raise TypeError(f"step: user_pcm must be a float torch.Tensor of samples in [-1, 1], got {got}")
    check_tensor("step: user_pcm", user_pcm)
    pcm = user_pcm[:, 0] if user_pcm.dim() == 3 and user_pcm.shape[1] == 1 else user_pcm
    if tuple(pcm.shape) != (batch_size, FRAME_SIZE):
        raise ValueError(
            f"step: user_pcm must be [{batch_size}, {FRAME_SIZE}] float samples at 24 kHz, got {tuple(user_pcm.shape)}"
        )
    return pcm


def check_unicode(text: str, what: str, error: type[Exception] = ValueError) -> None:
    """An ``error`` naming ``what`` when ``text`` holds a lone surrogate (U+D800 .. U+DFFF: what
    ``errors="surrogateescape"`` or ``os.fsdecode`` make of bytes that are not UTF-8), which no tokenizer can read."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise error(
            f"{what} is not valid Unicode text: U+{ord(text[exc.start]):04X} at character {exc.start} is a lone "
            "surrogate (bytes that are not UTF-8, decoded with surrogateescape?); decode them with "
            "errors='replace'"
        ) from None


def check_persona(texts: dict[str, object]) -> None:
    """``DuplexEngine.set_persona``'s ``texts`` (name -> value) are str or None, and valid Unicode."""
    for name, value in texts.items():
        if value is not None and not isinstance(value, str):
            raise TypeError(f"set_persona: {name} is a str or None, got {type(value).__name__}")
        if value is not None:
            check_unicode(value, f"set_persona: {name}")


def check_voice(voice: object, card: int, num_codebooks: int) -> None:
    """``DuplexEngine.set_persona``'s loaded ``voice``: None, a VoicePrompt or [C, N] Mimi codes (C =
    ``num_codebooks``), the codes a dense integer tensor with values in [0, ``card``)."""
    if voice is None:
        return
    if not isinstance(voice, torch.Tensor) and not hasattr(voice, "codes"):
        raise TypeError(
            "set_persona: voice is a VoicePrompt, a [8, N] torch tensor of Mimi codes, a voice name or a voice "
            f"file, got {type(voice).__name__}"
        )
    codes = voice if isinstance(voice, torch.Tensor) else voice.codes  # type: ignore[attr-defined]
    if codes is None:
        return
    check_tensor("set_persona: voice", codes)  # a meta or sparse tensor has no values to read
    if not is_integer(codes):
        raise ValueError(f"set_persona: voice codes are Mimi codes (an integer tensor), got {codes.dtype}")
    if codes.dim() != 2 or codes.shape[0] != num_codebooks:
        raise ValueError(f"set_persona: voice codes must be [{num_codebooks}, N] Mimi codes, got {list(codes.shape)}")
    if codes.numel():
        lo, hi = int(codes.min()), int(codes.max())
        if lo < 0 or hi >= card:
            raise ValueError(f"set_persona: voice codes in [{lo}, {hi}], expected Mimi codes in [0, {card})")


def check_prefix(
    frames: object, embeddings: object, rows: list[int], dim: int, where: str = "set_prefix", *, agent_codes: int = 0
) -> None:
    """``DuplexEngine.set_prefix``'s prefix: a TypeError / ValueError naming ``where`` (the method) unless ``frames``
    are [K, P] integer ids, row k below ``rows[k]`` (the rows of its embedding table; -1: no input) and the last
    column's rows ``1 .. agent_codes`` real codes (the prefix's step returns that column as the agent's frame, its
    audio codes decoded), and ``embeddings`` (or None) [E <= P, ``dim``] floats, finite when on the host."""
    K = len(rows)
    frames = check_tensor(f"{where}: frames", frames)
    if frames.dim() != 2 or frames.shape[0] != K or not is_integer(frames):
        raise ValueError(f"{where}: frames must be [{K}, P] integer ids, got {frames.dtype} {list(frames.shape)}")
    if frames.numel():
        highs = torch.tensor(list(rows))[:, None]
        ids = frames.cpu().long()  # uint8 ids compared with -1 would wrap to 255
        bad = (ids >= highs) | (ids < ZERO_TOKEN)
        if bool(bad.any()):
            k, p = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"{where}: frames[{k}, {p}] = {int(ids[k, p])} is outside -1 .. {rows[k] - 1}")
        missing = ids[1 : 1 + agent_codes, -1] < 0
        if bool(missing.any()):
            k, p = int(missing.nonzero()[0]) + 1, ids.shape[1] - 1
            raise ValueError(
                f"{where}: frames[{k}, {p}] = {int(ids[k, p])}: the prefix's last column is returned by its step as the "
                f"agent's frame, so its agent codes (rows 1 .. {agent_codes}) must be codes, not -1 (no input)"
            )
    if embeddings is not None:
        emb = check_tensor(f"{where}: embeddings", embeddings)
        if emb.dim() != 2 or emb.shape[0] > frames.shape[1] or emb.shape[1] != dim or not emb.is_floating_point():
            raise ValueError(
                f"{where}: embeddings must be [E <= {frames.shape[1]}, {dim}] floats, got {emb.dtype} {list(emb.shape)}"
            )
        # a NaN read into the KV cache would poison every later token of the session; only host tensors are read
        # (voice files load there): a device tensor's values would cost a synchronisation with the running step
        finite = torch.isfinite(emb).all(dim=1) if emb.device.type == "cpu" else None
        if finite is not None and not bool(finite.all()):
            row = int((~finite).nonzero()[0])
            raise ValueError(f"{where}: embeddings[{row}] holds NaN or infinite values")


def int_ids(token_ids: object) -> tuple[int, ...]:
    """``ContextSpan``'s ``token_ids`` as a tuple of Python ints (numpy's and torch's integers through
    ``operator.index``); a TypeError for anything else (a float id was silently rounded, a bool read as 0 or 1, a
    str read letter by letter, and numpy or torch scalars reached the report's ids)."""
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__iter__"):
        raise TypeError(f"ContextSpan: token_ids is a sequence of ints, got {type(token_ids).__name__}")
    ids = []
    for value in token_ids:  # type: ignore[attr-defined]
        index = as_index(value)
        if index is None:
            raise TypeError(f"ContextSpan: token ids are ints, got {type(value).__name__} {str(value)[:40]}")
        ids.append(index)
    return tuple(ids)
