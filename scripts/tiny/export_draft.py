"""Recipe, the draft model's last step: put it into the package (fp16 safetensors, tokenizer, model card).

    python scripts/tiny/export_draft.py --work runs/tiny

Writes clover_cli/bundled/tiny/draft/ from WORK/draft (written by scripts/tiny/train_draft.py): the weights in
fp16, the config, the target's own tokenizer files and chat template (copied from the bundled target, so the
directory loads on its own with AutoModelForCausalLM / AutoTokenizer and its vocabulary is the target's by
construction), and a README.md model card filled in from WORK/draft_log.jsonl and docs/tiny_draft_eval.json.
scripts/tiny/export.py keeps this directory when it rebuilds the bundled target.
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
TARGET = ROOT / "clover_cli" / "bundled" / "tiny"
DEST = TARGET / "draft"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def export(work: Path, dest: Path = DEST, target_dir: Path = TARGET) -> None:
    from transformers import AutoModelForCausalLM

    tmp = atomic.temp_dir(dest)  # built beside and renamed over: whole or not at all
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(work / "draft", dtype=torch.float16)
    model.save_pretrained(tmp)
    for name in TOKENIZER_FILES:
        shutil.copyfile(target_dir / name, tmp / name)
    atomic.write_text(tmp / "README.md", model_card(work, model))
    for p in tmp.iterdir():
        os.chmod(p, 0o644)  # transformers writes the weights 0600; the package's files are world-readable
    old = dest.with_name(f".{dest.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.replace(dest, old)
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)
    for p in sorted(dest.rglob("*")):
        if p.is_file():
            print(f"{p.relative_to(ROOT)}  {p.stat().st_size / 1e6:.2f} MB")


def model_card(work: Path, model) -> str:
    recipe = json.loads((ROOT / "scripts" / "tiny" / "recipe.json").read_text())
    dc, a = recipe["draft"], recipe["draft"]["arch"]
    log = [json.loads(line) for line in (work / "draft_log.jsonl").read_text().splitlines() if line.strip()]
    last = log[-1]
    n = sum(p.numel() for p in model.parameters())
    ev_path = ROOT / "docs" / "tiny_draft_eval.json"
    ev = json.loads(ev_path.read_text()) if ev_path.is_file() else {}
    if ev:
        sp, nl = ev["per_token_forward"], ev["without_loops"]
        measured = f"""On {ev['heldout_prompts']} held-out ShareGPT prompts, teacher-forced on the target's own greedy replies
({ev['reply_positions']} reply positions; `scripts/tiny/evaluate_draft.py`, {ev['date']}, {ev['machine']}):

| | value |
|---|---|
| top-1 agreement with the target's greedy next token | {ev['top1_agreement']} |
| mean accepted length of a greedy chain of 4 / 8 draft tokens | {ev['mean_accepted']['4']} / {ev['mean_accepted']['8']} |
| chain τ (reply tokens per target forward), chains of 4 / 8 | {ev['chain_tau']['4']} / {ev['chain_tau']['8']} |
| one-token forward with KV cache, fp32, 1 thread, CPU time: draft / target | {sp['draft_cpu_ms']} / {sp['target_cpu_ms']} ms ({sp['draft_over_target_cpu']}x) |

Over only the {ev['heldout_prompts'] - ev['replies_that_loop']} replies that do not end in a loop ({ev['replies_that_loop']} of {ev['heldout_prompts']} do; loops are easy to
predict): top-1 agreement {nl['top1_agreement']}, mean accepted length {nl['mean_accepted']['4']} / {nl['mean_accepted']['8']}, chain τ {nl['chain_tau']['4']} / {nl['chain_tau']['8']}.
"""
    else:
        measured = "(not measured yet: run scripts/tiny/evaluate_draft.py)"
    return f"""# tiny draft — a draft model for clover's bundled `tiny`

A much smaller Llama (`LlamaForCausalLM`, {a['num_hidden_layers']} layers, hidden {a['hidden_size']}, {a['num_attention_heads']} heads, MLP {a['intermediate_size']},
tied embeddings, {n / 1e6:.2f}M parameters) with exactly the target's tokenizer and vocabulary (8192), for
draft-model speculative decoding against `clover_cli/bundled/tiny` (the directory above this one). It loads on
its own with `AutoModelForCausalLM` / `AutoTokenizer`, so any HF-compatible assisted generation can use it.
Like its target it is a demonstration model: its only job is to guess what `tiny` will say next.

- Distilled from the target, offline, on CPU: {last['step']} steps of up to {dc['batch_tokens']} tokens over the target's own greedy
  replies to ShareGPT prompts of the training split (the regenerated conversations of the heads' recipe, cut to
  {dc['max_len']} tokens): soft cross-entropy against the target's top-{dc['teacher_topk']} distribution at every position plus
  {dc['hard_weight']} x hard cross-entropy on the reply tokens; AdamW, cosine schedule, seed {recipe['seed']}; {last['elapsed_s'] / 60:.0f} min of wall time on one thread of a shared 2-core CPU
  (besides the one-off teacher pass).
- Embedding initialised from the target's: its 8192 x 256 embedding projected onto its top {a['hidden_size']} right singular
  vectors (a truncated SVD, which keeps the dot products tied logits are made of as far as {a['hidden_size']} directions can).
- Weights: fp16 safetensors. Recipe: `scripts/tiny/train_draft.py` (the "draft" block of `scripts/tiny/recipe.json`),
  `scripts/tiny/build.sh`.

## Measured

{measured}"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="runs/tiny")
    args = ap.parse_args()
    export(Path(args.work))


if __name__ == "__main__":
    main()
