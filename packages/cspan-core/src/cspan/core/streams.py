"""The delayed token grid: which column the next step feeds, which column it fills, which frame it returns.

Coordinates (see ``docs/ENGINE.md``). A *frame* ``f`` is an undelayed 80 ms frame ``X[:, f]`` (row 0 text, rows
1..8 the agent's Mimi codebooks, rows 9..16 the user's). A *position* ``p`` is an index of the temporal
transformer's sequence (its KV/RoPE index), in DELAYED coordinates::

    G[k, p] = X[k, p - 1 - delays[k]]      (the initial token where p - 1 - delays[k] < 0)

which is the training forward's layout (kyutai-labs/moshi ``LMModel.forward``: roll each stream right by its delay,
then prepend one all-initial column). Position 0 is all initial.

Streaming calls (upstream ``LMGen.step``, moshi 0.2.13). Call ``c`` of a session:

1. writes the user codes it is given (user frame ``c - 1``) into the grid: a user row with delay ``d`` at position
   ``c + d`` (:meth:`TokenGrid.write_user`);
2. feeds position ``c`` (the *pending column*, :meth:`TokenGrid.input_column`) to the temporal transformer;
3. samples the *target column* ``c + 1`` (:meth:`TokenGrid.target_column` gives what is already known there:
   forced tokens and user codes; the rest is ``UNGENERATED`` = -2 and is sampled: text and the depformer rows);
4. stores it and returns frame ``c - D`` (``D`` the largest delay), valid once ``c >= D``
   (:meth:`TokenGrid.commit`). For the 7B delays (``D = 1``), call ``c`` returns frame ``c - 1``: its text and
   semantic codes were sampled at call ``c - 1``, its acoustic codes at call ``c``.

Entries of positions ``p <= delays[k]`` hold the initial token whatever is written there (the first frame of a
delayed stream does not exist), exactly as upstream replaces such inputs by the initial token.

The grid keeps, per session, only the few columns around the pending one, in a fixed buffer ``[B, K, W]`` that
shifts by one column per call: column ``j`` holds position ``position[b] - H + j`` with ``H = max(D - 1, 0)``
history columns (needed to return frame ``c - D`` when ``D > 1``) and ``W = H + max(D, 1) + 1``. For the 7B,
``W = 2``: the pending column and the target column. Every operation of the per-frame path is a tensor operation
on preallocated device tensors (no ``.item()``, no branching on tensor values), so a whole step can be captured
in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .constants import UNGENERATED


def delay_tokens(
    frames: torch.Tensor,
    delays: Sequence[int],
    initial_tokens: Sequence[int] | torch.Tensor,
    length: int | None = None,
) -> torch.Tensor:
    """Undelayed frames -> the delayed token sequence the temporal transformer reads.

    ``G[..., k, p] = X[..., k, p - 1 - delays[k]]``: the initial token where that index is negative, and
    ``UNGENERATED`` (-2) where it is past the last frame.

    Args:
        frames: X, [..., K, T] long.
        delays: K per-row delays.
        initial_tokens: K initial ids (``text_card`` for text, ``card`` for audio).
        length: number of positions L to produce; default ``T + 1 + max(delays)`` (every frame fully placed).

    Returns:
        [..., K, L] long.

    Raises:
        ValueError: K differs from ``len(delays)`` or ``len(initial_tokens)``.
    """
    K, T = frames.shape[-2], frames.shape[-1]
    if len(delays) != K or len(initial_tokens) != K:
        raise ValueError(
            f"delay_tokens: frames have {K} rows but {len(delays)} delays / {len(initial_tokens)} initials"
        )
    if length is None:
        length = T + 1 + max(delays)
    out = frames.new_full((*frames.shape[:-1], length), UNGENERATED)
    initial = torch.as_tensor(initial_tokens, dtype=frames.dtype, device=frames.device)
    for k, d in enumerate(delays):
        head = min(d + 1, length)  # positions 0..d hold the initial token
        out[..., k, :head] = initial[k]
        n = max(0, min(T, length - head))
        out[..., k, head : head + n] = frames[..., k, :n]
    return out


def undelay_tokens(delayed: torch.Tensor, delays: Sequence[int], num_frames: int | None = None) -> torch.Tensor:
    """The inverse of :func:`delay_tokens`: ``X[..., k, f] = G[..., k, f + 1 + delays[k]]``.

    Args:
        delayed: G, [..., K, L] long.
        delays: K per-row delays.
        num_frames: T; default ``L - 1 - min(delays)``. Frames whose position is past ``L - 1`` are -2.

    Returns:
        [..., K, T] long.
    """
    K, L = delayed.shape[-2], delayed.shape[-1]
    if len(delays) != K:
        raise ValueError(f"undelay_tokens: {K} rows but {len(delays)} delays")
    if num_frames is None:
        num_frames = max(0, L - 1 - min(delays))
    out = delayed.new_full((*delayed.shape[:-1], num_frames), UNGENERATED)
    for k, d in enumerate(delays):
        n = max(0, min(num_frames, L - 1 - d))
        out[..., k, :n] = delayed[..., k, 1 + d : 1 + d + n]
    return out


class TokenGrid:
    """Per-session delayed token grids of a batch of B sessions, with per-session positions.

    Args:
        delays: K per-row delays (17 for the 7B: ``[0, 0,1,1,1,1,1,1,1, 0,1,1,1,1,1,1,1]``).
        initial_tokens: K initial ids (``text_card``, then ``card`` for each audio row).
        user_rows: the rows that user codes are written to, in codebook order (9..16 for the 7B).
        batch_size: B.
        device: of the buffers.

    Attributes:
        buffer: [B, K, W] long; column ``j`` holds position ``position[b] - history + j`` (-2 = not known yet).
        position: [B] long; the pending position of each session (the position the next call feeds) = the
            number of positions each session's KV cache holds.
        history: H; ``pending`` = H is the buffer column of the pending position, ``H + 1`` the target column.
        max_delay: D.
    """

    def __init__(
        self,
        delays: Sequence[int],
        initial_tokens: Sequence[int],
        user_rows: Sequence[int],
        batch_size: int,
        device: torch.device | str | None = None,
    ) -> None:
        if len(delays) != len(initial_tokens):
            raise ValueError(f"TokenGrid: {len(delays)} delays but {len(initial_tokens)} initial tokens")
        if any(d < 0 for d in delays):
            raise ValueError(f"TokenGrid: delays must be >= 0, got {list(delays)}")
        if batch_size < 1:
            raise ValueError(f"TokenGrid: batch_size must be >= 1, got {batch_size}")
        self.delays = [int(d) for d in delays]
        self.num_rows = len(self.delays)
        self.max_delay = max(self.delays)
        self.history = max(self.max_delay - 1, 0)
        self.width = self.history + max(self.max_delay, 1) + 1
        self.pending = self.history
        self.target = self.history + 1
        self.user_rows = [int(r) for r in user_rows]
        self.batch_size = batch_size
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        dev = self.device
        self.delays_t = torch.tensor(self.delays, dtype=torch.long, device=dev)  # [K]
        self.initial_t = torch.tensor(list(initial_tokens), dtype=torch.long, device=dev)  # [K]
        self._user_rows_t = torch.tensor(self.user_rows, dtype=torch.long, device=dev)  # [U]
        self._user_cols_t = self.pending + self.delays_t[self._user_rows_t]  # [U] buffer column of each user row
        self._user_initial_t = self.initial_t[self._user_rows_t][None, :]  # [1, U]
        # buffer column of row k of the returned frame (frame c - D): position c - D + 1 + delay_k
        self._frame_cols_t = self.pending - self.max_delay + 1 + self.delays_t  # [K]
        # position offset of every buffer column relative to the pending position
        self._col_offsets_t = torch.arange(self.width, dtype=torch.long, device=dev) - self.history  # [W]
        self.buffer = torch.full((batch_size, self.num_rows, self.width), UNGENERATED, dtype=torch.long, device=dev)
        self.position = torch.zeros(batch_size, dtype=torch.long, device=dev)
        self.reset()

    # -- helpers -----------------------------------------------------------------------------------------------

    def _fresh(self, n: int) -> torch.Tensor:
        """Buffers of n sessions at position 0: the pending column (position 0) all initial, the rest -2.

        Later positions ``p <= delay_k`` stay -2 (to be sampled, as upstream's call 0 samples the delayed rows of
        a frame -1) and are stored as the initial token by :meth:`commit` / :meth:`write_user`.
        """
        buf = torch.full((n, self.num_rows, self.width), UNGENERATED, dtype=torch.long, device=self.device)
        buf[:, :, self.pending] = self.initial_t[None, :]
        return buf

    # -- session management --------------------------------------------------------------------------------

    def reset(self, rows: torch.Tensor | None = None) -> None:
        """Start the chosen sessions ([B'] long; all when None) again at position 0 (nothing fed yet)."""
        if rows is None:
            self.buffer.copy_(self._fresh(self.batch_size))
            self.position.zero_()
        else:
            self.buffer[rows] = self._fresh(rows.shape[0])
            self.position[rows] = 0

    def load(self, row: int, delayed: torch.Tensor, pending_position: int) -> None:
        """Set session ``row`` to the state "positions ``0 .. pending_position - 1`` fed" from a delayed sequence.

        Args:
            row: the session.
            delayed: [K, L] long delayed tokens (positions 0..L-1; -2 where not known yet), e.g. a
                :func:`delay_tokens` output. Buffer columns whose position is outside ``[0, L)`` become -2.
            pending_position: the position the next call will feed.
        """
        L = delayed.shape[-1]
        pos = pending_position + self._col_offsets_t  # [W]
        inside = (pos >= 0) & (pos < L)
        cols = delayed.to(self.device)[:, pos.clamp(0, max(L - 1, 0))]  # [K, W]
        cols = torch.where(inside[None, :], cols, torch.full_like(cols, UNGENERATED))
        self.buffer[row] = cols
        self.position[row] = pending_position

    # -- the per-frame path (tensor ops only) ------------------------------------------------------------------

    def _take(self, rows: torch.Tensor | slice | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(buffer, position) of ``rows``: copies for a tensor of rows, views for a slice or all (None)."""
        if rows is None:
            return self.buffer, self.position
        if isinstance(rows, slice):
            return self.buffer[rows], self.position[rows]
        return self.buffer.index_select(0, rows), self.position.index_select(0, rows)

    def write_user(
        self, user_codes: torch.Tensor, rows: torch.Tensor | slice | None = None, write: torch.Tensor | None = None
    ) -> None:
        """Write the user codes given to this call (user frame ``c - 1``): row r with delay d at position ``c + d``.

        Where that position is <= the row's delay (only at call 0) the initial token is kept.

        Args:
            user_codes: [b, U] long, U = ``len(user_rows)``, codebook order.
            rows: [b] long sessions, or a slice of them (None: all B, in order).
            write: [b] bool, the sessions to write (None: all); the others keep their user rows (a session whose
                persona prefix this call reads has them from the prefix).
        """
        buffer, position = self._take(rows)
        b = buffer.shape[0]
        index = (torch.arange(b, device=self.device)[:, None], self._user_rows_t[None, :], self._user_cols_t[None, :])
        keep_initial = position[:, None] <= 0  # position c + d <= d
        values = torch.where(keep_initial, self._user_initial_t, user_codes.to(self.device, torch.long))
        if write is not None:
            values = torch.where(write[:, None], values, buffer[index])
        buffer[index] = values
        if isinstance(rows, torch.Tensor):  # (a slice's buffer is a view: written in place)
            self.buffer.index_copy_(0, rows, buffer)

    def input_column(self, rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        """[b, K] long: the pending column (position ``c`` of each session), what this call feeds (a copy)."""
        column = self._take(rows)[0][:, :, self.pending]
        return column if isinstance(rows, torch.Tensor) else column.clone()

    def target_column(
        self, forced: torch.Tensor | None = None, rows: torch.Tensor | slice | None = None
    ) -> torch.Tensor:
        """[b, K] long: what is already known of position ``c + 1`` (-2 = to be sampled), with ``forced`` applied.

        Args:
            forced: [b, K] long tokens for position ``c + 1`` in delayed coordinates (-2 = no forcing), or None.
                Row k then holds frame ``c - delays[k]``: for the 7B, text and semantic codes of frame c and
                acoustic codes of frame ``c - 1``.
            rows: [b] long sessions, or a slice of them (None: all).
        """
        target = self._take(rows)[0][:, :, self.target]
        if forced is None:
            return target.clone()
        forced = forced.to(self.device, torch.long)
        return torch.where(forced != UNGENERATED, forced, target)

    def commit(
        self, column: torch.Tensor, rows: torch.Tensor | slice | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the target column, return the finished frame, advance the sessions by one position.

        Args:
            column: [b, K] long tokens of position ``c + 1`` (entries at positions <= their row's delay are stored
                as the initial token).
            rows: [b] long sessions, or a slice of them (None: all).

        Returns:
            (frame [b, K] long, valid [b] bool): frame ``c - D`` undelayed (row k read at position
            ``c - D + 1 + delays[k]``), -2 where not valid (``c < D``: the first call after a reset).
        """
        buffer, position = self._take(rows)
        keep_initial = (position + 1)[:, None] <= self.delays_t[None, :]  # [b, K]
        column = torch.where(keep_initial, self.initial_t[None, :].expand_as(column), column)
        buffer = buffer if isinstance(rows, torch.Tensor) else buffer.clone()  # (a copy, not a view)
        buffer[:, :, self.target] = column
        frame = buffer.gather(2, self._frame_cols_t[None, :, None].expand(buffer.shape[0], -1, 1))[:, :, 0]
        valid = position >= self.max_delay
        frame = torch.where(valid[:, None], frame, torch.full_like(frame, UNGENERATED))
        shifted = torch.cat([buffer[:, :, 1:], torch.full_like(buffer[:, :, :1], UNGENERATED)], dim=2)
        if isinstance(rows, torch.Tensor):
            self.buffer.index_copy_(0, rows, shifted)
            self.position.index_copy_(0, rows, position + 1)
        else:
            every = slice(None) if rows is None else rows
            self.buffer[every] = shifted
            self.position[every] += 1
        return frame, valid

    # -- per-session operations (between calls) ------------------------------------------------------------

    def splice(self, row: int, block: torch.Tensor) -> None:
        """Insert n columns before the pending position of session ``row`` (a Context Span block).

        The pending column and every later (partially filled) column move by n, so the next call feeds the column
        it would have fed, n positions later; the columns before it are now the block's. This is
        :func:`cspan.core.span.splice_block` applied to the session's window of the delayed sequence.

        Args:
            row: the session.
            block: [K, n] long, in delayed coordinates.
        """
        n = block.shape[-1]
        P = self.pending
        # splice_block(buffer[row], P, block)[:, n : n + W]: the columns from the pending one on keep their place
        # in the window; the P history columns become the last P of (history + block)
        if P > 0:
            block = block.to(torch.long)
            if n >= P:  # the history becomes the block's last P columns
                block = block[:, n - P :]
            if self.buffer.is_cuda and block.device.type == "cpu":  # page-locked: no host synchronisation
                block = block.contiguous().pin_memory()
            if n >= P:
                self.buffer[row, :, :P].copy_(block, non_blocking=True)
            else:
                block = block.to(self.device, non_blocking=True)
                self.buffer[row, :, :P] = torch.cat([self.buffer[row, :, :P], block], dim=1)[:, -P:]
        self.position[row : row + 1].add_(n)

    def row_state(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(buffer [K, W], position []) copies of one session's grid, for inspection and tests."""
        return self.buffer[row].clone(), self.position[row].clone()


__all__ = ["TokenGrid", "delay_tokens", "undelay_tokens"]
