"""Measure the merged drafter's lookup threshold (MergedDrafter.enough) on held-out prompts, CPU.

    python scripts/tiny/lookup_threshold.py [N_PROMPTS]

Each configuration runs in its own fresh session (n-gram statistics start empty), interleaved prompt by prompt,
after a warm-up on another prompt; every greedy output is checked against plain decoding.
"""
import sys, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from evaluate import heldout_prompts, run, loops
from clover_cli.session import Options, Session
torch.set_num_threads(2)
prompts = heldout_prompts(int(sys.argv[1]) if len(sys.argv) > 1 else 12)
def mk(d): return Session(Options(model="clover_cli/bundled/tiny", draft=d), quiet=True)
base = mk("none")
enc = [base.encode_chat([{"role": "user", "content": p}]) for _, p in prompts]
warm = base.encode_chat([{"role": "user", "content": "Hello, who are you?"}])
plain = [run(base, ids, 128, 0.0, 0)[0] for ids in enc]
lp = [loops(o) for o in plain]
confs = [("none", mk("none"), None), ("ngram", mk("ngram"), None)] + [(f"auto@{e}", mk("auto"), e) for e in (None, 1.0, 2.0, 3.0)]
for name, s, e in confs:
    if e is not None: s.drafter.enough = e
    run(s, warm, 16, 0.0, 0)
tot = {c[0]: [0, 0.0, 0, 0, 0] for c in confs}
for i, ids in enumerate(enc):
    for name, s, e in confs:
        out, r = run(s, ids, 128, 0.0, 0)
        assert out == plain[i]
        t = tot[name]; t[0] += r.new_tokens - 1; t[1] += r.decode_s; t[2] += r.steps
        if not lp[i]: t[3] += r.new_tokens - 1; t[4] += r.steps
print("loop share", sum(lp) / len(lp))
for k, t in tot.items():
    print(f"{k:10s} tok/s {t[0]/t[1]:6.1f}  tau {t[0]/t[2]:.2f}  tau_noloop {t[3]/max(1,t[4]):.2f}", flush=True)
