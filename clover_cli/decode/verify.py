"""The exact math of speculative decoding: the target's sampling distribution (warp, penalize), a draw from it
(sample), the verdict on a drafted tree (accept) and when a reply ends (StopCheck).

Every emitted token is one the target alone would have produced (greedy) or a sample of exactly the target's
distribution (sampling): nothing here depends on the drafter or on what a step costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..tree import DraftTree

@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    # transformers' repetition penalty (CTRL): before choosing, the logit of every token already in the sequence
    # (prompt included) is divided by it when positive, multiplied when negative; 1.0: none
    repetition_penalty: float = 1.0
    top_k: int = 0  # only the k most likely tokens (0: all)
    min_p: float = 0.0  # only tokens at least min_p times as likely as the most likely one (0: all)
    # None: nothing more. k >= 0: each emitted token's log-probability under the target (the log-softmax of its raw
    # logits, before any of the above) and its k most likely alternatives, in StepEvent.logprobs (clover serve)
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def token_logprobs(rows: torch.Tensor, tokens: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per token: its log-probability under its row of raw logits [len(tokens), V] (the target's log-softmax), and
    the `top` most likely tokens of that row with theirs."""
    z = torch.log_softmax(rows.float(), dim=-1)
    chosen = z.gather(1, torch.tensor(tokens, dtype=torch.long, device=z.device)[:, None])[:, 0].tolist()
    if top <= 0:
        return [(c, []) for c in chosen]
    values, ids = z.topk(min(top, z.shape[-1]), dim=-1)
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), values.tolist())]


def warp(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Sampling probabilities, unnormalised where a filter cut some tokens: softmax(logits / temperature), then
    transformers' warpers in the order its `generate` applies them: top-k, top-p (on what top-k kept), min-p. The
    largest logit is taken off first (the same softmax), so that a tiny temperature overflows to -inf only for the
    others, never to inf - inf = nan: such a temperature samples the argmax.

    Every filter keeps the most likely token (transformers' min_tokens_to_keep=1): for top-p, the mass before it
    is 0, below any top_p > 0, but a top_p under float32's smallest number (1e-300) compares as 0 and would leave
    nothing to sample from; such a top_p samples the argmax. Top-k keeps ties with the k-th logit, as transformers
    does; min-p compares each probability with min_p times the largest one, which no earlier filter changes."""
    z = logits.float()
    z = (z - z.max(-1, keepdim=True).values) / max(s.temperature, torch.finfo(torch.float32).tiny)
    probs = torch.softmax(z, dim=-1)
    if 0 < s.top_k < probs.shape[-1]:
        kth = z.topk(s.top_k, dim=-1).values[..., -1:]  # on the logits, as transformers compares them
        probs = probs.masked_fill(z < kth, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)  # top-p reads the mass of what top-k kept
    if s.top_p < 1.0:
        probs = _top_p(probs, s.top_p)
    if s.min_p > 0.0:
        probs = probs.masked_fill(probs < s.min_p * probs.max(-1, keepdim=True).values, 0.0)
    return probs


TOP_P_PEEK = 256  # top-p looks among this many most likely tokens first (a full sort of 49k takes ~4 ms a row)


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p: a token is cut where the mass of the tokens more likely than it already reaches top_p (the most likely
    one always stays). The cut nearly always falls among the few most likely tokens, so those are taken first
    (topk, sorted) and the whole row sorted only when their mass falls short of top_p: the same tokens kept with the
    same probabilities as the full sort gives, the partial sums being the same sums in the same order."""
    k = min(TOP_P_PEEK, probs.shape[-1])
    sorted_p, order = probs.topk(k, dim=-1)
    before = sorted_p.cumsum(-1) - sorted_p  # the mass of the tokens more likely than each
    if k < probs.shape[-1] and not bool((before[..., -1] >= top_p).all()):
        sorted_p, order = probs.sort(descending=True)  # a flat row: its cut lies further down
        before = sorted_p.cumsum(-1) - sorted_p
    outside = before >= top_p  # mass before this token already reaches top_p
    outside[..., 0] = False
    sorted_p = sorted_p.masked_fill(outside, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


def penalize(logits: torch.Tensor, tree: DraftTree, context: list[int], penalty: float) -> torch.Tensor:
    """The tree's logits [nodes, V] with transformers' repetition penalty applied per node: node j's row predicts
    the token after context + the tokens on the path from the root to j (both ends included), so every token in
    those is penalised, once, the way transformers' RepetitionPenaltyLogitsProcessor does (float32 logits; divided
    by the penalty where positive, multiplied where negative). The verdict on each node is then the one the target
    with that penalty gives alone, and the output stays exactly its output. Only the seen entries are read and
    written (a [nodes, V] mask would cost ~70 ms a step with a 152k vocabulary)."""
    if penalty == 1.0:
        return logits
    z = logits.float().clone()
    n, vocab = z.shape
    dev = z.device
    # ids past the logits are left out, as transformers leaves them out
    seen = torch.tensor(sorted(t for t in set(context) if 0 <= t < vocab), dtype=torch.long, device=dev)
    # node j's path: j and its ancestors (a path token seen before is written twice, the same value: penalised once)
    rows, nodes = tree.ancestor_mask().nonzero()
    cols = np.asarray(tree.tokens, dtype=np.int64)[nodes]
    inside = (cols >= 0) & (cols < vocab)
    rows_t = torch.cat([torch.arange(n, device=dev).repeat_interleave(seen.numel()),
                        torch.from_numpy(rows[inside].astype(np.int64)).to(dev)])
    cols_t = torch.cat([seen.repeat(n), torch.from_numpy(cols[inside]).to(dev)])
    picked = z[rows_t, cols_t]
    z[rows_t, cols_t] = torch.where(picked < 0, picked * penalty, picked / penalty)
    return z


def sample(p: torch.Tensor, rng: torch.Generator) -> int:
    """One token drawn from the (unnormalised) probabilities p [V], by inverting their cumulative sum in float64:
    token i is drawn when u falls in [c[i-1], c[i]) for u uniform in [0, c[V-1]), so exactly with probability
    p[i] / sum(p), and a zero entry never. torch.multinomial draws from the same distribution but costs ~180 us for
    8k entries on a CPU (one exponential draw per entry) against ~30 us for this: it took an eighth of a sampled
    step of the bundled model (docs/BENCHMARKS.md)."""
    c = p.double().cumsum(0)
    total = c[-1].item()
    if not 0.0 < total < float("inf"):  # NaN, negative or no mass: no distribution to draw from
        raise ValueError(f"cannot sample from probabilities summing to {total}")
    u = torch.rand((), generator=rng, dtype=torch.float64).item() * total
    i = int(torch.searchsorted(c, torch.tensor([u], dtype=torch.float64, device=c.device), right=True)[0])
    if i >= c.numel():  # u rounded up to the total: the last token with any probability
        i = int(torch.nonzero(p > 0)[-1, 0])
    return i


def cpu_rows(logits: torch.Tensor) -> np.ndarray | None:
    """The logits as a numpy array over their memory when they are on the CPU in a type numpy has, else None."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64, torch.float16):
        return (logits.detach() if logits.requires_grad else logits).numpy()
    return None


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first of equal maxima, as torch.argmax and transformers' greedy search pick). On a CPU
    through numpy: torch's reduction over the last dimension costs ~30 us for a few rows of 8k logits, numpy's ~5."""
    rows = cpu_rows(logits)
    return (logits if rows is None else rows).argmax(-1).tolist()


def accept(tree: DraftTree, logits: torch.Tensor, s: Sampling, rng: torch.Generator) -> tuple[list[int], int]:
    """Walk the tree with the target's verdict. Returns the accepted node path (root first) and the bonus token.

    Greedy: follow the child whose token is the target's argmax. Sampling: at each node, try its children in order;
    child x is accepted with probability p(x) under the target's (remaining) distribution p, otherwise x is removed
    from p. If no child is accepted the bonus token is drawn from what remains of p. The proposal of each try is
    the sibling itself, so the result is an exact sample of p (recursive rejection sampling over siblings).

    A node whose children were sampled from a proposal distribution q (`tree.proposals[node]`, the children in the
    order they were drawn, without replacement) is walked with q-aware multi-candidate rejection (SpecInfer / MCSD):
    child x is accepted with probability min(1, p(x) / q(x)); on a rejection p becomes the normalised positive part
    of p - q and x is taken out of q. Each accepted token is again an exact sample of p, and a draft close to the
    target gets its samples accepted more often than fixed tokens would be.
    """
    kids = tree.children()
    node, path = 0, [0]
    if s.greedy:
        rows = cpu_rows(logits)
        if rows is not None:  # only the rows the walk reaches: a 16-node tree is mostly left at depth 3 or 4
            choice = lambda i: int(rows[i].argmax())  # noqa: E731 - the first of equal maxima, as torch.argmax
        else:
            choice = argmax_rows(logits).__getitem__  # one transfer from the device
        while True:
            best = choice(node)
            nxt = next((c for c in kids[node] if tree.tokens[c] == best), None)
            if nxt is None:
                return path, best
            path.append(nxt)
            node = nxt
    proposals = tree.proposals or {}
    while True:
        p = warp(logits[node].cpu(), s)  # on the CPU, where the generator lives (the same draws on any device)
        q, chosen = proposals.get(node), None
        if q is None:
            for c in kids[node]:
                tok = tree.tokens[c]
                if torch.rand((), generator=rng).item() * p.sum().item() < p[tok].item():
                    chosen = c
                    break
                p[tok] = 0.0
        else:
            q = q.float().cpu().clone()
            for c in kids[node]:
                tok = tree.tokens[c]
                # accepted with probability min(1, p(x) / q(x)), p normalised
                if torch.rand((), generator=rng).item() * q[tok].item() * p.sum().item() < p[tok].item():
                    chosen = c
                    break
                residual = (p / p.sum() - q).clamp_(min=0.0)
                if residual.sum().item() <= 0.0:  # p == q up to rounding: a rejection had probability ~0
                    break
                p = residual
                q[tok] = 0.0
                q = q / q.sum().clamp(min=1e-30)
        if chosen is None:
            return path, sample(p, rng)
        path.append(chosen)
        node = chosen


class StopCheck:
    """Ends generation at an EOS token, at a stop string, or after max_new_tokens."""

    def __init__(self, max_new_tokens: int, eos_ids=(), stop_strings=(), decode: Callable | None = None):
        self.max_new_tokens = max_new_tokens
        self.eos_ids = set(eos_ids)
        self.stop_strings = [s for s in stop_strings if s]
        self.decode = decode
        self.window = max((len(s) for s in self.stop_strings), default=0) + 8
        self.out: list[int] = []
        self._ends = {s[-1] for s in self.stop_strings}
        self._may_end: dict[int, bool] = {}  # token -> its text holds the last character of a stop string

    def _may_complete(self, token: int) -> bool:
        """A stop string that appears only now ends inside this token's text, so that text holds its last
        character (a token that is part of a multi-byte character is always checked)."""
        known = self._may_end.get(token)
        if known is None:
            text = self.decode([token])
            known = self._may_end[token] = "\ufffd" in text or any(c in text for c in self._ends)
        return known

    def push(self, token: int) -> str | None:
        self.out.append(token)
        if token in self.eos_ids:
            return "eos"
        if self.stop_strings and self.decode is not None and self._may_complete(token):
            tail = self.decode(self.out[-self.window:])
            if any(s in tail for s in self.stop_strings):
                return "stop"
        if len(self.out) >= self.max_new_tokens:
            return "length"
        return None
