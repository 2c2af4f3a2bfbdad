"""Recipe part 3: put the trained target and its Clover-2 heads into the package (fp16 safetensors).

    python scripts/tiny/export.py --work runs/tiny

Writes clover_cli/bundled/tiny/ (config, tokenizer, chat template, weights, README.md model card) and
clover_cli/bundled/tiny/heads/ (the Clover-2 heads directory); an existing draft/ (the draft model, written by
scripts/tiny/export_draft.py) is kept. The model card is filled in from the recorded
training logs and from docs/tiny_eval.json (written by scripts/tiny/evaluate.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch

from clover_cli import atomic

ROOT = Path(__file__).resolve().parents[2]
DEST = ROOT / "clover_cli" / "bundled" / "tiny"


def main():
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="runs/tiny")
    args = ap.parse_args()
    work = Path(args.work)
    tmp = atomic.temp_dir(DEST)  # built beside the package's copy and renamed over it: whole or not at all
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(work / "target", dtype=torch.float16)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(work / "target").save_pretrained(tmp)
    heads_src = work / "heads-clover"
    (tmp / "heads").mkdir()
    state = load_file(str(heads_src / "model.safetensors"))
    half = {k: (v.to(torch.float16) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    meta = {"format": "pt"}  # token ids stay int64
    atomic.write_with(tmp / "heads" / "model.safetensors", lambda f: save_file(half, str(f), metadata=meta))
    cfg = json.loads((heads_src / "config.json").read_text())
    cfg["target"]["name_or_path"] = "tiny"
    atomic.write_text(tmp / "heads" / "config.json", json.dumps(cfg, indent=2) + "\n")
    atomic.write_text(tmp / "heads" / "README.md", (heads_src / "README.md").read_text())
    atomic.write_text(tmp / "README.md", model_card(work, cfg))
    if (DEST / "draft").is_dir():  # the draft model (scripts/tiny/export_draft.py) stays
        shutil.copytree(DEST / "draft", tmp / "draft")
    shutil.rmtree(DEST, ignore_errors=True)
    os.replace(tmp, DEST)
    for p in sorted(DEST.rglob("*")):
        if p.is_file():
            print(f"{p.relative_to(ROOT)}  {p.stat().st_size / 1e6:.2f} MB")


def measured(ev: dict) -> str:
    if not ev.get("drafters"):
        return "(not measured yet)"
    lines = ["| drafter | τ greedy | τ greedy, replies that do not loop | τ at T=0.7 | CPU tokens/s (greedy) |",
             "|---|---|---|---|---|"]
    speed = ev.get("tokens_per_s", {})
    for name in ("auto", "clover", "medusa", "ngram"):
        g, s = ev["drafters"].get(f"{name}@T=0.0"), ev["drafters"].get(f"{name}@T=0.7")
        if g:
            label = "auto (default: clover+ngram)" if name == "auto" else name
            lines.append(f"| {label} | {g['tau']} | {g.get('tau_without_loops')} | {s['tau'] if s else '-'} | "
                         f"{speed.get(name, '-')} |")
    lines.append(f"| none | 1.0 | 1.0 | 1.0 | {speed.get('none', '-')} |")
    return "\n".join(lines) + (f"\n\n{ev['prompts']} held-out prompts, {ev['max_new_tokens']} new tokens; "
                               f"{ev['greedy_loop_share']:.0%} of the greedy replies end in a loop (`/penalty 1.3` in "
                               f"the chat, or `--repetition-penalty 1.3`, stops most of them, at the cost of most "
                               f"drafts).")


def model_card(work: Path, heads_cfg: dict) -> str:
    recipe = json.loads((ROOT / "scripts" / "tiny" / "recipe.json").read_text())
    log = [json.loads(line) for line in (work / "train_log.jsonl").read_text().splitlines() if line.strip()]
    last = log[-1]
    eval_path = ROOT / "docs" / "tiny_eval.json"
    ev = json.loads(eval_path.read_text()) if eval_path.is_file() else {}
    t = recipe["target"]
    tr = heads_cfg.get("training", {})
    samples = "\n\n".join(f"**User:** {s['prompt']}\n\n**tiny:** {s['reply']}" for s in ev.get("samples", []))
    return f"""# tiny — clover's bundled chat model

A small Llama (`LlamaForCausalLM`, {t['num_hidden_layers']} layers, hidden {t['hidden_size']}, {t['num_attention_heads']}
heads, vocabulary {recipe['tokenizer']['vocab_size']}, tied embeddings, context {t['max_position_embeddings']}) trained from scratch
on the English part of ShareGPT V3 (the data Vicuna was tuned on), with its Clover-2 draft heads in `heads/`.
It exists so that `clover chat` works offline on a CPU and shows speculative decoding at work; it is far too small
to be a useful assistant — expect fluent-looking but often wrong or repetitive replies.

- Tokenizer: byte-level BPE ({recipe['tokenizer']['vocab_size']} tokens, `<s>`, `</s>`, `<unk>`) trained on the training split, Vicuna v1.1 chat template.
- Target: {recipe['pretrain']['steps']} steps of {recipe['pretrain']['batch_size']} x {recipe['pretrain']['seq_len']} tokens (all tokens, then assistant tokens only from step
  {recipe['pretrain']['assistant_only_from_step']}), AdamW, cosine schedule, seed {recipe['seed']}; {last['elapsed_s'] / 60:.0f} min on 2 CPU cores.
  Held-out assistant-token loss {last['heldout_assistant_loss']:.3f} (perplexity {last['heldout_ppl']:.1f}).
- Heads: Clover-2, {heads_cfg['num_heads']} heads, {heads_cfg['num_layers']} augmenting layer(s), distilled with `clover train` on the target's own
  replies (`--regenerate`): {tr.get('steps')} steps; held-out top-1 agreement per head {tr.get('heldout_accuracy')}.
- Weights: fp16 safetensors. Recipe: `scripts/tiny/build.sh` (config in `scripts/tiny/recipe.json`).

## Measured ({ev.get('date', '?')}, {ev.get('machine', '?')}; `scripts/tiny/evaluate.py`, details in docs/BENCHMARKS.md)

{measured(ev)}

## Sample replies (greedy, held-out prompts)

{samples or '(see docs/BENCHMARKS.md)'}
"""


if __name__ == "__main__":
    main()
