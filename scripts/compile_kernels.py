"""Compile every clover_kernels Triton kernel for NVIDIA GPUs without needing one.

The interpreter (TRITON_INTERPRET=1) checks the kernels' numerics on CPU but accepts constructs the GPU compiler
rejects, and says nothing about shared memory. This script runs Triton's real compiler (down to a cubin with the
ptxas bundled in the triton wheel) for the given architectures, with the launch configurations the host wrappers
use, and checks each kernel's shared memory against the architecture's per-block limit.

    python scripts/compile_kernels.py                 # sm_80, sm_86, sm_90; fp16, bf16, fp32; head dims 64..256
    python scripts/compile_kernels.py --quick --arch 90 86

Exit status 1 when a kernel fails to compile or does not fit. Must run without TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Per-block shared memory limit (bytes, opt-in maximum) by compute capability.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


def jobs(quick: bool):
    import triton.language as tl

    from clover_kernels import kv_commit, tree_attention

    dtypes = ("fp16",) if quick else ("fp16", "bf16", "fp32")
    size = {"fp16": 2, "bf16": 2, "fp32": 4}
    for dt in dtypes:
        for D in ((64, 128) if quick else (64, 128, 256)):
            BLOCK_M, BLOCK_N, BLOCK_D, stages = tree_attention.launch_config(4 * 128, D, size[dt])
            for single in ((False,) if quick else (True, False)):
                yield (f"tree_attn_fwd {dt} D={D} single={single}", tree_attention._tree_attn_fwd,
                       dict(Q=f"*{dt}", K=f"*{dt}", V=f"*{dt}", Bits="*i64", Out=f"*{dt}", Part="*fp32",
                            Lse="*fp32", scale_log2="fp32"),
                       dict(G=4, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, SINGLE=single,
                            PRECISION="ieee" if dt == "fp32" else "tf32"),
                       dict(num_stages=stages))
        yield (f"tree_attn_combine {dt}", tree_attention._tree_attn_combine,
               dict(Part="*fp32", Lse="*fp32", Out=f"*{dt}"), dict(BLOCK_R=16, BLOCK_D=128), {})
        for on_device in (True, False):
            yield (f"kv_commit {dt} count_on_device={on_device}", kv_commit._kv_commit,
                   dict(Table="*i64", Path="*i64", CountPtr="*i64", s_head="i64", s_pos="i64"),
                   dict(COUNT_ON_DEVICE=on_device, BLOCK_D=128,
                        DTYPE={"fp16": tl.float16, "bf16": tl.bfloat16, "fp32": tl.float32}[dt]), {})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 86, 90], help="compute capabilities, e.g. 90")
    ap.add_argument("--quick", action="store_true", help="fp16 only, head dims 64 and 128")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("0", ""):
        print("unset TRITON_INTERPRET: the interpreter replaces the compiler", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failures = 0
    for arch in args.arch:
        target = GPUTarget("cuda", arch, 32)
        for name, fn, types, consts, options in jobs(args.quick):
            sig = {a: ("constexpr" if a in consts else types.get(a, "i32")) for a in fn.arg_names}
            src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(a),): v for a, v in consts.items()})
            t = time.perf_counter()
            try:
                kernel = triton.compile(src, target=target, options={"num_warps": 4, **options})
            except Exception as e:  # noqa: BLE001 - report every failure, keep going
                failures += 1
                print(f"sm_{arch} {name:42s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            shared = kernel.metadata.shared
            fits = shared <= SHARED_LIMIT.get(arch, 101376)
            failures += not fits
            print(f"sm_{arch} {name:42s} shared {shared:7d} B{'' if fits else '  EXCEEDS THE LIMIT'}"
                  f"  ({time.perf_counter() - t:.1f}s)", flush=True)
    print("all kernels compiled and fit" if not failures else f"{failures} problem(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
