"""`clover train`: distill Clover-2 (or Medusa, or EAGLE) draft heads for a target model.

    data      ShareGPT conversations, rendered with the target's chat template; loss on assistant tokens only;
              a fixed held-out split (by conversation id) is never trained on. --regenerate replaces the assistant
              turns with the target's own greedy replies (self-distillation).
    features  the target runs once per batch (or once, into a safetensors shard cache, with --cache-features):
              last hidden states before and after its final norm; its distributions come from lm_head(after).
    loss      head i at position t predicts token t+2+i:
                  soft cross-entropy against softmax(lm_head(h_{t+1+i}))  +  reg_weight * SmoothL1(o_i, h_{t+1+i})
              weighted 0.7^i, over positions whose predicted token is an assistant token. With --loss-vocab draft
              both distributions cover the --draft-vocab tokens only (the target's renormalised over them).
              EAGLE (one model, teacher-forced on the target's own features as EAGLE-1 trains): its output at t
              regresses h_{t+1} from [e(tok_{t+1}); h_t + noise] (uniform noise of width 0.2 on the input features,
              as the reference adds), with the same soft cross-entropy and EAGLE-1's weights: the regression
              counts 10x the cross-entropy (its v_w 1.0, p_w 0.1).
    optimiser AdamW (0.9, 0.95), linear warmup then cosine decay (or --lr-schedule constant), grad-norm clip 0.5,
              bf16 autocast on GPU.
    scale     data-parallel through accelerate: under `accelerate launch clover train ...` every process holds the
              target and the heads (wrapped in DistributedDataParallel, which averages the gradients), and process
              r of n trains on batches r, r+n, r+2n, ... of each epoch's shuffled batch list, so an epoch takes 1/n
              of the steps. Regeneration and the feature cache are sharded over the processes (each writes its
              own files; the main process merges); evaluation, checkpoints and the heads are written by the main
              process only.
    output    a heads directory (config.json, model.safetensors, README.md model card) loadable with --heads DIR,
              plus checkpoint/ for --resume. Ctrl-C leaves the last complete checkpoint intact.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F

from . import atomic
from .errors import CloverError, one_line

ARCHS = {"clover": "clover2", "medusa": "medusa", "eagle": "eagle",
         "eagle3": "eagle3"}  # --arch -> the heads' architecture
EAGLE_REG_WEIGHT = 10.0  # EAGLE-1 weighs its feature regression 1.0 and its cross-entropy 0.1
EAGLE_NOISE = 0.2  # width of the uniform noise EAGLE-1 adds to the input features in training
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
    loss_vocab: str = "full"
    decay: float = 0.7
    warmup_frac: float = 0.05
    lr_schedule: str = "cosine"
    weight_decay: float = 0.0
    grad_clip: float = 0.5


def lr_factor(schedule: str, warmup: int, total_steps: int, step: int) -> float:
    """The learning rate at optimiser step `step`, as a share of --lr: a linear warm-up over `warmup` steps, then a
    cosine decay to 0.1x at the last step, or (constant) the peak to the end, as the Clover-2 authors' schedule
    stays near its peak for a whole run of this length (a linear decay after 8000 warm-up steps)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    frac = (step - warmup) / max(1, total_steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def validate(cfg: TrainConfig):
    if cfg.arch not in ARCHS:
        raise CloverError(f"--arch must be clover, medusa, eagle or eagle3, not {cfg.arch!r}")
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
    if cfg.regenerate and not 1 <= cfg.regen_max_tokens < cfg.max_len:
        raise CloverError(f"--regen-max-tokens must be between 1 and --max-len - 1, not {cfg.regen_max_tokens}")
    if cfg.lr_schedule not in ("cosine", "constant"):
        raise CloverError(f"--lr-schedule must be cosine or constant, not {cfg.lr_schedule!r}")
    if cfg.loss_vocab not in ("full", "draft"):
        raise CloverError(f"--loss-vocab must be full or draft, not {cfg.loss_vocab!r}")
    if not (math.isfinite(cfg.reg_weight) and 0 <= cfg.reg_weight <= 1000):
        raise CloverError(f"--reg-weight must be between 0 and 1000, not {cfg.reg_weight}")
    if cfg.max_conversations is not None and cfg.max_conversations < 1:
        raise CloverError(f"--max-conversations must be at least 1, not {cfg.max_conversations}")


def check_out(cfg: TrainConfig) -> bool:
    """Check --out, writing nothing; returns True when resuming from a checkpoint there."""
    from .drafters.registry import is_heads_dir

    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise CloverError(f"--out {out} is a file, not a directory")
    try:
        populated = out.is_dir() and any(out.iterdir())
    except OSError as e:
        raise CloverError(f"cannot read --out {out}: {e.strerror or e}")
    if populated:
        ours = (out / MARKER).is_file() or is_heads_dir(out)
        if not ours:  # someone's own files: never written over, --overwrite or not
            raise CloverError(f"--out {out} exists and is not a heads directory: choose a new or empty directory "
                              f"(--overwrite replaces only what clover train made)")
        if ours and not (cfg.resume or cfg.overwrite):
            if _checkpoint_dir(out) is None and not is_heads_dir(out):
                kept = " (its regenerated replies are reused)" if any(out.glob("regenerated*.jsonl")) else ""
                raise CloverError(f"--out {out} holds an unfinished run with no checkpoint: pass --overwrite to "
                                  f"start again{kept}")
            raise CloverError(f"--out {out} already holds heads: pass --resume to continue or --overwrite")
    if cfg.resume:
        if _checkpoint_dir(out) is None:
            raise CloverError(f"--resume: no checkpoint in {out}")
        _check_resumable(_checkpoint_dir(out), cfg)
        return True
    if not out.exists():
        parent = out.absolute().parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise CloverError(f"cannot create --out {out}: {parent} is not a writable directory")
    return False


# What the regenerated replies (--out/regenerated.jsonl) depend on: they are reused only when these match.
REGEN_KEYS = ("model", "revision", "data", "max_conversations", "regen_turns", "regen_max_tokens", "max_len")


def _marker(cfg: TrainConfig) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}


def make_out(cfg: TrainConfig, resuming: bool) -> str | None:
    """Create --out and its marker (main process, after the model and the data are known to be good).

    Returns "created" or "empty" when this run made the directory or found it empty (a run that then fails before
    its first checkpoint removes what it wrote there, see discard_unfinished), else None.
    """
    from .drafters.registry import is_heads_dir

    out = Path(cfg.out)
    made = "created" if not out.exists() else ("empty" if not any(out.iterdir()) else None)
    ours = (out / MARKER).is_file() or is_heads_dir(out)
    if ours and cfg.overwrite and not resuming:
        for name in ("checkpoint", "checkpoint-old", "checkpoint-new", "features", "model.safetensors"):
            p = out / name
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    regen = [out / "regenerated.jsonl", *out.glob("regenerated.*-of-*.jsonl")] if out.is_dir() else []
    if any(p.is_file() for p in regen):
        try:
            before = json.loads((out / MARKER).read_text())
        except (OSError, ValueError):
            before = {}
        now = _marker(cfg)
        if any(before.get(k) != now[k] for k in REGEN_KEYS):  # made for another model or data: not reusable
            for p in regen:
                p.unlink(missing_ok=True)
    try:
        out.mkdir(parents=True, exist_ok=True)
        atomic.write_text(out / MARKER, json.dumps(_marker(cfg), indent=2) + "\n")
    except OSError as e:
        if made == "created":
            shutil.rmtree(out, ignore_errors=True)
        raise CloverError(f"cannot write --out {out}: {e.strerror or e}")
    return made


def discard_unfinished(out: Path, made: str | None):
    """After a failure: remove what a run wrote into an --out it created (or found empty) if it never reached a
    checkpoint, so that the same command can simply be run again. Regenerated replies are kept (they are costly;
    --overwrite reuses them)."""
    if made is None or not out.is_dir() or _checkpoint_dir(out) is not None or (out / "model.safetensors").exists():
        return
    if any(out.glob("regenerated*.jsonl")):
        return
    if made == "created":
        shutil.rmtree(out, ignore_errors=True)
        return
    for p in out.iterdir():
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def _heads_settings(arch: str, num_heads: int, num_layers: int) -> dict:
    """What a checkpoint's heads were built with: resuming with other options cannot load it."""
    return {"arch": arch, "heads": num_heads, **({"layers": num_layers} if arch == "clover" else {})}


def _check_resumable(path: Path, cfg: TrainConfig):
    """Refuse --resume from a damaged checkpoint, or with options that build other heads than the checkpoint's
    (before the model and the data load: a run that cannot resume says so in one line, up front)."""
    from safetensors import safe_open

    from . import torchload

    def damaged(why: str):
        return CloverError(f"--resume: the checkpoint in {path} is damaged ({why}); pass --overwrite to start again")

    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise damaged(f"state.json: {getattr(e, 'strerror', None) or one_line(e, 160)}") from None
    if not (isinstance(state, dict) and type(state.get("step")) is int and isinstance(state.get("history"), list)):
        raise damaged("state.json does not hold a step and a history")
    try:
        saved = torchload.load(path / "optimizer.pt", "optimizer state", mmap=True)  # mapped: a cheap check
    except CloverError as e:
        raise CloverError(f"--resume: {e}; pass --overwrite to start again") from None
    if not (isinstance(saved, dict) and {"opt", "sched"} <= set(saved)):
        raise damaged("optimizer.pt does not hold an optimizer and a schedule")
    try:
        with safe_open(str(path / "heads.safetensors"), "pt") as f:
            f.keys()
    except Exception as e:  # SafetensorError, OSError
        raise damaged(f"heads.safetensors: {getattr(e, 'strerror', None) or one_line(e, 160)}") from None
    made = state.get("settings")
    want = _heads_settings(cfg.arch, cfg.num_heads, cfg.num_layers)
    if isinstance(made, dict) and made != want:
        flags = " ".join(f"--{k} {v}" for k, v in made.items())
        raise CloverError(f"--resume: the checkpoint in {path} was made with {flags}; resume with those options, "
                          f"or pass --overwrite to start again")


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


def nothing_to_train(cfg, conversations, tokenizer, template) -> CloverError:
    """The error for data that gave no assistant token to train on, saying whether --max-len cut them off."""
    if encode(conversations[:64], tokenizer, template, 1 << 30)[0]:
        return CloverError(f"{cfg.data}: no assistant tokens within --max-len {cfg.max_len} (the template and the "
                           f"first turns take it all); raise --max-len")
    return CloverError(f"{cfg.data}: no assistant tokens to train on")


def _read_jsonl(path: Path, repair: bool = True) -> list:
    """The complete rows of a JSONL file we append to; a row cut short by a crash is dropped (from the file too,
    with repair)."""
    if not path.is_file():
        return []
    rows, good = [], 0
    text = path.read_text(encoding="utf-8")
    for line in text.split("\n"):
        if not line.strip():
            good += len(line) + 1
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            break
        good += len(line) + 1
    if repair and good < len(text):  # atomically: a crash while repairing must not lose the good rows
        atomic.write_text(path, text[:good].rstrip("\n") + "\n" if rows else "")
    return rows


def regenerate(cfg: TrainConfig, model, tokenizer, template: str, stop_strings, conversations, device, log,
               target_box: dict, rank: int = 0, world: int = 1, barrier=lambda: None):
    """Self-distillation: replace each assistant turn with the target's own greedy reply.

    Turn by turn, so later turns see the target's earlier replies; at most cfg.regen_turns turns, each at most
    cfg.regen_max_tokens tokens. On a CPU each reply comes from clover's own engine with the n-gram drafter (greedy
    is lossless, and one sequence at a time beats padded batches there); on a GPU from batched transformers
    generate over prompts sorted by length, at most 32 and at most 4 * --batch-tokens / --max-len at a time.
    Finished conversations are appended to --out/regenerated.jsonl, so an interrupted run resumes where it stopped.
    With several processes (rank of world), process r regenerates conversations r, r+world, ... of those still to
    do into its own regenerated.<start>.<r>-of-<world>.jsonl; the main process then merges them in order into
    regenerated.jsonl, and every process reads that.
    """
    from .session import strip_stop
    from .templates import render

    cache = Path(cfg.out) / "regenerated.jsonl"
    if world > 1:  # every process must see the same rows: the main one repairs the file first
        if rank == 0:
            _read_jsonl(cache)
        barrier()
    done = _read_jsonl(cache, repair=world == 1)
    convs = [m[: 2 * cfg.regen_turns + (m[0]["role"] == "system")] for m in conversations]
    if len(done) >= len(convs):
        return done[: len(convs)]
    eos = {i for i in (tokenizer.eos_token_id,) if i is not None}

    def prompt_ids(messages, a):
        text = render(tokenizer, messages[:a], template, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"][-(cfg.max_len - cfg.regen_max_tokens):]

    def replies_engine(prompts):
        from .drafters.ngram import NgramDrafter
        from .decode.engine import Engine
        from .decode.verify import StopCheck

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
        per_batch = max(1, min(32, 4 * cfg.batch_tokens // cfg.max_len))
        for b in range(0, len(order), per_batch):
            rows = order[b:b + per_batch]
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
    start = len(done)
    todo = convs[start:][rank::world]
    part = cache if world == 1 else cache.with_name(f"regenerated.{start}.{rank}-of-{world}.jsonl")
    mine = [] if world == 1 else _read_jsonl(part)
    for c0 in range(len(mine), len(todo), chunk_size):
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
        atomic.append(part, "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in chunk).encode(), 0o644)
        mine.extend(chunk)
        share = "" if world == 1 else f" (this process: {len(mine)}/{len(todo)})"
        log(f"regenerated {start + min(len(convs) - start, len(mine) * world)}/{len(convs)} conversations"
            f"{share} ({time.time() - t0:.0f}s)")
    if world == 1:
        return done + mine
    barrier()
    if rank == 0:
        parts = [_read_jsonl(cache.with_name(f"regenerated.{start}.{r}-of-{world}.jsonl")) for r in range(world)]
        atomic.append(cache, "".join(json.dumps(parts[k % world][k // world], ensure_ascii=False) + "\n"
                                     for k in range(len(convs) - start)).encode(), 0o644)
        for r in range(world):
            cache.with_name(f"regenerated.{start}.{r}-of-{world}.jsonl").unlink(missing_ok=True)
    barrier()
    return _read_jsonl(cache)[:len(convs)]


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

    def _compute(self, s: int):
        from safetensors.torch import save_file

        path = self._shard_path(s)
        if path.is_file():
            return
        tensors = {}
        for i in range(s * self.shard_size, min(len(self.ids), (s + 1) * self.shard_size)):
            x = torch.tensor([self.ids[i]], device=self.device)
            with torch.no_grad(), _autocast(self.device):
                pre, post = _hidden(self.model, x)
            tensors[f"{i}.pre"] = pre[0].to(self.dtype).cpu()
            tensors[f"{i}.post"] = post[0].to(self.dtype).cpu()
        atomic.write_with(path, lambda tmp: save_file(tensors, str(tmp)))

    def precompute(self, rank: int, world: int, barrier):
        """Several processes: each computes every world-th missing shard, then all wait for the others."""
        for s in range(rank, math.ceil(len(self.ids) / self.shard_size), world):
            self._compute(s)
        barrier()

    def _ensure(self, s: int):
        from safetensors.torch import load_file

        if s in self.loaded:
            return
        self._compute(s)
        self.loaded = {s: load_file(str(self._shard_path(s)))}

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
    reg_weight = cfg.reg_weight
    if arch == "eagle3":
        from .drafters.eagle3 import eagle3_loss

        return eagle3_loss(heads, model, x, mask, post, cfg)
    inner = getattr(heads, "module", heads)  # under DistributedDataParallel
    # --loss-vocab draft: both distributions over the draft vocabulary only (the tokens the heads can propose),
    # the target's renormalised there: a head's projection costs draft_vocab / vocab_size of the whole one's
    vocab = getattr(inner, "draft_vocab", None) if cfg.loss_vocab == "draft" else None
    weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
    if vocab is not None:
        weight, bias = weight[vocab], (bias[vocab] if bias is not None else None)
    if arch in ("clover", "eagle"):
        pos = torch.arange(T, device=x.device)[None].expand(B, T)
        feature = pre
        if arch == "eagle":  # EAGLE reads the post-norm features, noised while training
            feature = post
            if inner.training:
                feature = post + (torch.rand_like(post) - 0.5) * EAGLE_NOISE
            reg_weight = cfg.reg_weight * EAGLE_REG_WEIGHT
        rope = inner.rotary(model)(feature, pos)
        outs = heads(feature, x, inner.token_embedding(model), rope, pos)  # forward: a DDP wrapper syncs gradients
    else:
        outs = heads(post)
    # The target's distribution at every position whose next token is an assistant token, computed once and
    # shared by all heads (head i reads it i positions further on). The soft cross-entropy of a head output o is
    #     -sum_v p(v) log q(v) = logsumexp(W o) - sum_v p(v) (W o)_v = logsumexp(W o) - (p W) . o
    # so the target side reduces to its expected output embedding pW, one [H] vector per position.
    need = torch.zeros_like(mask, dtype=torch.bool)
    need[:, :-1] = mask[:, 1:] > 0
    with torch.no_grad():
        t_logits = lm_head(post[need].to(lm_head.weight.dtype)).float()
        t_arg = t_logits.argmax(-1)
        t_prob = torch.softmax(t_logits if vocab is None else t_logits[:, vocab], -1)
        del t_logits
        t_emb = t_prob @ weight.float()
        t_bias = t_prob @ bias.float() if bias is not None else None
        del t_prob
        row_of = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
        row_of[need] = torch.arange(t_emb.shape[0], device=mask.device)
    total = pre.new_zeros(())
    per_head = []
    for i, out in enumerate(outs):
        n = T - 2 - i
        m = mask[:, 2 + i:2 + i + n] > 0 if n > 0 else None  # the token predicted at t is t+2+i
        if m is None or not m.any():
            # no position for this head in the batch: a zero term keeps its parameters in the graph, as
            # DistributedDataParallel needs every parameter to get a gradient on every process
            total = total + 0.0 * out.float().sum()
            per_head.append((0.0, 0.0, 0))
            continue
        student = out[:, :n][m]
        teacher = post[:, 1 + i:1 + i + n][m]
        rows = row_of[:, 1 + i:1 + i + n][m]
        s_logits = F.linear(student.to(weight.dtype), weight, bias)
        dot = (t_emb[rows] * student.float()).sum(-1) + (t_bias[rows] if t_bias is not None else 0.0)
        ce = (torch.logsumexp(s_logits.float(), -1) - dot).mean()
        reg = F.smooth_l1_loss(student.float(), teacher.float(), reduction="none").mean(-1).mean()
        loss_i = ce + reg_weight * reg
        total = total + (cfg.decay ** i) * loss_i
        s_arg = s_logits.argmax(-1) if vocab is None else vocab[s_logits.argmax(-1)]
        acc = (s_arg == t_arg[rows]).float().mean().item()
        per_head.append((loss_i.item(), acc, int(m.sum())))
    return total, per_head


# ----------------------------------------------------------------------------------------------------- eval

@torch.no_grad()
def evaluate(heads, cfg, model, tokenizer, template, held_ids, held_masks, held_msgs, device, target_box):
    """Per-head top-1 agreement on held-out conversations, and τ of the real engine on held-out prompts."""
    import copy

    from .decode.engine import Engine
    from .decode.verify import StopCheck
    from .drafters.registry import drafter_for
    from .session import RunStats
    from .target import Target
    from .templates import render

    heads.eval()
    agree = [[0.0, 0] for _ in range(1 if cfg.arch in ("eagle", "eagle3") else cfg.num_heads)]  # EAGLE: one model
    per_batch = max(1, min(8, cfg.batch_tokens // cfg.max_len))
    for k in range(0, min(len(held_ids), 64), per_batch):
        rows = list(range(k, min(k + per_batch, len(held_ids), 64)))
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
    engine = Engine(target, drafter_for(draft_heads, target), budget=24, auto_budget=False)
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
    if not any(n for _, n in agree):  # nothing held out (or nothing of it fits --max-len): nothing measured
        return None
    return {"accuracy": accuracy, "tau": stats.tau if stats.steps else None,
            "accept_by_depth": stats.accept_by_depth}


# ----------------------------------------------------------------------------------------------------- main

def _train_device(cfg: TrainConfig):
    """(run on the CPU?, the exact device when --device names one GPU) from --device, before accelerate starts.

    `--device cuda:N` makes GPU N the current one for this single process; under `accelerate launch` each process
    is given its own GPU, so naming one there is refused.
    """
    from .loading import pick_device

    dev = pick_device(cfg.device)  # unknown names, and GPUs that are not there, fail here in one line
    if dev.type == "cuda" and dev.index is not None:
        launched = os.environ.get("LOCAL_RANK") is not None or int(os.environ.get("WORLD_SIZE") or 1) > 1
        if launched:
            raise CloverError(f"--device {cfg.device}: under accelerate launch each process gets its own GPU; "
                              f"choose them with CUDA_VISIBLE_DEVICES or accelerate's --gpu_ids instead")
        torch.cuda.set_device(dev.index)
        return False, dev
    return dev.type == "cpu", None


def _is_out_of_memory(e: BaseException) -> bool:
    if isinstance(e, (MemoryError, torch.cuda.OutOfMemoryError)):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


@contextmanager
def _memory_advice(device, doing: str, hint: str):
    """Out of (GPU or CPU) memory while `doing`: one line suggesting `hint`."""
    try:
        yield
    except (MemoryError, RuntimeError) as e:
        if not _is_out_of_memory(e):
            raise
        where = "GPU memory" if device.type == "cuda" else "memory"
        raise CloverError(f"out of {where} {doing}; try {hint}") from None


def run_training(cfg: TrainConfig):
    validate(cfg)
    want_cpu, exact_device = _train_device(cfg)
    resuming = check_out(cfg)
    from .hub import resolve_model
    from .loading import load
    from .templates import STOP_STRINGS, chat_template

    try:
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs
    except ImportError:
        raise CloverError("clover train needs accelerate: pip install accelerate")

    # Clover-2 with one head never uses its recurrent block; DDP must then be told that some parameters idle.
    # The long timeout covers processes waiting for each other's share of regeneration and for the evaluation.
    accelerator = Accelerator(cpu=want_cpu, mixed_precision="no", kwargs_handlers=[
        DistributedDataParallelKwargs(find_unused_parameters=cfg.arch == "clover" and cfg.num_heads == 1),
        InitProcessGroupKwargs(timeout=timedelta(hours=2))])
    main, world = accelerator.is_main_process, accelerator.num_processes
    barrier = accelerator.wait_for_everyone
    device = exact_device if exact_device is not None and world == 1 else accelerator.device
    log = _logger(accelerator)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    # The model and the data are checked before anything is written into --out.
    with accelerator.main_process_first():  # one download; the other processes then find it cached
        resolved = resolve_model(cfg.model, cfg.revision, quiet=not main)
    loaded = load(resolved.path, device=str(device), dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
    model, tokenizer = loaded.model, loaded.tokenizer
    model.requires_grad_(False)
    spec = resolved.spec
    template_name, template = chat_template(tokenizer, spec.template if spec else None)
    stop_strings = STOP_STRINGS.get(template_name) or STOP_STRINGS.get(spec.template if spec else "", [])
    train_msgs, held_msgs = load_data(cfg, tokenizer, template)
    if not cfg.regenerate:
        ids, masks = encode(train_msgs, tokenizer, template, cfg.max_len)
        if not ids:
            raise nothing_to_train(cfg, train_msgs, tokenizer, template)

    out = Path(cfg.out)
    barrier()  # every process has checked --out before the main one writes there
    made = make_out(cfg, resuming) if main else None
    barrier()
    try:
        _train(cfg, accelerator, device, log, resuming, resolved, model, tokenizer, template, stop_strings,
               train_msgs, held_msgs, None if cfg.regenerate else (ids, masks))
    except BaseException:
        if main:
            discard_unfinished(out, made)
        raise


def _train(cfg, accelerator, device, log, resuming, resolved, model, tokenizer, template, stop_strings,
           train_msgs, held_msgs, encoded):
    from .drafters.common import HeadsConfig
    from .drafters.registry import build_heads, save_heads

    main, rank, world = accelerator.is_main_process, accelerator.process_index, accelerator.num_processes
    barrier = accelerator.wait_for_everyone
    out = Path(cfg.out)
    target_box: dict = {}  # one Target wrapper (our cache + attention) for regeneration and evaluation
    if cfg.regenerate:
        hint = f"a smaller --regen-max-tokens (now {cfg.regen_max_tokens})"
        hint += f", --batch-tokens (now {cfg.batch_tokens})" if device.type == "cuda" else ""
        with _memory_advice(device, "regenerating replies", hint + " or --max-len"):
            train_msgs = regenerate(cfg, model, tokenizer, template, stop_strings, train_msgs, device, log,
                                    target_box, rank, world, barrier)
        ids, masks = encode(train_msgs, tokenizer, template, cfg.max_len)
    else:
        ids, masks = encoded
    held_ids, held_masks = encode(held_msgs, tokenizer, template, cfg.max_len)
    if not ids:
        raise nothing_to_train(cfg, train_msgs, tokenizer, template)
    n_tokens = sum(len(i) for i in ids)
    log(f"{len(ids)} training conversations ({n_tokens} tokens), {len(held_ids)} held out"
        + (f"; {world} processes, each on its own 1/{world} of every epoch's batches" if world > 1 else ""))

    lengths = [len(i) for i in ids]

    def my_batches(epoch: int) -> list[list[int]]:
        """This process's batches of an epoch: r, r+n, ... of the shuffled list (the same on every process)."""
        every = make_batches(lengths, cfg.batch_tokens, random.Random(cfg.seed + epoch))
        return every[rank::world] or [every[rank % len(every)]]

    per_epoch = len(make_batches(lengths, cfg.batch_tokens, random.Random(0)))
    total_steps = cfg.max_steps or max(1, int(math.ceil(per_epoch * cfg.epochs)))
    total_steps = max(1, total_steps // world) if cfg.max_steps is None else total_steps

    hcfg = HeadsConfig.for_target(model.config, architecture=ARCHS[cfg.arch], num_heads=cfg.num_heads,
                                  num_layers=1 if cfg.arch in ("eagle", "eagle3") else cfg.num_layers,
                                  name=resolved.repo or resolved.name, revision=cfg.revision)
    vocab = draft_vocabulary(ids, masks, model.config.vocab_size, cfg.draft_vocab)
    hcfg.draft_vocab_size = 0 if vocab is None else len(vocab)
    heads = build_heads(hcfg, model)
    if cfg.arch == "eagle3":  # its own lm_head over the draft vocabulary, mapped by d2t/t2d (drafters/eagle3.py)
        heads.use_vocab(vocab)
        vocab = None
    heads.init_from_target(model)
    heads.draft_vocab = None if vocab is None else vocab.to(device)
    heads.to(device=device, dtype=torch.float32).train()
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    warmup = max(1, int(cfg.warmup_frac * total_steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(lr_factor, cfg.lr_schedule, warmup, total_steps))
    heads, opt = accelerator.prepare(heads, opt)  # several processes: heads is now a DDP wrapper
    step, history = 0, []
    if resuming:
        step, history = _load_checkpoint(_checkpoint_dir(out), accelerator.unwrap_model(heads), opt, sched)
        log(f"resumed from step {step}")
    features = None
    if cfg.cache_features:
        features = FeatureCache(out / "features", model, ids, device, torch.bfloat16 if device.type == "cuda"
                                else torch.float32)
        if world > 1:  # shard by shard over the processes up front, rather than racing for shards later
            with _memory_advice(device, "computing the feature cache", "a smaller --max-len"):
                features.precompute(rank, world, barrier)

    t_start, tokens_seen, last = time.time(), 0, {}
    epoch = step // len(my_batches(0))  # the batch count is the same every epoch: only the order changes
    batches = my_batches(epoch)
    cursor = step % len(batches)
    progress = _Progress(total_steps, step, main)
    try:
        while step < total_steps:
            if cursor >= len(batches):
                epoch += 1
                batches = my_batches(epoch)
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
                if main:
                    with _memory_advice(device, f"evaluating at step {step}",
                                        f"a smaller --batch-tokens (now {cfg.batch_tokens}) or --max-len"):
                        ev = evaluate(accelerator.unwrap_model(heads), cfg, model, tokenizer, template, held_ids,
                                      held_masks, held_msgs, device, target_box)
                    rec = {"step": step, "train_loss": round(last["loss"], 4), "heldout_accuracy": None,
                           "heldout_tau": None, "elapsed_s": round(time.time() - t_start, 1)}
                    if ev is not None:
                        rec.update(heldout_accuracy=[round(a, 4) for a in ev["accuracy"]],
                                   heldout_tau=None if ev["tau"] is None else round(ev["tau"], 3),
                                   accept_by_depth=[round(a, 3) for a in ev["accept_by_depth"]])
                    history.append(rec)
                    progress.note(f"eval step {step}: " + heldout_text(rec))
                    _save_checkpoint(out, accelerator.unwrap_model(heads), opt, sched, step, history)
                barrier()
    except (MemoryError, RuntimeError) as e:
        if not _is_out_of_memory(e):
            raise
        progress.close()
        where = "GPU memory" if device.type == "cuda" else "memory"
        raise CloverError(f"out of {where} at step {step + 1}; try a smaller --batch-tokens (now "
                          f"{cfg.batch_tokens}) or --max-len") from None
    except KeyboardInterrupt:
        progress.close()
        done = _checkpoint_dir(out)
        where = f"; the checkpoint in {done} is intact: continue with --resume" if done else ""
        sys.stderr.write(f"\nclover: training interrupted at step {step}{where}\n")
        raise SystemExit(130)
    progress.close()

    if main:
        final = history[-1] if history else {}
        unwrapped = accelerator.unwrap_model(heads)
        unwrapped.cfg.training = {"data": cfg.data, "steps": step, "regenerate": cfg.regenerate,
                                  "conversations": len(ids), "tokens_per_epoch": n_tokens, "lr": cfg.lr,
                                  "lr_schedule": cfg.lr_schedule,
                                  "batch_tokens": cfg.batch_tokens, "max_len": cfg.max_len,
                                  "reg_weight": cfg.reg_weight, "loss_vocab": cfg.loss_vocab,
                                  "heldout_accuracy": final.get("heldout_accuracy"),
                                  "heldout_tau": final.get("heldout_tau"),
                                  "accept_by_depth": final.get("accept_by_depth"),
                                  "elapsed_s": round(time.time() - t_start, 1)}
        if world > 1:
            unwrapped.cfg.training["processes"] = world
        save_heads(unwrapped, out, model_card(unwrapped.cfg, resolved.name, history, resolved.repo))
        log(f"heads written to {out} ({heldout_text(final)})")
        if cfg.push_to_hub:
            push(out, cfg.push_to_hub)
            log(f"pushed to {cfg.push_to_hub}")


def heldout_text(rec: dict) -> str:
    """What an evaluation measured, in words: its τ and top-1 agreement, or that nothing was held out to measure."""
    if rec.get("heldout_accuracy") is None:
        return "nothing held out to measure on: no held-out τ"
    tau = rec.get("heldout_tau")
    return (f"held-out τ {tau}" if tau is not None else "no held-out prompt fit for τ") + \
        f", top-1 {rec['heldout_accuracy']}"


def model_card(hcfg, target_name: str, history: list[dict], repo: str | None = None) -> str:
    t = hcfg.training
    arch = {"clover2": "Clover-2", "medusa": "Medusa-1", "eagle": "EAGLE", "eagle3": "EAGLE-3"}[hcfg.architecture]
    one_model = hcfg.architecture in ("eagle", "eagle3")
    rows = "\n".join(f"| {h['step']} | {h['train_loss']} | {h['heldout_accuracy'] or '–'} | "
                     f"{'–' if h['heldout_tau'] is None else h['heldout_tau']} |"
                     for h in history)
    meta = "---\nlibrary_name: clover\ntags:\n- speculative-decoding\n- " + arch.lower() + "\n"
    meta += (f"base_model: {repo}\n" if repo else "") + "---\n\n"  # the Hub warns about a card without metadata
    return meta + f"""# {arch} draft heads for {target_name}

Made with `clover train` (clover). Load with `clover chat {target_name} --heads <this directory>`.

- architecture: {hcfg.architecture}, {f"one layer, drafting {hcfg.num_heads} deep" if one_model
                                   else f"{hcfg.num_heads} heads"}{f", {hcfg.num_layers} augmenting layers"
                                                                  if hcfg.architecture == "clover2" else ""}
- target: {target_name} (hidden {hcfg.hidden_size}, vocabulary {hcfg.vocab_size})
- data: {t.get('data')}{' (assistant turns regenerated by the target)' if t.get('regenerate') else ''},
  {t.get('conversations')} conversations, {t.get('tokens_per_epoch')} tokens per epoch
- steps: {t.get('steps')}, peak lr {t.get('lr')}, {t.get('batch_tokens')} tokens per batch, max length
  {t.get('max_len')}, {t.get('elapsed_s')} s

Measured on the fixed held-out split (top-1 agreement of each head with the target, EAGLE's over one step on the
target's own features; τ = tokens per target forward of the real engine, greedy, {EVAL_PROMPTS} prompts x
{EVAL_NEW_TOKENS} tokens, 24-node dynamic tree):

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
    except (HTTPError, OSError, ValueError) as e:  # ValueError: huggingface_hub on a malformed server answer
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise CloverError(f"could not push to {repo}: {why} (the heads are saved in {out})")


def _save_checkpoint(out: Path, heads, opt, sched, step: int, history: list):
    from safetensors.torch import save_file

    new, cur, old = out / "checkpoint-new", out / "checkpoint", out / "checkpoint-old"
    shutil.rmtree(new, ignore_errors=True)
    new.mkdir()
    tensors = {k: v.detach().cpu().contiguous() for k, v in heads.state_dict().items()}
    atomic.write_with(new / "heads.safetensors", lambda tmp: save_file(tensors, str(tmp)))
    optimizer = {"opt": opt.state_dict(), "sched": sched.state_dict()}
    atomic.write_with(new / "optimizer.pt", lambda tmp: torch.save(optimizer, tmp))
    settings = _heads_settings("clover" if heads.cfg.architecture == "clover2" else "medusa", heads.cfg.num_heads,
                               heads.cfg.num_layers)
    atomic.write_text(new / "state.json", json.dumps({"step": step, "history": history, "settings": settings}))
    # at every moment one complete checkpoint is on disk: checkpoint-old goes only once checkpoint is complete
    # (a run resumed from checkpoint-old has none) and the new one is in place
    if (cur / "state.json").is_file():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(cur, old)
    else:
        shutil.rmtree(cur, ignore_errors=True)  # absent, or not a checkpoint
    os.replace(new, cur)
    shutil.rmtree(old, ignore_errors=True)


def _load_checkpoint(path: Path, heads, opt, sched):
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from . import torchload

    saved = torchload.load(path / "optimizer.pt", "optimizer state")
    try:
        state = json.loads((path / "state.json").read_text())
        heads.load_state_dict(load_file(str(path / "heads.safetensors")))
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
        return int(state["step"]), list(state["history"])
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as e:
        # made with other options (before checkpoints recorded them), or damaged
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise CloverError(f"--resume: the checkpoint in {path} does not fit these options or is damaged ({why}); "
                          f"resume with the options it was made with, or pass --overwrite to start again") from None


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
