"""How long `clover chat` takes to reach its prompt and answer, cold or warm compile cache, in a real terminal.

    python scripts/startup.py                 # warm: the compiled step is in the cache (built first if needed)
    python scripts/startup.py --cold          # an empty compile cache: the build starts in the background
    python scripts/startup.py --json

Runs `clover chat` (the bundled model unless --model) under a pseudo-terminal and times the start to the `>>>`
prompt and to the banner (the model loaded: the prompt comes up before it), then sends one message and times its
reply (to the stats line under it) and reads the banner's step line. Also times a one-shot `clover generate --json`
of 128 tokens and reports what it spent outside prefill and decoding.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent  # every clover this runs starts here: never from the caller's cwd,
# whose own clover_cli (if any) `python -m` would import


def clover() -> list[str]:
    here = Path(sys.executable).with_name("clover")
    return [str(here)] if here.is_file() else [sys.executable, "-m", "clover_cli"]


def chat_timings(model: list[str], env: dict, message: str) -> dict:
    import pexpect

    t0 = time.perf_counter()
    child = pexpect.spawn(clover()[0], clover()[1:] + ["chat", *model, "--stats-file", "off", "--no-color"],
                          env=env, encoding="utf-8", timeout=300, dimensions=(40, 160), cwd=str(ROOT))
    # the banner says the model is loaded: printed above the prompt when the prompt came first, before the prompt
    # when the model had to be fetched or converted first (its progress is drawn before the prompt comes up)
    if child.expect([">>>", "Ctrl-D or /exit leaves"]) == 0:
        to_prompt = time.perf_counter() - t0
        child.expect("Ctrl-D or /exit leaves")
        to_ready = time.perf_counter() - t0
        banner = child.before
        child.expect(">>>")
    else:
        to_ready = time.perf_counter() - t0
        banner = child.before
        child.expect(">>>")
        to_prompt = time.perf_counter() - t0
    step = next((ln.strip() for ln in banner.splitlines() if "step" in ln or "eager" in ln), "")
    t1 = time.perf_counter()
    child.sendline(message)
    child.expect(r"tok/s")
    reply = time.perf_counter() - t1
    child.expect(">>>")
    stats = re.findall(r"(\d+) tokens .*? ([\d.]+) tok/s", child.before + child.after)
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    return {"to_prompt_s": round(to_prompt, 2), "to_model_ready_s": round(to_ready, 2), "first_reply_s": round(reply, 2),
            "step": step}


def generate_overhead(model: list[str], env: dict, message: str) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(message)
    t0 = time.perf_counter()
    p = subprocess.run(clover() + ["generate", *model, "-f", f.name, "-n", "128", "--json", "--stats-file",
                                   "off"], capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    os.unlink(f.name)
    if p.returncode:
        sys.exit(p.stderr.strip().splitlines()[-1])
    r = json.loads(p.stdout)
    return {"wall_s": round(wall, 2), "load_s": r["load_s"], "elapsed_s": r["elapsed_s"],
            "outside_prefill_and_decode_ms": round(1000 * (r["elapsed_s"] - r["prefill_s"] - r["decode_s"]), 1),
            "new_tokens": r["new_tokens"], "tokens_per_s": r["tokens_per_s"], "tokens_per_s_e2e": r["tokens_per_s_e2e"],
            "compiled": r["compiled"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--cold", action="store_true", help="start from an empty compile cache")
    ap.add_argument("--message", default="Give me three tips for learning a new language.")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    # a model directory named relative to where this was started, as seen from ROOT
    model = [os.path.abspath(args.model) if os.path.exists(args.model) else args.model] if args.model else []
    env = dict(os.environ)
    if args.cold:
        env["CLOVER_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="clover-cold-")
    else:
        subprocess.run(clover() + ["compile", *model], check=True, capture_output=True, env=env, cwd=ROOT)
    report = {"cold": args.cold, "chat": chat_timings(model, env, args.message),
              "generate": generate_overhead(model, env, args.message)}
    print(json.dumps(report, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
