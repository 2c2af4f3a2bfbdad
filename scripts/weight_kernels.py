"""The CPU kernels a quantized step could run on, timed on SmolLM2's linears (q/k/v fused, o, gate/up fused, down;
--layers of them, each a weight of its own so the bytes stream as a step's do) for 1 to 64 rows: torch's float32 and
bfloat16 F.linear, torch's own weight-only kernels (aten._weight_int8pack_mm: int8, a scale per output;
aten._weight_int4pack_mm_for_cpu: int4 in groups of 32) and clover's (clover_kernels.quant: Q4_1's layout and
Q8_0's). What chose clover's kernel (docs/BENCHMARKS.md).

    python scripts/weight_kernels.py [--layers 4] [--threads 2] [--rows 1,4,16,64]

Prints a markdown table: milliseconds for the --layers layers, and the same scaled to SmolLM2's 30.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # out, in


def per_call(fn, n: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,16,64")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from clover_cli.store import kernels_dir
    from clover_kernels import quant

    quant.load(kernels_dir())
    g = np.random.default_rng(0)
    weights = [torch.randn(n, k) * 0.02 for _ in range(a.layers) for n, k in SHAPES]
    kernels = {}
    kernels["float32"] = [(w.shape[1], lambda x, w=w: torch.nn.functional.linear(x, w)) for w in weights]
    kernels["bfloat16"] = [(w.shape[1], lambda x, w=w.bfloat16(): torch.nn.functional.linear(x.bfloat16(), w))
                           for w in weights]
    int8 = [(torch.randint(-127, 128, w.shape, dtype=torch.int8), torch.rand(w.shape[0])) for w in weights]
    kernels["aten int8pack"] = [(w.shape[1], lambda x, q=q, s=s: torch.ops.aten._weight_int8pack_mm(x, q, s))
                                for w, (q, s) in zip(weights, int8)]
    int4 = []
    for w in weights:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, w.shape, dtype=torch.int32),
                                                                    1)
        int4.append((w.shape[1], packed, torch.rand(w.shape[1] // 32, w.shape[0], 2)))
    kernels["aten int4pack (g32)"] = [
        (k, lambda x, p=p, sz=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, 32, sz)) for k, p, sz in int4]
    for name, bits, affine in (("clover Q4_1", 4, True), ("clover Q8_0", 8, False)):
        made = []
        for w in weights:
            n, k = w.shape
            q = g.integers(0, 16, (n, k)) if bits == 4 else g.integers(-127, 128, (n, k))
            d = (g.random((n, k // 32)) * 0.01).astype(np.float16).astype(np.float32)
            m = (g.standard_normal((n, k // 32)) * 0.01).astype(np.float16).astype(np.float32) if affine else None
            made.append((k, lambda x, p=quant.pack(q, d, m, bits): quant.qlinear(x, p)))
        kernels[name] = made
    rows = [int(r) for r in a.rows.split(",")]
    print(f"{a.layers} layers of SmolLM2's linears, {a.threads} threads; ms (scaled to 30 layers)")
    print("| kernel | " + " | ".join(f"{r} rows" for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name, calls in kernels.items():
        cells = []
        for r in rows:
            xs = {576: torch.randn(r, 576), 1536: torch.randn(r, 1536)}
            s = per_call(lambda: [fn(xs[k]) for k, fn in calls], n=1 if "aten" in name and r > 4 else 5)
            cells.append(f"{s * 1e3:.2f} ({s * 1e3 * 30 / a.layers:.1f})")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
