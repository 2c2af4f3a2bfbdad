"""One linear layer of SmolLM2's shape (576 -> 1536) timed per row count in float32 and bfloat16 on this CPU, with
torch's own kernels, and what oneDNN offers for bfloat16 here: whether a bf16 weight is fast on this machine at the
row counts a draft tree needs (1 row reads the weights once; 16-64 rows are a tree's verify; 1024 a prefill).

    python scripts/linear_dtypes.py [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch


def per_call(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, avx512_bf16 "
          f"{torch.cpu._is_avx512_bf16_supported()}, mkldnn bf16 {torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
    weight = torch.randn(1536, 576)
    print("| rows | float32 ms | GFLOP/s | bfloat16 ms | GFLOP/s |")
    print("|---|---|---|---|---|")
    for rows in (1, 16, 64, 256, 1024):
        cells = []
        for dtype in (torch.float32, torch.bfloat16):
            w, x = weight.to(dtype), torch.randn(rows, 576).to(dtype)
            s = per_call(lambda: torch.nn.functional.linear(x, w))
            cells += [f"{s * 1e3:.3f}", f"{2 * rows * 576 * 1536 / s / 1e9:.1f}"]
        print(f"| {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
