"""Recipe for the bundled `tiny` chat model, part 1: tokenizer and target, trained from scratch on ShareGPT.

    python scripts/tiny/train_target.py --work runs/tiny          # tokenizer, data, target (resumable)

Writes runs/tiny/target/ (a standard transformers Llama directory with tokenizer and Vicuna v1.1 template) and
runs/tiny/target/train_log.jsonl. Part 2 (the heads) is `clover train`: see scripts/tiny/build.sh.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch

from clover_cli import atomic, torchload
from clover_cli.data import ascii_share, is_heldout, iter_conversations, tokenize_conversation
from clover_cli.templates import VICUNA_V11

HERE = Path(__file__).parent


def build_tokenizer(out: Path, texts, cfg):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg["vocab_size"], special_tokens=cfg["special_tokens"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=VICUNA_V11,
        model_max_length=2048, clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out)  # not atomic: prepare() redoes it until data.npz, written last, exists
    return fast


def prepare(work: Path, recipe: dict):
    """Tokenizer plus tokenised train/held-out conversations, cached in work/."""
    tok_dir = work / "target"
    data_file = work / "data.npz"
    if data_file.exists():
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(tok_dir), dict(np.load(data_file))
    convs = [(cid, m) for cid, m in iter_conversations("sharegpt") if ascii_share(m) >= recipe["ascii_share_min"]]
    train = [m for cid, m in convs if not is_heldout(cid)]
    held = [m for cid, m in convs if is_heldout(cid)]
    print(f"conversations: {len(train)} train, {len(held)} held out", flush=True)
    from transformers import PreTrainedTokenizerFast

    proto = PreTrainedTokenizerFast(tokenizer_object=_bootstrap(), bos_token="<s>", eos_token="</s>")
    texts = (proto.apply_chat_template(m, chat_template=VICUNA_V11, tokenize=False) for m in train)
    t0 = time.time()
    tok = build_tokenizer(tok_dir, texts, recipe["tokenizer"])
    print(f"tokenizer trained in {time.time() - t0:.0f}s", flush=True)
    arrays = {}
    for name, part in (("train", train), ("held", held)):
        ids, mask, starts = [], [], []
        for m in part:
            i, k = tokenize_conversation(tok, m, VICUNA_V11)
            starts.append(len(ids))
            ids.extend(i)
            mask.extend(k)
        arrays[f"{name}_ids"] = np.asarray(ids, dtype=np.uint16)
        arrays[f"{name}_mask"] = np.asarray(mask, dtype=np.uint8)
        arrays[f"{name}_starts"] = np.asarray(starts, dtype=np.int64)
        print(f"{name}: {len(ids)} tokens, {sum(mask)} assistant tokens", flush=True)

    def fill(tmp: Path):
        with tmp.open("wb") as tmp_file:  # a file object: given a name, savez would add .npz to it
            np.savez(tmp_file, **arrays)

    atomic.write_with(data_file, fill)
    return tok, arrays


def _bootstrap():
    """A throwaway tokenizer that only knows the special tokens, used to render templates before training."""
    from tokenizers import Tokenizer, models

    t = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    t.add_special_tokens(["<unk>", "<s>", "</s>"])
    return t


def batches(ids, mask, seq_len, batch_size, rng):
    n = len(ids) - seq_len - 1
    while True:
        starts = rng.integers(0, n, size=batch_size)
        x = np.stack([ids[s: s + seq_len + 1] for s in starts]).astype(np.int64)
        m = np.stack([mask[s: s + seq_len + 1] for s in starts]).astype(np.float32)
        yield torch.from_numpy(x), torch.from_numpy(m)


@torch.no_grad()
def evaluate(model, arrays, n_conv, seq_len):
    """Mean loss on assistant tokens of the first n held-out conversations (each cut to seq_len)."""
    model.eval()
    ids, mask, starts = arrays["held_ids"], arrays["held_mask"], arrays["held_starts"]
    ends = list(starts[1:]) + [len(ids)]
    tot, cnt = 0.0, 0
    for s, e in list(zip(starts, ends))[:n_conv]:
        x = torch.from_numpy(ids[s: min(e, s + seq_len + 1)].astype(np.int64))[None]
        m = torch.from_numpy(mask[s: min(e, s + seq_len + 1)].astype(np.float32))[None, 1:]
        if m.sum() == 0:
            continue
        logits = model(input_ids=x[:, :-1]).logits.float()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")
        tot += (nll * m).sum().item()
        cnt += m.sum().item()
    model.train()
    return tot / max(cnt, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="runs/tiny")
    ap.add_argument("--recipe", default=str(HERE / "recipe.json"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    recipe = json.loads(Path(args.recipe).read_text())
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    random.seed(recipe["seed"])
    torch.manual_seed(recipe["seed"])
    tok, arrays = prepare(work, recipe)

    from transformers import LlamaConfig, LlamaForCausalLM

    pc = recipe["pretrain"]
    cfg = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=None, **recipe["target"])
    model = LlamaForCausalLM(cfg)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": pc["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=pc["lr"], betas=tuple(pc["betas"]))
    ckpt = work / "target_ckpt.pt"
    step = 0
    log_path = work / "train_log.jsonl"
    if ckpt.exists():
        state = torchload.load(ckpt, "checkpoint")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        print(f"resumed at step {step}", flush=True)
    rng = np.random.default_rng(recipe["seed"] + step)
    print(f"target: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)

    def lr_at(s):
        if s < pc["warmup_steps"]:
            return pc["lr"] * (s + 1) / pc["warmup_steps"]
        frac = (s - pc["warmup_steps"]) / max(1, pc["steps"] - pc["warmup_steps"])
        return pc["lr"] * (pc["min_lr_ratio"] + (1 - pc["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * frac)))

    all_mask = np.ones_like(arrays["train_mask"])
    data_all = batches(arrays["train_ids"], all_mask, pc["seq_len"], pc["batch_size"], rng)
    data_asst = batches(arrays["train_ids"], arrays["train_mask"], pc["seq_len"], pc["batch_size"], rng)
    model.train()
    t0, tokens = time.time(), 0
    while step < pc["steps"]:
        x, m = next(data_asst if step >= pc["assistant_only_from_step"] else data_all)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x[:, :-1]).logits
        nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), x[:, 1:], reduction="none")
        w = m[:, 1:]
        loss = (nll * w).sum() / w.sum().clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), pc["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += x.numel()
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.3f} lr {lr_at(step):.2e} "
                  f"{tokens / (time.time() - t0):.0f} tok/s", flush=True)
        if step % pc["eval_every"] == 0 or step == pc["steps"]:
            held = evaluate(model, arrays, pc["eval_conversations"], pc["seq_len"])
            rec = {"step": step, "train_loss": loss.item(), "heldout_assistant_loss": held,
                   "heldout_ppl": math.exp(held), "elapsed_s": time.time() - t0, "time": time.time()}
            atomic.append(log_path, (json.dumps(rec) + "\n").encode(), 0o644)
            print(rec, flush=True)
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}
            atomic.write_with(ckpt, lambda tmp: torch.save(state, tmp))
    out = work / "target"
    model.config.use_cache = True
    # not atomic: transformers writes the directory; a crash here is undone by running again (from the checkpoint)
    model.save_pretrained(out)  # not atomic: see above
    tok.save_pretrained(out)  # not atomic: see above
    print(f"saved {out}", flush=True)


if __name__ == "__main__":
    main()
