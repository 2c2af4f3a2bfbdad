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
