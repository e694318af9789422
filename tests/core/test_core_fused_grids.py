"""The block attention's launch grid (cspan.core.modules.fused.prefill_grid): key splits and programs per shape,
on the CPU (the kernels themselves run in test_core_fused_cuda.py)."""

from __future__ import annotations

import pytest

from cspan.core.modules import fused

SMS, HEADS = 132, 32  # an H200; the 7B's heads
RING_BLOCKS = 47  # a 3000-slot ring in key blocks of 64


@pytest.mark.parametrize("beside_decode", [False, True])
def test_a_short_block_keeps_its_key_splits_and_one_program_per_tile(beside_decode: bool) -> None:
    """A 17-token sequence (16 span columns and the next position): one query block of 32 per head, 8 key splits
    (the two waves of PREFILL_WAVES over 32 programs), every tile its own program, beside a decode or not (its 32
    programs alone would each walk the whole ring)."""
    splits, programs = fused.prefill_grid(1, 17, 32, HEADS, RING_BLOCKS, SMS, beside_decode)
    assert (splits, programs) == (8, 1 * HEADS * 8)


def test_a_long_block_alone_takes_two_splits_and_the_full_grid() -> None:
    """A 601-token sequence with no decode slots (batch 1): 10 query blocks x 32 heads = 320 live programs, fewer
    than two waves of 2 x 132, so two key splits (14 % faster than one, PREFILL_WAVES); one program per tile."""
    assert fused.prefill_grid(10, 601, 64, HEADS, RING_BLOCKS, SMS) == (2, 640)


def test_a_long_block_beside_a_decode_loops_on_one_program_per_sm() -> None:
    """The same block beside 64 rows' decode: one split and PREFILL_BESIDE_PROGRAMS programs per SM, each looping
    over its share of the 320 tiles, so every SM keeps room for the decode's programs (device calls C88-C90)."""
    splits, programs = fused.prefill_grid(10, 601, 64, HEADS, RING_BLOCKS, SMS, beside_decode=True)
    assert (splits, programs) == (1, fused.PREFILL_BESIDE_PROGRAMS * SMS)


def test_the_last_layers_one_query_block_beside_a_decode_keeps_the_full_grid() -> None:
    """The last layer reads only the query block of each sequence's next position: 1 block x 32 heads is fewer
    programs than SMs, so it keeps its splits and one program per tile even beside a decode (a grid of 32 looping
    programs took 134 us a layer against 47, device call C89's trace)."""
    splits, programs = fused.prefill_grid(1, 640, 64, HEADS, RING_BLOCKS, SMS, beside_decode=True)
    assert splits > 1
    assert programs == HEADS * splits


def test_a_graphs_idle_query_blocks_do_not_count_as_live() -> None:
    """A graph's grid for 8 sequences in a 641-token bucket: ceil(641 / 64) + 7 = 18 query blocks, of which the
    tokens fill at most 11; the splits are sized for those 11 x 32 = 352 programs (two splits: fewer than two waves
    of 264), beside a decode one split on the looping grid, alone every one of the 18 x 32 x 2 tiles its own program."""
    assert fused.prefill_grid(18, 641, 64, HEADS, RING_BLOCKS, SMS) == (2, 18 * HEADS * 2)
    assert fused.prefill_grid(18, 641, 64, HEADS, RING_BLOCKS, SMS, beside_decode=True) == (1, SMS)


def test_a_padded_grid_of_few_live_blocks_beside_a_decode_keeps_its_splits() -> None:
    """A graph's grid of 74 query blocks (74 x 32 programs: more than the SMs) holding a 17-token block: only
    ceil(17 / 16) = 2 blocks are live, 64 programs, fewer than the SMs, so beside a decode it keeps the splits sized for
    them (2 x 132 // 64 = 4) and one program per tile: the decision counts live blocks, not the grid's."""
    assert fused.prefill_grid(74, 17, 16, HEADS, RING_BLOCKS, SMS, beside_decode=True) == (4, 74 * HEADS * 4)


def test_the_looping_grid_starts_where_the_live_blocks_give_every_sm_a_program() -> None:
    """Beside a decode: 4 live query blocks x 32 heads = 128 programs, fewer than 132 SMs, keep their splits and the
    full grid; 5 blocks (160 programs) take one split and one program per SM."""
    splits, programs = fused.prefill_grid(4, 256, 64, HEADS, RING_BLOCKS, SMS, beside_decode=True)
    assert splits == 2 and programs == 4 * HEADS * 2
    assert fused.prefill_grid(5, 257, 64, HEADS, RING_BLOCKS, SMS, beside_decode=True) == (1, SMS)
    assert fused.prefill_grid(4, 256, 64, HEADS, RING_BLOCKS, 128, beside_decode=True) == (1, 128)  # live == SMs


def test_a_decode_after_the_block_keeps_one_split_on_the_full_grid() -> None:
    """CSPAN_SPAN_OVERLAP=0: the decode attention runs after the block's, on one stream. The block keeps the one key
    split it takes beside a decode (both orders give the same bits) but runs one program per tile, faster alone
    than the looping grid (device call C89: 159 against 190 us a layer)."""
    assert fused.prefill_grid(10, 601, 64, HEADS, RING_BLOCKS, SMS, beside_decode=True, concurrent=False) == (1, 320)


def test_given_splits_and_programs_are_kept_within_the_tiles() -> None:
    assert fused.prefill_grid(10, 601, 64, HEADS, RING_BLOCKS, SMS, splits=2) == (2, 640)
    assert fused.prefill_grid(10, 601, 64, HEADS, RING_BLOCKS, SMS, splits=1, programs=66) == (1, 66)
    assert fused.prefill_grid(1, 17, 32, HEADS, RING_BLOCKS, SMS, splits=1, programs=1000) == (1, 32)
    # given splits beside a decode: the grid as given, one program per tile
    assert fused.prefill_grid(10, 601, 64, HEADS, RING_BLOCKS, SMS, beside_decode=True, splits=2) == (2, 640)


@pytest.mark.parametrize("programs", [0, -3])
def test_a_grid_of_no_programs_is_refused(programs: int) -> None:
    with pytest.raises(ValueError, match=f"programs must be at least 1, got {programs}"):
        fused.prefill_grid(10, 601, 64, HEADS, RING_BLOCKS, SMS, programs=programs)
