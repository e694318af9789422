"""The block attention kernel's instructions for sm_90, compiled on any machine (no GPU: Triton's bundled LLVM and
ptxas), to compare two trees' kernels without a device call.

Prints, per (key splits, persistent grid), the number of instruction lines of ``_prefill_attn_kernel``'s PTX body
(the ``.entry`` up to its closing brace, without comments, debug locations, label numbers and the parameter list)
and their SHA-1; ``--write DIR`` also writes the bodies. Two trees compile to the same instructions when the hashes
agree (C88-C91 in docs/PERFORMANCE.md: the full grid of 5827c02 against 68b1ccc). Usage, for each tree:

    PYTHONPATH=<tree>/packages/cspan-core/src python3 scripts/prefill_kernel_ptx.py

(Triton's interpreter and NumPy >= 2.3 do not mix; this compiles, it does not interpret.)
"""

from __future__ import annotations

import argparse
import hashlib
import pathlib
import re


def body(ptx: str) -> list[str]:
    """The instruction lines of the kernel's ``.entry``, normalised as the module docstring says."""
    lines, inside, depth = [], False, 0
    for line in ptx.splitlines():
        if line.startswith(".visible .entry"):
            inside = True
            continue
        if not inside:
            continue
        depth += line.count("{") - line.count("}")
        text = line.split("//")[0].strip()
        if not text or text.startswith((".loc", ".param", ".file")) or re.fullmatch(r"\$L__tmp\d+:", text):
            continue
        lines.append(re.sub(r"_param_\d+", "_param_N", re.sub(r"\$L__tmp\d+", "$L__tmpN", text)))
        if depth == 0 and "}" in line:
            break
    return lines


def compile_sm90(
    kernel, constants: dict, bf16: set[str], int64: set[str] = frozenset(), divisible: set[str] = frozenset(), **options
):
    """``kernel`` compiled for sm_90 by Triton's own LLVM (no GPU): pointers named in ``bf16`` are bf16, in ``int64``
    int64, the others float32; ``scale_log2`` is a float, every other argument an int32; the arguments named in
    ``divisible`` carry the divisibility by 16 that Triton's launcher specializes at run time (none: code that may
    differ from what runs, but a stable way to compare two trees). Returns the compiled kernel (``.asm["ptx"]``,
    ``.metadata.shared``)."""
    import triton
    from triton.backends.compiler import GPUTarget

    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*bf16" if name in bf16 else "*i64" if name in int64 else "*fp32"
        else:
            signature[name] = "fp32" if name == "scale_log2" else "i32"
        if name in divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    constexprs = {(kernel.arg_names.index(n),): v for n, v in constants.items()}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def compile_kernel(splits: int, persistent: bool) -> str:
    """PTX of ``_prefill_attn_kernel`` for sm_90 with the engine's prefill config, bf16, PDL on."""
    from cspan.core.modules import fused

    kernel = fused._prefill_attn_kernel
    constants = dict(IEEE=False, FP8=False, DH=128, BM=64, BN=64, QG=64, SPLITS=splits, PDL=True)
    if "PERSISTENT" in kernel.arg_names:  # trees before 5827c02 have no persistent grid
        constants["PERSISTENT"] = persistent
    elif persistent:
        raise SystemExit("this tree's kernel has no persistent grid")
    bf16 = {"q_ptr", "k_ptr", "v_ptr", "kc_ptr", "vc_ptr", "out_ptr"}
    int64 = {name for name in kernel.arg_names if name.endswith("_ptr")} - bf16 - {"part_o_ptr", "part_lse_ptr",
                                                                                   "ks_ptr", "vs_ptr"}  # fmt: skip
    _, _, warps, stages = fused.PREFILL_CONFIG
    return compile_sm90(kernel, constants, bf16, int64, num_warps=warps, num_stages=stages).asm["ptx"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=pathlib.Path, help="write each body to DIR/prefill_<splits>_<grid>.ptx")
    args = parser.parse_args()
    for splits, persistent in ((1, False), (2, False), (1, True)):
        try:
            lines = body(compile_kernel(splits, persistent))
        except SystemExit as exc:
            print(f"splits {splits}, persistent grid: {exc}")
            continue
        grid = "persistent" if persistent else "full"
        digest = hashlib.sha1("\n".join(lines).encode()).hexdigest()
        print(f"splits {splits}, {grid} grid: {len(lines)} instruction lines, sha1 {digest}")
        if args.write:
            args.write.mkdir(parents=True, exist_ok=True)
            (args.write / f"prefill_{splits}_{grid}.ptx").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
