"""GPU: the fused kernels (cspan.core.modules.fused) against the eager modules (decode, ragged prefill, FP8, sampling
noise), the 7B-dimension engine's CUDA-graph step against its eager step (greedy, 20 frames), mixed ragged steps
(spans, a prefix, an idle row) graphed against eager and against stepping, and Mimi's codes on the GPU against the
CPU reference (TF32 off inside Mimi whatever the global flags say)."""

from __future__ import annotations

import gc
import json
import math

import pytest
import torch
from torch.nn import functional as F

from cspan.core.config import LMConfig
from cspan.core.engine import DuplexEngine
from cspan.core.kv_cache import KVCache, attention_mask
from cspan.core.lm import LMModel
from cspan.core.modules import fused
from cspan.core.modules.rope import apply_rope, rope_tables
from cspan.core.span import ContextSpan, span_block, splice_block

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _eager_step(
    ref: KVCache, qkv: torch.Tensor, rows: torch.Tensor, H: int, window: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The eager cache path for T new positions of ``rows`` ([b, T, 3 * H * Dh] projections): RoPE, the write into
    ``ref`` (advanced), masked SDPA in float64. Returns (attention [b, T, H * Dh], q after RoPE [b, H, T, Dh], the
    positions [b, T])."""
    b, T = qkv.shape[:2]
    Dh = qkv.shape[-1] // (3 * H)
    pos = ref.offset[rows][:, None] + torch.arange(T, device=qkv.device)
    q, k, v = qkv.view(b, T, 3, H, Dh).permute(2, 0, 3, 1, 4)
    q, k = apply_rope(q, k, pos, 10_000.0)
    st = ref.begin(T, rows)
    keys, values = ref.update(0, k, v, st)
    mask = attention_mask(st.positions, st.key_positions, window)
    want = F.scaled_dot_product_attention(q.double(), keys.double(), values.double(), attn_mask=mask)
    ref.advance(st)
    return want.transpose(1, 2).reshape(b, T, H * Dh), q, pos


@pytest.mark.parametrize("kv", ["model", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 7, 100])
@pytest.mark.parametrize("subset", [False, True])
def test_attention_kernels_equal_the_eager_cache_path(dtype: torch.dtype, T: int, subset: bool, kv: str) -> None:
    """Decode (T = 1) and prefill (T > 1) attention + cache writes = KVCache.update + masked SDPA, through a ring
    that has wrapped (window < capacity) and on a subset of rows; with an FP8 cache the same codes and scales."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(T)
    B, H, Dh, C, window = 3, 4, 128, 160, 150
    kv_dtype = torch.float8_e4m3fn if kv == "fp8" else dtype
    cache, ref = (KVCache(1, B, H, Dh, C, dev, kv_dtype, dtype) for _ in range(2))
    for hist, rows in ((170, None), (60, torch.tensor([0, 2], device=dev))):  # ring wrapped; rows at 230 / 170
        Bq = B if rows is None else 2
        k0 = torch.randn(Bq, H, hist, Dh, device=dev, generator=gen).to(dtype)
        v0 = torch.randn(Bq, H, hist, Dh, device=dev, generator=gen).to(dtype)
        for c in (cache, ref):
            st = c.begin(hist, rows)
            c._write(0, k0, v0, st)
            c.advance(st)
    rows = torch.tensor([1], device=dev) if subset else torch.arange(B, device=dev)
    Bq = rows.shape[0]
    qkv = torch.randn(Bq, T, 3 * H * Dh, device=dev, generator=gen).to(dtype)
    want, q, pos = _eager_step(ref, qkv, rows, H, window)
    cos, sin = rope_tables(pos, Dh, 10_000.0)
    tol_rope = 1e-2 if dtype == torch.bfloat16 else 1e-6
    scales = cache.layer_scales(0)
    if T == 1:
        got = fused.decode_attention(
            qkv, cache.keys[0], cache.values[0], cache.offset[rows], rows, window, (cos[:, 0], sin[:, 0]), scales
        )
    else:
        flat = (cos.reshape(Bq * T, -1), sin.reshape(Bq * T, -1))
        q2, k2, v2 = fused.rope_split(qkv.reshape(Bq * T, -1), H, flat)
        q_ref = q.transpose(1, 2).reshape(Bq * T, H, Dh)
        assert _rel(q2, q_ref) < tol_rope  # same formula; FMA contraction may differ
        ragged = fused.Ragged.uniform(rows, T, C).at(cache.offset)
        got = fused.prefill_attention(q2, k2, v2, cache.keys[0], cache.values[0], ragged, window, scales)
        got = got.view(Bq, T, H * Dh)
        fused.kv_write(k2, v2, cache.keys[0], cache.values[0], ragged.tok_row, ragged.store_pos, scales)
    cache.advance_by(T, rows)
    torch.cuda.synchronize()
    tol = 1e-5 if dtype == torch.float32 and kv == "model" else 1e-2 if kv == "model" else 6e-2
    assert _rel(got, want) < tol
    assert torch.equal(cache.offset, ref.offset)
    assert _rel(cache.values.float(), ref.values.float()) < (1e-6 if kv == "model" else 7e-2)
    assert _rel(cache.keys.float(), ref.keys.float()) < (tol_rope if kv == "model" else 7e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ragged_prefill_of_several_rows_equals_each_row_alone(dtype: torch.dtype) -> None:
    """One launch for blocks of 5, 37 and 70 tokens of three rows at different offsets (a padded grid with idle
    programs and padding tokens, as the engine's graphs use) = each row's chunk through the eager cache path."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(7)
    B, H, Dh, C, window = 4, 4, 64, 96, 96
    cache, ref = (KVCache(1, B, H, Dh, C, dev, dtype) for _ in range(2))
    for c in (cache, ref):
        c.offset.copy_(torch.tensor([0, 40, 130, 7], device=dev))
    fill = torch.randn(1, B, H, C, Dh, device=dev, generator=gen).to(dtype)
    cache.keys.copy_(fill)
    ref.keys.copy_(fill)
    cache.values.copy_(fill.flip(-1))
    ref.values.copy_(fill.flip(-1))
    lengths, rows = [5, 37, 70], [2, 0, 1]
    N = sum(lengths) + 8  # 8 padding tokens
    q, k, v = (torch.randn(N, H, Dh, device=dev, generator=gen).to(dtype) for _ in range(3))
    bm = fused.block_m_for(N)
    starts = [0, 5, 42]
    qb_seq, qb_j = [], []
    for s, n in enumerate(lengths):
        per = -(-n // bm)
        qb_seq += [s] * per
        qb_j += [j * bm for j in range(per)]
    qb_seq += [-1] * 3  # idle programs
    qb_j += [0] * 3
    tok_row = torch.full((N,), 3, dtype=torch.long)
    tok_j = torch.full((N,), -1, dtype=torch.long)
    for r, s0, n in zip(rows, starts, lengths, strict=True):
        tok_row[s0 : s0 + n] = r
        tok_j[s0 : s0 + n] = torch.arange(n)
    t = lambda x: torch.tensor(x, dtype=torch.long, device=dev)  # noqa: E731
    ragged = fused.Ragged(
        seq_row=t(rows), seq_start=t(starts), seq_len=t(lengths), qb_seq=t(qb_seq), qb_j=t(qb_j),
        tok_row=tok_row.to(dev), tok_j=tok_j.to(dev), tok_keep=tok_j.to(dev) >= 0, block_m=bm,
    ).at(cache.offset)  # fmt: skip
    got = fused.prefill_attention(q, k, v, cache.keys[0], cache.values[0], ragged, window)
    fused.kv_write(k, v, cache.keys[0], cache.values[0], ragged.tok_row, ragged.store_pos)
    for r, s0, n in zip(rows, starts, lengths, strict=True):
        sl = slice(s0, s0 + n)
        st = ref.begin(n, torch.tensor([r], device=dev))
        qr, kr, vr = (x[sl].transpose(0, 1)[None] for x in (q, k, v))
        keys, values = ref.update(0, kr, vr, st)
        mask = attention_mask(st.positions, st.key_positions, window)
        want = F.scaled_dot_product_attention(qr.double(), keys.double(), values.double(), attn_mask=mask)
        want = want[0].transpose(0, 1).reshape(n, H * Dh)
        assert _rel(got[sl], want) < (1e-5 if dtype == torch.float32 else 1e-2), r
    torch.cuda.synchronize()
    assert _rel(cache.keys.float(), ref.keys.float()) < 1e-6 and _rel(cache.values.float(), ref.values.float()) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_splits_past_a_short_rings_keys_are_left_out(dtype: torch.dtype) -> None:
    """Rings far from full in a large capacity (fresh sessions): most key splits of the prefill and decode kernels
    see no key, write their log-sum-exp only, and the combine must not read their (unwritten) outputs. The memory
    those outputs land in is poisoned with NaN first; prefill in 9 splits and decode in the default split count
    equal the eager cache path, and prefill in 9 splits equals 1 split to float32 rounding."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(11)
    B, H, Dh, C, window = 3, 4, 128, 1024, 1000
    cache, ref = (KVCache(1, B, H, Dh, C, dev, dtype, dtype) for _ in range(2))
    offsets = [0, 5, 100]
    for r, hist in enumerate(offsets):
        if hist:
            rows = torch.tensor([r], device=dev)
            k0, v0 = (torch.randn(1, H, hist, Dh, device=dev, generator=gen).to(dtype) for _ in range(2))
            for c in (cache, ref):
                st = c.begin(hist, rows)
                c._write(0, k0, v0, st)
                c.advance(st)
    rows = torch.arange(B, device=dev)
    for T in (65, 1):
        qkv = torch.randn(B, T, 3 * H * Dh, device=dev, generator=gen).to(dtype)
        want, _, pos = _eager_step(ref, qkv, rows, H, window)
        cos, sin = rope_tables(pos, Dh, 10_000.0)
        poison = torch.full((1 << 24,), float("nan"), device=dev)  # the partials' memory, once freed, holds NaN
        del poison
        if T == 1:
            got = fused.decode_attention(
                qkv, cache.keys[0], cache.values[0], cache.offset[rows], rows, window, (cos[:, 0], sin[:, 0])
            ).view(B, 1, H * Dh)
        else:
            flat = (cos.reshape(B * T, -1), sin.reshape(B * T, -1))
            q2, k2, v2 = fused.rope_split(qkv.reshape(B * T, -1), H, flat)
            ragged = fused.Ragged.uniform(rows, T, C).at(cache.offset)
            config = (ragged.block_m, 64, 4, 3)
            got = fused.prefill_attention(q2, k2, v2, cache.keys[0], cache.values[0], ragged, window, None, config, 9)
            one = fused.prefill_attention(q2, k2, v2, cache.keys[0], cache.values[0], ragged, window, None, config, 1)
            torch.testing.assert_close(got, one, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-5)
            got = got.view(B, T, H * Dh)
            fused.kv_write(k2, v2, cache.keys[0], cache.values[0], ragged.tok_row, ragged.store_pos)
        cache.advance_by(T, rows)
        torch.cuda.synchronize()
        assert not got.isnan().any(), T
        assert _rel(got, want) < (1e-5 if dtype == torch.float32 else 1e-2), T


@pytest.mark.parametrize("kv", ["model", "fp8"])
@pytest.mark.parametrize(
    ("C", "window", "offsets"), [(96, 72, [300, 20, 96, 1235]), (512, 480, [5000, 480, 512, 7000])]
)
def test_ragged_prefill_does_not_depend_on_the_queries_per_block(
    kv: str, C: int, window: int, offsets: list[int]
) -> None:
    """The same sequences through query blocks of 16, 32 and 64 (a padded step's block_m differs from the unpadded
    step's): the key blocks sit at the same offsets whatever the query block, and whether a key block takes the
    window mask is decided per group of 64 queries, so every query adds the same scores in the same order. Blocks of
    16 and 32 queries give bit-identical outputs; 64 within one bf16 rounding step: its products run as Hopper's
    warpgroup MMA (64 rows), the smaller blocks' as mma.sync, and the tensor cores' float32 sums differ in the last
    bits (device calls C40 / C41: only block_m 64 differed, with the mask decision already the same for all).
    Windows below the ring whose masked keys end off the key-block grid (96 / 72: only masked blocks; 512 / 480:
    masked, unmasked and partial blocks), wrapped and filling rings, 1 and 2 key splits. Fewer programs than tiles
    (each looping over its share, as beside a decode attention) give the same bits as one program per tile, with the
    test's config and with the engine's (PREFILL_CONFIG)."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(3)
    H, Dh = 4, 128
    kv_dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    cache = KVCache(1, 4, H, Dh, C, dev, kv_dtype, torch.bfloat16)
    cache.offset.copy_(torch.tensor(offsets, device=dev))
    fill = torch.randn(4, H, C, Dh, device=dev, generator=gen)
    cache.keys[0].copy_(fill.to(kv_dtype))
    cache.values[0].copy_(fill.flip(-1).to(kv_dtype))
    if kv == "fp8":  # per-slot scales that vary
        cache.key_scale.copy_(torch.rand(cache.key_scale.shape, device=dev, generator=gen) + 0.5)
        cache.value_scale.copy_(torch.rand(cache.value_scale.shape, device=dev, generator=gen) + 0.5)
    lengths, rows = [17, 40], [3, 1]
    n = sum(lengths)
    q, k, v = (torch.randn(n, H, Dh, device=dev, generator=gen).bfloat16() for _ in range(3))
    t = lambda x: torch.tensor(x, dtype=torch.long, device=dev)  # noqa: E731
    outs = {}
    for bm in (16, 32, 64):
        qb = [(s, j) for s in range(2) for j in range(0, lengths[s], bm)]
        ragged = fused.Ragged(
            seq_row=t(rows), seq_start=t([0, lengths[0]]), seq_len=t(lengths), qb_seq=t([s for s, _ in qb]),
            qb_j=t([j for _, j in qb]), tok_row=t([r for r, m in zip(rows, lengths, strict=True) for _ in range(m)]),
            tok_j=t([j for m in lengths for j in range(m)]), tok_keep=t([1] * n).bool(), block_m=bm,
        ).at(cache.offset)  # fmt: skip
        for splits in (1, 2):
            args = (q, k, v, cache.keys[0], cache.values[0], ragged, window, cache.layer_scales(0), (bm, 64, 4, 2))
            outs[bm, splits] = fused.prefill_attention(*args, splits)
            for programs in (1, 3, 7):
                looped = fused.prefill_attention(*args, splits, programs=programs)
                assert torch.equal(looped, outs[bm, splits]), (bm, splits, programs)
            if bm == fused.PREFILL_CONFIG[0]:  # the engine's own config (its pipeline stages) loops the same way
                engine = fused.prefill_attention(*args[:-1], None, splits)
                for programs in (1, 5, 2 * H * splits - 1):  # the tiles: 2 query blocks x H x splits
                    looped = fused.prefill_attention(*args[:-1], None, splits, programs=programs)
                    assert torch.equal(looped, engine), ("engine config", splits, programs)
    for (bm, splits), out in outs.items():
        if bm == 64:
            torch.testing.assert_close(out.float(), outs[16, splits].float(), atol=0.02, rtol=0.01)
        else:
            assert torch.equal(out, outs[16, splits]), (bm, splits)


def test_norm_and_gate_kernels_equal_the_eager_arithmetic() -> None:
    dev = torch.device("cuda")
    x = torch.randn(5, 4096, device=dev).bfloat16()
    r = torch.randn(5, 4096, device=dev).bfloat16()
    w = torch.rand(1, 1, 4096, device=dev).bfloat16()
    s, y = fused.rms_norm(x, w, 1e-8, r)
    assert torch.equal(s, x + r)
    sf = (x + r).float()
    want = (sf * (w.float().view(-1) * torch.rsqrt(1e-8 + (sf * sf).mean(-1, keepdim=True)))).bfloat16()
    assert (y.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
    h = torch.randn(3, 2 * 2816, device=dev).bfloat16()
    want = (F.silu(h[:, :2816]) * h[:, 2816:]).float()
    assert ((fused.silu_gate(h).float() - want).abs() <= 2**-7 * want.abs() + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_embed_sum_equals_the_chain_of_lookups(dtype: torch.dtype) -> None:
    """fused.embed_sum (the temporal input in one launch) equals the chain of fused.embed_add it replaced, bit for
    bit: 16 audio tables and the text table (another vocabulary), streams 1..16 then 0, ids of -1, strided ids
    (a ragged step's [1, K, T] view of the [K, T] columns), one and 601 positions."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(17)
    K, D = 17, 4096
    tables = [torch.randn(2049 if k < K - 1 else 32001, D, device=dev, generator=gen).to(dtype) for k in range(K)]
    for B, T in ((1, 1), (3, 1), (1, 601)):
        columns = torch.randint(-1, 2049, (K, B * T), device=dev, generator=gen)
        columns[0] = torch.randint(-1, 32001, (B * T,), device=dev, generator=gen)
        ids = columns.view(K, B, T).transpose(0, 1)  # [B, K, T], not contiguous
        x = None
        for k, table in enumerate(tables):
            x = fused.embed_add(x, table, ids[:, (k + 1) % K])
        assert torch.equal(fused.embed_sum(tables, ids), x)
    with pytest.raises(ValueError, match="16 tables for 17 streams"):
        fused.embed_sum(tables[:16], ids)


@pytest.mark.parametrize(
    ("M", "N", "K", "norm", "gate", "residual"),
    [
        (1, 3072, 1024, True, False, False),  # depformer qkv
        (1, 1024, 2816, False, False, True),  # depformer FFN out
        (4, 2816, 1024, True, True, False),  # depformer FFN in (gated), 4 rows
        (1, 12288, 4096, True, False, False),  # temporal qkv (large config)
        (2, 4096, 11264, False, False, True),  # temporal FFN out: K not a power of two
        (1, 11264, 4096, True, True, False),  # temporal FFN in (gated)
    ],
)
def test_gemv_kernel_equals_the_eager_arithmetic(
    M: int, N: int, K: int, norm: bool, gate: bool, residual: bool
) -> None:
    """fused.gemv against norm -> F.linear -> gate / residual in float64 on the same bf16 inputs."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(N + K)
    x = torch.randn(M, K, device=dev, generator=gen).bfloat16()
    w = (torch.randn(2 * N if gate else N, K, device=dev, generator=gen) / math.sqrt(K)).bfloat16()
    alpha = (torch.rand(K, device=dev, generator=gen) + 0.5).bfloat16()
    r = torch.randn(M, N, device=dev, generator=gen).bfloat16()
    y = fused.gemv(x, w, norm=(alpha, 1e-8) if norm else None, residual=r if residual else None, gate=gate)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    h = x.double()
    if norm:
        h = (h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-8) * alpha.double()).bfloat16().double()
    want = h @ w.double().T
    if gate:
        want = F.silu(want[:, :N]) * want[:, N:]
    if residual:
        want = want + r.double()
    assert _rel(y, want) < 1e-2
    with pytest.raises(ValueError, match="at most"):
        fused.gemv(torch.zeros(fused.GEMV_MAX_ROWS + 1, K, device=dev, dtype=torch.bfloat16), w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sample_kernel_is_the_top_k_exponential_race(dtype: torch.dtype) -> None:
    """fused.sample_top_k (16-bit keys for 16-bit logits, noise computed in the kernel) picks sample_race's token:
    argmax over the top k of softmax(l / T) / q with the counter-based noise, ties with the k-th largest included,
    forced entries kept; the noise kernel gives race_noise's values."""
    from cspan.core.sampling import sample_race

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(11)
    logits = (torch.randn(8, 2048, device=dev, generator=gen) * 3).to(dtype)
    logits[0, :12] = logits[0, 7]  # a run of ties
    seed = torch.arange(8, device=dev) * 1000 + 5
    counter = torch.arange(8, device=dev) + 77
    known = torch.full((8,), -2, dtype=torch.long, device=dev)
    known[3] = 5
    noise = fused.race_noise(seed, counter, 3, 2048)
    torch.testing.assert_close(fused.race_noise_fused(seed, counter, 3, 2048), noise, rtol=1e-6, atol=0)
    got = fused.sample_top_k(logits, 0.8, 250, seed, counter, 3, known, torch.empty(8, dtype=torch.long, device=dev))
    want = sample_race(logits, 0.8, 250, noise)
    want[3] = 5
    assert got.tolist() == want.tolist()
    greedy = fused.sample_top_k(logits, 0.0, 250, seed, counter, 3, known, torch.empty(8, dtype=torch.long, device=dev))
    want_greedy = logits.float().argmax(-1)
    want_greedy[3] = 5
    assert greedy.tolist() == want_greedy.tolist()
    # per-row parameters (each session's own): row r equals the one-parameter call for that row
    temps = torch.tensor([0.8, 0.0, 1.3, 0.5, 0.7, 0.0, 2.0, 0.9], device=dev)
    top_ks = torch.tensor([250, 25, 1, 0, 2048, 7, 3, 500], device=dev)
    rows = fused.sample_top_k(
        logits, temps, top_ks, seed, counter, 3, known, torch.empty(8, dtype=torch.long, device=dev)
    )
    assert rows.tolist() == sample_race(logits, temps, top_ks, noise).where(known == -2, known).tolist()
    for r in range(8):
        one = fused.sample_top_k(logits[r : r + 1], float(temps[r]), int(top_ks[r]), seed[r : r + 1],
                                 counter[r : r + 1], 3, known[r : r + 1], torch.empty(1, dtype=torch.long, device=dev))  # fmt: skip
        assert rows[r].item() == one.item(), r
    # the same integers on the CPU; -log of them agrees to float32 rounding (the two devices' log may differ by an ulp)
    torch.testing.assert_close(noise.cpu(), fused.race_noise(seed.cpu(), counter.cpu(), 3, 2048), rtol=1e-6, atol=0)


def _random_7b(dtype: torch.dtype = torch.bfloat16) -> LMModel:
    """PersonaPlex 7B dimensions (dep_q 16), random weights built directly on the GPU."""
    lm = LMModel(LMConfig.personaplex_7b(), device="meta", dtype=dtype).to_empty(device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if p.dim() < 2 or name.endswith("alpha"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]), generator=gen)
    return lm.eval()


def _free_cuda() -> None:
    """Free the CUDA memory of engines no longer referenced (an engine's graphs and streams hold reference cycles, so
    only the collector frees its KV cache): the 7B tests build engines of 8 GB and more one after another, which an
    80 GB H100 holds only if each is freed before the next."""
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _free_after_test():
    yield
    if torch.cuda.is_available():
        _free_cuda()


@pytest.fixture(scope="module")
def lm7b() -> LMModel:
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("the 7B-dimension model needs a GPU with 40 GB")
    lm = _random_7b()
    yield lm
    del lm
    torch.cuda.empty_cache()


def test_7b_graph_step_equals_eager_step_greedy(lm7b: LMModel) -> None:
    """The CUDA-graph step equals the eager step for 20 frames in greedy mode (random 7B weights); with the
    user-stream predictions skipped (serve / infer) the agent and text columns stay the same."""
    kw = {"batch_size": 1, "temp": 0.0, "temp_text": 0.0, "seed": 0}
    columns = {}
    for predict_user in (True, False):
        eager = DuplexEngine(lm7b, cuda_graphs=False, predict_user=predict_user, **kw)
        graphed = DuplexEngine(lm7b, cuda_graphs=True, predict_user=predict_user, **kw)
        gen = torch.Generator().manual_seed(3)
        columns[predict_user] = []
        for t in range(20):
            user = torch.randint(0, 2048, (1, 8), generator=gen).cuda()
            a, b = eager.step_tokens(user), graphed.step_tokens(user)
            assert torch.equal(a.column, b.column), f"frame {t}: graph replay differs from eager"
            assert torch.equal(a.text_logits, b.text_logits), f"frame {t}"
            columns[predict_user].append(b.column)
        assert any(g is not None for g in graphed._step_graphs.graphs.values())
    for a, b in zip(columns[True], columns[False], strict=True):
        assert torch.equal(a[:, :9], b[:, :9])


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="PDL needs sm_90 or later"
)
def test_7b_graph_step_is_the_same_with_and_without_pdl(lm7b: LMModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Programmatic dependent launch changes when kernels start, never what they compute: graphed steps of an
    engine built with CSPAN_PDL=0 and of one built with PDL give identical columns and logits."""
    kw = {"batch_size": 1, "temp": 0.0, "temp_text": 0.0, "seed": 0}
    monkeypatch.setenv("CSPAN_PDL", "0")
    off = DuplexEngine(lm7b, cuda_graphs=True, **kw)
    assert not off.plan.pdl
    gen = torch.Generator().manual_seed(4)
    users = [torch.randint(0, 2048, (1, 8), generator=gen).cuda() for _ in range(6)]
    want = [off.step_tokens(u) for u in users]
    monkeypatch.delenv("CSPAN_PDL")
    on = DuplexEngine(lm7b, cuda_graphs=True, **kw)
    assert on.plan.pdl
    for t, (u, a) in enumerate(zip(users, want, strict=True)):
        b = on.step_tokens(u)
        assert torch.equal(a.column, b.column), f"frame {t}: PDL changed the column"
        assert torch.equal(a.text_logits, b.text_logits), f"frame {t}"


def test_7b_block_attention_beside_the_decode_attention_changes_nothing(
    lm7b: LMModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's block attention on the plan's second stream, beside the other rows' decode attention (FlashInfer's
    from 8 rows, where installed), gives the same columns, text logits and sessions' cache rows as the two one after
    the other (``CSPAN_SPAN_OVERLAP=0``), bit for bit: graphed, 8 sessions, spans of 600 and 40 columns into two
    of them (row 8, the scratch row, takes the padding and block rows' dummy slots, several writes to one slot)."""
    kw = {"batch_size": 8, "temp": 0.0, "temp_text": 0.0, "seed": 0, "cuda_graphs": True}
    gen = torch.Generator().manual_seed(9)
    users = [torch.randint(0, 2048, (8, 8), generator=gen).cuda() for _ in range(9)]
    spans = [ContextSpan.from_ids(torch.randint(32, 32000, (n - 2,), generator=gen).tolist()) for n in (600, 40)]

    def run(engine: DuplexEngine) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for t in range(9):
            if t in (2, 4, 6):  # the third use of a graph key replays it
                engine.inject_span(0, spans[0])
                engine.inject_span(5, spans[1])
            o = engine.step_tokens(users[t])
            out.append((o.column, o.text_logits))
        return out

    monkeypatch.setenv("CSPAN_SPAN_OVERLAP", "0")
    apart = DuplexEngine(lm7b, **kw)
    assert apart.plan.attention_stream is None
    want = run(apart)
    monkeypatch.delenv("CSPAN_SPAN_OVERLAP")
    beside = DuplexEngine(lm7b, **kw)
    assert beside.plan.attention_stream is not None
    got = run(beside)
    for t, ((ca, la), (cb, lb)) in enumerate(zip(want, got, strict=True)):
        assert torch.equal(ca, cb), f"step {t}: the columns differ"
        assert torch.equal(la, lb), f"step {t}: the text logits differ"
    a, b = apart.lm_state.transformer.cache, beside.lm_state.transformer.cache
    assert torch.equal(a.offset, b.offset)
    rows = slice(0, 8)  # the sessions' rows
    assert torch.equal(a.keys[:, rows], b.keys[:, rows]), "the keys differ"
    assert torch.equal(a.values[:, rows], b.values[:, rows]), "the values differ"


def test_7b_mixed_ragged_steps_graphed_equal_eager_and_stepwise(lm7b: LMModel) -> None:
    """Four sessions; in the same steps one reads a 64-column span, one a 40-column span, one a persona prefix, one
    steps plainly (and later is idle). The graphed engine equals the eager fused engine laid out as the graphs lay
    it out (padded to the buckets) bit for bit; fed the same tokens, it equals the unpadded eager engine up to bf16
    rounding (padding changes the shapes of the matrix products, so cuBLAS may pick other kernels: free-running
    greedy tokens may then flip, and everything after a flip differs); and a span read in the step equals forcing
    the spliced sequence one call at a time (bf16 rounding)."""
    import dataclasses

    from cspan.core.kv_cache import slot_positions

    kw = {"batch_size": 4, "temp": 0.0, "temp_text": 0.0, "seed": 0}
    gen = torch.Generator().manual_seed(8)
    users = [torch.randint(0, 2048, (4, 8), generator=gen).cuda() for _ in range(12)]
    voice = torch.randint(0, 2048, (8, 6), generator=gen)
    spans = [ContextSpan.from_ids(torch.randint(32, 32000, (n - 2,), generator=gen).tolist()) for n in (64, 40)]

    def run(engine: DuplexEngine, forced: list[torch.Tensor] | None = None):
        logits, columns = [], []
        for t in range(12):
            if t in (3, 6, 9):  # the third use of a key replays its graph
                engine.inject_span(0, spans[0])
                engine.inject_span(1, spans[1])
                engine.set_persona(2, None, voice)
            engine.set_live(3, t < 7)
            out = engine.step_tokens(users[t], None if forced is None else forced[t])
            logits.append(out.text_logits.float())
            columns.append(out.column)
        cache = engine.lm_state.transformer.cache
        return torch.stack(logits), columns, cache.offset.clone(), cache.keys.clone()

    def diff(a, b) -> tuple[float, float]:  # (max |text logit diff|, max |key diff| in filled slots)
        filled = (slot_positions(a[2], a[3].shape[3]) >= 0)[None, :, None, :, None]
        return (a[0] - b[0]).abs().max().item(), ((a[3].float() - b[3].float()).abs() * filled).max().item()

    def first_flip(a, b) -> str:  # the first sampled token where two free-running runs part
        for t, (x, y) in enumerate(zip(a[1], b[1], strict=True)):
            if not torch.equal(x, y):
                r, k = (x != y).nonzero()[0].tolist()
                return f"step {t}, session {r}, stream {k}: {x[r, k].item()} vs {y[r, k].item()}"
        return "none"

    # one engine at a time, each freed before the next (_free_cuda)
    eager = run(DuplexEngine(lm7b, cuda_graphs=False, **kw))
    _free_cuda()
    padded = DuplexEngine(lm7b, cuda_graphs=False, **kw)
    padded.plan = dataclasses.replace(padded.plan, buckets=True)  # the graphs' layout, run eagerly
    padded_run = run(padded)
    del padded
    _free_cuda()
    graphed_engine = DuplexEngine(lm7b, cuda_graphs=True, **kw)
    graphed = run(graphed_engine)
    assert any(g is not None for g in graphed_engine._step_graphs.graphs.values())
    del graphed_engine
    _free_cuda()
    forced = run(DuplexEngine(lm7b, cuda_graphs=True, **kw), forced=eager[1])  # the eager run's tokens fed
    _free_cuda()
    dl, dk = diff(eager, forced)
    scale = (eager[0].abs().max().item(), eager[3].float().abs().max().item())
    print(
        f"graphed vs eager padded: {diff(padded_run, graphed)} (first flip: {first_flip(padded_run, graphed)}); "
        f"free-running graphed vs eager unpadded: {diff(eager, graphed)} (first flip: {first_flip(eager, graphed)}); "
        f"same tokens: max |text logit diff| {dl:.3g} (max |logit| {scale[0]:.3g}), max |key diff| in filled "
        f"slots {dk:.3g} (max |key| {scale[1]:.3g})"
    )
    # a replay changes nothing: bit for bit the eager step laid out the same way
    (la, ca, oa, ka), (lb, cb, ob, kb) = padded_run, graphed
    assert torch.equal(oa, ob)
    assert all(torch.equal(a, b) for a, b in zip(ca, cb, strict=True)), "graphed columns differ from eager padded"
    assert torch.equal(la, lb), "graphed text logits differ from the eager padded step"
    filled = (slot_positions(oa, ka.shape[3]) >= 0)[None, :, None, :, None]
    assert torch.equal(ka * filled, kb * filled), "graphed keys differ from the eager padded step"
    # padding changes the shapes of the products (other cuBLAS kernels): fed the same tokens, rounding only
    assert torch.equal(eager[2], forced[2])
    assert dl <= 0.05 * scale[0] and dk <= 0.05 * scale[1], (dl, dk)

    # one-pass read == stepwise forcing, session 0 alone (batch 1)
    one = DuplexEngine(lm7b, cuda_graphs=True, batch_size=1, temp=0.0, temp_text=0.0)
    ref = DuplexEngine(lm7b, cuda_graphs=False, batch_size=1, temp=0.0, temp_text=0.0)
    inputs = [one.step_tokens(users[c][:1]).input[0] for c in range(3)]
    pending = one.grid.row_state(0)[0][:, one.grid.pending]
    one.inject_span(0, spans[0])
    a = one.step_tokens(users[3][:1])
    block = span_block([12, *spans[0].token_ids, 13], device="cuda")
    seq = splice_block(torch.stack([*inputs, pending], dim=1), 3, block)
    for c in range(seq.shape[1] - 1):
        user = torch.stack([seq[r, c + ref.grid.delays[r]] for r in ref.user_rows])
        ref.step_tokens(user[None], seq[:, c + 1][None])
    b = ref.step_tokens(users[3][:1])
    ca, cb = one.lm_state.transformer.cache, ref.lm_state.transformer.cache
    assert torch.equal(ca.offset, cb.offset)
    end = int(ca.offset[0])
    assert _rel(ca.keys[:, :1, :end], cb.keys[:, :1, :end]) < 2e-2
    assert _rel(a.text_logits.float(), b.text_logits.float()) < 5e-2


def test_mimi_gpu_codes_equal_cpu_reference_with_tf32_allowed(fixture_file) -> None:
    """Mimi turns TF32 off itself: even with the global flags on, GPU codes equal the CPU reference codes."""
    from safetensors.torch import load_file

    from cspan.core.config import MimiConfig
    from cspan.core.mimi import Mimi

    cfg = MimiConfig.from_upstream(json.loads(fixture_file("reference", "mimi-small", "config.json").read_text()))
    pcm = load_file(fixture_file("reference", "mimi-small", "input.safetensors"))["pcm"]
    want = load_file(fixture_file("reference", "mimi-small", "codes.safetensors"))["codes"]
    model = Mimi(cfg, device="cuda").eval()
    model.load_state_dict(load_file(fixture_file("reference", "mimi-small", "model.safetensors")), strict=True)
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        with torch.no_grad():
            codes = model.encode(pcm.cuda())
            state = model.new_encoder_state(1)
            steps = [
                model.encode_step(pcm[..., 1920 * t : 1920 * (t + 1)].cuda(), state) for t in range(want.shape[-1])
            ]
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (True, True)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    assert torch.equal(codes.cpu(), want)
    assert torch.equal(torch.cat(steps, -1).cpu(), want)


def test_fused_streaming_convs_equal_the_eager_convs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mimi's SEANet encoder and decoder and its learnt down/upsampling at the released dimensions (random
    weights), streamed frame by frame through the fused conv kernels (where they are chosen) against the eager
    cuDNN path, one row (weight-streaming kernels) and two rows (the batched choice), a reset in the middle:
    outputs within float32 rounding."""
    from cspan.core.config import MimiConfig
    from cspan.core.mimi import Mimi

    torch.manual_seed(0)
    model = Mimi(MimiConfig.mimi_24khz(), device="cuda").eval()
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(1)
    parts = [
        (model.encoder, (1, 1920), 0.1),
        (model.decoder, (512, 2), 1.0),
        (model.downsample, (512, 2), 1.0),
        (model.upsample, (512, 1), 1.0),
    ]
    try:
        for module, shape, scale in parts:
            for rows in (1, 2):
                monkeypatch.setenv("CSPAN_FUSED", "0")
                eager_state = module.new_state(rows)
                monkeypatch.delenv("CSPAN_FUSED")
                fused_state = module.new_state(rows)
                for t in range(5):
                    if t == 3:
                        eager_state.reset([rows - 1])
                        fused_state.reset([rows - 1])
                    x = torch.randn(rows, *shape, device="cuda", generator=gen) * scale
                    with torch.no_grad():
                        monkeypatch.setenv("CSPAN_FUSED", "0")
                        want = module(x, eager_state)
                        monkeypatch.delenv("CSPAN_FUSED")
                        got = module(x, fused_state)
                    assert got.shape == want.shape
                    assert _rel(got, want) < 1e-5, (type(module).__name__, rows, t, _rel(got, want))
    finally:
        torch.backends.cudnn.allow_tf32 = saved
