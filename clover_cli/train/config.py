"""clover train's options (TrainConfig), their checks, the learning-rate schedule, and constants several parts share."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from .. import families
from ..errors import CloverError
from ..families import Family, Training, by_draft, either, spec

EVAL_PROMPTS = 4
EVAL_NEW_TOKENS = 64


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
    # Clover-2: the heads norm the target's hidden state first (HeadsConfig.feature_norm); None: FEATURE_NORM for new
    # heads, --init's own for heads trained further (settled by validate)
    feature_norm: bool | None = None
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
    # the repetition penalty of the regenerated replies and of the held-out τ's replies: None = the model's own (its
    # alias's measured default, as chat and generate use it; else 1, none), resolved once the model is known
    repetition_penalty: float | None = None
    reg_weight: float = 1.0
    loss_vocab: str = "full"
    decay: float = 0.7
    warmup_frac: float = 0.05
    lr_schedule: str = "cosine"
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    init: Path | None = None  # heads to start from (their weights, shape and draft vocabulary): more training


FEATURE_NORM = True  # new Clover-2 heads norm the hidden state first (docs/BENCHMARKS.md, 2026-12-07 04:08)


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


def family(arch: str) -> Family:
    """The heads family --arch names (--arch takes the heads drafters' names, --draft's)."""
    found = by_draft(arch)
    if found is None:
        raise CloverError(f"--arch must be {either(f.draft for f in families.FAMILIES)}, not {arch!r}")
    return found


def training(arch: str) -> Training:
    """How the family --arch names is trained (its file's SPEC.training)."""
    return spec(family(arch).architecture).training


def validate(cfg: TrainConfig):
    family(cfg.arch)
    if not 1 <= cfg.num_heads <= 16:
        raise CloverError(f"--heads must be between 1 and 16, not {cfg.num_heads}")
    if training(cfg.arch).layers and not 1 <= cfg.num_layers <= 8:
        raise CloverError(f"--layers must be between 1 and 8, not {cfg.num_layers}")
    if cfg.feature_norm and not training(cfg.arch).layers:
        raise CloverError(f"--feature-norm is Clover-2's (--arch clover), not --arch {cfg.arch}'s")
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
    if cfg.repetition_penalty is not None and not (math.isfinite(cfg.repetition_penalty)
                                                   and 0.0 < cfg.repetition_penalty <= 10.0):
        raise CloverError(f"--repetition-penalty must be above 0 and at most 10, not {cfg.repetition_penalty}")
    if cfg.regenerate and not 1 <= cfg.regen_max_tokens < cfg.max_len:
        raise CloverError(f"--regen-max-tokens must be between 1 and --max-len - 1, not {cfg.regen_max_tokens}")
    if cfg.lr_schedule not in ("cosine", "constant"):
        raise CloverError(f"--lr-schedule must be cosine or constant, not {cfg.lr_schedule!r}")
    if cfg.loss_vocab not in ("full", "draft"):
        raise CloverError(f"--loss-vocab must be full or draft, not {cfg.loss_vocab!r}")
    if not (math.isfinite(cfg.reg_weight) and 0 <= cfg.reg_weight <= 1000):
        raise CloverError(f"--reg-weight must be between 0 and 1000, not {cfg.reg_weight}")
    if cfg.init is not None:
        take_init_shape(cfg)
    elif cfg.feature_norm is None:
        cfg.feature_norm = FEATURE_NORM and training(cfg.arch).layers
    if cfg.max_conversations is not None and cfg.max_conversations < 1:
        raise CloverError(f"--max-conversations must be at least 1, not {cfg.max_conversations}")


def take_init_shape(cfg: TrainConfig):
    """--init: the heads to start from set the run's --heads and --layers (their weights fit no others); CloverError
    (one line) for a directory that holds no heads or heads of another family than --arch."""
    from ..drafters.registry import load_heads_config

    init = load_heads_config(Path(cfg.init))
    want = family(cfg.arch)
    if init.architecture != want.architecture:
        raise CloverError(f"--init {cfg.init}: those are {init.architecture} heads, not --arch {cfg.arch}'s "
                          f"({want.architecture})")
    cfg.num_heads = init.num_heads
    if training(cfg.arch).layers:
        cfg.num_layers = init.num_layers
        if cfg.feature_norm is not None and cfg.feature_norm != init.feature_norm:
            made, asked = ("norm it first", "--no-feature-norm") if init.feature_norm else \
                ("read the hidden state as it is", "--feature-norm")
            raise CloverError(f"--init {cfg.init}: those heads {made}; they cannot be trained further with {asked}")
        cfg.feature_norm = init.feature_norm
