"""What a verify forward of the bundled model costs by tree size, with and without prepacked CPU linears.

    python scripts/verify_cost.py                 # both ways, alternating, 3 rounds; prints one JSON object
    python scripts/verify_cost.py --markdown      # also table rows for docs/BENCHMARKS.md

Each measurement runs in its own process (CLOVER_PACKED=1 or 0), after a 300-token prompt is in the cache; a
tree of n tokens is a chain (speed does not depend on its shape). Median of --repeats forwards per size, then the
median over rounds. The machine's speed drifts, so the two settings alternate.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date

SIZES = (1, 2, 4, 8, 16, 32)


def measure(repeats: int, context: int) -> dict:
    import torch

    from clover_cli import packed
    from clover_cli.session import Options, Session
    from clover_cli.tree import DraftTree

    session = Session(Options(draft="none"), quiet=True)
    target = session.target
    prompt = torch.randint(3, target.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    target.forward(prompt)
    target.cache.append(context)
    out = {"packed": packed.supported() and type(target.lm_head) is packed.PackedLinear, "ms": {}}
    for n in SIZES:
        tokens, depths, mask = DraftTree([5] * n, [-1] + list(range(n - 1))).tensors("cpu")
        times = []
        for _ in range(repeats + 5):
            t = time.perf_counter()
            target.forward(tokens, target.length + depths, mask if n > 1 else None)
            times.append(time.perf_counter() - t)
        out["ms"][n] = 1000 * statistics.median(times[5:])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.repeats, args.context)))
        return
    runs = {"1": [], "0": []}
    for _ in range(args.rounds):
        for flag in runs:
            p = subprocess.run([sys.executable, __file__, "--child", "--repeats", str(args.repeats), "--context",
                                str(args.context)], capture_output=True, text=True,
                               env={**os.environ, "CLOVER_PACKED": flag})
            if p.returncode:
                sys.exit(p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "measurement failed")
            runs[flag].append(json.loads(p.stdout))
    report = {"date": date.today().isoformat(), "machine": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cpus", "context": args.context, "sizes": list(SIZES)}
    for flag, name in (("1", "packed"), ("0", "stock")):
        report[name + "_is_packed"] = runs[flag][0]["packed"]
        report[name + "_ms"] = {n: round(statistics.median(r["ms"][str(n)] for r in runs[flag]), 2) for n in SIZES}
    report["speedup"] = {n: round(report["stock_ms"][n] / report["packed_ms"][n], 2) for n in SIZES}
    print(json.dumps(report, indent=2))
    if args.markdown:
        for name in ("stock", "packed"):
            print(f"| {report['date']} | {name} | " + " | ".join(f"{report[name + '_ms'][n]}" for n in SIZES) + " |")


if __name__ == "__main__":
    main()
