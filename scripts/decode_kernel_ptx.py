"""The decode kernel's resources for sm_90 per config, compiled on any machine (no GPU: Triton's bundled LLVM and
ptxas), with the divisibility by 16 that Triton's launcher specializes at run time for the 7B's rings (the pointers,
H = 32 and the ring strides; C = 3000 is not a multiple of 16). Prints, per config: shared memory, the number of
``cp.async`` instructions, and ptxas's registers and spills. Without the divisibility hints the kernels compile to
other code (255 registers and spills for form 1), which is not what runs.

    PYTHONPATH=packages/cspan-core/src python3 scripts/decode_kernel_ptx.py
"""

from __future__ import annotations

import pathlib
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from cspan.core.modules import fused

RUNTIME_MULTIPLES_OF_16 = {"H": 32, "stride_q": 3 * 32 * 128, "stride_cb": 32 * 3000 * 128, "stride_ch": 3000 * 128,
                           "stride_cs": 128}  # fmt: skip
CONFIGS = {  # name: (block_n, warps, stages, mma, key splits at one row of 32 heads)
    "form 1 (64, 16, 2, 4, 2, 1)": (64, 4, 2, False, 9),
    "form 1 (32, 16, 2, 4, 3, 1)": (32, 4, 3, False, 9),
    "form 2 (64, 64, 8, 4, 2, 2)": (64, 4, 2, True, 24),
    "form 2 (64, 64, 8, 2, 3, 2)": (64, 2, 3, True, 24),
    "form 2 (64, 16, 8, 4, 2, 2)": (64, 4, 2, True, 16),
    "form 2 (64, 16, 2, 4, 3, 2)": (64, 4, 3, True, 3),
}


def compile_decode(bn: int, warps: int, stages: int, mma: bool, splits: int) -> tuple[str, int]:
    """(PTX, shared bytes) of ``_decode_attn_kernel`` for sm_90: bf16 ring, RoPE, head size 128, PDL on."""
    kernel = fused._decode_attn_kernel
    constants = dict(ROPE=True, FP8=False, DH=128, BN=bn, SPLITS=splits, STAGES=stages, LANES=True, MMA=mma, PDL=True)
    bf16 = {"qkv_ptr", "kc_ptr", "vc_ptr", "out_ptr"}
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = (
                "*bf16" if name in bf16 else "*fp32" if name != "rows_ptr" and name != "pos_ptr" else "*i64"
            )
        else:
            signature[name] = "fp32" if name == "scale_log2" else "i32"
        if name.endswith("_ptr") or name in RUNTIME_MULTIPLES_OF_16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    constexprs = {(kernel.arg_names.index(n),): v for n, v in constants.items()}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return compiled.asm["ptx"], compiled.metadata.shared


def main() -> None:
    ptxas = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    for name, args in CONFIGS.items():
        ptx, shared = compile_decode(*args)
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(ptx)
            f.flush()
            out = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", f.name, "-o", "/dev/null"],
                                 capture_output=True, text=True)  # fmt: skip
        info = " ".join(
            line.split(":", 1)[-1].strip() for line in out.stderr.splitlines() if "Used" in line or "spill" in line
        )
        asyncs = ptx.count("cp.async.cg") + ptx.count("cp.async.ca")
        print(f"{name}: shared {shared} B, cp.async {asyncs}; {info}")


if __name__ == "__main__":
    main()
