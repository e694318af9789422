"""FlashAttention 4 (``flash-attn-4``, the CuTe DSL kernels; SM90 path on the H200) against the kernels the engine
uses, on the engine's shapes: decode over a full 3000-slot ring and a block's prefill over the ring. An experiment for
docs/PERFORMANCE.md ("Decode attention: what each kernel gave"); the engine does not call FlashAttention.

- Decode: one query per row over its whole full ring (32 heads of 128, bf16), the ring read in place as
  ``[B, C, H, Dh]`` through a transposed view of the engine's ``[B, H, C, Dh]`` buffer (on a full ring the
  attention does not depend on the slot order). Against torch SDPA (no mask) and FlashInfer's decode as the engine
  runs it (``cspan.core.attention.FlashInferDecode``). FA4 is timed at several ``num_splits``, the best printed.
- Prefill: a block of n tokens over the ``window - 1`` newest ring positions and its own keys, causal (aligned to the
  bottom right) with ``window_size = (window - 1, 0)``: the engine's mask. FA4 and FlashInfer's ragged prefill read
  a position-ordered contiguous copy (the copy not timed: what the kernel gives), the engine's
  ``fused.prefill_attention`` reads the ring in place.

Each line gives µs per layer (median of CUDA-event runs over 4 layers' buffers, so the reads come from HBM) and the
max |difference| from the engine's kernel. The first FA4 call of each shape compiles it (seconds).

Usage (on the device, the wheels of flash-attn-4 and the CUTLASS DSL installed): python scripts/flashattention_bench.py

The CUTLASS DSL's library wheel (``nvidia-cutlass-dsl-libs-cu13``, 92 MB) is larger than the 64 MiB a device call
carries; its files travel as an xz tarball with the x86 filter (52 MB). Here, once (about 5 minutes)::

    mkdir -p .fa4 /tmp/fa4 && echo /.fa4/ >> .git/info/exclude   # then pip download (--no-deps, --pre, cp312
    # manylinux_2_28_x86_64) into /tmp/fa4: flash-attn-4==4.0.0b36 nvidia-cutlass-dsl-libs-base==4.8.1
    # nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5
    # torch-c-dlpack-ext==0.1.5 apache-tvm-ffi==0.1.15.post2
    cp /tmp/fa4/{flash_attn_4,quack,torch_c,apache_tvm}*.whl .fa4/
    for w in /tmp/fa4/*libs_{base,core,cu13}*.whl; do unzip -qo $w -d /tmp/fa4/lib; done
    rm -rf /tmp/fa4/lib/nvidia_cutlass_dsl/dsl_packages/iket /tmp/fa4/lib/nvidia_cutlass_dsl/cu13/lib/stubs
    tar -C /tmp/fa4/lib -cf - . | xz --x86 --lzma2=preset=9e,dict=256MiB > .fa4/cutlass.tar.xz

On the device (``run`` with carry ``[".fa4"]``, the machine's torch and Triton)::

    S=/tmp/fa4site; pip install -q --no-index --no-deps --target $S .fa4/*.whl
    xz -d < .fa4/cutlass.tar.xz | tar -x -C $S
    PYTHONPATH=$S:$S/nvidia_cutlass_dsl/dsl_packages:$PWD/packages/cspan-core/src \
      python3 scripts/flashattention_bench.py

(the ``.pth`` of ``nvidia-cutlass-dsl`` that puts ``dsl_packages`` on the path is not read from a ``--target``
folder, hence the second PYTHONPATH entry). FlashInfer's columns print ``nan`` when it is not installed (it did not
fit the same call: docs/PERFORMANCE.md C36).
"""

from __future__ import annotations

import sys
import time
import traceback

import torch

H, C, DH, WINDOW, LAYERS = 32, 3000, 128, 3000, 4


def _best(fns: dict[str, object]) -> tuple[str, float]:
    sys.path.insert(0, "scripts")
    from perf_h200 import _events_ms

    times = {}
    for name, fn in fns.items():
        try:
            fn()
            torch.cuda.synchronize()
            times[name] = _events_ms(fn, 10) * 1000 / LAYERS
        except Exception as exc:  # a variant the library refuses is reported, the others go on
            print(f"    {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
    if not times:
        return "-", float("nan")
    name = min(times, key=times.__getitem__)
    return name, times[name]


def decode(batch_sizes: list[int]) -> None:
    for B in batch_sizes:
        _decode_case(B)
        torch.cuda.empty_cache()


def _decode_case(B: int) -> None:
    from flash_attn.cute import flash_attn_func

    from cspan.core.attention import FlashInferDecode, available

    dev = torch.device("cuda")
    keys = [torch.randn(B, H, C, DH, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    values = [torch.randn_like(x) for x in keys]
    q = torch.randn(B, H, DH, device=dev, dtype=torch.bfloat16)
    want = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], keys[0], values[0])[:, :, 0]
    q4 = q[:, None]  # [B, 1, H, Dh]

    def fa4(splits):
        def run():
            for kk, vv in zip(keys, values, strict=True):
                flash_attn_func(q4, kk.transpose(1, 2), vv.transpose(1, 2), num_splits=splits)

        return run

    t0 = time.perf_counter()
    flash_attn_func(q4, keys[0].transpose(1, 2), values[0].transpose(1, 2))
    compile_s = time.perf_counter() - t0
    got = flash_attn_func(q4, keys[0].transpose(1, 2), values[0].transpose(1, 2))
    got = got[0] if isinstance(got, tuple) else got
    diff = (got[:, 0].float() - want.float()).abs().max().item()
    name, us_fa4 = _best({f"splits {s}": fa4(s) for s in (1, 2, 4, 8, 16, 32)})

    def sdpa():
        for kk, vv in zip(keys, values, strict=True):
            torch.nn.functional.scaled_dot_product_attention(q[:, :, None], kk, vv)

    _, us_sdpa = _best({"sdpa": sdpa})
    us_fi = float("nan")
    if available():
        fi = FlashInferDecode(dev, H, DH, C, torch.bfloat16, cuda_graphs=False)
        fi.plan(list(range(B)), [10 * C] * B)

        def flashinfer():
            for kk, vv in zip(keys, values, strict=True):
                fi.run(q, kk, vv)

        _, us_fi = _best({"flashinfer": flashinfer})
    floor = 2 * B * H * C * DH * 2 / 4.26e12 * 1e6  # K and V bytes at the copy rate (read + write)
    print(
        f"decode B={B:3d}: flash-attn-4 {us_fa4:7.1f} us/layer ({name}; first call {compile_s:.1f} s; max |diff| "
        f"from SDPA {diff:.2g}), SDPA {us_sdpa:7.1f}, FlashInfer {us_fi:7.1f}, floor {floor:6.1f}",
        flush=True,
    )


def prefill(lengths: list[int]) -> None:
    for n in lengths:
        _prefill_case(n)
        torch.cuda.empty_cache()


def _prefill_case(n: int) -> None:
    from flash_attn.cute import flash_attn_func

    from cspan.core.attention import available
    from cspan.core.modules import fused

    dev = torch.device("cuda")
    keys = [torch.randn(2, H, C, DH, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]  # row 0 + scratch
    values = [torch.randn_like(x) for x in keys]
    q, k, v = (torch.randn(n, H, DH, device=dev, dtype=torch.bfloat16) for _ in range(3))
    pos0 = 10 * C
    ring = WINDOW - 1
    order = torch.tensor([p % C for p in range(pos0 - ring, pos0)], device=dev)
    # position-ordered contiguous copies [1, ring + n, H, Dh]: the ring's window - 1 newest, then the block
    kc = [torch.cat([kk[0][:, order].transpose(0, 1), k])[None].contiguous() for kk in keys]
    vc = [torch.cat([vv[0][:, order].transpose(0, 1), v])[None].contiguous() for vv in values]
    t = lambda x: torch.tensor(x, dtype=torch.long, device=dev)  # noqa: E731
    bm = fused.block_m_for(n)
    ragged = fused.Ragged(
        seq_row=t([0]), seq_start=t([0]), seq_len=t([n]), qb_seq=t([0] * len(range(0, n, bm))),
        qb_j=t(list(range(0, n, bm))), tok_row=t([0] * n), tok_j=t(list(range(n))), tok_keep=t([1] * n).bool(),
        block_m=bm,
    ).at(t([pos0, 0]))  # fmt: skip
    want = fused.prefill_attention(q, k, v, keys[0], values[0], ragged, WINDOW).float().view(n, H, DH)

    def ours():
        for kk, vv in zip(keys, values, strict=True):
            fused.prefill_attention(q, k, v, kk, vv, ragged, WINDOW)

    def fa4():
        for kk, vv in zip(kc, vc, strict=True):
            flash_attn_func(q[None], kk, vv, causal=True, window_size=(WINDOW - 1, 0))

    t0 = time.perf_counter()
    got = flash_attn_func(q[None], kc[0], vc[0], causal=True, window_size=(WINDOW - 1, 0))
    compile_s = time.perf_counter() - t0
    got = got[0] if isinstance(got, tuple) else got
    diff_fa4 = (got[0].float() - want).abs().max().item()

    _, us_ours = _best({"ours": ours})
    _, us_fa4 = _best({"fa4": fa4})
    us_fi = diff_fi = float("nan")
    if available():
        import flashinfer

        workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
        i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
        wrapper.plan(i32([0, n]), i32([0, ring + n]), H, H, DH, causal=True, window_left=WINDOW - 1,
                     q_data_type=torch.bfloat16)  # fmt: skip

        def fi():
            for kk, vv in zip(kc, vc, strict=True):
                wrapper.run(q, kk[0], vv[0])

        diff_fi = (wrapper.run(q, kc[0][0], vc[0][0]).float() - want).abs().max().item()
        _, us_fi = _best({"flashinfer": fi})
    flops = 4 * n * (ring + n / 2) * H * DH
    tf = lambda us: flops / us / 1e6  # noqa: E731
    print(
        f"prefill n={n:4d}: ours {us_ours:6.1f} us/layer ({tf(us_ours):.0f} TFLOP/s), flash-attn-4 {us_fa4:6.1f} "
        f"({tf(us_fa4):.0f}; first call {compile_s:.1f} s; max |diff| {diff_fa4:.2g}), FlashInfer ragged "
        f"{us_fi:6.1f} ({tf(us_fi):.0f}; max |diff| {diff_fi:.2g})",
        flush=True,
    )


def main() -> None:
    import flash_attn.cute

    print(f"flash-attn-4 {flash_attn.cute.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for part, args in ((decode, [1, 8, 32, 64]), (prefill, [601, 257])):
        try:
            part(args)
        except Exception:  # print the failure, go on with the other part
            traceback.print_exc()


if __name__ == "__main__":
    main()
