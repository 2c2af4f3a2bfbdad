"""What inductor's register blocking does to a few-row float32 step: the bundled model's products alone (8 layers of
fused q/k/v, output, fused gate/up and down projections at its sizes, then the lm_head; random weights), compiled
by AOTInductor with frozen weights, timed by rows.

    python scripts/gemm_blocking.py [--threads 2] [--rows 1,4,5,6,7,8,10,12,16]

Variants: oneDNN alone (no autotuning; any rows), inductor's autotuned C++ kernels for 5-8 rows on its own choice of
register blocks (8x48 here), and the same restricted to 16x16 or 8x32 blocks (step/aot_export.register_blocking). Each call is
timed after 64 MB of other memory traffic, as a step is in decoding (the drafter runs in between); the median of
--repeats calls.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

H, INTER, VOCAB, LAYERS = 256, 768, 8192, 8


class Products(torch.nn.Module):
    def __init__(self):
        super().__init__()
        lin = torch.nn.Linear
        self.qkv = torch.nn.ModuleList(lin(H, 3 * H, bias=False) for _ in range(LAYERS))
        self.o = torch.nn.ModuleList(lin(H, H, bias=False) for _ in range(LAYERS))
        self.up = torch.nn.ModuleList(lin(H, 2 * INTER, bias=False) for _ in range(LAYERS))
        self.down = torch.nn.ModuleList(lin(INTER, H, bias=False) for _ in range(LAYERS))
        self.head = lin(H, VOCAB, bias=False)

    def forward(self, x):
        for i in range(LAYERS):
            q = self.qkv[i](x)
            x = x + self.o[i](q[:, :H] * q[:, H:2 * H].sigmoid())
            g = self.up[i](x)
            x = x + self.down[i](torch.nn.functional.silu(g[:, :INTER]) * g[:, INTER:])
        return self.head(x)


def build(module, lo: int, hi: int, example: int, autotune: bool, blocking, out: Path):
    from clover_cli.step.aot_export import compile_package, export

    program = export(module, (torch.randn(example, H),), ({0: torch.export.Dim("n", min=lo, max=hi)},))
    compile_package(program, out, autotune=autotune, blocking=blocking)
    return torch._inductor.aoti_load_package(str(out)).loader


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,5,6,7,8,10,12,16")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    module = Products().eval()
    rows = [int(r) for r in args.rows.split(",")]
    variants = {"oneDNN (1-64 rows)": (1, 64, 5, False, None),
                "autotuned 5-8, inductor's blocks": (5, 8, 6, True, None),
                "autotuned 5-8, 16x16 blocks": (5, 8, 6, True, (16, 16)),
                "autotuned 5-8, 8x32 blocks": (5, 8, 6, True, (8, 32))}
    traffic = torch.randn(16_000_000)
    print(f"{'variant':36}" + "".join(f"{r:>8}" for r in rows) + "   (ms per call, by rows)")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (lo, hi, example, autotune, blocking)) in enumerate(variants.items()):
            run = build(module, lo, hi, example, autotune, blocking, Path(tmp) / f"v{i}.pt2")
            cells = []
            for r in rows:
                if not lo <= r <= hi:  # outside the sizes the program was built for
                    cells.append(f"{'-':>8}")
                    continue
                x = torch.randn(r, H)
                times = []
                for _ in range(args.repeats):
                    traffic.add_(1.0)
                    t = time.perf_counter()
                    run.boxed_run([x])
                    times.append(time.perf_counter() - t)
                cells.append(f"{1000 * statistics.median(times):8.2f}")
            print(f"{name:36}" + "".join(cells), flush=True)


if __name__ == "__main__":
    main()
