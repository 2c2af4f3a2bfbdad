"""The protocol every drafter implements, every optional hook declared with its default, and NoDrafter.

The engine keeps the drafter in step with the target's committed tokens:

    reset(length)          forget everything from position `length` on (a new or edited conversation)
    observe(hidden, next)  the target committed positions p..p+m-1: hidden[i] is its pre-norm last hidden state
                           at position p+i, next[i] the token at position p+i+1 (the last one is the new root)
    propose(context, n)    a DraftTree rooted at context[-1] (the root) with at most n drafted nodes

`context` is every token so far, the root included. A drafter subclasses Drafter, so that the engine, the session
and the compiler read every hook below by plain attribute access; a drafter overrides only those it uses.
"""

from __future__ import annotations

import torch

from ..tree import DraftTree


class Drafter:
    name: str = "drafter"  # as --draft and the statistics say it
    # whether observe() reads its arguments: a drafter that learns only from the context (lookup, a draft model
    # with its own cache) says False, and the engine skips making them (the accepted rows of the target's hidden
    # states and the tokens as a tensor: ~60 us a step on a CPU, whose caches the step's forward has just flushed)
    observes: bool = True
    max_depth: int = 1  # deepest node it drafts (chat's depth legend)
    # which layers' inputs it reads instead of the pre-norm last hidden state (EAGLE-3: three), None: that state
    feature_layers = None
    # whether it scores its nodes by an acceptance curve the engine learns and hands it (`curve`,
    # decode.budget.AcceptanceCurve; None when learning is off)
    learns_acceptance: bool = False
    curve = None
    sampling = None  # set by the engine before each reply (decode.verify.Sampling): a drafter sampling its candidates
    min_score: float = 0.0  # set by the engine: nodes scored below it do not pay for their verification
    heads = None  # the heads (nn.Module) a heads drafter runs
    programs = None  # their compiled programs, once attached (None: the heads run eager)
    # which compiled programs step/ builds for its heads ("clover": Clover-2's, "medusa": Medusa's; step.heads_kind),
    # None: its heads (if any) run eager
    programs_kind: str | None = None
    draft = None  # a draft model's drafter: its model, run as a Target (the compiler builds its step too)
    choices = None  # a MergedDrafter's learned choice of when its first drafter pays (merged.ChoiceStats)

    @property
    def primary(self) -> Drafter:
        """The drafter that runs heads or a model (a MergedDrafter's first); itself for every other."""
        return self

    def reset(self, length: int) -> None:
        pass

    def observe(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        pass

    def propose(self, context: list[int], budget: int) -> DraftTree:
        raise NotImplementedError

    def save_learning(self) -> None:
        """Keep what it learned on disk (a draft model's learned early stop); called after each reply."""


class NoDrafter(Drafter):
    """Plain decoding through the same engine: the tree is just the root."""

    name = "none"
    observes = False

    def propose(self, context, budget) -> DraftTree:
        return DraftTree.root_only(context[-1])
