"""The persona past the attention window: how a session keeps its persona prefix in the model's context.

The temporal transformer attends to the last ``W = context`` positions (3000 = 240 s of frames for the 7B). A
session's persona prefix takes positions ``0 .. P`` (``P`` = its frames; position P is the prefix's last column,
read with it). Without help it slides out of the window after ``W - P`` more positions, and the model then talks
without its role and voice. A **persona policy**, chosen once per engine (``DuplexEngine(persona_policy=...)``,
``--persona-policy``) and optionally per session (``set_persona(..., policy=...)``), decides what happens:

``pinned`` (the default; the reasoning is in ``docs/ENGINE.md``, "The persona past the window")
    The prefix's keys and values stay in the ring as *sink positions* while the rest of the ring slides (Xiao et
    al. 2024, "Efficient Streaming Language Models with Attention Sinks", with positions assigned inside the
    window). Once a step's last query ``q`` is at ``q >= W``, the S = P + 1 prefix entries are written, at the head
    of that step, over the slots of the window's S oldest positions ``v_j = q - W + 1 + j`` (j = 0 .. S - 1), their
    keys rotated from position ``j`` to ``v_j`` (RoPE is a rotation: ``R(v_j) k = R(v_j - j) R(j) k``;
    :class:`PinnedSinks` rotates the stored keys of every pinned session in one pass, the angle in float64, the
    product in float32, rounded once to the cache dtype). The step's last query therefore sees exactly the relative distances of a training window of
    W positions that starts with the persona: prefix entry j at distance ``W - 1 - j``, the latest ``W - S``
    conversation positions at ``0 .. W - S - 1``. The stored prefix entries are those the model computed with the
    prefix at the start of the sequence (nothing before it), as in training. The ring's slot arithmetic and every
    attention kernel are unchanged: the sinks are ordinary ring entries at the positions they stand for.
    (A block read in the same step -- a Context Span's columns, ``n`` positions before the last query -- sees the
    sinks ``n - t`` positions closer and, in front of them, up to ``n`` of the entries the previous step placed.)

``reprefix``
    Shortly before the prefix would leave the window, it is read again, as a block of the batched step (like a
    Context Span; no stall, queued spans kept): at the moment the pending position reaches ``first + W`` (``first``
    = the first position of the latest copy), positions ``1 .. P`` of the delayed prefix (:func:`reprefix_block`;
    position 0, the all-initial start-of-stream column, is not repeated) are queued for the next step, so its last
    query sees the whole new copy. The sequence grows by P positions per window.

``none``
    The prefix slides out of the window like any other position (upstream Moshi's ring cache).

A session reports what its policy did through :class:`WindowEvent` records (``DuplexEngine.take_window_events``):
``pin`` once, when the sinks take over, and ``reprefix`` for every copy read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from .constants import PAD, SILENCE_TOKENS, SINE_TOKENS
from .kv_cache import KVCache, quantize_fp8
from .prefix import PrefixBlock
from .span import Block

PERSONA_POLICIES = ("pinned", "reprefix", "none")
"""The persona policies (module docstring)."""
DEFAULT_PERSONA_POLICY = "pinned"
"""The policy closest to what the model saw in training (``docs/ENGINE.md``)."""

PersonaPolicy = Literal["pinned", "reprefix", "none"]


def check_policy(policy: str, where: str | None = None) -> str:
    """``policy`` if it is one of :data:`PERSONA_POLICIES`; ValueError naming the choices (and ``where``, the
    method, when given) otherwise."""
    if policy not in PERSONA_POLICIES:
        at = f"{where}: " if where else ""
        raise ValueError(f"{at}persona policy {policy!r}: use one of {', '.join(PERSONA_POLICIES)}")
    return policy


@dataclass(frozen=True)
class WindowEvent:
    """What a session's persona policy did (host record, for the runtime's event log).

    Attributes:
        kind: ``"pin"`` (the prefix's entries became sink positions: from this step on they are placed at the
            window's oldest positions) or ``"reprefix"`` (a copy of the prefix was read by this step).
        position: the first position of the window the step's last query sees (``pin``), or the first position of
            the new copy (``reprefix``).
        positions: the prefix's positions (S = P + 1 sinks, or the P columns of the copy).
    """

    kind: Literal["pin", "reprefix"]
    position: int
    positions: int


def reprefix_block(
    prefix: PrefixBlock,
    delays: Sequence[int],
    agent_placeholder: Sequence[int] = SILENCE_TOKENS,
    user_placeholder: Sequence[int] = SINE_TOKENS,
) -> Block:
    """The block that reads a persona prefix again in the middle of a stream.

    Positions ``1 .. P`` of the delayed prefix (``prefix.delayed``; P columns: the prefix frames in the model's
    delayed coordinates, its last column included, as the prefix step feeds it). Position 0, the all-initial
    start-of-stream column, is not repeated; the initial tokens of the delayed rows at positions ``1 .. delay``
    (which only exist at a stream's start) become the placeholder codes of a span block (SILENCE for the agent,
    SINE for the user). Spliced before the pending position like a Context Span, so the stream's pending column and
    everything already sampled in it follow the copy. Input embeddings of the prefix's positions ``1 .. E - 1``
    (an embedding voice) come with the block's first ``E - 1`` columns.

    Args:
        prefix: the session's :class:`cspan.core.prefix.PrefixBlock`.
        delays: the model's K delays.
        agent_placeholder, user_placeholder: C codes each.

    Returns:
        a :class:`cspan.core.span.Block` of P columns.
    """
    P = prefix.pending
    tokens = prefix.delayed[:, 1 : P + 1].clone()
    column = torch.tensor([PAD, *agent_placeholder, *user_placeholder], dtype=torch.long)
    if column.numel() != tokens.shape[0]:
        raise ValueError(f"placeholders of {column.numel() - 1} codes for {tokens.shape[0] - 1} audio rows")
    for k, d in enumerate(delays):
        tokens[k, : max(0, min(d, P))] = column[k]  # block column c is position c + 1: positions 1 .. d
    emb = prefix.block.embeddings
    embeddings = None if emb is None or emb.shape[0] <= 1 else emb[1:].clone()
    return Block(tokens.contiguous(), embeddings)


def rope_frequencies(head_dim: int, max_period: float) -> torch.Tensor:
    """[Dh/2] float64: the RoPE frequencies of :func:`cspan.core.modules.rope.apply_rope` (computed in float32
    there, as here, then widened: the rotation uses the very frequencies the model uses)."""
    ds = torch.arange(head_dim // 2, dtype=torch.float32)
    return torch.exp(ds * (-math.log(max_period) * 2 / head_dim)).double()


def rope_rotate(
    keys: torch.Tensor, delta: torch.Tensor | int, max_period: float, freqs: torch.Tensor | None = None
) -> torch.Tensor:
    """Move RoPE keys by ``delta`` positions: ``R(p + delta) k`` from ``R(p) k`` (interleaved pairs, as
    :func:`cspan.core.modules.rope.apply_rope`).

    Pair m of a head is the complex number ``x[2m] + j x[2m+1]``; it is multiplied by ``exp(j delta f_m)``. The
    angle and the product are computed in float64, so a key moved by any distance differs from the key the model
    would compute at the new position by the rounding of the result's dtype only (less than the model's own RoPE,
    whose float32 angle ``f_m * p`` loses precision at large positions).

    Args:
        keys: [..., S, Dh] keys after RoPE.
        delta: an int, or [S] long (one distance per key).
        max_period: the RoPE base.
        freqs: :func:`rope_frequencies` of ``keys``' head size and ``max_period`` on their device, when the caller
            keeps them (computed here otherwise).

    Returns:
        [..., S, Dh] in the dtype of ``keys``.
    """
    Dh = keys.shape[-1]
    if freqs is None:
        freqs = rope_frequencies(Dh, max_period).to(keys.device)
    d = torch.as_tensor(delta, dtype=torch.float64, device=keys.device).reshape(-1, 1)  # [S or 1, 1]
    angle = d * freqs  # [S, Dh/2]
    cos, sin = torch.cos(angle), torch.sin(angle)
    pairs = keys.double().reshape(*keys.shape[:-1], Dh // 2, 2)
    re, im = pairs[..., 0], pairs[..., 1]
    out = torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1)
    return out.reshape(keys.shape).to(keys.dtype)


@dataclass
class PinnedPrefix:
    """One session's prefix entries kept for the ``pinned`` policy (views into a :class:`PinnedSinks` store, or
    tensors of their own).

    Attributes:
        keys: [L, H, S, Dh] the keys of positions ``0 .. S - 1`` (after RoPE at those positions), in the cache's
            compute dtype (an FP8 cache's entries dequantized).
        values: [L, H, S, Dh].
        max_period: the RoPE base (None: the model has no RoPE; the keys are placed as they are).
        freqs: [Dh / 2] float64, the RoPE frequencies (None without RoPE).
    """

    keys: torch.Tensor
    values: torch.Tensor
    max_period: float | None = None
    freqs: torch.Tensor | None = None

    @property
    def size(self) -> int:
        """S, the sink positions."""
        return int(self.keys.shape[2])


class PinnedSinks:
    """The pinned prefixes of an engine's sessions, in one store, placed in one pass per step.

    A session's S prefix entries are copied from its ring once, when it is pinned (:meth:`add`: positions
    ``0 .. S - 1`` are still in their slots then), into a store of every pinned session's entries, ``[L, N, H, Dh]``
    (N: their S summed) in the cache's compute dtype: S x L x H x Dh x 2 values per session (the 7B with a
    200-frame persona: 105 MB in bf16). :meth:`place` writes the entries of the given rows at the head of a step:
    row r's entry j into the slot of position ``first_r + j``, its key rotated by ``first_r`` positions (RoPE: the
    angle in float64, exact at any position; the product in float32, rounded once to the cache dtype). On CUDA with
    the fused kernels that is one :func:`cspan.core.modules.fused.kv_write` launch for every layer and session
    (the rotation inside it); otherwise a few tensor operations (the CPU).

    Args:
        cache: the temporal KV cache.
        max_period: the RoPE base (None: no RoPE).
        kernel: place with the fused kernel (the engine's plan: CUDA with Triton).
    """

    def __init__(self, cache: KVCache, max_period: float | None, kernel: bool) -> None:
        self.cache = cache
        self.max_period = max_period
        self.kernel = kernel
        L, _, H, _, Dh = cache.keys.shape
        dev = cache.keys.device
        self.freqs = rope_frequencies(Dh, max_period).to(dev) if max_period is not None else None
        self.keys = torch.empty(L, 0, H, Dh, device=dev, dtype=cache.compute_dtype)
        self.values = torch.empty_like(self.keys)
        self.segments: dict[int, tuple[int, int]] = {}  # row -> (start, S) in the store
        self._index()

    def __contains__(self, row: int) -> bool:
        return row in self.segments

    def __getitem__(self, row: int) -> PinnedPrefix:
        start, S = self.segments[row]
        keys, values = (x[:, start : start + S].permute(0, 2, 1, 3) for x in (self.keys, self.values))
        return PinnedPrefix(keys, values, self.max_period, self.freqs)

    def add(self, row: int, size: int) -> None:
        """Copy positions ``0 .. size - 1`` of ``row`` from the ring into the store (they must still be in their
        slots: no position ``>= capacity`` written yet)."""
        self.remove(row)
        cache = self.cache
        slots = torch.arange(size, device=cache.keys.device) % cache.capacity
        new = []
        for buf, scale in ((cache.keys, cache.key_scale), (cache.values, cache.value_scale)):
            x = buf[:, row].index_select(2, slots)  # [L, H, S, Dh]
            if scale is not None:
                x = x.float() * scale[:, row].index_select(2, slots)[..., None]
            new.append(x.to(cache.compute_dtype).permute(0, 2, 1, 3))  # [L, S, H, Dh]
        self.segments[row] = (int(self.keys.shape[1]), int(size))
        self.keys = torch.cat([self.keys, new[0]], dim=1)
        self.values = torch.cat([self.values, new[1]], dim=1)
        self._index()

    def remove(self, row: int) -> None:
        """Forget ``row``'s entries (a restart)."""
        if row not in self.segments:
            return
        start, S = self.segments.pop(row)
        self.keys = torch.cat([self.keys[:, :start], self.keys[:, start + S :]], dim=1)
        self.values = torch.cat([self.values[:, :start], self.values[:, start + S :]], dim=1)
        self.segments = {r: (b - S if b > start else b, n) for r, (b, n) in self.segments.items()}
        self._index()

    def _index(self) -> None:
        """Per entry of the store: its row and its index j within its row's prefix (device), after a change."""
        dev = self.cache.keys.device
        row, j = [], []
        for r, (_, S) in sorted(self.segments.items(), key=lambda item: item[1][0]):
            row += [r] * S
            j += list(range(S))
        self.row = torch.tensor(row, dtype=torch.long, device=dev)
        self.j = torch.tensor(j, dtype=torch.long, device=dev)

    def place(self, firsts: dict[int, int]) -> None:
        """Write the entries of the rows of ``firsts`` (row -> the first position of the window its step's last
        query sees; every row must have been added): entry j at position ``first + j``."""
        cache = self.cache
        N = int(self.row.shape[0])
        if not firsts or not N:
            return
        dev = cache.keys.device
        B = cache.keys.shape[1]
        per_row = torch.full((B,), -1, dtype=torch.long)
        for r, first in firsts.items():
            per_row[r] = first
        first = per_row.to(dev).index_select(0, self.row)  # [N]; -1: a row not placed in this step
        live = first >= 0
        positions = torch.where(live, first + self.j, -1)
        cos = sin = None
        if self.freqs is not None:
            angle = first.clamp_min(0).double()[:, None] * self.freqs  # [N, Dh/2]
            cos, sin = torch.cos(angle).float(), torch.sin(angle).float()
        L, _, H, C, Dh = cache.keys.shape
        if self.kernel:
            from .modules import fused

            layer_rows = (torch.arange(L, device=dev)[:, None] * B + self.row[None, :]).reshape(-1)
            scales = None
            if cache.key_scale is not None:
                scales = (cache.key_scale.view(L * B, H, C), cache.value_scale.view(L * B, H, C))
            fused.kv_write(
                self.keys.reshape(L * N, H, Dh), self.values.reshape(L * N, H, Dh),
                cache.keys.view(L * B, H, C, Dh), cache.values.view(L * B, H, C, Dh),
                layer_rows, positions.repeat(L), scales,
                rope=None if cos is None else (cos, sin), rope_rows=N,
            )  # fmt: skip
            return
        keys = self.keys.float()
        if cos is not None:  # [L, N, H, Dh]: pairs rotated by each entry's angle
            pairs = keys.reshape(L, N, H, Dh // 2, 2)
            re, im = pairs[..., 0], pairs[..., 1]
            c, s = cos[None, :, None], sin[None, :, None]
            keys = torch.stack([re * c - im * s, re * s + im * c], dim=-1).reshape(L, N, H, Dh)
        sel = live.nonzero().squeeze(1)
        rows, slots = self.row.index_select(0, sel), positions.index_select(0, sel) % C
        for buf, scale, x in ((cache.keys, cache.key_scale, keys), (cache.values, cache.value_scale, self.values)):
            x = x.index_select(1, sel).permute(1, 0, 2, 3)  # [n, L, H, Dh]
            if scale is not None:
                x, sc = quantize_fp8(x)
                scale.permute(1, 3, 0, 2)[rows, slots] = sc
            buf.permute(1, 3, 0, 2, 4)[rows, slots] = x.to(buf.dtype)


__all__ = [
    "DEFAULT_PERSONA_POLICY",
    "PERSONA_POLICIES",
    "PersonaPolicy",
    "PinnedPrefix",
    "PinnedSinks",
    "WindowEvent",
    "check_policy",
    "reprefix_block",
    "rope_frequencies",
    "rope_rotate",
]
