"""--out, the directory clover train writes: checking it before a run, its marker, the checkpoints (written and
read back for --resume), and cleaning up after a run that failed before its first checkpoint."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from .. import atomic
from ..errors import CloverError, one_line
from ..families import by_architecture
from .config import TrainConfig, training

MARKER = "clover-train.json"


def check_out(cfg: TrainConfig) -> bool:
    """Check --out, writing nothing; returns True when resuming from a checkpoint there."""
    from ..drafters.registry import is_heads_dir

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
                kept = [what for what, there in (("regenerated replies", any(out.glob("regenerated*.jsonl"))),
                                                 ("feature cache", _has_features(out))) if there]
                kept = f" (its {' and '.join(kept)} reused where the options match)" if kept else ""
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


# What the regenerated replies (--out/regenerated.jsonl) depend on: they are reused only when these match. Not
# --max-conversations: the training conversations are the data's first ones (load_data) and their replies are kept
# in that order, so a run over fewer reuses the first of them and a run over more regenerates only the rest (a run
# stopped after hours of regeneration and started again on what it had).
REGEN_KEYS = ("model", "revision", "data", "regen_turns", "regen_max_tokens", "max_len", "repetition_penalty")
# What the feature cache (--out/features, the target's hidden states per conversation) depends on: the same
# conversations (REGEN_KEYS, how many, and whether they were regenerated) through the same weights.
FEATURE_KEYS = (*REGEN_KEYS, "max_conversations", "regenerate", "device", "dtype")


def _has_features(out: Path) -> bool:
    return any((out / "features").glob("shard_*.safetensors"))


def _marker(cfg: TrainConfig) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}


def make_out(cfg: TrainConfig, resuming: bool) -> str | None:
    """Create --out and its marker (main process, after the model and the data are known to be good).

    Returns "created" or "empty" when this run made the directory or found it empty (a run that then fails before
    its first checkpoint removes what it wrote there, see discard_unfinished), else None.
    """
    from ..drafters.registry import is_heads_dir

    out = Path(cfg.out)
    made = "created" if not out.exists() else ("empty" if not any(out.iterdir()) else None)
    ours = (out / MARKER).is_file() or is_heads_dir(out)
    try:
        before = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        before = {}
    now = _marker(cfg)
    if ours and cfg.overwrite and not resuming:
        features_kept = all(before.get(k) == now[k] for k in FEATURE_KEYS)  # the same conversations and weights
        for name in ("checkpoint", "checkpoint-old", "checkpoint-new", "model.safetensors",
                     *(() if features_kept else ("features",))):
            p = out / name
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    regen = [out / "regenerated.jsonl", *out.glob("regenerated.*-of-*.jsonl")] if out.is_dir() else []
    if any(p.is_file() for p in regen):
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
    if any(out.glob("regenerated*.jsonl")) or _has_features(out):  # costly: kept for the next run
        return
    if made == "created":
        shutil.rmtree(out, ignore_errors=True)
        return
    for p in out.iterdir():
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def _heads_settings(arch: str, num_heads: int, num_layers: int, feature_norm: bool = False) -> dict:
    """What a checkpoint's heads were built with: resuming with other options cannot load it."""
    return {"arch": arch, "heads": num_heads, **({"layers": num_layers} if training(arch).layers else {}),
            **({"feature-norm": True} if feature_norm else {})}


def _check_resumable(path: Path, cfg: TrainConfig):
    """Refuse --resume from a damaged checkpoint, or with options that build other heads than the checkpoint's
    (before the model and the data load: a run that cannot resume says so in one line, up front)."""
    from safetensors import safe_open

    from .. import torchload

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
    want = _heads_settings(cfg.arch, cfg.num_heads, cfg.num_layers, cfg.feature_norm)
    if isinstance(made, dict) and made != want:
        flags = " ".join(f"--{k}" if v is True else f"--{k} {v}" for k, v in made.items()) + \
            ("" if "feature-norm" in made else " --no-feature-norm" if cfg.feature_norm else "")
        raise CloverError(f"--resume: the checkpoint in {path} was made with {flags}; resume with those options, "
                          f"or pass --overwrite to start again")


def _checkpoint_dir(out: Path) -> Path | None:
    for name in ("checkpoint", "checkpoint-old"):
        if (out / name / "state.json").is_file():
            return out / name
    return None


def _save_checkpoint(out: Path, heads, opt, sched, step: int, history: list):
    from safetensors.torch import save_file

    new, cur, old = out / "checkpoint-new", out / "checkpoint", out / "checkpoint-old"
    shutil.rmtree(new, ignore_errors=True)
    new.mkdir()
    tensors = {k: v.detach().cpu().contiguous() for k, v in heads.state_dict().items()}
    atomic.write_with(new / "heads.safetensors", lambda tmp: save_file(tensors, str(tmp)))
    optimizer = {"opt": opt.state_dict(), "sched": sched.state_dict()}
    atomic.write_with(new / "optimizer.pt", lambda tmp: torch.save(optimizer, tmp))
    arch = by_architecture(heads.cfg.architecture).draft  # its --arch
    settings = _heads_settings(arch, heads.cfg.num_heads, heads.cfg.num_layers, heads.cfg.feature_norm)
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

    from .. import torchload

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
