"""What a verify forward of the bundled model (or --model) costs by tree size: eager with stock linears, eager with
prepacked CPU linears for every row count, eager as clover runs it (prepacked where pack_linears timed it faster:
"auto"), and the compiled step (clover_cli/step/; built first if it is not cached) with the weights clover runs by
default (a GGUF's own blocks on a CPU) or in a chosen format: compiled-float32 and compiled-bfloat16 (a GGUF
dequantized), compiled-int8 and compiled-int4 (--quantize); auto-float32 and the like are the eager steps.

    python scripts/verify_cost.py                      # all four, alternating, 3 rounds; one JSON object
    python scripts/verify_cost.py --markdown --plot docs/step_cost.png   # also table rows and a chart
    python scripts/verify_cost.py --settings stock,packed   # only some

Each measurement runs in its own process (CLOVER_PACKED=0/1/auto, CLOVER_COMPILE=off/on), after a 300-token prompt is
in the cache; a tree of n tokens is a chain (speed does not depend on its shape). Median of --repeats forwards per
size, then the median over rounds. The machine's speed drifts, so the settings alternate.
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

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
SETTINGS = {"stock": {"CLOVER_PACKED": "0", "CLOVER_COMPILE": "off"},
            "packed": {"CLOVER_PACKED": "1", "CLOVER_COMPILE": "off"},
            "auto": {"CLOVER_PACKED": "auto", "CLOVER_COMPILE": "off"},
            "compiled": {"CLOVER_PACKED": "1", "CLOVER_COMPILE": "on"}}
# the weights of a setting (Options' dtype / quantize): the default is what clover runs (a GGUF: its own blocks)
WEIGHTS = {"float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"}, "int8": {"quantize": "int8"},
           "int4": {"quantize": "int4"}, "gguf": {}}
for _base in ("auto", "compiled"):
    for _w in WEIGHTS:
        SETTINGS[f"{_base}-{_w}"] = {**SETTINGS[_base], "WEIGHTS": _w}


def measure(repeats: int, context: int, model: str | None, weights: str | None) -> dict:
    import torch

    from clover_cli import packed
    from clover_cli.session import Options, Session
    from clover_cli.tree import DraftTree

    session = Session(Options(model=model, draft="none", **WEIGHTS.get(weights, {})), quiet=True)
    session.compiler.start(background=False)  # CLOVER_COMPILE=on: built here if not cached
    target = session.target
    prompt = torch.randint(3, target.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    target.forward(prompt)
    target.cache.append(context)
    out = {"packed": packed.supported() and type(target.lm_head) is packed.PackedLinear,
           "compiled": session.compiler.active, "weights": session.weights, "ms": {}}
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
    ap.add_argument("--model", help="an alias, Hub repo or directory (default: the bundled model)")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated: stock, packed, auto, compiled")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--plot", help="write a PNG chart of ms per forward against tree size")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.repeats, args.context, args.model, os.environ.get("WEIGHTS"))))
        return
    names = [n.strip() for n in args.settings.split(",") if n.strip()]
    if not names or any(n not in SETTINGS for n in names):
        sys.exit(f"--settings: choose from {', '.join(SETTINGS)}")
    runs = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            p = subprocess.run([sys.executable, __file__, "--child", "--repeats", str(args.repeats), "--context",
                                str(args.context), *(["--model", args.model] if args.model else [])],
                               capture_output=True, text=True,
                               env={**os.environ, **SETTINGS[name]})
            if p.returncode:
                sys.exit(p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "measurement failed")
            runs[name].append(json.loads(p.stdout))
    report = {"date": date.today().isoformat(), "machine": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cpus", "model": args.model or "tiny (bundled)", "context": args.context,
              "sizes": list(SIZES)}
    for name in names:
        report[name + "_is_packed"] = runs[name][0]["packed"]
        report[name + "_is_compiled"] = runs[name][0]["compiled"]
        report[name + "_weights"] = runs[name][0]["weights"]
        report[name + "_ms"] = {n: round(statistics.median(r["ms"][str(n)] for r in runs[name]), 3) for n in SIZES}
    if "stock" in names and "packed" in names:
        report["speedup"] = {n: round(report["stock_ms"][n] / report["packed_ms"][n], 2) for n in SIZES}
    if "compiled" in names:
        eager = next((n for n in ("auto", "packed") if n in names), names[0])
        report["compiled_speedup"] = {n: round(report[eager + "_ms"][n] / report["compiled_ms"][n], 2)
                                      for n in SIZES}
    for name in names:  # each setting's cost per size against its own one-token step
        report[name + "_vs_1"] = {n: round(report[name + "_ms"][n] / report[name + "_ms"][1], 2) for n in SIZES}
    print(json.dumps(report, indent=2))
    if args.markdown:
        for name in names:
            print(f"| {report['date']} | {name} | " + " | ".join(f"{report[name + '_ms'][n]:.2f}" for n in SIZES)
                  + " |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4))
        for name in names:
            ax.plot(SIZES, [report[name + "_ms"][n] for n in SIZES], marker="o", label=name)
        ax.set_xlabel("new tokens verified in one forward")
        ax.set_ylabel("ms per forward")
        ax.set_title(f"{report['model']}, verify forward · {report['machine']} · {report['date']}", fontsize=9)
        ax.set_ylim(bottom=0)
        ax.legend()
        fig.tight_layout()
        from pathlib import Path

        from clover_cli import atomic

        fmt = Path(args.plot).suffix[1:] or "png"
        atomic.write_with(Path(args.plot), lambda tmp: fig.savefig(tmp, dpi=110, format=fmt))


if __name__ == "__main__":
    main()
