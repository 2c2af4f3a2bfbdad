"""Recipe part 4: measure the bundled model and its drafters on held-out ShareGPT prompts.

    python scripts/tiny/evaluate.py --model runs/tiny/target --clover runs/tiny/heads-clover \
        --medusa runs/tiny/heads-medusa --prompts 20 --max-new-tokens 128

For each drafter (auto = the default, clover heads merged with n-gram lookup; clover; medusa; ngram) and
temperature (0 and 0.7): τ and per-depth acceptance; greedy τ also over only the replies that do not loop. Greedy
outputs are checked token for token against --draft none. Then CPU tokens/s of --draft none against each drafter,
interleaved prompt by prompt in one run. Replies that fall into a loop are counted (a reply loops when
its last 48 tokens are one block of 1-16 tokens repeated). Writes docs/tiny_eval.json and prints markdown rows.
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def heldout_prompts(n: int, min_share: float = 0.97):
    from clover_cli.data import ascii_share, is_heldout, iter_conversations

    out = []
    for conv_id, messages in iter_conversations("sharegpt"):
        if is_heldout(conv_id) and ascii_share(messages) >= min_share and len(messages[0]["content"]) < 1500:
            out.append((conv_id, messages[0]["content"]))
            if len(out) >= n:
                break
    return out


def loops(tokens: list[int], tail: int = 48) -> bool:
    """Whether a reply ends in a loop: its last 48 tokens one block of 1-16 tokens repeated (the chat's test)."""
    from clover_cli.reply import ends_in_loop

    return ends_in_loop(tokens, tail)


def run(session, ids, n, temperature, seed):
    from clover_cli.decode.verify import Sampling
    from clover_cli.stats import Stats

    session.engine.reset()
    stats = Stats()
    out = []
    for ev in session.generate(ids, n, Sampling(temperature, 1.0, seed)):
        stats.add(ev)
        out += ev.tokens
    return out, stats


def summarise(runs) -> dict:
    """τ (tokens after the first over steps) and per-depth acceptance over a list of stats.Stats."""
    new = sum(r.new_tokens - 1 for r in runs)
    steps = sum(r.steps for r in runs)
    depth = max((len(r.depth_tries) for r in runs), default=0)
    hits = [sum(r.depth_hits[d] for r in runs if d < len(r.depth_hits)) for d in range(depth)]
    tries = [sum(r.depth_tries[d] for r in runs if d < len(r.depth_tries)) for d in range(depth)]
    return {"tau": round(new / max(1, steps), 3),
            "accept_by_depth": [round(h / t, 3) if t else 0.0 for h, t in zip(hits, tries)]}


def main():
    from clover_cli.session import Options, Session

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "clover_cli" / "bundled" / "tiny"))
    ap.add_argument("--clover", default=None, help="Clover-2 heads (default: the model's own, if bundled)")
    ap.add_argument("--medusa", default=None)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "docs" / "tiny_eval.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    prompts = heldout_prompts(args.prompts)
    # One session per drafter (each loads the same weights); auto is the default: clover heads + n-gram lookup.
    sessions = {name: Session(Options(model=args.model, heads=args.clover, draft=name), quiet=True)
                for name in ("none", "auto", "clover", "ngram")}
    if args.medusa:
        sessions["medusa"] = Session(Options(model=args.model, heads=args.medusa, draft="medusa"), quiet=True)
    base = sessions["none"]
    encoded = [base.encode_chat([{"role": "user", "content": p}]) for _, p in prompts]
    report = {"date": date.today().isoformat(), "machine": f"{platform.machine()}, {args.threads} threads",
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "default_drafter": sessions["auto"].draft_name, "drafters": {}}

    # 1. Reference greedy outputs (plain decoding) and loops.
    plain = [run(base, ids, args.max_new_tokens, 0.0, 0)[0] for ids in encoded]
    looping = [loops(o) for o in plain]
    report["greedy_loop_share"] = round(sum(looping) / len(plain), 3)
    report["samples"] = [{"prompt": prompts[i][1][:300], "reply": base.decode(plain[i])[:600]} for i in range(3)]

    # 2. τ and per-depth acceptance per drafter and temperature; greedy also on the replies that do not loop.
    for name in [n for n in ("auto", "clover", "medusa", "ngram") if n in sessions]:
        for temperature in (0.0, 0.7):
            runs, identical = [], True
            for i, ids in enumerate(encoded):
                out, stats = run(sessions[name], ids, args.max_new_tokens, temperature, seed=i)
                identical &= temperature > 0.0 or out == plain[i]
                runs.append(stats)
            row = summarise(runs)
            if temperature == 0.0:
                row["identical_to_plain"] = identical
                row["tau_without_loops"] = summarise([r for r, lp in zip(runs, looping) if not lp])["tau"]
            key = f"{name}@T={temperature}"
            report["drafters"][key] = row
            print(key, row, flush=True)

    # 3. CPU tokens/s: --draft none vs each drafter, interleaved prompt by prompt, after a warm-up. Fresh sessions:
    # the n-gram statistics learned in part 2 would otherwise have seen these very replies.
    order = ["none", "auto", "clover", "ngram"]
    sessions = {name: Session(Options(model=args.model, heads=args.clover, draft=name), quiet=True) for name in order}
    warm = base.encode_chat([{"role": "user", "content": "Hello, who are you?"}])
    for name in order:
        run(sessions[name], warm, 16, 0.0, 0)
    speed = {name: [0, 0.0] for name in order}
    for ids in encoded:
        for name in order:
            out, stats = run(sessions[name], ids, args.max_new_tokens, 0.0, 0)
            speed[name][0] += stats.new_tokens - 1
            speed[name][1] += stats.decode_s
    report["tokens_per_s"] = {k: round(v[0] / v[1], 2) for k, v in speed.items()}
    report["speedup_vs_none"] = {k: round(v / report["tokens_per_s"]["none"], 3)
                                 for k, v in report["tokens_per_s"].items() if k != "none"}
    print(json.dumps({k: report[k] for k in ("tokens_per_s", "speedup_vs_none", "greedy_loop_share")}), flush=True)
    from clover_cli import atomic

    atomic.write_text(Path(args.out), json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
