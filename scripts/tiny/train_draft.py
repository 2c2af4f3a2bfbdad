"""Recipe for the bundled `tiny` model, the draft model: a much smaller Llama distilled from the target.

    python scripts/tiny/train_draft.py --work runs/tiny \
        --regenerated runs/tiny/heads-clover/regenerated.jsonl --sharegpt runs/tiny/sharegpt_en.jsonl

Same tokenizer and vocabulary as the target; the sizes are the "draft" block of recipe.json. Steps (each cached
in --work, so the script resumes where it stopped):

1. teacher cache (work/draft_teacher.npz): the regenerated conversations (the target's own greedy replies to
   ShareGPT prompts of the training split) tokenised with the target's chat template, cut to max_len tokens, and
   the target's top-k log-probabilities at every position (one inference-mode forward per conversation).
2. held-out set (work/draft_heldout.jsonl): held-out ShareGPT prompts (first user turn) and the target's greedy
   reply to each, kept as token ids, so that "the target's greedy continuation" is exact, not re-tokenised text.
3. training: soft cross-entropy against the target's top-k distribution (renormalised over those k) at every
   position, plus hard cross-entropy on the tokens of the assistant replies; AdamW, cosine schedule. The draft's
   embedding starts from the target's, projected onto its top principal directions (truncated SVD of the
   target's 8192 x 256 embedding, no centring: E ≈ E V Vᵀ keeps the dot products that tied logits are made of).
   Checkpoints (work/draft_ckpt.pt, atomic) every eval; a held-out eval (top-1 agreement with the target's greedy
   token) every eval_every steps into work/draft_log.jsonl.
4. writes work/draft/ (transformers Llama directory, fp32, with the target's tokenizer and template).

scripts/tiny/evaluate_draft.py measures it; scripts/tiny/export_draft.py puts it into the package.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from clover_cli import atomic, torchload
from clover_cli.data import ascii_share, is_heldout, iter_conversations, tokenize_conversation
from clover_cli.templates import VICUNA_V11

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
BUNDLED = ROOT / "clover_cli" / "bundled" / "tiny"


def load_target(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(path)


# ------------------------------------------------------------------------------------------------ teacher cache

@torch.inference_mode()
def build_teacher_cache(work: Path, target, tok, regenerated: Path, dc: dict) -> dict:
    path = work / "draft_teacher.npz"
    if path.exists():
        return dict(np.load(path))
    k, max_len = dc["teacher_topk"], dc["max_len"]
    text = regenerated.read_text(encoding="utf-8")
    convs = [json.loads(line) for line in text.split("\n") if line.strip()]  # not splitlines(): U+2028 in text
    ids_all, mask_all, starts, top_i, top_v = [], [], [], [], []
    t0, n_tok = time.time(), 0
    for n, messages in enumerate(convs):
        ids, mask = tokenize_conversation(tok, messages, VICUNA_V11, max_len)
        if sum(mask) == 0 or len(ids) < 3:
            continue
        x = torch.tensor(ids)[None]
        logp = torch.log_softmax(target(input_ids=x).logits[0].float(), -1)
        v, i = logp.topk(k, -1)
        starts.append(len(ids_all))
        ids_all.extend(ids)
        mask_all.extend(mask)
        top_i.append(i.numpy().astype(np.uint16))
        top_v.append(v.numpy().astype(np.float16))
        n_tok += len(ids)
        if (n + 1) % 100 == 0:
            print(f"teacher: {n + 1}/{len(convs)} conversations, {n_tok} tokens, "
                  f"{n_tok / (time.time() - t0):.0f} tok/s", flush=True)
    arrays = {"ids": np.asarray(ids_all, dtype=np.uint16), "mask": np.asarray(mask_all, dtype=np.uint8),
              "starts": np.asarray(starts, dtype=np.int64), "top_i": np.concatenate(top_i),
              "top_v": np.concatenate(top_v)}
    print(f"teacher cache: {len(starts)} conversations, {len(ids_all)} tokens ({sum(mask_all)} assistant), "
          f"top-{k}, {time.time() - t0:.0f}s", flush=True)

    def fill(tmp: Path):
        with tmp.open("wb") as tmp_file:  # a file object: given a name, savez would add .npz to it
            np.savez(tmp_file, **arrays)

    atomic.write_with(path, fill)
    return arrays


# ------------------------------------------------------------------------------------------------ held-out set

@torch.inference_mode()
def build_heldout(work: Path, target, tok, sharegpt: Path, n: int, max_new: int, max_prompt: int) -> list[dict]:
    """Held-out prompts and the target's greedy replies, as token ids: [{"id", "ids", "prompt_len"}]."""
    path = work / "draft_heldout.jsonl"
    if path.exists():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if len(rows) >= n:
            return rows[:n]
    rows, t0 = [], time.time()
    for conv_id, messages in iter_conversations(str(sharegpt)):
        if not is_heldout(conv_id) or ascii_share(messages) < 0.97 or messages[0]["role"] != "user":
            continue
        text = tok.apply_chat_template(messages[:1], chat_template=VICUNA_V11, tokenize=False,
                                       add_generation_prompt=True)
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        if len(prompt) > max_prompt:
            continue
        out = target.generate(input_ids=torch.tensor(prompt)[None], attention_mask=torch.ones(1, len(prompt),
                              dtype=torch.long), do_sample=False, max_new_tokens=max_new,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        rows.append({"id": conv_id, "ids": out[0].tolist(), "prompt_len": len(prompt)})
        if len(rows) >= n:
            break
    print(f"held-out: {len(rows)} prompts, {sum(len(r['ids']) - r['prompt_len'] for r in rows)} greedy reply "
          f"tokens, {time.time() - t0:.0f}s", flush=True)
    atomic.write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


@torch.inference_mode()
def heldout_targets(target, rows) -> list[torch.Tensor]:
    """The target's greedy next token at every position of each held-out row (teacher-forced)."""
    return [target(input_ids=torch.tensor(r["ids"])[None]).logits[0].argmax(-1) for r in rows]


@torch.inference_mode()
def agreement(model, rows, tgt_next) -> tuple[float, float]:
    """Top-1 agreement of `model` with the target's greedy next token over the reply positions of the held-out
    rows (the positions whose next token is part of the reply), and the model's mean CE on the reply tokens."""
    hit = cnt = 0
    nll = 0.0
    for r, t in zip(rows, tgt_next):
        x = torch.tensor(r["ids"])
        logits = model(input_ids=x[None]).logits[0].float()
        a = r["prompt_len"] - 1  # position a predicts the first reply token
        b = len(r["ids"]) - 1
        if b <= a:
            continue
        hit += (logits[a:b].argmax(-1) == t[a:b]).sum().item()
        nll += F.cross_entropy(logits[a:b], x[a + 1:b + 1], reduction="sum").item()
        cnt += b - a
    return hit / max(cnt, 1), nll / max(cnt, 1)


# ------------------------------------------------------------------------------------------------ the draft

def make_draft(target, tok, dc: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    arch = dc["arch"]
    cfg = LlamaConfig(vocab_size=target.config.vocab_size, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=None,
                      max_position_embeddings=target.config.max_position_embeddings,
                      rms_norm_eps=target.config.rms_norm_eps, **arch)
    model = LlamaForCausalLM(cfg)
    # embedding: the target's, projected onto its top right singular vectors (rows keep their dot products as
    # far as `hidden_size` directions can), rescaled to the target's per-row RMS so the first norms see the same
    # scale
    e = target.get_input_embeddings().weight.detach().float()
    _, s, vh = torch.linalg.svd(e, full_matrices=False)
    h = arch["hidden_size"]
    proj = e @ vh[:h].T
    kept = (s[:h] ** 2).sum() / (s ** 2).sum()
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(proj)
    print(f"draft embedding: target's projected onto its top {h} singular directions "
          f"({kept:.1%} of its energy)", flush=True)
    return model, float(kept)


def make_batches(starts, total, max_tokens, seed_epoch):
    """Conversations grouped by length into batches of at most max_tokens padded tokens; order shuffled per
    epoch (seeded), so a resumed run sees the same batches."""
    ends = list(starts[1:]) + [total]
    lens = [e - s for s, e in zip(starts, ends)]
    rng = np.random.default_rng(seed_epoch)
    order = sorted(range(len(lens)), key=lambda i: (lens[i], rng.random()))
    batches, cur = [], []
    for i in order:
        if cur and lens[i] * (len(cur) + 1) > max_tokens:  # sorted ascending: the new one is the longest
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches, ends


def collate(arrays, rows, ends, pad_id):
    starts = arrays["starts"]
    width = max(ends[i] - starts[i] for i in rows)
    k = arrays["top_i"].shape[1]
    x = np.full((len(rows), width), pad_id, dtype=np.int64)
    m = np.zeros((len(rows), width), dtype=np.float32)  # assistant tokens
    valid = np.zeros((len(rows), width), dtype=np.float32)
    ti = np.zeros((len(rows), width, k), dtype=np.int64)
    tv = np.full((len(rows), width, k), -1e4, dtype=np.float32)
    for r, i in enumerate(rows):
        s, e = starts[i], ends[i]
        x[r, :e - s] = arrays["ids"][s:e]
        m[r, :e - s] = arrays["mask"][s:e]
        valid[r, :e - s] = 1
        ti[r, :e - s] = arrays["top_i"][s:e]
        tv[r, :e - s] = arrays["top_v"][s:e]
    return tuple(torch.from_numpy(a) for a in (x, m, valid, ti, tv))


def losses(logits, x, m, valid, ti, tv):
    """(soft CE against the target's renormalised top-k at every real position but the last, hard CE on the
    assistant tokens)."""
    logq = torch.log_softmax(logits[:, :-1].float(), -1)
    p = torch.softmax(tv[:, :-1], -1)
    soft = -(p * logq.gather(-1, ti[:, :-1])).sum(-1)
    w = valid[:, 1:]  # position t has a next token
    soft = (soft * w).sum() / w.sum().clamp(min=1)
    hard = -logq.gather(-1, x[:, 1:, None])[..., 0]
    wm = m[:, 1:]
    hard = (hard * wm).sum() / wm.sum().clamp(min=1)
    return soft, hard


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="runs/tiny")
    ap.add_argument("--target", default=str(BUNDLED), help="the target directory (default: the bundled tiny)")
    ap.add_argument("--regenerated", default=None,
                    help="the target's regenerated conversations (default: WORK/heads-clover/regenerated.jsonl)")
    ap.add_argument("--sharegpt", default=None, help="for the held-out prompts (default: WORK/sharegpt_en.jsonl)")
    ap.add_argument("--recipe", default=str(HERE / "recipe.json"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=None, help="override the recipe's step count")
    args = ap.parse_args()
    recipe = json.loads(Path(args.recipe).read_text())
    dc = recipe["draft"]
    if args.steps:
        dc["steps"] = args.steps
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(recipe["seed"])
    target, tok = load_target(args.target)
    regenerated = Path(args.regenerated or work / "heads-clover" / "regenerated.jsonl")
    arrays = build_teacher_cache(work, target, tok, regenerated, dc)
    held = build_heldout(work, target, tok, Path(args.sharegpt or work / "sharegpt_en.jsonl"),
                         dc["heldout_prompts"], dc["heldout_max_new_tokens"], dc["heldout_max_prompt"])
    eval_rows = held[: dc["eval_prompts"]]
    eval_next = heldout_targets(target, eval_rows)

    model, kept = make_draft(target, tok, dc)
    del target
    n_params = sum(p.numel() for p in model.parameters())
    print(f"draft: {n_params / 1e6:.2f}M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": dc["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=dc["lr"], betas=tuple(dc["betas"]))
    ckpt = work / "draft_ckpt.pt"
    log_path = work / "draft_log.jsonl"
    step, elapsed0 = 0, 0.0
    if ckpt.exists():
        state = torchload.load(ckpt, "checkpoint")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, elapsed0 = state["step"], state["elapsed_s"]
        print(f"resumed at step {step}", flush=True)

    def lr_at(s):
        if s < dc["warmup_steps"]:
            return dc["lr"] * (s + 1) / dc["warmup_steps"]
        frac = (s - dc["warmup_steps"]) / max(1, dc["steps"] - dc["warmup_steps"])
        return dc["lr"] * (dc["min_lr_ratio"] + (1 - dc["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * frac)))

    total = len(arrays["ids"])
    epoch_batches = {}

    def batch_at(s):
        n_per_epoch = len(make_batches(arrays["starts"], total, dc["batch_tokens"], 0)[0])
        ep, j = divmod(s, n_per_epoch)
        if ep not in epoch_batches:
            epoch_batches[ep] = make_batches(arrays["starts"], total, dc["batch_tokens"], recipe["seed"] + ep)
        b, ends = epoch_batches[ep]
        return collate(arrays, b[j], ends, tok.eos_token_id), ep

    n_epoch = len(make_batches(arrays["starts"], total, dc["batch_tokens"], 0)[0])
    print(f"{n_epoch} batches per epoch of at most {dc['batch_tokens']} tokens; {dc['steps']} steps "
          f"({dc['steps'] / n_epoch:.1f} epochs)", flush=True)
    model.train()
    t0, tokens = time.time(), 0
    while step < dc["steps"]:
        (x, m, valid, ti, tv), ep = batch_at(step)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits = model(input_ids=x).logits
        soft, hard = losses(logits, x, m, valid, ti, tv)
        loss = soft + dc["hard_weight"] * hard
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), dc["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += int(valid.sum())
        if step % 10 == 0:
            print(f"step {step} epoch {ep} soft {soft.item():.3f} hard {hard.item():.3f} lr {lr_at(step):.2e} "
                  f"{tokens / (time.time() - t0):.0f} tok/s", flush=True)
        if step % dc["eval_every"] == 0 or step == dc["steps"]:
            model.eval()
            acc, nll = agreement(model, eval_rows, eval_next)
            model.train()
            elapsed = elapsed0 + time.time() - t0
            rec = {"step": step, "epoch": ep, "soft_ce": round(soft.item(), 4), "hard_ce": round(hard.item(), 4),
                   "heldout_top1_agreement": round(acc, 4), "heldout_reply_ce": round(nll, 4),
                   "elapsed_s": round(elapsed, 1), "time": time.time()}
            atomic.append(log_path, (json.dumps(rec) + "\n").encode(), 0o644)
            print(rec, flush=True)
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed_s": elapsed}
            atomic.write_with(ckpt, lambda tmp: torch.save(state, tmp))
    out = work / "draft"
    model.config.use_cache = True
    model.config.clover_draft = {"target": "tiny", "embedding_init": f"target SVD top-{dc['arch']['hidden_size']}",
                                 "embedding_energy_kept": round(kept, 4)}
    model.save_pretrained(out)  # not atomic: a crash here is undone by running again (from the checkpoint)
    tok.save_pretrained(out)  # not atomic: see above
    print(f"saved {out}", flush=True)


if __name__ == "__main__":
    main()
