"""Drafters propose token trees for the target to verify. Every drafter implements the same small protocol.

The engine keeps the drafter in step with the target's committed tokens:

    reset(length)          forget everything from position `length` on (a new or edited conversation)
    observe(hidden, next)  the target committed positions p..p+m-1: hidden[i] is its pre-norm last hidden state
                           at position p+i, next[i] the token at position p+i+1 (the last one is the new root)
    propose(context, n)    a DraftTree rooted at context[-1] (the root) with at most n drafted nodes

`context` is every token so far, the root included.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..tree import DraftTree

NAMES = ("clover", "medusa", "ngram", "none")


class Drafter(Protocol):
    name: str

    def reset(self, length: int) -> None: ...

    def observe(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> None: ...

    def propose(self, context: list[int], budget: int) -> DraftTree: ...


class NoDrafter:
    """Plain decoding through the same engine: the tree is just the root."""

    name = "none"

    def reset(self, length: int) -> None:
        pass

    def observe(self, hidden, next_tokens) -> None:
        pass

    def propose(self, context, budget) -> DraftTree:
        return DraftTree.root_only(context[-1])


class MergedDrafter:
    """Two drafters proposing into one tree: Clover-2 heads with n-gram lookup (the default when heads exist).

    The heads predict what comes next from the target's hidden state; lookup copies long stretches that already
    occurred in the conversation. Each node keeps the better of the two scores.
    """

    def __init__(self, first, second, enough: float | None = None):
        self.first, self.second = first, second
        self.enough = enough  # when the second tree alone expects this many accepted tokens, the first is skipped
        self.name = f"{first.name}+{second.name}"
        self.max_depth = max(getattr(first, "max_depth", 1), getattr(second, "max_depth", 1))

    @property
    def min_score(self) -> float:
        return getattr(self.first, "min_score", 0.0)

    @min_score.setter
    def min_score(self, value: float) -> None:
        for d in (self.first, self.second):
            if hasattr(d, "min_score"):
                d.min_score = value

    def reset(self, length: int) -> None:
        self.first.reset(length)
        self.second.reset(length)

    def observe(self, hidden, next_tokens) -> None:
        self.first.observe(hidden, next_tokens)
        self.second.observe(hidden, next_tokens)

    def propose(self, context, budget) -> DraftTree:
        from ..tree import merge_trees

        second = self.second.propose(context, budget)
        if self.enough is not None and sum(second.scores[1:]) >= self.enough:
            return second
        # the second tree goes first: its best chain then takes nodes 1, 2, ... and an accepted run of it needs no
        # move in the target's cache
        return merge_trees(second, self.first.propose(context, budget)).prune(budget)
