"""Measure the bundled draft model against its target on held-out prompts.

    python scripts/tiny/evaluate_draft.py --work runs/tiny      # the held-out set of train_draft.py

What is measured (all on the held-out set written by train_draft.py: held-out ShareGPT prompts and the target's
own greedy reply to each, kept as token ids, so the reply *is* the target's greedy continuation):

- top-1 agreement: at every position whose next token belongs to the reply, does the draft's most likely next
  token (teacher-forced on the target's greedy text) equal the target's? Chance is 1/8192.
- mean accepted length of a greedy chain of k draft tokens (k = 4, 8), from every reply position: the draft
  proposes k tokens greedily and the target accepts the longest prefix equal to its own greedy continuation.
  Because the text is the target's greedy continuation, the draft's j-th proposal is made from exactly the
  text's prefix as long as the earlier j-1 were accepted, so one teacher-forced draft forward gives the chain:
  accepted = the number of consecutive positions, from the start, where the draft's top-1 equals the next token
  (at most k, and not past the reply's end). Mean over all start positions.
- chain τ: the same, walked as chain speculative decoding does (start at the reply's first token, accept a,
  the target adds one token of its own, move on a + 1), as reply tokens per target forward.
- per-token forward time, draft vs target: one token with a KV cache (transformers, fp32, 1 thread) after a
  prompt of 128 tokens, median over 5 rounds of 64 steps, the two interleaved round by round; CPU time of the
  process (what the step consumed: robust to a shared machine's load) and wall time.
- the same agreement figures over only the replies that do not end in a loop (last 48 tokens one repeated block
  of 1-16 tokens, as scripts/tiny/evaluate.py counts them): loops are easy to predict and inflate the rest.

Writes docs/tiny_draft_eval.json and prints a markdown row.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import train_draft  # noqa: E402  (scripts/tiny is not a package)
from clover_cli.target import cache_kwarg  # noqa: E402


@torch.inference_mode()
def agreement_stats(target, draft, rows, ks=(4, 8)) -> dict:
    hit = cnt = consistent = 0
    acc_sum = {k: 0 for k in ks}
    tau_tok = {k: 0 for k in ks}
    tau_steps = {k: 0 for k in ks}
    for r in rows:
        x = torch.tensor(r["ids"])[None]
        t_next = target(input_ids=x).logits[0].argmax(-1)
        d_next = draft(input_ids=x).logits[0].argmax(-1)
        a, b = r["prompt_len"] - 1, len(r["ids"]) - 1  # positions a..b-1 predict reply tokens
        if b <= a:
            continue
        text_next = x[0, a + 1:b + 1]
        consistent += (t_next[a:b] == text_next).sum().item()
        hit += (d_next[a:b] == t_next[a:b]).sum().item()
        cnt += b - a
        match = (d_next[a:b] == text_next).tolist()  # the draft's top-1 is the target's greedy next token
        n = len(match)
        run = [0] * (n + 1)  # run[p]: consecutive matches from p
        for p in range(n - 1, -1, -1):
            run[p] = run[p + 1] + 1 if match[p] else 0
        for k in ks:
            acc_sum[k] += sum(min(run[p], k) for p in range(n))
            p = 0
            while p < n:
                accepted = min(run[p], k)
                tau_tok[k] += min(accepted + 1, n - p)
                tau_steps[k] += 1
                p += accepted + 1
    return {"reply_positions": cnt,
            "target_greedy_consistency": round(consistent / max(cnt, 1), 4),
            "top1_agreement": round(hit / max(cnt, 1), 4),
            "mean_accepted": {str(k): round(acc_sum[k] / max(cnt, 1), 3) for k in ks},
            "chain_tau": {str(k): round(tau_tok[k] / max(tau_steps[k], 1), 3) for k in ks}}


@torch.inference_mode()
def decode_ms(model, prompt, steps):
    """Per-step (wall ms, CPU ms) of one-token forwards with a KV cache after `prompt`. CPU time is what the
    step itself consumed (one thread), so it does not count time spent waiting for a core on a shared machine."""
    out = model(input_ids=prompt, use_cache=True)
    past, tok = (out.cache if hasattr(out, "cache") else out.past_key_values), out.logits[:, -1:].argmax(-1)
    wall, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        out = model(input_ids=tok, **{cache_kwarg(model): past}, use_cache=True)
        cpu.append((time.process_time() - c0) * 1e3)
        wall.append((time.perf_counter() - t0) * 1e3)
        past, tok = (out.cache if hasattr(out, "cache") else out.past_key_values), out.logits[:, -1:].argmax(-1)
    return wall, cpu


def timing(target, draft, prompt, rounds=5, steps=64) -> dict:
    tw, tc, dw, dc = [], [], [], []
    for _ in range(rounds):
        w, c = decode_ms(target, prompt, steps)
        tw += w
        tc += c
        w, c = decode_ms(draft, prompt, steps)
        dw += w
        dc += c
    med = statistics.median
    return {"context": prompt.shape[1], "steps": rounds * steps,
            "target_cpu_ms": round(med(tc), 3), "draft_cpu_ms": round(med(dc), 3),
            "draft_over_target_cpu": round(med(dc) / med(tc), 3),
            "target_wall_ms": round(med(tw), 3), "draft_wall_ms": round(med(dw), 3)}


def loops(tokens: list[int], tail: int = 48) -> bool:
    """Whether a reply ends in a loop: its last 48 tokens one block of 1-16 tokens repeated (the chat's test)."""
    from clover_cli.reply import ends_in_loop

    return ends_in_loop(tokens, tail)


def _name(path: str) -> str:
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="runs/tiny")
    ap.add_argument("--target", default=str(train_draft.BUNDLED))
    ap.add_argument("--draft", default=str(train_draft.BUNDLED / "draft"))
    ap.add_argument("--sharegpt", default=None, help="only if the held-out set must be made (default: "
                    "WORK/sharegpt_en.jsonl)")
    ap.add_argument("--recipe", default=str(HERE / "recipe.json"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "tiny_draft_eval.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    dc = json.loads(Path(args.recipe).read_text())["draft"]
    target, tok = train_draft.load_target(args.target)
    draft, dtok = train_draft.load_target(args.draft)
    assert dtok.get_vocab() == tok.get_vocab(), "the draft's tokenizer differs from the target's"
    rows = train_draft.build_heldout(Path(args.work), target, tok,
                                     Path(args.sharegpt or Path(args.work) / "sharegpt_en.jsonl"),
                                     dc["heldout_prompts"], dc["heldout_max_new_tokens"], dc["heldout_max_prompt"])
    t0 = time.time()
    stats = agreement_stats(target, draft, rows)
    plain = [r for r in rows if not loops(r["ids"][r["prompt_len"]:])]
    stats["replies_that_loop"] = len(rows) - len(plain)
    stats["without_loops"] = agreement_stats(target, draft, plain)
    print(f"agreement: {stats} ({time.time() - t0:.0f}s)", flush=True)
    prompt = torch.tensor(rows[0]["ids"][:128])[None]
    speed = timing(target, draft, prompt)
    print(f"timing: {speed}", flush=True)
    n_t = sum(p.numel() for p in target.parameters())
    n_d = sum(p.numel() for p in draft.parameters())
    result = {"date": str(date.today()), "machine": f"{platform.machine()}, 1 thread",
              "target": _name(args.target), "draft": _name(args.draft), "target_params": n_t, "draft_params": n_d,
              "heldout_prompts": len(rows), **stats, "per_token_forward": speed}
    from clover_cli import atomic

    atomic.write_text(Path(args.out), json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"| tiny draft ({n_d / 1e6:.2f}M) vs tiny ({n_t / 1e6:.2f}M) | {stats['top1_agreement']} | "
          f"{stats['mean_accepted']['4']} / {stats['mean_accepted']['8']} | "
          f"{stats['chain_tau']['4']} / {stats['chain_tau']['8']} | {speed['draft_cpu_ms']} / "
          f"{speed['target_cpu_ms']} ms |")


if __name__ == "__main__":
    main()
