"""The decode kernel's tensor-core form and the split combine under Triton's interpreter (run by
test_core_decode_forms.py in a subprocess: the interpreter is chosen when triton is imported).

Checks, on float16 rings (the interpreter's bfloat16 products are not faithful): form 2 (the query as row 0 of a
16-row tile) against masked attention in float64 over the ring's positions and the new key, for rings empty, filling,
full and wrapped, windows shorter than the ring, one to five rows, head sizes 64 and 128, and one to many key splits;
that it writes the same key and value as form 1 and agrees with form 1 with RoPE; and that the split combine gives
every row the same bits whatever the number of rows (a step padded to its graph bucket). Prints one JSON line."""

from __future__ import annotations

import json

import interpreter_shims
import torch

from cspan.core.modules import fused
from cspan.core.modules.rope import rope_tables


def _reference(qkv, keys, values, pos, window):
    """Attention of each row's query over ring slots s < min(pos, C) (position pos-1-((pos-1-s) mod C)) within the
    window, and its own new key, in float64: [B, H * Dh]."""
    B, H, C, Dh = keys.shape
    q, k, v = qkv.double().view(B, 3, H, Dh).unbind(1)
    out = torch.empty(B, H, Dh, dtype=torch.float64)
    for b in range(B):
        p = int(pos[b])
        n = min(p, C)
        slots = torch.arange(n)
        key_pos = (p - 1) - ((p - 1 - slots) % C)
        seen = slots[(p - key_pos) < window]
        kk = torch.cat([keys[b, :, seen].double(), k[b][:, None]], 1)  # [H, n + 1, Dh]
        vv = torch.cat([values[b, :, seen].double(), v[b][:, None]], 1)
        w = torch.softmax((kk @ q[b][:, :, None]).squeeze(-1) / Dh**0.5, -1)
        out[b] = (w[:, :, None] * vv).sum(1)
    return out.view(B, H * Dh)


def main() -> None:
    interpreter_shims.apply()
    torch.manual_seed(0)
    worst = 0.0
    cases = [  # B, H, Dh, C, position, window
        (1, 2, 64, 100, 0, 100),
        (1, 2, 64, 100, 37, 100),
        (2, 3, 128, 160, 160, 160),
        (2, 3, 128, 160, 400, 150),
        (3, 2, 64, 96, 250, 40),
        (5, 1, 128, 200, 7, 200),
    ]
    configs = [
        (32, 8, 8, 2, 3, 2),
        (32, 16, 2, 2, 3, 2),
        (64, 64, 8, 4, 2, 2),
        (16, 16, 2, 4, 2, 2),
        (16, 1, 2, 4, 2, 2),
    ]
    for B, H, Dh, C, p, window in cases:
        keys = torch.randn(B, H, C, Dh).half()
        values = torch.randn(B, H, C, Dh).half()
        qkv = torch.randn(B, 3 * H * Dh).half()
        pos = torch.full((B,), p, dtype=torch.long)
        rows = torch.arange(B)
        want = _reference(qkv, keys, values, pos, window)
        k1, v1 = keys.clone(), values.clone()
        fused.decode_attention(qkv, k1, v1, pos, rows, window, config=(16, 16, 2, 4, 2, 1))
        for config in configs:
            k2, v2 = keys.clone(), values.clone()
            got = fused.decode_attention(qkv, k2, v2, pos, rows, window, config=config).double()
            err = float((got - want).norm() / want.norm())
            worst = max(worst, err)
            assert err < 5e-3, (B, H, Dh, C, p, window, config, err)
            assert torch.equal(k2, k1) and torch.equal(v2, v1), (B, H, Dh, C, p, config)
        rope = rope_tables(pos, Dh, 10_000.0)
        one = fused.decode_attention(qkv, keys.clone(), values.clone(), pos, rows, window, rope, config=configs[0])
        ref = fused.decode_attention(
            qkv, keys.clone(), values.clone(), pos, rows, window, rope, config=(16, 16, 2, 4, 2, 1)
        )
        assert float((one.double() - ref.double()).norm() / ref.double().norm()) < 5e-3

    combine = {}
    for splits in (2, 3, 8, 24):
        R, Dh = 37, 64
        part_o = torch.randn(splits, R, Dh)
        part_lse = torch.randn(splits, R) * 4
        part_lse[0, 5] = -1.0e30  # a split that saw no key
        part_o[0, 5] = float("nan")  # its output is never read
        full = torch.empty(R, Dh)
        fused._combine(part_o, part_lse, full, R, splits, False)
        w = torch.softmax(part_lse.double() * torch.log(torch.tensor(2.0, dtype=torch.float64)), 0)
        want = (torch.nan_to_num(part_o.double()) * w[:, :, None]).sum(0)
        assert float((full.double() - want).abs().max()) < 1e-5, splits
        for r in (1, 5, 16, 17):
            part = torch.empty(r, Dh)
            fused._combine(part_o[:, :r].contiguous(), part_lse[:, :r].contiguous(), part, r, splits, False)
            assert torch.equal(part, full[:r]), (splits, r)
        combine[splits] = True
    print(json.dumps({"decode_worst_relative_error": worst, "combine_rows_invariant": combine}))


if __name__ == "__main__":
    main()
