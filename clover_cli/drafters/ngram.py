"""Training-free drafting for any model: prompt lookup plus adaptive tri-gram statistics.

Prompt lookup (as in prompt-lookup / aggressive decoding): find earlier places where the last n tokens (n = 4..1,
longest first) occurred in the conversation and propose what followed them. The tri-gram statistics (as in
ADED) count, over everything this session has seen, the model's own replies included, which token followed each
pair of tokens; their most likely chain is proposed too. Both go into one trie rooted at the current token.

How far a looked-up continuation stays right is learned as it goes: after each step the drafter compares the chain
it proposed with the tokens the target went on to produce and keeps, per depth, how often a token was right when
every token before it was, separately for each length of the matched suffix (a one-token match predicts far less
than a four-token one). Text that repeats (a loop, a quoted passage, code being edited) earns long chains; text
that does not keeps them short. A node's score is its share of the matches times those survival rates.

A model directory may hold tri-gram counts of the model's own replies to other prompts (PRIOR_FILE, made by
`scripts/build_ngram_prior.py`; the bundled model has one), as llama.cpp's static lookup cache and REST's datastore
do: where the conversation has no counts yet for the last two tokens, the chain follows the prior's instead. A
model's replies reuse its own phrases from conversation to conversation, so this drafts where lookup finds nothing.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import torch

from ..errors import CloverError
from ..tree import DraftTree
from ..store import PRIOR_FILE
from .base import Drafter

MIN_CHAIN_P = 0.1  # a tri-gram chain stops at a token predicted with less than this


def best_next(counts: Counter) -> tuple[int, float]:
    """The most frequent next token and its share of the counts."""
    tok, c = counts.most_common(1)[0]
    return tok, c / sum(counts.values())


def prior_table(trigrams: dict[tuple, Counter]) -> dict[tuple[int, int], tuple[int, float]]:
    """(a, b) -> best_next of its counts, for the pairs whose best share reaches MIN_CHAIN_P: all the chain needs of
    a pair."""
    best = {pair: best_next(counts) for pair, counts in trigrams.items()}
    return {pair: (tok, p) for pair, (tok, p) in best.items() if p >= MIN_CHAIN_P}


def save_prior(path: Path, trigrams: dict[tuple, Counter]) -> Path:
    """Write tri-gram counts ((a, b) -> Counter of next tokens) as PRIOR_FILE's layout, atomically."""
    from safetensors.torch import save

    from .. import atomic

    rows = sorted((a, b, c, n) for (a, b), counts in trigrams.items() for c, n in counts.items() if n > 0)
    table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)
    return atomic.write_bytes(Path(path), save({"trigrams": table}))


def load_prior(model_dir, vocab_size: int) -> dict[tuple[int, int], tuple[int, float]] | None:
    """The prior in a model directory (None when it has none). A damaged file, or one for another vocabulary, is
    refused in one line."""
    from .common import read_tensors

    file = Path(model_dir) / PRIOR_FILE
    if not file.is_file():
        return None
    table = read_tensors(file, "n-gram prior").get("trigrams")
    if (table is None or table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != 4
            or (table.numel() and (table[:, :3].min() < 0 or table[:, 3].min() < 1))):
        raise CloverError(f"n-gram prior {file}: not a table of (a, b, c, count) rows")
    if table.numel() and table[:, :3].max() >= vocab_size:
        raise CloverError(f"n-gram prior {file} was made for a larger vocabulary than this model's ({vocab_size})")
    trigrams: dict[tuple, Counter] = defaultdict(Counter)
    for a, b, c, n in table.tolist():
        trigrams[(a, b)][c] += n
    return prior_table(trigrams)


class NgramDrafter(Drafter):
    name = "ngram"
    observes = False  # the statistics come from the context itself

    # decay 0.9 rather than 0.8: 2-12% more tokens/s with the prior on the bundled model (compiled step; the bench's
    # prompts and 27 unseen ShareGPT training-split first turns; docs/BENCHMARKS.md, 2026-11-25 afternoon)
    def __init__(self, max_n: int = 4, max_depth: int = 32, matches: int = 4, decay: float = 0.9,
                 chain_depth: int = 8, prior: dict | None = None):
        self.max_n, self.max_depth, self.matches, self.chain_depth = max_n, max_depth, matches, chain_depth
        self.decay = decay  # per-depth survival before anything is learned, and the tri-gram chain's discount
        self.tokens: list[int] = []
        self.checked = 0  # how many of `tokens` the next context is known to share (until reset() says less)
        self.index: dict[tuple, list[int]] = defaultdict(list)
        self.trigrams: dict[tuple, Counter] = defaultdict(Counter)  # session-wide, survives resets
        self.best: dict[tuple, tuple[int, float]] = {}  # best_next of trigrams' counts, per pair, while unchanged
        self.prior = prior or {}  # (a, b) -> (next token, share): the model's own replies elsewhere (load_prior)
        # survival[k][d]: [right, tried] (decayed counts) for the token at depth d+1 looked up after a k-token match,
        # when all before it were right; starts as PRIOR_WEIGHT observations at `decay`
        self.survival = {k: [[decay * self.PRIOR_WEIGHT, float(self.PRIOR_WEIGHT)] for _ in range(max_depth)]
                         for k in range(1, max_n + 1)}
        # (context length, matched suffix length, best looked-up chain) of the last proposal
        self.last: tuple[int, int, list[int]] | None = None
        self.min_score = 0.0  # set by the engine: nodes scored below it do not pay for their verification

    PRIOR_WEIGHT = 2
    FORGET = 0.97  # each new observation at a depth weighs the older ones down by this

    def _learn(self, last: tuple[int, int, list[int]], context: list[int]) -> None:
        """Score a proposal's chain against what the target produced after it; `context` continues the one the
        proposal was made for, so its tokens from there on are what came next (as far as known)."""
        start, k, chain = last
        for d, (tok, real) in enumerate(zip(chain, context[start:])):
            stat = self.survival[k][d]
            stat[0] = stat[0] * self.FORGET + (tok == real)
            stat[1] = stat[1] * self.FORGET + 1.0
            if tok != real:
                break

    def survival_rates(self, k: int) -> list[float]:
        return [right / tried for right, tried in self.survival[k]]

    def reset(self, length: int) -> None:
        # the next context may differ from the one indexed from here on: propose() compares it from there
        self.checked = min(self.checked, length)

    def observe(self, hidden, next_tokens) -> None:
        pass  # the statistics come from the context itself

    def _sync(self, context: list[int]) -> bool:
        """Index the context's new tokens. Returns whether it continues the context seen before."""
        n = len(self.tokens)
        start = min(self.checked, n)  # the indexed tokens before it are the context's (nothing reset them)
        if n > len(context) or self.tokens[start:] != context[start:n]:
            self.tokens, self.index, n = [], defaultdict(list), 0
            learn = False  # a rewritten conversation: index it again, but count its tri-grams only once
        else:
            learn = True
        self.checked = len(context)
        for i in range(n, len(context)):
            self.tokens.append(context[i])
            for k in range(1, self.max_n + 1):
                if i - k + 1 >= 0:
                    self.index[tuple(context[i - k + 1:i + 1])].append(i)
            if learn and i >= 2:
                pair = (context[i - 2], context[i - 1])
                self.trigrams[pair][context[i]] += 1
                self.best.pop(pair, None)
        return learn

    def _lookup(self, context: list[int]) -> tuple[int, list[int]]:
        """(k, positions) for the longest suffix of k tokens that occurred before: where its latest (at most
        `matches`) earlier occurrences end, most recent first ((0, []) when none did)."""
        last = len(context) - 1
        for k in range(min(self.max_n, len(context)), 0, -1):
            ends = self.index.get(tuple(context[-k:]))
            if not ends:
                continue
            picked = []
            for p in reversed(ends):  # ascending positions: the latest first
                if p < last:
                    picked.append(p)
                    if len(picked) == self.matches:
                        break
            if picked:
                return k, picked
        return 0, []

    def _continuation(self, context: list[int], p: int, depth: int) -> list[int]:
        """What followed position p, up to `depth` tokens. When it runs into the end of the context (the match is
        the text repeating itself with period last - p), the repeat is carried on."""
        out = context[p + 1:p + 1 + depth]
        period = len(context) - 1 - p
        while len(out) < depth:
            out.append(out[len(out) - period])
        return out

    def _trigram_chain(self, context: list[int]) -> tuple[list[int], list[float]]:
        chain, probs = [], []
        a, b = (context[-2], context[-1]) if len(context) >= 2 else (None, context[-1])
        for _ in range(self.chain_depth):
            best = self.best.get((a, b))
            if best is None and self.trigrams.get((a, b)):
                best = self.best[(a, b)] = best_next(self.trigrams[(a, b)])
            if best is not None:  # what this conversation says first
                tok, p = best
            elif (a, b) in self.prior:
                tok, p = self.prior[(a, b)]
            else:
                break
            if p < MIN_CHAIN_P:
                break
            chain.append(tok)
            probs.append(p)
            a, b = b, tok
        return chain, probs

    def propose(self, context, budget) -> DraftTree:
        """A trie of the looked-up continuations and the tri-gram chain. A node's score is the share of earlier
        matches that continued through it times the learned chance of getting that deep (or the chain's tri-gram
        probability, discounted by decay per depth). Nothing deeper than where that chance falls below min_score
        is grown: such a node cannot pay for its verification."""
        last, self.last = self.last, None
        if self._sync(context) and last is not None:
            self._learn(last, context)
        tokens, parents, depth = [context[-1]], [-1], [0]
        mass, chained = [0.0], [0.0]  # per node: its share of the matches, its tri-gram chain probability
        kids: list[dict[int, int]] = [{}]

        def child(node: int, tok: int) -> int:
            nxt = kids[node].get(tok)
            if nxt is None:
                nxt = kids[node][tok] = len(tokens)
                kids.append({})
                tokens.append(tok)
                parents.append(node)
                depth.append(depth[node] + 1)
                mass.append(0.0)
                chained.append(0.0)
            return nxt

        k, ends = self._lookup(context)
        reach = [1.0]  # the chance a looked-up token at each depth is right, with all before it
        if ends:
            for rate in self.survival_rates(k):
                if reach[-1] * rate < self.min_score:
                    break
                reach.append(reach[-1] * rate)
            # the chain to learn from: the most recent match's continuation, as deep as it can be scored
            self.last = (len(context), k, self._continuation(context, ends[0], self.max_depth))
            for p in ends:
                node = 0
                for tok in self._continuation(context, p, len(reach) - 1):
                    node = child(node, tok)
                    mass[node] += 1.0 / len(ends)
        chain, probs = self._trigram_chain(context)
        node, p_path = 0, 1.0
        for tok, p in zip(chain, probs):
            p_path *= p * self.decay
            if p_path < self.min_score:
                break
            node = child(node, tok)
            chained[node] = max(chained[node], p_path)
        score = [max(m * reach[d] if m else 0.0, c) for m, d, c in zip(mass, depth, chained)]
        score[0] = 1.0
        for i in range(1, len(tokens)):
            score[i] = min(score[i], score[parents[i]])
        return DraftTree(tokens, parents, score).prune(budget)
