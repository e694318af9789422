"""The delayed token grid: delay/undelay, what each call feeds, fills and returns, splicing."""

from __future__ import annotations

import pytest
import torch

from cspan.core.constants import UNGENERATED
from cspan.core.lm import delay_sequence
from cspan.core.span import splice_block
from cspan.core.streams import TokenGrid, delay_tokens, undelay_tokens

DELAYS_7B = [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]
INITIAL = [100] + [64] * 16
USER_ROWS = list(range(9, 17))


def test_delay_tokens_matches_the_training_forward_layout() -> None:
    g = torch.Generator().manual_seed(0)
    X = torch.randint(0, 64, (2, 17, 9), generator=g)
    G = delay_tokens(X, DELAYS_7B, INITIAL)
    assert G.shape == (2, 17, 9 + 2)
    # the training forward: roll right by delay (initial head), then prepend one all-initial column
    initial = torch.tensor(INITIAL)[None, :, None]
    ref = torch.cat([initial.expand(2, -1, 1), delay_sequence(X, DELAYS_7B, initial)], dim=2)  # [2, 17, 10]
    assert torch.equal(G[..., :10], ref)
    # past the data: acoustic rows hold the last frame at position T + 1, text/cb0 rows are not known there
    assert torch.equal(G[:, 2, 10], X[:, 2, 8])
    assert (G[:, 0, 10] == UNGENERATED).all() and (G[:, 9, 10] == UNGENERATED).all()
    assert torch.equal(undelay_tokens(G, DELAYS_7B, 9), X)


def test_general_delays_round_trip() -> None:
    delays = [0, 1, 2, 4]
    X = torch.arange(4 * 6).view(4, 6)
    G = delay_tokens(X, delays, [90, 91, 92, 93])
    assert G.shape == (4, 6 + 1 + 4)
    assert G[3, :5].tolist() == [93] * 5 and G[3, 5] == X[3, 0]
    assert torch.equal(undelay_tokens(G, delays, 6), X)


def _grid(B: int = 2) -> TokenGrid:
    return TokenGrid(DELAYS_7B, INITIAL, USER_ROWS, B)


def test_grid_shape_and_fresh_state() -> None:
    grid = _grid()
    assert grid.width == 2 and grid.pending == 0 and grid.target == 1 and grid.max_delay == 1
    assert torch.equal(grid.input_column(), torch.tensor(INITIAL).expand(2, -1))
    assert (grid.target_column() == UNGENERATED).all()
    assert grid.position.tolist() == [0, 0]


def test_grid_call_sequence_follows_lmgen() -> None:
    """Calls 0..3 with given user frames: what is fed, what is returned (fixture README conventions)."""
    grid = _grid(B=1)
    user = [torch.full((1, 8), 10 + c) for c in range(4)]  # user frame c - 1 given at call c
    sampled = [torch.full((1, 17), 40 + c) for c in range(4)]  # what the model "samples" at call c
    fed, returned = [], []
    for c in range(4):
        grid.write_user(user[c])
        fed.append(grid.input_column().clone())
        target = grid.target_column()
        # user acoustic rows of position c + 1 are known (user frame c - 1), everything else is to be sampled
        if c >= 1:
            assert (target[0, 10:17] == 10 + c).all()
        assert (target[0, :10] == UNGENERATED).all()
        column = torch.where(target != UNGENERATED, target, sampled[c])
        frame, valid = grid.commit(column)
        returned.append((frame.clone(), bool(valid)))
    # call 0 feeds all-initial and returns nothing; the user frame given at call 0 is never seen
    assert torch.equal(fed[0][0], torch.tensor(INITIAL))
    assert returned[0][1] is False and (returned[0][0] == UNGENERATED).all()
    # call 1 feeds text/cb0 sampled at call 0, initial acoustics (position 1 <= delay), user cb0 of frame 0
    assert (
        fed[1][0, 0] == 40 and fed[1][0, 1] == 40 and fed[1][0, 2] == 64 and fed[1][0, 9] == 11 and fed[1][0, 10] == 64
    )
    # call 2 feeds acoustics sampled at call 1 (agent) and user acoustics of frame 0 (given at call 1)
    assert fed[2][0, 2] == 41 and fed[2][0, 10] == 11 and fed[2][0, 9] == 12
    # call c returns frame c - 1: text/cb0 sampled at call c - 1, acoustics sampled at call c
    for c in (1, 2, 3):
        frame, valid = returned[c]
        assert valid
        assert frame[0, 0] == 40 + c - 1 and frame[0, 1] == 40 + c - 1
        assert (frame[0, 2:9] == 40 + c).all()
        assert frame[0, 9] == 10 + c and (frame[0, 10:17] == 10 + c).all()  # user frame c - 1, given at call c
    assert grid.position.tolist() == [4]


def test_forced_tokens_override_the_target_column() -> None:
    grid = _grid(B=2)
    grid.write_user(torch.zeros(2, 8, dtype=torch.long))
    forced = torch.full((2, 17), UNGENERATED)
    forced[1, 0] = 7  # force the text of session 1 only
    target = grid.target_column(forced)
    assert target[1, 0] == 7 and target[0, 0] == UNGENERATED


def test_reset_and_load_one_row() -> None:
    grid = _grid(B=2)
    for _ in range(3):
        grid.write_user(torch.ones(2, 8, dtype=torch.long))
        grid.commit(torch.full((2, 17), 5))
    grid.reset(torch.tensor([1]))
    assert grid.position.tolist() == [3, 0]
    assert torch.equal(grid.input_column()[1], torch.tensor(INITIAL))
    assert grid.input_column()[0, 0] == 5
    delayed = torch.arange(17 * 6).view(17, 6)
    grid.load(1, delayed, pending_position=4)
    assert grid.position.tolist() == [3, 4]
    assert torch.equal(grid.buffer[1, :, 0], delayed[:, 4]) and torch.equal(grid.buffer[1, :, 1], delayed[:, 5])
    grid.load(1, delayed, pending_position=5)
    assert (grid.buffer[1, :, 1] == UNGENERATED).all()  # past the data


def test_splice_moves_the_pending_column() -> None:
    grid = _grid(B=2)
    grid.write_user(torch.ones(2, 8, dtype=torch.long))
    grid.commit(torch.full((2, 17), 5))
    before, pos = grid.row_state(0)
    block = torch.full((17, 3), 9)
    grid.splice(0, block)
    after, new_pos = grid.row_state(0)
    assert int(new_pos) == int(pos) + 3
    assert torch.equal(after, before)  # the window is relative to the pending position: same content, 3 later
    assert grid.position.tolist() == [4, 1]


@pytest.mark.parametrize("delays", [[0, 0, 1, 1, 1], [0, 2, 3, 3, 1]])
@pytest.mark.parametrize("n", [1, 2, 7])
def test_splice_is_splice_block_on_the_window(delays: list[int], n: int) -> None:
    """TokenGrid.splice equals span.splice_block on the session's window (the columns around the pending one),
    for a history of 0 and of 2 columns; other sessions are untouched."""
    grid = TokenGrid(delays, [5] * 5, [3, 4], 2)
    grid.buffer = torch.randint(0, 100, grid.buffer.shape, generator=torch.Generator().manual_seed(n))
    other, before, position = grid.buffer[0].clone(), grid.buffer[1].clone(), grid.position.clone()
    block = torch.randint(100, 200, (5, n), generator=torch.Generator().manual_seed(n + 1))
    grid.splice(1, block)
    assert torch.equal(grid.buffer[1], splice_block(before, grid.pending, block)[:, n : n + grid.width])
    assert torch.equal(grid.buffer[0], other)
    assert grid.position.tolist() == [int(position[0]), int(position[1]) + n]
