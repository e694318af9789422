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
from prefill_kernel_ptx import compile_sm90

from cspan.core.modules import fused

RUNTIME_MULTIPLES_OF_16 = {"H", "stride_q", "stride_cb", "stride_ch", "stride_cs"}
"""The integer arguments the 7B's decode passes as multiples of 16 (H = 32, strides of 3 x 32 x 128 and of rings of
3000 x 128); C = 3000 and the window are not."""
CONFIGS = {  # name: (block_n, warps, stages, mma, key splits at one row of 32 heads)
    "form 1 (64, 16, 2, 4, 2, 1)": (64, 4, 2, False, 9),
    "form 1 (32, 16, 2, 4, 3, 1)": (32, 4, 3, False, 9),
    "form 2 (64, 64, 8, 4, 2, 2)": (64, 4, 2, True, 24),
    "form 2 (64, 64, 8, 2, 3, 2)": (64, 2, 3, True, 24),
    "form 2 (64, 16, 8, 4, 2, 2)": (64, 4, 2, True, 16),
    "form 2 (64, 16, 2, 4, 3, 2)": (64, 4, 3, True, 3),
    "form 2 (32, 8, 8, 2, 3, 2)": (32, 2, 3, True, 8),
    "form 2 (32, 16, 2, 2, 3, 2)": (32, 2, 3, True, 3),
}


def compile_decode(bn: int, warps: int, stages: int, mma: bool, splits: int):
    """``_decode_attn_kernel`` compiled for sm_90: bf16 ring, RoPE, head size 128, PDL on, the run-time hints."""
    kernel = fused._decode_attn_kernel
    constants = dict(ROPE=True, FP8=False, DH=128, BN=bn, SPLITS=splits, STAGES=stages, LANES=True, MMA=mma, PDL=True)
    pointers = {name for name in kernel.arg_names if name.endswith("_ptr")}
    return compile_sm90(kernel, constants, {"qkv_ptr", "kc_ptr", "vc_ptr", "out_ptr"}, {"rows_ptr", "pos_ptr"},
                        pointers | RUNTIME_MULTIPLES_OF_16, num_warps=warps)  # fmt: skip


def main() -> None:
    ptxas = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    for name, args in CONFIGS.items():
        compiled = compile_decode(*args)
        ptx, shared = compiled.asm["ptx"], compiled.metadata.shared
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
