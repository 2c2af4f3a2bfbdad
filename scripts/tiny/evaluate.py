"""Recipe part 4: measure the bundled model and its drafters on held-out ShareGPT prompts.

    python scripts/tiny/evaluate.py --model runs/tiny/target --clover runs/tiny/heads-clover \
        --medusa runs/tiny/heads-medusa --prompts 20 --max-new-tokens 128

For each drafter (clover, medusa, ngram) and temperature (0 and 0.7): τ and per-depth acceptance. Greedy outputs
are checked token for token against --draft none. Then CPU tokens/s of --draft none against the default drafter
(clover), interleaved prompt by prompt in one run. Replies that fall into a loop are counted (a reply loops when
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
    t = tokens[-tail:]
    if len(t) < tail:
        return False
    return any(all(t[i] == t[i % p] for i in range(len(t))) for p in range(1, 17))


def run(session, drafter_name, ids, n, temperature, seed):
    from clover_cli.engine import Sampling
    from clover_cli.session import RunStats

    if session.draft_name != drafter_name:
        session.switch_draft(drafter_name)
    session.engine.reset()
    stats = RunStats()
    out = []
    for ev in session.generate(ids, n, Sampling(temperature, 1.0, seed)):
        stats.add(ev)
        out += ev.tokens
    return out, stats


def main():
    from clover_cli.session import Options, Session

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "clover_cli" / "bundled" / "tiny"))
    ap.add_argument("--clover", default=None)
    ap.add_argument("--medusa", default=None)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "docs" / "tiny_eval.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    prompts = heldout_prompts(args.prompts)
    sessions = {"clover": Session(Options(model=args.model, heads=args.clover, draft="clover"), quiet=True)}
    if args.medusa:
        sessions["medusa"] = Session(Options(model=args.model, heads=args.medusa, draft="medusa"), quiet=True)
    base = sessions["clover"]
    encoded = [base.encode_chat([{"role": "user", "content": p}]) for _, p in prompts]
    report = {"date": date.today().isoformat(), "machine": f"{platform.machine()}, {args.threads} threads",
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "drafters": {}}

    # 1. Reference greedy outputs (plain decoding) and loops.
    plain = [run(base, "none", ids, args.max_new_tokens, 0.0, 0)[0] for ids in encoded]
    report["greedy_loop_share"] = sum(loops(o) for o in plain) / len(plain)
    report["samples"] = [{"prompt": prompts[i][1][:300], "reply": base.decode(plain[i])[:600]} for i in range(3)]

    # 2. τ and per-depth acceptance per drafter and temperature.
    for name in ["clover", "medusa", "ngram"]:
        session = sessions.get(name, base)
        for temperature in (0.0, 0.7):
            total = None
            identical = True
            for i, ids in enumerate(encoded):
                out, stats = run(session, name, ids, args.max_new_tokens, temperature, seed=i)
                if temperature == 0.0 and out != plain[i]:
                    identical = False
                if total is None:
                    total = stats
                else:
                    for f in ("new_tokens", "steps", "drafted_accepted", "proposed"):
                        setattr(total, f, getattr(total, f) + getattr(stats, f))
                    total.decode_s += stats.decode_s
                    for d in range(len(stats.depth_hits)):
                        while len(total.depth_hits) <= d:
                            total.depth_hits.append(0)
                            total.depth_tries.append(0)
                        total.depth_hits[d] += stats.depth_hits[d]
                        total.depth_tries[d] += stats.depth_tries[d]
            key = f"{name}@T={temperature}"
            report["drafters"][key] = {
                "tau": round((total.new_tokens - len(encoded)) / max(1, total.steps), 3),
                "accept_by_depth": [round(a, 3) for a in total.accept_by_depth],
                "identical_to_plain": identical if temperature == 0.0 else None,
            }
            print(key, report["drafters"][key], flush=True)

    # 3. CPU tokens/s: --draft none vs the default drafter (clover), interleaved, after a warm-up.
    run(base, "none", encoded[0], 16, 0.0, 0)
    run(base, "clover", encoded[0], 16, 0.0, 0)
    speed = {"none": [0, 0.0], "clover": [0, 0.0]}
    for ids in encoded:
        for name in ("none", "clover"):
            out, stats = run(base, name, ids, args.max_new_tokens, 0.0, 0)
            speed[name][0] += stats.new_tokens - 1
            speed[name][1] += stats.decode_s
    report["tokens_per_s"] = {k: round(v[0] / v[1], 2) for k, v in speed.items()}
    report["speedup"] = round(report["tokens_per_s"]["clover"] / report["tokens_per_s"]["none"], 3)
    print(json.dumps({k: report[k] for k in ("tokens_per_s", "speedup", "greedy_loop_share")}), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
