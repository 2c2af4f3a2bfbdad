"""`clover train`: distill Clover-2 (or Medusa) draft heads for a target model.

    data      ShareGPT conversations, rendered with the target's chat template; loss on assistant tokens only;
              a fixed held-out split (by conversation id) is never trained on. --regenerate replaces the assistant
              turns with the target's own greedy replies (self-distillation).
    features  the target runs once per batch (or once, into a safetensors shard cache, with --cache-features):
              last hidden states before and after its final norm; its distributions come from lm_head(after).
    loss      head i at position t predicts token t+2+i:
                  soft cross-entropy against softmax(lm_head(h_{t+1+i}))  +  reg_weight * SmoothL1(o_i, h_{t+1+i})
              weighted 0.7^i, over positions whose predicted token is an assistant token.
    optimiser AdamW (0.9, 0.95), linear warmup then cosine decay, grad-norm clip 0.5, bf16 autocast on GPU;
              `accelerate launch clover train ...` spreads batches over GPUs.
    output    a heads directory (config.json, model.safetensors, README.md model card) loadable with --heads DIR,
              plus checkpoint/ for --resume. Ctrl-C leaves the last complete checkpoint intact.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .errors import CloverError

EVAL_PROMPTS = 4
EVAL_NEW_TOKENS = 64
MARKER = "clover-train.json"


@dataclass
class TrainConfig:
    model: str
    out: Path
    data: str = "sharegpt"
    arch: str = "clover"
    max_steps: int | None = None
    epochs: float = 1.0
    num_heads: int = 5
    num_layers: int = 2
    lr: float = 1e-3
    batch_tokens: int = 8192
    max_len: int = 1024
    eval_every: int = 200
    max_conversations: int | None = None
    regenerate: bool = False
    cache_features: bool = False
    resume: bool = False
    overwrite: bool = False
    push_to_hub: str | None = None
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    revision: str | None = None
    trust_remote_code: bool = False
    draft_vocab: int = 32768
    regen_turns: int = 4
    regen_max_tokens: int = 256
    reg_weight: float = 1.0
    decay: float = 0.7
    warmup_frac: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 0.5


def validate(cfg: TrainConfig):
    if cfg.arch not in ("clover", "medusa"):
        raise CloverError(f"--arch must be clover or medusa, not {cfg.arch!r}")
    if not 1 <= cfg.num_heads <= 16:
        raise CloverError(f"--heads must be between 1 and 16, not {cfg.num_heads}")
    if cfg.arch == "clover" and not 1 <= cfg.num_layers <= 8:
        raise CloverError(f"--layers must be between 1 and 8, not {cfg.num_layers}")
    if not (math.isfinite(cfg.lr) and 0 < cfg.lr <= 1):
        raise CloverError(f"--lr must be in (0, 1], not {cfg.lr}")
    if cfg.max_len < 16:
        raise CloverError(f"--max-len must be at least 16, not {cfg.max_len}")
    if cfg.batch_tokens < cfg.max_len:
        raise CloverError(f"--batch-tokens ({cfg.batch_tokens}) must be at least --max-len ({cfg.max_len})")
    if cfg.max_steps is not None and cfg.max_steps < 1:
        raise CloverError(f"--max-steps must be at least 1, not {cfg.max_steps}")
    if not (math.isfinite(cfg.epochs) and cfg.epochs > 0):
        raise CloverError(f"--epochs must be positive, not {cfg.epochs}")
    if cfg.eval_every < 1:
        raise CloverError(f"--eval-every must be at least 1, not {cfg.eval_every}")
    if cfg.draft_vocab < 0:
        raise CloverError(f"--draft-vocab must be 0 (the whole vocabulary) or positive, not {cfg.draft_vocab}")
    if not 1 <= cfg.regen_turns <= 64:
        raise CloverError(f"--regen-turns must be between 1 and 64, not {cfg.regen_turns}")
    if not 1 <= cfg.regen_max_tokens < cfg.max_len:
        raise CloverError(f"--regen-max-tokens must be between 1 and --max-len - 1, not {cfg.regen_max_tokens}")
    if cfg.max_conversations is not None and cfg.max_conversations < 1:
        raise CloverError(f"--max-conversations must be at least 1, not {cfg.max_conversations}")


def prepare_out(cfg: TrainConfig) -> bool:
    """Check --out; returns True when resuming from a checkpoint there."""
    from .heads import is_heads_dir

    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise CloverError(f"--out {out} is a file, not a directory")
    ours = out.is_dir() and ((out / MARKER).is_file() or is_heads_dir(out))
    if out.is_dir() and any(out.iterdir()):
        if not ours and not cfg.overwrite:
            raise CloverError(f"--out {out} exists and is not a heads directory (pass --overwrite to write into it)")
        if ours and not (cfg.resume or cfg.overwrite):
            raise CloverError(f"--out {out} already holds heads: pass --resume to continue or --overwrite")
    if cfg.resume:
        if _checkpoint_dir(out) is None:
            raise CloverError(f"--resume: no checkpoint in {out}")
        return True
    if ours and cfg.overwrite:
        for name in ("checkpoint", "checkpoint-old", "checkpoint-new", "features", "model.safetensors"):
            p = out / name
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    return False


def _checkpoint_dir(out: Path) -> Path | None:
    for name in ("checkpoint", "checkpoint-old"):
        if (out / name / "state.json").is_file():
            return out / name
    return None


# ----------------------------------------------------------------------------------------------------- data

def load_data(cfg: TrainConfig, tokenizer, template: str):
    """(train, held-out) lists of conversations (messages)."""
    from .data import is_heldout, iter_conversations

    train, held = [], []
    for conv_id, messages in iter_conversations(cfg.data):
        if not any(m["role"] == "assistant" for m in messages):
            continue
        (held if is_heldout(conv_id) else train).append(messages)
        if cfg.max_conversations and len(train) >= cfg.max_conversations and len(held) >= EVAL_PROMPTS:
            break
    if not train and not held:
        raise CloverError(f"{cfg.data}: no conversations with assistant turns")
    if not train:  # a tiny file can hash entirely into the held-out bucket: keep one conversation for eval
        train, held = held[1:] or held, held[:1]
    if cfg.max_conversations:
        train = train[: cfg.max_conversations]
    return train, held


def encode(conversations, tokenizer, template: str, max_len: int):
    from .data import tokenize_conversation

    ids, masks = [], []
    for messages in conversations:
        i, m = tokenize_conversation(tokenizer, messages, template, max_len)
        if sum(m) > 0 and len(i) >= 3:
            ids.append(i)
            masks.append(m)
    return ids, masks


def regenerate(cfg: TrainConfig, model, tokenizer, template: str, stop_strings, conversations, device, log,
               target_box: dict):
    """Self-distillation: replace each assistant turn with the target's own greedy reply.

    Turn by turn, so later turns see the target's earlier replies; at most cfg.regen_turns turns, each at most
    cfg.regen_max_tokens tokens. On a CPU each reply comes from clover's own engine with the n-gram drafter (greedy
    is lossless, and one sequence at a time beats padded batches there); on a GPU from batched transformers
    generate over prompts sorted by length. Finished conversations are appended to --out/regenerated.jsonl, so an
    interrupted run resumes where it stopped.
    """
    from .session import strip_stop
    from .templates import render

    cache = Path(cfg.out) / "regenerated.jsonl"
    done = []
    if cache.is_file():
        done = [json.loads(line) for line in cache.read_text().split("\n") if line.strip()]
    convs = [m[: 2 * cfg.regen_turns + (m[0]["role"] == "system")] for m in conversations]
    if len(done) >= len(convs):
        return done[: len(convs)]
    eos = {i for i in (tokenizer.eos_token_id,) if i is not None}

    def prompt_ids(messages, a):
        text = render(tokenizer, messages[:a], template, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"][-(cfg.max_len - cfg.regen_max_tokens):]

    def replies_engine(prompts):
        from .drafters.ngram import NgramDrafter
        from .engine import Engine, StopCheck

        if target_box.get("target") is None:
            from .target import Target

            target_box["target"] = Target(model)
        engine = Engine(target_box["target"], NgramDrafter(), budget=32, auto_budget=True)
        outs = []
        for ids in prompts:
            stop = StopCheck(cfg.regen_max_tokens, eos, stop_strings,
                             lambda t: tokenizer.decode(t, skip_special_tokens=False))
            outs.append([tok for ev in engine.generate(ids, stop) for tok in ev.tokens])
        return outs

    def replies_batched(prompts):
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (min(eos) if eos else 0)
        order = sorted(range(len(prompts)), key=lambda k: len(prompts[k]))
        outs = [None] * len(prompts)
        for b in range(0, len(order), 32):
            rows = order[b:b + 32]
            width = max(len(prompts[k]) for k in rows)
            x = torch.full((len(rows), width), pad, dtype=torch.long)
            att = torch.zeros_like(x)
            for r, k in enumerate(rows):  # left padding
                x[r, width - len(prompts[k]):] = torch.tensor(prompts[k])
                att[r, width - len(prompts[k]):] = 1
            model.set_attn_implementation("sdpa")
            try:
                with torch.no_grad():
                    out = model.generate(input_ids=x.to(device), attention_mask=att.to(device), do_sample=False,
                                         max_new_tokens=cfg.regen_max_tokens, pad_token_id=pad,
                                         eos_token_id=sorted(eos) or None)
            finally:
                from .target import ATTN_NAME

                model.set_attn_implementation(ATTN_NAME)
            for r, k in enumerate(rows):
                outs[k] = out[r, width:].tolist()
        return outs

    generate = replies_engine if device.type == "cpu" else replies_batched
    chunk_size = 8 if device.type == "cpu" else 256
    t0 = time.time()
    todo = convs[len(done):]
    for c0 in range(0, len(todo), chunk_size):
        chunk = [list(c) for c in todo[c0:c0 + chunk_size]]
        for turn in range(cfg.regen_turns):
            where = [(k, _assistant_index(c, turn)) for k, c in enumerate(chunk)]
            where = [(k, a) for k, a in where if a is not None]
            if not where:
                break
            outs = generate([prompt_ids(chunk[k], a) for k, a in where])
            for (k, a), ids in zip(where, outs):
                reply = strip_stop(tokenizer.decode(ids, skip_special_tokens=True), stop_strings).strip()
                chunk[k][a] = {"role": "assistant", "content": reply}
        with cache.open("a") as f:
            for c in chunk:
                f.write(json.dumps(c, ensure_ascii=False) + "\n")
        done.extend(chunk)
        log(f"regenerated {len(done)}/{len(convs)} conversations ({time.time() - t0:.0f}s)")
    return done


def _assistant_index(messages, turn: int):
    seen = 0
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            if seen == turn:
                return i
            seen += 1
    return None


def draft_vocabulary(ids, masks, vocab_size: int, size: int) -> torch.Tensor | None:
    """The `size` tokens used most in the training replies (then by id), or None for the whole vocabulary."""
    if size <= 0 or size >= vocab_size:
        return None
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i, m in zip(ids, masks):
        t = torch.tensor(i)[torch.tensor(m, dtype=torch.bool)]
        counts += torch.bincount(t, minlength=vocab_size)[:vocab_size]
    order = sorted(range(vocab_size), key=lambda v: (-int(counts[v]), v))
    return torch.tensor(order[:size], dtype=torch.long)


def make_batches(lengths: list[int], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Group conversations of similar length so that (rows x longest) stays within batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    batches, cur, longest = [], [], 0
    for i in order:
        longest_new = max(longest, lengths[i])
        if cur and longest_new * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, longest_new = [], lengths[i]
        cur.append(i)
        longest = longest_new
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(ids, masks, rows, device):
    T = max(len(ids[i]) for i in rows)
    x = torch.zeros(len(rows), T, dtype=torch.long)
    m = torch.zeros(len(rows), T, dtype=torch.float32)
    for r, i in enumerate(rows):
        x[r, :len(ids[i])] = torch.tensor(ids[i])
        m[r, :len(masks[i])] = torch.tensor(masks[i], dtype=torch.float32)
    return x.to(device), m.to(device)


class FeatureCache:
    """--cache-features: the target's hidden states per conversation, in safetensors shards under --out/features."""

    def __init__(self, root: Path, model, ids, device, dtype):
        self.root, self.model, self.ids, self.device, self.dtype = root, model, ids, device, dtype
        self.root.mkdir(parents=True, exist_ok=True)
        self.shard_size = 256
        self.loaded: dict[int, dict] = {}

    def _shard_path(self, s: int) -> Path:
        return self.root / f"shard_{s:05d}.safetensors"

    def _ensure(self, s: int):
        from safetensors.torch import load_file, save_file

        if s in self.loaded:
            return
        path = self._shard_path(s)
        if not path.is_file():
            tensors = {}
            for i in range(s * self.shard_size, min(len(self.ids), (s + 1) * self.shard_size)):
                x = torch.tensor([self.ids[i]], device=self.device)
                with torch.no_grad(), _autocast(self.device):
                    pre, post = _hidden(self.model, x)
                tensors[f"{i}.pre"] = pre[0].to(self.dtype).cpu()
                tensors[f"{i}.post"] = post[0].to(self.dtype).cpu()
            tmp = path.with_suffix(".tmp")
            save_file(tensors, str(tmp))
            tmp.replace(path)
        self.loaded = {s: load_file(str(path))}

    def get(self, rows):
        T = max(len(self.ids[i]) for i in rows)
        pres, posts = [], []
        for i in rows:
            self._ensure(i // self.shard_size)
            shard = self.loaded[i // self.shard_size]
            pre, post = shard[f"{i}.pre"], shard[f"{i}.post"]
            pres.append(F.pad(pre, (0, 0, 0, T - pre.shape[0])))
            posts.append(F.pad(post, (0, 0, 0, T - post.shape[0])))
        return (torch.stack(pres).to(self.device, torch.float32), torch.stack(posts).to(self.device, torch.float32))


def _autocast(device):
    """bf16 autocast on GPUs, and on CPUs with native bf16 instructions (AVX512-BF16/AMX); fp32 elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    native = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)() or \
        getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(native))


def _hidden(model, x):
    from .target import hidden_states

    return hidden_states(model, x)


# ----------------------------------------------------------------------------------------------------- loss

def heads_loss(heads, arch: str, model, x, mask, pre, post, cfg: TrainConfig):
    """Total loss and per-head (loss, top-1 agreement with the target, positions) for one batch."""
    B, T = x.shape
    lm_head = model.get_output_embeddings()
    if arch == "clover":
        pos = torch.arange(T, device=x.device)[None].expand(B, T)
        rope = model.base_model.rotary_emb(pre, pos)
        outs = heads.forward_train(pre, x, model.get_input_embeddings(), rope, pos)
    else:
        outs = heads.forward_train(post)
    # The target's distribution at every position whose next token is an assistant token, computed once and
    # shared by all heads (head i reads it i positions further on). The soft cross-entropy of a head output o is
    #     -sum_v p(v) log q(v) = logsumexp(W o) - sum_v p(v) (W o)_v = logsumexp(W o) - (p W) . o
    # so the target side reduces to its expected output embedding pW, one [H] vector per position.
    need = torch.zeros_like(mask, dtype=torch.bool)
    need[:, :-1] = mask[:, 1:] > 0
    with torch.no_grad():
        t_logits = lm_head(post[need].to(lm_head.weight.dtype)).float()
        t_arg = t_logits.argmax(-1)
        t_prob = torch.softmax(t_logits, -1)
        del t_logits
        t_emb = t_prob @ lm_head.weight.float()
        t_bias = t_prob @ lm_head.bias.float() if getattr(lm_head, "bias", None) is not None else None
        del t_prob
        row_of = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
        row_of[need] = torch.arange(t_emb.shape[0], device=mask.device)
    total = pre.new_zeros(())
    per_head = []
    for i, out in enumerate(outs):
        n = T - 2 - i
        m = mask[:, 2 + i:2 + i + n] > 0 if n > 0 else None  # the token predicted at t is t+2+i
        if m is None or not m.any():
            per_head.append((0.0, 0.0, 0))
            continue
        student = out[:, :n][m]
        teacher = post[:, 1 + i:1 + i + n][m]
        rows = row_of[:, 1 + i:1 + i + n][m]
        s_logits = lm_head(student.to(lm_head.weight.dtype))
        dot = (t_emb[rows] * student.float()).sum(-1) + (t_bias[rows] if t_bias is not None else 0.0)
        ce = (torch.logsumexp(s_logits.float(), -1) - dot).mean()
        reg = F.smooth_l1_loss(student.float(), teacher.float(), reduction="none").mean(-1).mean()
        loss_i = ce + cfg.reg_weight * reg
        total = total + (cfg.decay ** i) * loss_i
        acc = (s_logits.argmax(-1) == t_arg[rows]).float().mean().item()
        per_head.append((loss_i.item(), acc, int(m.sum())))
    return total, per_head


# ----------------------------------------------------------------------------------------------------- eval

@torch.no_grad()
def evaluate(heads, cfg, model, tokenizer, template, held_ids, held_masks, held_msgs, device, target_box):
    """Per-head top-1 agreement on held-out conversations, and τ of the real engine on held-out prompts."""
    import copy

    from .drafters.heads import CloverDrafter, MedusaDrafter
    from .engine import Engine, StopCheck
    from .session import RunStats
    from .target import Target
    from .templates import render

    heads.eval()
    agree = [[0.0, 0] for _ in range(cfg.num_heads)]
    for k in range(0, min(len(held_ids), 64), 8):
        rows = list(range(k, min(k + 8, len(held_ids), 64)))
        x, m = collate(held_ids, held_masks, rows, device)
        with _autocast(device):
            pre, post = _hidden(model, x)
            _, per_head = heads_loss(heads, cfg.arch, model, x, m, pre.float(), post.float(), cfg)
        for i, (_, acc, n) in enumerate(per_head):
            agree[i][0] += acc * n
            agree[i][1] += n
    accuracy = [a / n if n else 0.0 for a, n in agree]

    if target_box.get("target") is None:
        target_box["target"] = Target(model)
    target = target_box["target"]
    dtype = model.get_input_embeddings().weight.dtype
    draft_heads = copy.deepcopy(heads).to(dtype).eval()
    cls = CloverDrafter if cfg.arch == "clover" else MedusaDrafter
    engine = Engine(target, cls(draft_heads, target), budget=24, auto_budget=False)
    stats = RunStats()
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for messages in held_msgs[:EVAL_PROMPTS]:
        first_user = next((j for j, msg in enumerate(messages) if msg["role"] == "user"), None)
        if first_user is None:
            continue
        text = render(tokenizer, messages[:first_user + 1], template, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][-(cfg.max_len // 2):]
        room = min(EVAL_NEW_TOKENS, target.max_context - len(ids) - 30)
        if room < 2:
            continue
        for ev in engine.generate(ids, StopCheck(room, eos)):
            stats.add(ev)
    engine.reset()
    heads.train()
    return {"accuracy": accuracy, "tau": stats.tau, "accept_by_depth": stats.accept_by_depth}


# ----------------------------------------------------------------------------------------------------- main

def run_training(cfg: TrainConfig):
    validate(cfg)
    resuming = prepare_out(cfg)
    from .heads import HeadsConfig, build_heads, save_heads
    from .hub import resolve_model
    from .loading import load
    from .templates import STOP_STRINGS, chat_template

    try:
        from accelerate import Accelerator
    except ImportError:
        raise CloverError("clover train needs accelerate: pip install accelerate")

    out = Path(cfg.out)
    (out / MARKER).write_text(json.dumps({k: str(v) if isinstance(v, Path) else v
                                          for k, v in asdict(cfg).items()}, indent=2) + "\n")
    want_cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
    accelerator = Accelerator(cpu=want_cpu, mixed_precision="no")
    device = accelerator.device
    log = _logger(accelerator)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    resolved = resolve_model(cfg.model, cfg.revision, quiet=not accelerator.is_main_process)
    loaded = load(resolved.path, device=str(device), dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
    model, tokenizer = loaded.model, loaded.tokenizer
    model.requires_grad_(False)
    spec = resolved.spec
    template_name, template = chat_template(tokenizer, spec.template if spec else None)
    stop_strings = STOP_STRINGS.get(template_name) or STOP_STRINGS.get(spec.template if spec else "", [])

    target_box: dict = {}  # one Target wrapper (our cache + attention) for regeneration and evaluation
    train_msgs, held_msgs = load_data(cfg, tokenizer, template)
    if cfg.regenerate:
        train_msgs = regenerate(cfg, model, tokenizer, template, stop_strings, train_msgs, device, log, target_box)
    ids, masks = encode(train_msgs, tokenizer, template, cfg.max_len)
    held_ids, held_masks = encode(held_msgs, tokenizer, template, cfg.max_len)
    if not ids:
        raise CloverError(f"{cfg.data}: no assistant tokens to train on")
    n_tokens = sum(len(i) for i in ids)
    log(f"{len(ids)} training conversations ({n_tokens} tokens), {len(held_ids)} held out")

    per_epoch = len(make_batches([len(i) for i in ids], cfg.batch_tokens, random.Random(0)))
    total_steps = cfg.max_steps or max(1, int(math.ceil(per_epoch * cfg.epochs)))
    total_steps = max(1, total_steps // accelerator.num_processes) if cfg.max_steps is None else total_steps

    hcfg = HeadsConfig.for_target(model.config, architecture="clover2" if cfg.arch == "clover" else "medusa",
                                  num_heads=cfg.num_heads, num_layers=cfg.num_layers, name=resolved.name,
                                  revision=cfg.revision)
    vocab = draft_vocabulary(ids, masks, model.config.vocab_size, cfg.draft_vocab)
    hcfg.draft_vocab_size = 0 if vocab is None else len(vocab)
    heads = build_heads(hcfg, model)
    heads.init_from_target(model)
    heads.draft_vocab = None if vocab is None else vocab.to(device)
    heads.to(device=device, dtype=torch.float32).train()
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    warmup = max(1, int(cfg.warmup_frac * total_steps))

    def lr_lambda(step):
        if step < warmup:
            return (step + 1) / warmup
        frac = (step - warmup) / max(1, total_steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    heads, opt = accelerator.prepare(heads, opt)
    step, history = 0, []
    if resuming:
        step, history = _load_checkpoint(_checkpoint_dir(out), accelerator.unwrap_model(heads), opt, sched)
        log(f"resumed from step {step}")
    features = FeatureCache(out / "features", model, ids, device, torch.bfloat16 if device.type == "cuda"
                            else torch.float32) if cfg.cache_features else None

    t_start, tokens_seen, last = time.time(), 0, {}
    epoch = step // max(1, per_epoch)
    batches = make_batches([len(i) for i in ids], cfg.batch_tokens, random.Random(cfg.seed + epoch))
    batches = batches[accelerator.process_index::accelerator.num_processes]
    cursor = step % max(1, len(batches))
    progress = _Progress(total_steps, step, accelerator.is_main_process)
    try:
        while step < total_steps:
            if cursor >= len(batches):
                epoch += 1
                batches = make_batches([len(i) for i in ids], cfg.batch_tokens, random.Random(cfg.seed + epoch))
                batches = batches[accelerator.process_index::accelerator.num_processes]
                cursor = 0
            rows = batches[cursor]
            cursor += 1
            x, m = collate(ids, masks, rows, device)
            with torch.no_grad(), _autocast(device):
                if features is not None:
                    pre, post = features.get(rows)
                else:
                    pre, post = _hidden(model, x)
            with _autocast(device):
                loss, per_head = heads_loss(heads, cfg.arch, model, x, m, pre.float(), post.float(), cfg)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(heads.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += x.numel()
            last = {"step": step, "loss": loss.item(), "acc": [round(a, 4) for _, a, _ in per_head],
                    "tok_s": tokens_seen / max(1e-9, time.time() - t_start), "lr": sched.get_last_lr()[0]}
            progress.update(step, last)
            if step % cfg.eval_every == 0 or step == total_steps:
                if accelerator.is_main_process:
                    ev = evaluate(accelerator.unwrap_model(heads), cfg, model, tokenizer, template, held_ids,
                                  held_masks, held_msgs, device, target_box)
                    rec = {"step": step, "train_loss": round(last["loss"], 4),
                           "heldout_accuracy": [round(a, 4) for a in ev["accuracy"]],
                           "heldout_tau": round(ev["tau"], 3),
                           "accept_by_depth": [round(a, 3) for a in ev["accept_by_depth"]],
                           "elapsed_s": round(time.time() - t_start, 1)}
                    history.append(rec)
                    progress.note(f"eval step {step}: held-out top-1 {rec['heldout_accuracy']} "
                                  f"τ {rec['heldout_tau']}")
                    _save_checkpoint(out, accelerator.unwrap_model(heads), opt, sched, step, history)
                accelerator.wait_for_everyone()
    except torch.cuda.OutOfMemoryError:
        raise CloverError(f"out of GPU memory at step {step}; try a smaller --batch-tokens (now "
                          f"{cfg.batch_tokens}) or --max-len")
    except KeyboardInterrupt:
        progress.close()
        done = _checkpoint_dir(out)
        where = f"; the checkpoint in {done} is intact: continue with --resume" if done else ""
        sys.stderr.write(f"\nclover: training interrupted at step {step}{where}\n")
        raise SystemExit(130)
    progress.close()

    if accelerator.is_main_process:
        final = history[-1] if history else {}
        unwrapped = accelerator.unwrap_model(heads)
        unwrapped.cfg.training = {"data": cfg.data, "steps": step, "regenerate": cfg.regenerate,
                                  "conversations": len(ids), "tokens_per_epoch": n_tokens, "lr": cfg.lr,
                                  "batch_tokens": cfg.batch_tokens, "max_len": cfg.max_len,
                                  "heldout_accuracy": final.get("heldout_accuracy"),
                                  "heldout_tau": final.get("heldout_tau"),
                                  "accept_by_depth": final.get("accept_by_depth"),
                                  "elapsed_s": round(time.time() - t_start, 1)}
        save_heads(unwrapped, out, model_card(unwrapped.cfg, resolved.name, history))
        log(f"heads written to {out} (held-out τ {final.get('heldout_tau')}, top-1 "
            f"{final.get('heldout_accuracy')})")
        if cfg.push_to_hub:
            push(out, cfg.push_to_hub)
            log(f"pushed to {cfg.push_to_hub}")


def model_card(hcfg, target_name: str, history: list[dict]) -> str:
    t = hcfg.training
    arch = "Clover-2" if hcfg.architecture == "clover2" else "Medusa-1"
    rows = "\n".join(f"| {h['step']} | {h['train_loss']} | {h['heldout_accuracy']} | {h['heldout_tau']} |"
                     for h in history)
    return f"""# {arch} draft heads for {target_name}

Made with `clover train` (clover). Load with `clover chat {target_name} --heads <this directory>`.

- architecture: {hcfg.architecture}, {hcfg.num_heads} heads{f", {hcfg.num_layers} augmenting layers"
                                                          if hcfg.architecture == "clover2" else ""}
- target: {target_name} (hidden {hcfg.hidden_size}, vocabulary {hcfg.vocab_size})
- data: {t.get('data')}{' (assistant turns regenerated by the target)' if t.get('regenerate') else ''},
  {t.get('conversations')} conversations, {t.get('tokens_per_epoch')} tokens per epoch
- steps: {t.get('steps')}, peak lr {t.get('lr')}, {t.get('batch_tokens')} tokens per batch, max length
  {t.get('max_len')}, {t.get('elapsed_s')} s

Measured on the fixed held-out split (top-1 agreement of each head with the target; τ = tokens per target
forward of the real engine, greedy, {EVAL_PROMPTS} prompts x {EVAL_NEW_TOKENS} tokens, 24-node dynamic tree):

| step | train loss | held-out top-1 per head | held-out τ |
|---|---|---|---|
{rows}
"""


def push(out: Path, repo: str):
    from huggingface_hub import HfApi
    # the HTTP client's base error (httpx in huggingface_hub 1.x, httpx2 in 2.x): both HfHubHTTPError and a
    # connection error (refused, timed out, unknown host), which huggingface_hub raises as it is
    from huggingface_hub.errors import HTTPError

    api = HfApi()
    try:
        api.create_repo(repo, exist_ok=True)
        api.upload_folder(repo_id=repo, folder_path=str(out),
                          allow_patterns=["config.json", "model.safetensors", "README.md"])
    except (HTTPError, OSError) as e:
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise CloverError(f"could not push to {repo}: {why} (the heads are saved in {out})")


def _save_checkpoint(out: Path, heads, opt, sched, step: int, history: list):
    from safetensors.torch import save_file

    new, cur, old = out / "checkpoint-new", out / "checkpoint", out / "checkpoint-old"
    shutil.rmtree(new, ignore_errors=True)
    new.mkdir()
    save_file({k: v.detach().cpu().contiguous() for k, v in heads.state_dict().items()},
              str(new / "heads.safetensors"))
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, new / "optimizer.pt")
    (new / "state.json").write_text(json.dumps({"step": step, "history": history}))
    shutil.rmtree(old, ignore_errors=True)
    if cur.exists():
        os.replace(cur, old)
    os.replace(new, cur)
    shutil.rmtree(old, ignore_errors=True)


def _load_checkpoint(path: Path, heads, opt, sched):
    from safetensors.torch import load_file

    state = json.loads((path / "state.json").read_text())
    heads.load_state_dict(load_file(str(path / "heads.safetensors")))
    saved = torch.load(path / "optimizer.pt", weights_only=False)
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    return state["step"], state["history"]


def _logger(accelerator):
    def log(msg: str):
        if accelerator.is_main_process:
            sys.stderr.write(msg + "\n")
            sys.stderr.flush()

    return log


class _Progress:
    """A rich progress bar on a terminal; plain lines every 10 steps otherwise."""

    def __init__(self, total: int, start: int, enabled: bool):
        self.enabled, self.bar = enabled, None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                                console=Console(stderr=True))
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
            self.bar.start()

    def update(self, step: int, last: dict):
        if not self.enabled:
            return
        info = (f"loss {last['loss']:.3f} · top-1 {' '.join(f'{a:.2f}' for a in last['acc'])} · "
                f"{last['tok_s']:.0f} tok/s")
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        elif step % 10 == 0 or step == 1:
            sys.stderr.write(f"step {step}: {info}\n")
            sys.stderr.flush()

    def note(self, text: str):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.console.print(text)
        else:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()

    def close(self):
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
