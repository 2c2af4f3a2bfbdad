"""run_training: the device, accelerate's processes, the model and the data loaded and checked before --out is
written; then the training loop with its evaluations, checkpoints and progress line."""

from __future__ import annotations

import functools
import math
import os
import random
import sys
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch

from ..errors import CloverError
from .config import EVAL_NEW_TOKENS, EVAL_PROMPTS, TrainConfig, family, lr_factor, training, validate
from .data import collate, draft_vocabulary, encode, load_data, make_batches, nothing_to_train, regenerate
from .features import FeatureCache, _autocast, _hidden
from .loss import heads_loss
from .output import _checkpoint_dir, _load_checkpoint, _save_checkpoint, check_out, discard_unfinished, make_out
from .publish import heldout_text, model_card, push


@torch.no_grad()
def evaluate(heads, cfg, model, tokenizer, template, held_ids, held_masks, held_msgs, device, target_box):
    """Per-head top-1 agreement on held-out conversations, and τ of the real engine on held-out prompts."""
    import copy

    from ..decode.engine import Engine
    from ..decode.verify import Sampling, StopCheck
    from ..drafters.registry import drafter_for
    from ..stats import Stats
    from ..target import Target
    from ..templates import render

    heads.eval()
    agree = [[0.0, 0] for _ in range(1 if training(cfg.arch).one_model else cfg.num_heads)]  # EAGLE: one model
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
    stats = Stats()
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
        for ev in engine.generate(ids, StopCheck(room, eos), Sampling(repetition_penalty=cfg.repetition_penalty)):
            stats.add(ev)
    engine.reset()
    heads.train()
    if not any(n for _, n in agree):  # nothing held out (or nothing of it fits --max-len): nothing measured
        return None
    return {"accuracy": accuracy, "tau": stats.tau if stats.steps else None,
            "accept_by_depth": stats.hit_rates}


# ----------------------------------------------------------------------------------------------------- main

def _train_device(cfg: TrainConfig):
    """(run on the CPU?, the exact device when --device names one GPU) from --device, before accelerate starts.

    `--device cuda:N` makes GPU N the current one for this single process; under `accelerate launch` each process
    is given its own GPU, so naming one there is refused.
    """
    from ..loading import pick_device

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
    from ..hub import resolve_model
    from ..loading import load
    from ..templates import STOP_STRINGS, chat_template

    try:
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs
    except ImportError:
        raise CloverError("clover train needs accelerate: pip install 'clover-cli[train]'")

    # Clover-2 with one head never uses its recurrent block; DDP must then be told that some parameters idle.
    # The long timeout covers processes waiting for each other's share of regeneration and for the evaluation.
    accelerator = Accelerator(cpu=want_cpu, mixed_precision="no", kwargs_handlers=[
        DistributedDataParallelKwargs(find_unused_parameters=training(cfg.arch).idle_one_head and cfg.num_heads == 1),
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
    if main:  # in `clover ps`, and its model safe from `clover rm` while it trains
        from types import SimpleNamespace

        from ..running import register

        register("train", SimpleNamespace(resolved=resolved), None, None)
    model, tokenizer = loaded.model, loaded.tokenizer
    model.requires_grad_(False)
    spec = resolved.spec
    if cfg.repetition_penalty is None:
        cfg.repetition_penalty = spec.repetition_penalty if spec else 1.0
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
    from ..drafters.common import HeadsConfig
    from ..drafters.registry import build_heads, load as load_heads, save_heads

    main, rank, world = accelerator.is_main_process, accelerator.process_index, accelerator.num_processes
    barrier = accelerator.wait_for_everyone
    out = Path(cfg.out)
    target_box: dict = {}  # one Target wrapper (our cache + attention) for regeneration and evaluation
    if cfg.regenerate:
        hint = f"a smaller --regen-max-tokens (now {cfg.regen_max_tokens})"
        hint += f", --batch-tokens (now {cfg.batch_tokens})" if device.type == "cuda" else ""
        with _memory_advice(device, "regenerating replies", hint + " or --max-len"):
            train_msgs = regenerate(cfg, model, tokenizer, template, stop_strings, train_msgs, device, log,
                                    target_box, rank, world, barrier, model_dir=resolved.path)
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

    trained = training(cfg.arch)
    if cfg.init is not None:  # more training for heads made before: their weights and draft vocabulary
        heads = load_heads(cfg.init, model)
        made = heads.cfg.training or {}
        started_from = {"from": str(cfg.init), **{k: made.get(k) for k in ("data", "steps", "conversations",
                                                                             "regenerate")}}
        if made.get("init"):  # they were trained further from others in turn: the whole line of runs is kept
            started_from["init"] = made["init"]
    else:
        hcfg = HeadsConfig.for_target(model.config, architecture=family(cfg.arch).architecture,
                                      num_heads=cfg.num_heads, num_layers=1 if trained.one_model else cfg.num_layers,
                                      name=resolved.repo or resolved.name, revision=cfg.revision)
        vocab = draft_vocabulary(ids, masks, model.config.vocab_size, cfg.draft_vocab)
        hcfg.feature_norm = cfg.feature_norm  # settled by validate: only Clover-2's can be true
        hcfg.draft_vocab_size = 0 if vocab is None else len(vocab)
        heads = build_heads(hcfg, model)
        if trained.own_vocab:  # EAGLE-3: its own lm_head over the draft vocabulary, mapped by d2t/t2d
            heads.use_vocab(vocab)
            vocab = None
        heads.init_from_target(model)
        heads.draft_vocab = None if vocab is None else vocab.to(device)
        started_from = None
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
        t_features = time.time()

        def report(done: int, total: int):
            if main:
                elapsed = time.time() - t_features
                log(f"target features: {done}/{total} shards cached · {_duration(elapsed)} elapsed · "
                    f"ETA {_duration(elapsed / done * (total - done))}")

        # up front (over the processes, shard by shard), not at the first batch: the steps are then timed alone
        with _memory_advice(device, "computing the feature cache", "a smaller --max-len"):
            features.precompute(rank, world, barrier, report)

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
                                  "lr_schedule": cfg.lr_schedule, "repetition_penalty": cfg.repetition_penalty,
                                  "batch_tokens": cfg.batch_tokens, "max_len": cfg.max_len,
                                  "reg_weight": cfg.reg_weight, "loss_vocab": cfg.loss_vocab,
                                  "heldout_accuracy": final.get("heldout_accuracy"),
                                  "heldout_tau": final.get("heldout_tau"),
                                  "accept_by_depth": final.get("accept_by_depth"),
                                  "elapsed_s": round(time.time() - t_start, 1)}
        if world > 1:
            unwrapped.cfg.training["processes"] = world
        if started_from is not None:
            unwrapped.cfg.training["init"] = started_from
        save_heads(unwrapped, out, model_card(unwrapped.cfg, resolved.name, history, resolved.repo))
        log(f"heads written to {out} ({heldout_text(final)})")
        if cfg.push_to_hub:
            push(out, cfg.push_to_hub)
            log(f"pushed to {cfg.push_to_hub}")


def _logger(accelerator):
    def log(msg: str):
        if accelerator.is_main_process:
            sys.stderr.write(msg + "\n")
            sys.stderr.flush()

    return log


RATE_WINDOW = 20  # the ETA comes from the time of the last this many steps (evaluations included, as they recur)


def _duration(seconds: float) -> str:
    """A duration in words short enough for a progress line: 42s, 3m05s, 2h07m."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class _Progress:
    """A rich progress bar on a terminal (steps done / total, elapsed, ETA); plain lines every 10 steps otherwise,
    with the same: `step 120/2000: loss ... · 5m12s elapsed · ETA 1h21m`. The plain ETA comes from the rate of the
    last RATE_WINDOW steps of this run (a resumed run's steps before it are not timed); rich's from its own
    recent samples."""

    def __init__(self, total: int, start: int, enabled: bool, clock=time.monotonic):
        self.enabled, self.bar = enabled, None
        self.total, self.clock = total, clock
        self.t0 = clock()
        self.recent = [(start, self.t0)]  # (step, time) of the last RATE_WINDOW + 1 updates
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("ETA"),
                                TimeRemainingColumn(), console=Console(stderr=True))
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
            self.bar.start()

    def timing(self, step: int) -> str:
        """Elapsed time and the ETA at `step` (`ETA ?` until a step has been timed)."""
        now = self.clock()
        self.recent = (self.recent + [(step, now)])[-(RATE_WINDOW + 1):]
        (s0, t0), (s1, t1) = self.recent[0], self.recent[-1]
        eta = _duration((self.total - step) * (t1 - t0) / (s1 - s0)) if s1 > s0 else "?"
        return f"{_duration(now - self.t0)} elapsed · ETA {eta}"

    def update(self, step: int, last: dict):
        if not self.enabled:
            return
        info = (f"loss {last['loss']:.3f} · top-1 {' '.join(f'{a:.2f}' for a in last['acc'])} · "
                f"{last['tok_s']:.0f} tok/s")
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
            return
        timing = self.timing(step)
        if step % 10 == 0 or step == 1:
            sys.stderr.write(f"step {step}/{self.total}: {info} · {timing}\n")
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
