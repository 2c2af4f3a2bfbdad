"""Two checkouts of clover against each other: `clover bench` run from each in turn, the side that goes first
alternating from round to round (ABBA), and per method the mean tokens/s, the ratio, the median of the paired
ratios and how many rounds each side won.

    git worktree add /tmp/old HEAD~1
    python scripts/ab_bench.py /tmp/old . --rounds 8 -- --methods plain,ngram,clover+ngram --limit 10
    python scripts/ab_bench.py . . --old-env CLOVER_KV16=0 --model smollm2 -- --methods plain   (one checkout, two
                                                                                            environments)

Everything after `--` goes to `clover bench` as it is (--json is added). Both sides run the same model directory
(default: the new side's bundled `tiny`, or --model); each imports its own clover_cli and clover_kernels (a folder of
links to its clover_cli/ and clover_kernels/, or an older checkout's kernels/, on PYTHONPATH), so where the kernels
differ each side builds and runs its own compiled package, with its own step costs. On the project's 2-core machine the
second run of a pair was a few percent faster whatever it ran (the same code on both sides, the old side always first:
1.035-1.065x; docs/BENCHMARKS.md, 2026-11-27): an order kept fixed reads that as a gain. Prints one JSON object (--json)
or a table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def first_side(round_index: int) -> tuple[str, str]:
    """The order of the two sides in round `round_index` (0-based): old first in even rounds, new first in odd."""
    return ("old", "new") if round_index % 2 == 0 else ("new", "old")


def summarize(runs: list[dict]) -> dict:
    """runs: one {"side": "old" | "new", "round": r, "rows": {method: tokens/s}} per bench run. Per method: mean
    tokens/s of each side, new / old of the means, the median of the per-round ratios, and the rounds new won."""
    out = {}
    methods = dict.fromkeys(m for run in runs for m in run["rows"])
    for m in methods:
        by_round = {}
        for run in runs:
            if m in run["rows"]:
                by_round.setdefault(run["round"], {})[run["side"]] = run["rows"][m]
        pairs = [(r["old"], r["new"]) for r in by_round.values() if "old" in r and "new" in r]
        if not pairs:
            continue
        old = statistics.mean(a for a, _ in pairs)
        new = statistics.mean(b for _, b in pairs)
        out[m] = {"old": round(old, 1), "new": round(new, 1), "ratio": round(new / old, 3),
                  "paired_median": round(statistics.median(b / a for a, b in pairs), 3),
                  "new_ahead": sum(b > a for a, b in pairs), "rounds": len(pairs)}
    return out


def env_pairs(items: list[str]) -> dict:
    """NAME=VALUE strings (--old-env, --new-env) as a dict; a malformed one stops the script in one line."""
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise SystemExit(f"ab_bench: {item!r} is not NAME=VALUE")
        out[name] = value
    return out


def import_root(checkout: Path, shims: Path) -> Path:
    """A folder whose clover_cli and clover_kernels are the checkout's own (links to its clover_cli/ and
    clover_kernels/), for PYTHONPATH. The checkout itself will not do for older ones, whose kernels live in kernels/:
    `import clover_kernels` would fall through to the installed clover's, and both sides would run one side's
    kernels; nor would it keep the checkout's other folders off the import path."""
    root = shims / hashlib.sha256(str(checkout).encode()).hexdigest()[:12]
    root.mkdir(parents=True, exist_ok=True)
    kernels = checkout / "clover_kernels"
    for name, target in (("clover_cli", checkout / "clover_cli"),
                         ("clover_kernels", kernels if kernels.is_dir() else checkout / "kernels")):
        link = root / name
        if target.is_dir() and not link.exists():
            link.symlink_to(target, target_is_directory=True)
    return root


def bench(checkout: Path, model: str, args: list[str], shims: Path, extra_env: dict | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(import_root(checkout, shims)), **(extra_env or {})}
    # python -m clover_cli where the checkout has clover_cli/__main__.py; older ones ran as clover_cli.cli
    module = "clover_cli" if (checkout / "clover_cli" / "__main__.py").is_file() else "clover_cli.cli"
    cmd = [sys.executable, "-m", module, "bench", model, "--json", *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/")
    if done.returncode:
        raise SystemExit(f"ab_bench: clover bench from {checkout} failed: {done.stderr.strip().splitlines()[-1:]}")
    report = json.loads(done.stdout)
    return {row["method"]: row["tokens_per_s"] for row in report["methods"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path, help="The old checkout (its directory holds clover_cli/).")
    ap.add_argument("new", type=Path, help="The new checkout.")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--model", default=None, help="Model for both sides (default: the new side's bundled tiny).")
    ap.add_argument("--old-env", action="append", default=[], metavar="NAME=VALUE",
                    help="An environment variable the old side runs with (repeatable).")
    ap.add_argument("--new-env", action="append", default=[], metavar="NAME=VALUE",
                    help="An environment variable the new side runs with (repeatable).")
    ap.add_argument("--json", action="store_true")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # after it: clover bench's own options
    a, rest = ap.parse_args(argv[:cut]), argv[cut + 1:]
    checkouts = {"old": a.old.resolve(), "new": a.new.resolve()}
    for side, path in checkouts.items():
        if not (path / "clover_cli" / "__init__.py").is_file():
            raise SystemExit(f"ab_bench: {path} is not a clover checkout (no clover_cli/ in it)")
    envs = {"old": env_pairs(a.old_env), "new": env_pairs(a.new_env)}
    model = a.model or str(checkouts["new"] / "clover_cli" / "bundled" / "tiny")
    runs = []
    with tempfile.TemporaryDirectory(prefix="clover-ab-") as shims:
        for r in range(a.rounds):
            for side in first_side(r):
                rows = bench(checkouts[side], model, rest, Path(shims), envs[side])
                runs.append({"side": side, "round": r, "rows": rows})
                if not a.json:
                    print(f"round {r + 1} {side}: " + ", ".join(f"{m} {v:.1f}" for m, v in rows.items()), flush=True)
    summary = summarize(runs)
    if a.json:
        print(json.dumps({"runs": runs, "summary": summary}))
        return
    print("| method | old tok/s | new tok/s | new / old | paired median | rounds new ahead |")
    print("|---|---|---|---|---|---|")
    for m, s in summary.items():
        print(f"| {m} | {s['old']} | {s['new']} | {s['ratio']}x | {s['paired_median']}x | {s['new_ahead']} / {s['rounds']} |")


if __name__ == "__main__":
    main()
