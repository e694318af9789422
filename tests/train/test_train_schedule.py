"""The learning-rate schedule of ``cspan train`` (:func:`cspan.train.train.lr_factor`): linear warm-up to the peak,
then a half cosine that the last optimizer step ends on exactly ``--min-lr-ratio``; and the rates a real
``torch.optim`` scheduler driven by it gives each step."""

from __future__ import annotations

import math

import pytest
import torch

from cspan.train.train import lr_factor


@pytest.mark.parametrize(
    ("warmup", "total", "min_ratio"), [(2, 30, 0.1), (50, 1000, 0.1), (1, 10, 0.0), (10, 11, 0.25), (7, 100, 1.0)]
)
def test_first_warmup_end_and_last_steps(warmup: int, total: int, min_ratio: float) -> None:
    assert lr_factor(0, warmup, total, min_ratio) == 1 / warmup  # the first step
    assert lr_factor(warmup - 1, warmup, total, min_ratio) == 1.0  # the last warm-up step: the peak
    assert lr_factor(total - 1, warmup, total, min_ratio) == min_ratio  # the last step: exactly the floor


def test_warmup_is_linear_and_the_cosine_falls_from_the_peak_to_the_floor() -> None:
    warmup, total, floor = 4, 20, 0.1
    factors = [lr_factor(s, warmup, total, floor) for s in range(total)]
    assert factors[:warmup] == [0.25, 0.5, 0.75, 1.0]
    # step n (1-based) past the warm-up is at progress (n - warmup) / (total - warmup) of the half cosine
    for n in range(warmup + 1, total):
        expect = floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (n - warmup) / (total - warmup)))
        assert factors[n - 1] == pytest.approx(expect, rel=1e-12)
    assert all(a > b for a, b in zip(factors[warmup - 1 :], factors[warmup:], strict=False))  # strictly down
    assert factors[-1] == floor and min(factors) == floor


def test_without_warmup_the_first_step_is_on_the_cosine_and_the_last_on_the_floor() -> None:
    assert lr_factor(0, 0, 10, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 10)), rel=1e-12)
    assert lr_factor(9, 0, 10, 0.1) == 0.1
    assert lr_factor(0, 0, 1, 0.3) == 0.3  # a one-step run: its only step is its last


def test_a_run_that_ends_within_its_warmup_never_decays() -> None:
    assert [lr_factor(s, 1, 1, 0.1) for s in range(1)] == [1.0]  # --steps 1 takes the default warm-up of 1 step
    assert [lr_factor(s, 8, 4, 0.1) for s in range(4)] == [0.125, 0.25, 0.375, 0.5]
    # the scheduler's look-ahead after the last step (no step uses it) is a number, not a ZeroDivisionError
    assert lr_factor(1, 1, 1, 0.1) == 0.1


def test_a_negative_step_or_an_empty_run_is_refused() -> None:
    with pytest.raises(ValueError, match="step -1"):
        lr_factor(-1, 2, 10, 0.1)
    with pytest.raises(ValueError, match="total 0"):
        lr_factor(0, 2, 0, 0.1)


def test_torch_lambda_scheduler_gives_each_step_its_rate() -> None:
    """What the trainer builds (``LambdaLR`` over two parameter groups, ``scheduler.step()`` after each
    ``optimizer.step()``): the rate of step n is ``lr x lr_factor(n - 1)``, the last one exactly ``lr x ratio``."""
    warmup, total, ratio, lr, lr_dep = 3, 12, 0.1, 2e-6, 4e-6
    params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))]
    optimizer = torch.optim.AdamW([{"params": [params[0]], "lr": lr}, {"params": [params[1]], "lr": lr_dep}])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, warmup, total, ratio))
    used = []
    for _ in range(total):
        used.append([g["lr"] for g in optimizer.param_groups])
        sum((p * p).sum() for p in params).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    assert used[0] == [lr * (1 / 3), lr_dep * (1 / 3)]
    assert used[warmup - 1] == [lr, lr_dep]
    assert used[-1] == [lr * ratio, lr_dep * ratio]
