"""The heads families clover knows, listed once: FAMILIES below. Everything else that names a family (--draft and
/draft, `clover train --arch`, the option checks and help texts, the registry, training, the model card, `clover
models`, `clover bench`'s rows) reads this table, and what is specific to a family is declared in its own file
(drafters/<family>.py) as `SPEC = Spec(...)`.

This module imports nothing of clover's and no torch: options.py checks --draft before the model and torch load. A
family's file (and torch) is imported only when its SPEC is asked for (`spec`: drafters/registry.py, train/, bench.py).

Adding a heads family: write drafters/<family>.py ending in `SPEC = Spec(...)` and add its one line to FAMILIES.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Family:
    architecture: str  # the heads config's "architecture" (config.json)
    draft: str  # its name as --draft, /draft and `clover train --arch` take it
    name: str  # as users read it (clover models, messages)
    module: str  # its file, as a module path (imported when its heads are built, loaded, drafted or trained)
    about: str = ""  # a few words for `clover train --arch`'s help


FAMILIES = (  # in this order in --draft's list, the help texts and the messages
    Family("clover2", "clover", "Clover-2", "clover_cli.drafters.clover2", "Clover-2"),
    Family("medusa", "medusa", "Medusa", "clover_cli.drafters.medusa"),
    Family("eagle", "eagle", "EAGLE", "clover_cli.drafters.eagle",
           "EAGLE-1's one-layer model, drafting EAGLE-2's dynamic tree"),
    Family("eagle3", "eagle3", "EAGLE-3", "clover_cli.drafters.eagle3",
           "EAGLE-3: three target layers fused, a --draft-vocab vocabulary"),
)


@dataclass(frozen=True)
class Layout:
    """A published layout a family's file reads (besides clover's own format, which every family has)."""
    name: str  # detect()'s answer for it, e.g. "medusa-authors"
    text: str  # in the list of layouts an error names: "Medusa's"
    is_layout: Callable  # (path, raw config.json dict) -> bool
    load: Callable  # (path, target_model, dtype) -> heads
    before: str | None = None  # an architecture whose layout's test its files pass too: this one is tried first


@dataclass(frozen=True)
class Training:
    """How `clover train` trains the family (train/loss.py, train/loop.py, train/publish.py)."""
    features: str = "post"  # the target's last hidden states its heads read: "pre" (before the final norm), "post"
    tokens: bool = False  # its forward reads (features, tokens, token embedding, rotary, positions), not features alone
    noise: float = 0.0  # width of the uniform noise added to the features while training
    reg_scale: float = 1.0  # its feature regression weighs this many times --reg-weight
    one_model: bool = False  # one layer drafting --heads deep: one accuracy row, one layer, said so on the card
    layers: bool = False  # takes --layers (augmenting layers): checked, recorded in a checkpoint, on the card
    idle_one_head: bool = False  # with one head some parameters get no gradient (DistributedDataParallel is told)
    own_vocab: bool = False  # its heads keep the draft vocabulary themselves (heads.use_vocab) instead of a mapping
    loss: Callable | None = None  # its own loss (heads, model, x, mask, post, cfg) -> (total, per head) instead of
    #                               train/loss.py's
    card_name: str | None = None  # the model card's name for it (default: the family's name)


@dataclass(frozen=True)
class Spec:
    """What a family's file declares about it, as `SPEC` (registry.py and train/ read it)."""
    build: Callable  # (HeadsConfig, target_model) -> nn.Module: clover's own format, filled by registry.load_own
    drafter: type  # its Drafter class, made as drafter(heads, target, **grow)
    layout: Layout | None = None  # its published layout, if clover reads one
    training: Training = field(default_factory=Training)
    copies_layer: bool = False  # its heads copy the target's decoder layer: the layer's shape must match the target's
    config_problem: Callable | None = None  # (HeadsConfig) -> what is wrong with a config of its, or None
    bench_row: str | None = None  # `clover bench`'s row that runs its heads (default: its --draft name)


def by_architecture(architecture: str | None) -> Family | None:
    return next((f for f in FAMILIES if f.architecture == architecture), None)


def by_draft(name: str | None) -> Family | None:
    return next((f for f in FAMILIES if f.draft == name), None)


def heads_drafts() -> dict[str, str]:
    """A heads drafter's --draft name -> its family's architecture (what --draft NAME needs the heads to be)."""
    return {f.draft: f.architecture for f in FAMILIES}


def drafts() -> tuple[str, ...]:
    """Every --draft name. auto: the model's heads merged with n-gram lookup when it has heads, else ngram; model: a
    smaller draft model (drafters/draft_model.py); self: the target with layers skipped as its own draft
    (drafters/self_draft.py)."""
    return ("auto", *(f.draft for f in FAMILIES), "ngram", "model", "self", "none")


def either(names) -> str:
    """'a, b, c or d'."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def spec(architecture: str) -> Spec:
    """The SPEC of a family's file (imported now, torch with it). KeyError for an architecture not in FAMILIES."""
    family = by_architecture(architecture)
    if family is None:
        raise KeyError(architecture)
    return importlib.import_module(family.module).SPEC
