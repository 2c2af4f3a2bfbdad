"""The one place a drafter is made from its name (families.drafts()) and what it runs on: used by the session (--draft,
/draft) and by clover bench (one fresh drafter per run). Finding and loading what a drafter needs (heads, a draft
model, the n-gram prior, cache files) is the caller's; which class runs a heads family is the registry's."""

from __future__ import annotations

from .base import Drafter, NoDrafter
from .merged import ChoiceStats, MergedDrafter

LOOKUP_ENOUGH = 3.0  # measured on the bundled model, CPU: 1.98x vs 1.83x plain without the skip (docs/BENCHMARKS.md)


def make_drafter(name: str, target, *, heads=None, draft_model=None, prior=None, static: bool = False,
                 learned_stop: bool = False, stop_file=None, self_cache=None, log=None,
                 choices: ChoiceStats | None = None) -> Drafter:
    """The drafter `name` over `target`.

    auto          `heads` merged with n-gram lookup (auto_drafter, learning in `choices`); n-gram lookup alone when
                  there are no heads
    clover, medusa, eagle, eagle3
                  `heads` (loaded by registry.load; the caller checks they are of that family), static: the fixed
                  tree shape (common.STATIC_TREE)
    ngram         n-gram lookup with the model's `prior` (ngram.load_prior), if any
    model         `draft_model` (draft_model.load_draft_model) drafting a multi-candidate tree, or its top-1 chain
                  when static; learned_stop: its branches end by a learned rule, kept in `stop_file`
    self          the target with layers skipped (their choice cached in `self_cache`; `log` says what it does)
    none          plain decoding
    """
    if name == "none":
        return NoDrafter()
    if name == "ngram" or (name == "auto" and heads is None):
        from .ngram import NgramDrafter

        return NgramDrafter(prior=prior)
    if name == "model":
        from .draft_model import ModelDrafter

        if static:
            return ModelDrafter(draft_model, target, tree="chain", stop_below=0.0)
        if learned_stop:
            return ModelDrafter(draft_model, target, learned_stop=True, stop_file=stop_file)
        return ModelDrafter(draft_model, target)
    if name == "self":
        from .self_draft import SelfDrafter

        if static:
            return SelfDrafter(target, tree="chain", cache=self_cache, log=log, stop_below=0.0)
        return SelfDrafter(target, cache=self_cache, log=log, learned_stop=learned_stop)
    from . import registry

    drafter = registry.drafter_for(heads, target, **({"static": True} if static else {}))
    return auto_drafter(drafter, choices, prior) if name == "auto" else drafter


def auto_drafter(heads_drafter, choices=None, prior=None) -> MergedDrafter:
    """The default drafter when there are heads: the heads, and n-gram lookup for what already occurred (with the
    model's n-gram `prior`, if any). Whether a step runs the heads is learned from the tokens per second steps gave
    with and without them (`choices`, shared by the drafters of one session or bench method); before that, lookup
    alone when it already expects LOOKUP_ENOUGH accepted tokens (a repeat)."""
    from .ngram import NgramDrafter

    return MergedDrafter(heads_drafter, NgramDrafter(prior=prior), enough=LOOKUP_ENOUGH,
                         choices=choices or ChoiceStats())
