"""What the default drafter (Clover-2 heads + n-gram lookup, `--draft auto`) learns about when the heads pay, against
fixed policies, on a model with the compiled step:

    python scripts/default_drafter_probe.py [--limit 27]                         # the bundled model, greedy
    python scripts/default_drafter_probe.py --model smollm2 --temperature 0.7 --top-p 0.9 --budgets 3,6 --shipped

Rows: plain decoding; ngram alone; the default as shipped (ChoiceStats learning per bin whether a step runs the heads),
once from nothing and once from the choice stored by earlier processes (as `clover generate`, `clover chat` and
`clover bench` start; read, not written back); the same merged drafter always running the heads; never running
them; and with --budgets, the default with each fixed tree budget instead of the cost model's. Interleaved prompt by
prompt in `clover bench`'s balanced order (a rotation would keep each row's predecessor, and a run right after one
with the heads on every step measured ~5% slower), `--rounds` times over the prompts, 128 new tokens, after one
warm-up run each; sampled rows draw with the prompt's seed. Without --shipped every row drafts at every step the cost
model allows (skip_unpaid off: the rows differ only in when the heads run); with it, as clover runs (DraftValue also
skips whole proposals that do not pay). Prints decode tokens/s, target steps, steps that drafted, steps that ran the
heads and nodes verified per drafting step, per row; then the learned decisions per bin and the estimated tokens/s
of each way in each bin (bins: what lookup alone expects, drafters.merged.ChoiceStats.BINS).
"""

from __future__ import annotations

import argparse

import torch


def main():
    from clover_cli.bench import balanced_order, load_prompts
    from clover_cli.decode.budget import mode_key, mode_parts
    from clover_cli.decode.engine import Engine
    from clover_cli.decode.verify import Sampling, StopCheck
    from clover_cli.drafters.factory import make_drafter
    from clover_cli.drafters.merged import ChoiceStats, MergedDrafter
    from clover_cli.drafters.registry import load
    from clover_cli.session import Options, Session
    from clover_cli.stats import Stats

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--limit", type=int, default=27)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="1.0 as clover bench runs (chat and generate run an alias's own, smollm2's 1.1)")
    ap.add_argument("--budgets", default="", help="fixed tree budgets for extra rows of the default, e.g. 3,6")
    ap.add_argument("--shipped", action="store_true", help="skip unpaid proposals (DraftValue) as clover does")
    args = ap.parse_args()
    # the sampling mode as the engine keys what it learns (temperature to two decimals)
    args.temperature, args.repetition_penalty = mode_parts(mode_key(args.temperature, args.repetition_penalty))
    fixed = [int(x) for x in args.budgets.split(",") if x]
    if any(b < 1 for b in fixed):
        raise SystemExit("--budgets: tree budgets of 1 node or more")
    torch.set_num_threads(args.threads)
    s = Session(Options(model=args.model, draft="auto", compile="on"), quiet=True)
    if not isinstance(s.drafter, MergedDrafter):
        raise SystemExit(f"{args.model} has no heads: its default drafter is {s.drafter.name}")
    s.compiler.start(background=False)
    encoded = [s.encode_chat(p["messages"]) for p in load_prompts(None, args.limit)]
    heads = load(s.heads_path, s.model)

    class Fixed(ChoiceStats):
        def __init__(self, way: bool):
            super().__init__()
            self.way = way

        def choose(self, b, prior):
            return self.way

    stored = ChoiceStats()
    store = s.engine.policy.cost_store
    store.load_choices(stored, store.choices_path(s.heads_path, args.repetition_penalty, args.temperature,
                                                  s.drafter.primary.int8))
    print("stored choice:", sum(stored.decisions.values()), "decisions")
    rows = {"plain": None, "ngram": None, "learned (default)": ChoiceStats(), "learned, stored": stored,
            "always heads": Fixed(True), "never heads": Fixed(False)}
    budgets = {}
    for b in fixed:
        rows[f"learned, budget {b}"] = ChoiceStats()
        budgets[f"learned, budget {b}"] = b

    def make(name):
        if name in ("plain", "ngram"):
            return make_drafter({"plain": "none"}.get(name, name), s.target,
                                prior=s.ngram_prior if name == "ngram" else None)
        d = make_drafter("auto", s.target, heads=heads, prior=s.ngram_prior, choices=rows[name])  # as clover runs it
        s.compiler.ready_heads(d.primary, s.heads_path)
        return d

    policy = s.engine.policy

    def engine(name):
        b = budgets.get(name)
        return Engine(s.target, make(name), budget=policy.budget if b is None else b,
                      auto_budget=b is None and policy.auto_budget,
                      cost_store=store, skip_unpaid=args.shipped)

    def sampling(seed):
        return Sampling(args.temperature, args.top_p, seed, args.repetition_penalty)

    engines = {name: engine(name) for name in rows}
    totals = {name: [0.0, 0, 0, 0, 0, 0] for name in rows}  # seconds, tokens, steps, drafting steps, heads, nodes
    heads_steps = {"n": 0}
    propose = MergedDrafter.propose

    def counted(self, context, budget):  # counts the steps that ran the heads
        tree = propose(self, context, budget)
        heads_steps["n"] += self._open.ran_first
        return tree

    MergedDrafter.propose = counted
    names = list(rows)
    with torch.inference_mode():
        for name, eng in engines.items():  # warm-up
            eng.reset()
            for _ in eng.generate(encoded[0][:64], StopCheck(8, s.eos_ids), sampling(0)):
                pass
        for i, ids in enumerate(encoded * args.rounds):
            for name in (names[j] for j in balanced_order(len(names), i)):
                eng = engines[name]
                eng.drafter = make(name)
                eng.reset()
                stats = Stats()
                heads_steps["n"] = drafting = nodes = 0
                for ev in eng.generate(ids, StopCheck(args.max_new_tokens, s.eos_ids), sampling(i % len(encoded))):
                    stats.add(ev)
                    drafting += ev.proposed > 0
                    nodes += ev.proposed
                for col, v in enumerate((stats.decode_s, stats.new_tokens - 1, stats.steps, drafting,
                                         heads_steps["n"], nodes)):
                    totals[name][col] += v
    base = totals["plain"][1] / totals["plain"][0]
    for name, (secs, tokens, steps, drafting, with_heads, nodes) in totals.items():
        print(f"{name:20s} {tokens / secs:7.1f} tok/s ({tokens / secs / base:.3f}x plain)  decode {secs:.2f} s  "
              f"steps {steps}  tau {tokens / steps:.3f}  drafting steps {drafting}  with the heads {with_heads}  "
              f"nodes per drafting step {nodes / max(drafting, 1):.2f}")
    learned = rows["learned (default)"]
    print("decisions per bin:", dict(sorted(learned.decisions.items())))
    for b in sorted(learned.decisions):
        for way in (False, True):
            rate = learned.rate(b, way)
            print(f"bin {b} heads={way!s:5s} " + (f"{rate:7.0f} tok/s (estimated)" if rate else "not measured"))


if __name__ == "__main__":
    main()
