"""Preallocated key/value cache with absolute per-row positions, a sliding window, exact chunked appends and an
optional FP8 storage.

One :class:`KVCache` holds the keys (after RoPE) and values of every attention layer of one transformer for a
batch of independent streams, in fixed buffers ``[L, B, H, C, Dh]`` (each head's ring contiguous) used as rings
of ``C`` slots: the entry for absolute position ``p`` of a row lives in slot ``p % C``. ``offset[b]`` (a long tensor on the device) is the next position row ``b`` will write,
so the slot contents are a pure function of the offset: slot ``s`` holds the latest position ``p < offset`` with
``p % C == s`` (or nothing when there is none). Positions are never stored.

A forward over ``T`` new positions of some rows goes in three steps, driven by the transformer:

1. :meth:`KVCache.begin` computes, once for all layers, the new positions ``[B', T]`` and the positions of the
   keys the new queries will see.
2. :meth:`KVCache.update` (per layer) returns the keys/values to attend over and stores the new ones.
   - ``T == 1``: the new entry is written first, then the whole ring is attended. Exact whenever the window is at
     most ``C`` (the entry it evicts, ``position - C``, is out of the window). Static shapes, no host sync.
   - ``T > 1``: the chunk attends over the old ring *and* its own keys (concatenated), and only then is written
     into the ring (its last ``min(T, C)`` positions). Upstream's ``RingKVCache`` (kyutai-labs/moshi,
     ``moshi/modules/transformer.py``) writes first, so a chunk that wraps the ring evicts keys its own earlier
     queries still need; this order keeps a chunk exactly equal to ``T`` single steps.
3. :meth:`KVCache.advance` moves the offsets of the rows by ``T``.

The duplex engine's step (:meth:`cspan.core.modules.transformer.StreamingTransformer.forward_step`) uses the same
pieces per layer: each row's block as one chunk (attend, then write), then every row's next position as one step
at ``offset + n`` (``begin(1, rows, start=...)``) over a ring that now holds the block; the offsets move once, at
the end.

FP8 storage (``dtype=torch.float8_e4m3fn``): each stored key and value vector (one position of one head) is kept
as e4m3 codes and one float32 scale, ``x ~ code * scale`` with ``scale = max|x| / 448`` (the largest finite e4m3
value), so every vector uses the format's whole range; reads dequantize to the compute dtype. Half the bytes of
bf16 plus 3 %: the capacity option of ``DuplexEngine(kv_dtype="fp8")``.

The attention window is ``pos_q - pos_k < window`` (see :func:`attention_mask`); it must not exceed the capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value: a vector's scale maps its largest magnitude onto it."""


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [..., Dh] e4m3, scale [...] float32) with ``x ~ codes * scale``, one scale per vector of the last dim."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    codes = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale


def slot_positions(end: torch.Tensor, capacity: int) -> torch.Tensor:
    """Absolute position held by each ring slot once positions ``[0, end)`` of a row have been written.

    Args:
        end: [B] long, the number of positions written per row (the row's offset).
        capacity: number of slots C.

    Returns:
        [B, C] long: slot ``s`` holds ``end - 1 - ((end - 1 - s) mod C)``, or -1 where that is negative (empty).
    """
    slots = torch.arange(capacity, device=end.device, dtype=torch.long)
    last = end.view(-1, 1) - 1
    pos = last - torch.remainder(last - slots, capacity)
    return torch.where(pos >= 0, pos, torch.full_like(pos, -1))


def attention_mask(
    pos_q: torch.Tensor, pos_k: torch.Tensor, window: int | None, causal: bool = True
) -> torch.Tensor | None:
    """Boolean attention mask (True = attend) from absolute query and key positions.

    A key is visible iff ``pos_k >= 0`` (a filled slot) and, when causal, ``0 <= pos_q - pos_k < window``
    (no upper bound when ``window`` is None). Source: kyutai-labs/moshi ``StreamingMultiheadAttention.forward``.

    Args:
        pos_q: [B, T] long query positions.
        pos_k: [B, S] long key positions (-1 for empty slots).
        window: attention context in positions, or None for unbounded.
        causal: when False only empty slots are masked.

    Returns:
        [B, 1, T, S] bool, broadcastable over heads.
    """
    pk = pos_k[:, None, :]  # [B, 1, S]
    mask = pk >= 0
    if causal:
        delta = pos_q[:, :, None] - pk  # [B, T, S]
        mask = mask & (delta >= 0)
        if window is not None:
            mask = mask & (delta < window)
    else:
        mask = mask.expand(pos_q.shape[0], pos_q.shape[1], pos_k.shape[1])
    return mask[:, None]


@dataclass
class CacheStep:
    """What one forward over ``T`` new positions needs from a :class:`KVCache`; built by :meth:`KVCache.begin`.

    Attributes:
        rows: [B'] long batch rows being advanced, a slice of consecutive rows, or None for all rows.
        positions: [B', T] long absolute positions of the new entries (the queries).
        key_positions: [B', S] long positions of the keys :meth:`KVCache.update` returns (-1 = empty slot);
            ``S = C`` when ``T == 1``, else ``C + T``.
        batch: [B', 1] long buffer row of each row; slots: [B', n] long ring slot of each of the last
            ``n = min(T, C)`` positions (what :meth:`KVCache.update` writes in every layer, computed once).
    """

    rows: torch.Tensor | slice | None
    positions: torch.Tensor
    key_positions: torch.Tensor
    batch: torch.Tensor
    slots: torch.Tensor


class KVCache:
    """Keys (after RoPE) and values of every layer of one transformer, for a batch of independent streams.

    Args:
        num_layers: L, attention layers sharing this cache (one buffer slice each).
        batch_size: B, independent streams (rows).
        num_heads: H.
        head_dim: Dh.
        capacity: C, ring slots per row; must be at least the attention window.
        device, dtype: of the buffers: the model's activation dtype, or ``torch.float8_e4m3fn`` (FP8 storage with
            one scale per vector; reads return ``compute_dtype``).
        compute_dtype: the dtype reads dequantize to (default ``dtype``; the activation dtype with FP8 storage).

    Attributes:
        keys, values: [L, B, H, C, Dh] buffers.
        key_scale, value_scale: [L, B, H, C] float32 scales with FP8 storage, else None.
        offset: [B] long, next absolute position per row (positions since the row's last reset).
        capacity: C.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_heads: int,
        head_dim: int,
        capacity: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"KVCache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.fp8 = dtype == FP8
        self.compute_dtype = compute_dtype or (torch.bfloat16 if self.fp8 else dtype) or torch.float32
        shape = (num_layers, batch_size, num_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.key_scale = self.value_scale = None
        if self.fp8:
            self.key_scale = torch.zeros(shape[:-1], device=device, dtype=torch.float32)
            self.value_scale = torch.zeros(shape[:-1], device=device, dtype=torch.float32)
        self.offset = torch.zeros(batch_size, device=device, dtype=torch.long)
        self.rows = torch.arange(batch_size, device=device)
        """[B] long: every row (built once: a forward over all rows gathers nothing)."""

    @property
    def batch_size(self) -> int:
        return self.offset.shape[0]

    def reset(self, rows: torch.Tensor | None = None, clear: bool = False) -> None:
        """Empty the chosen rows (all when None): offset 0. No host synchronisation.

        The buffers keep their old contents unless ``clear``: the kernels never read a slot past a row's offset,
        but the eager path's masked attention multiplies them by zero weights, so a NaN that reached a row (from
        input that was not sanitized) would stay in its outputs after a reset. ``clear`` zeroes the rows' buffers
        too: cheap for small caches (Mimi's), a full ring's bytes for the LM's.
        """
        if rows is None:
            self.offset.zero_()
        else:
            rows = rows.to(self.offset.device)
            self.offset[rows] = 0
        if clear:
            for buf in (self.keys, self.values, self.key_scale, self.value_scale):
                if buf is None:
                    continue
                if rows is None:
                    buf.zero_()
                elif rows.dtype == torch.bool:  # a row mask [B]
                    buf.masked_fill_(rows.view(1, -1, *([1] * (buf.dim() - 2))), 0)
                else:
                    buf.index_fill_(1, rows, 0)

    def begin(
        self, num_positions: int, rows: torch.Tensor | slice | None = None, start: torch.Tensor | None = None
    ) -> CacheStep:
        """Plan the append of ``num_positions`` (T) new positions to the chosen rows (all when None).

        Args:
            num_positions: T.
            rows: [B'] long rows, a slice of consecutive rows (read as a view: no copy of their rings), or None for
                all.
            start: [B'] long position of the first new entry per row (default the rows' offsets); a larger start
                means the positions in between were written by an earlier chunk of the same forward.

        Returns:
            :class:`CacheStep` with the query positions [B', T] and the key positions [B', S].
        """
        if isinstance(rows, torch.Tensor):
            rows = rows.to(self.offset.device)
        if start is None:
            start = self.offset if rows is None else self.offset[rows]
        arange = torch.arange(num_positions, device=start.device, dtype=torch.long)
        positions = start[:, None] + arange  # [B', T]
        if num_positions == 1:
            key_positions = slot_positions(start + 1, self.capacity)
        else:
            key_positions = torch.cat([slot_positions(start, self.capacity), positions], dim=1)
        n = min(num_positions, self.capacity)  # a chunk longer than the ring keeps only its last C positions
        slots = torch.remainder(positions[:, num_positions - n :], self.capacity)  # [B', n]
        if rows is None or isinstance(rows, slice):
            first = 0 if rows is None else rows.start or 0
            batch = torch.arange(first, first + slots.shape[0], device=slots.device)[:, None]
        else:
            batch = rows[:, None]
        return CacheStep(rows=rows, positions=positions, key_positions=key_positions, batch=batch, slots=slots)

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, step: CacheStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer ``layer``'s new keys/values and return what its queries attend over.

        Args:
            layer: layer index into the buffers.
            k, v: [B', H, T, Dh] new keys (after RoPE) and values of the rows ``step.rows``.
            step: from :meth:`begin` with the same T and rows.

        Returns:
            (keys, values), each [B', H, S, Dh] in the compute dtype, aligned with ``step.key_positions``.
        """
        T = k.shape[2]
        if T == 1:
            self._write(layer, k, v, step)
            return self._read(layer, step.rows)
        old_keys, old_values = self._read(layer, step.rows)
        keys = torch.cat([old_keys, k.to(old_keys.dtype)], dim=2)
        values = torch.cat([old_values, v.to(old_values.dtype)], dim=2)
        self._write(layer, k, v, step)
        return keys, values

    def advance(self, step: CacheStep) -> None:
        """Move the offsets of ``step.rows`` past the positions of ``step`` (after every layer is updated)."""
        T = step.positions.shape[1]
        if step.rows is None:
            self.offset.add_(T)
        else:
            self.offset[step.rows] = step.positions[:, -1] + 1

    def advance_by(self, count: int | torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Move the offsets of ``rows`` (all when None) by ``count`` positions: a Python int, or a long device
        tensor broadcast over the rows (no host synchronisation)."""
        if rows is None:
            self.offset.add_(count)
            return
        rows = rows.to(self.offset.device)
        if isinstance(count, torch.Tensor):
            step = count.to(self.offset.device, torch.long).expand(rows.shape[0])
        else:
            step = torch.full_like(rows, int(count))
        self.offset.index_add_(0, rows, step)

    def layer_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(key_scale, value_scale) [B, H, C] of one layer of an FP8 cache, else None."""
        if self.key_scale is None or self.value_scale is None:
            return None
        return self.key_scale[layer], self.value_scale[layer]

    def _read(self, layer: int, rows: torch.Tensor | slice | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot of the rows as [B', H, C, Dh] in the compute dtype."""

        def take(x: torch.Tensor) -> torch.Tensor:
            if rows is None:
                return x
            return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)

        out = []
        for buf, scale in ((self.keys, self.key_scale), (self.values, self.value_scale)):
            x = take(buf[layer])
            if scale is not None:
                x = (x.float() * take(scale[layer])[..., None]).to(self.compute_dtype)
            elif x.dtype != self.compute_dtype:  # a 16-bit cache of a float32 model
                x = x.to(self.compute_dtype)
            out.append(x)
        return out[0], out[1]

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, step: CacheStep) -> None:
        T = k.shape[2]
        batch, slots = step.batch, step.slots
        n = slots.shape[1]
        for buf, scale, x in ((self.keys, self.key_scale, k), (self.values, self.value_scale, v)):
            # advanced indices on dims 0 and 2 -> the indexed view is [B', n, H, Dh]
            new = (x if n == T else x[:, :, T - n :]).transpose(1, 2)
            if scale is not None:
                new, sc = quantize_fp8(new)
                scale[layer][batch, :, slots] = sc
            buf[layer][batch, :, slots] = new.to(buf.dtype)
