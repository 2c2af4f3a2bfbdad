"""Two versions of the quantized kernel (clover_kernels/quant_cpu.cpp) timed against each other on all of SmolLM2's
linears for one step (q/k/v fused, o, gate/up fused, down, 30 layers in Q4_1's layout, and the Q8_0 output embedding), in
alternation (ABBA: the side that runs first alternates) in one process: each version is built as a library of its own
(its op namespace renamed) with a loop in C++ that runs every linear, so no Python sits between the calls.

    python scripts/quant_kernel_ab.py HEAD~1 HEAD                 # two commits' kernels
    python scripts/quant_kernel_ab.py old.cpp clover_kernels/quant_cpu.cpp --rows 1,8,16 --rounds 6
    python scripts/quant_kernel_ab.py HEAD HEAD --act8 b           # float32 against int8 activations, one kernel
    python scripts/quant_kernel_ab.py HEAD~1 HEAD --avx2           # the AVX2 path, built so on an AVX-512 CPU

A version is a file or a git revision (its clover_kernels/quant_cpu.cpp). Both must pack weights as
clover_kernels/quant.py does. Prints the median ms of each side per row count and B/A.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LOOP = r"""
#include <chrono>
namespace {
double clover_ab_model(const at::Tensor& x576, const at::Tensor& x1536, at::TensorList packed,
                       const std::vector<int64_t>& ns, const std::vector<int64_t>& ks,
                       const std::vector<int64_t>& kinds, int64_t iters) {
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; i++)
    for (size_t j = 0; j < packed.size(); j++) linear(ks[j] == 576 ? x576 : x1536, packed[j], ns[j], ks[j], kinds[j]);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
}
}
TORCH_LIBRARY_FRAGMENT(clover_quant, m) {
  m.def("ab_model(Tensor x576, Tensor x1536, Tensor[] packed, int[] ns, int[] ks, int[] kinds, int iters) -> float");
}
TORCH_LIBRARY_IMPL(clover_quant, CPU, m) { m.impl("ab_model", &clover_ab_model); }
"""


def source(version: str) -> str:
    if Path(version).is_file():
        return Path(version).read_text()
    for folder in ("clover_kernels", "kernels"):  # kernels/ until the folder took its package's name
        p = subprocess.run(["git", "-C", str(ROOT), "show", f"{version}:{folder}/quant_cpu.cpp"], capture_output=True,
                           text=True)
        if p.returncode == 0:
            return p.stdout
    sys.exit(f"{version}: neither a file nor a git revision with clover_kernels/quant_cpu.cpp")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--rows", default="1,4,8,16,32,64")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--act8", choices=("a", "b", "both"), default=None,
                    help="that side rounds the activations to int8 (the kernel's ACT8 kinds)")
    ap.add_argument("--avx2", action="store_true", help="both sides built for AVX2 (-mno-avx512f) on an AVX-512 CPU")
    args = ap.parse_args()

    import numpy as np
    import torch
    from torch.utils.cpp_extension import load

    from clover_kernels import quant

    torch.set_num_threads(args.threads)
    build = Path(tempfile.mkdtemp(prefix="clover-kernel-ab-"))
    ops = []
    for i, version in enumerate((args.a, args.b)):
        name = f"clover_ab{i}"
        (build / name).mkdir()
        path = build / name / f"{name}.cpp"
        path.write_text((source(version) + LOOP).replace("clover_quant", name))  # not atomic: a fresh temporary folder
        load(name=name, sources=[str(path)], extra_cflags=quant.FLAGS + ["-mno-avx512f"] * args.avx2,
             extra_ldflags=["-fopenmp"], build_directory=str(build / name), is_python_module=False)
        ops.append(getattr(torch.ops, name))
    g = np.random.default_rng(0)

    def made(n, k, bits, affine):
        q = g.integers(0, 16, (n, k)) if bits == 4 else g.integers(-127, 128, (n, k))
        d = (g.random((n, k // 32)) * 0.01).astype(np.float16).astype(np.float32)
        m = (g.standard_normal((n, k // 32)) * 0.01).astype(np.float16).astype(np.float32) if affine else None
        return quant.pack(q, d, m, bits)

    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    packed = [made(n, k, 4, True) for _ in range(30) for n, k in shapes] + [made(49152, 576, 8, False)]
    def lists(side):
        act8 = args.act8 in ("both", "ab"[side])
        records = [quant.act8_records(p) for p in packed] if act8 else packed  # (an older kernel reads them
        # in its own order: the same work, other sums)
        return ([p.data for p in records], [p.out_features for p in records], [p.in_features for p in records],
                [p.kind for p in records])
    prepared = [lists(0), lists(1)]
    rows = [int(r) for r in args.rows.split(",")]
    times = {(side, r): [] for side in range(2) for r in rows}
    for n in range(args.rounds):
        for r in rows:
            x576, x1536 = torch.randn(r, 576), torch.randn(r, 1536)
            for side in ((0, 1) if n % 2 == 0 else (1, 0)):
                ops[side].ab_model(x576, x1536, *prepared[side], 1)
                times[(side, r)].append(ops[side].ab_model(x576, x1536, *prepared[side], 8 if r <= 16 else 3))
    act8 = f"; int8 activations: {args.act8}" if args.act8 else ""
    print(f"A = {args.a}, B = {args.b}; {args.threads} threads, {args.rounds} rounds{act8}; median ms per step's "
          f"linears")
    for r in rows:
        a, b = statistics.median(times[(0, r)]), statistics.median(times[(1, r)])
        print(f"rows {r:2d}: A {a * 1e3:7.2f}  B {b * 1e3:7.2f}  B/A {b / a:.3f}")


if __name__ == "__main__":
    main()
