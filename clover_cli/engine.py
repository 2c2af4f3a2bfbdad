"""The speculative decoding loop: draft a token tree, verify it in one target forward, keep the longest agreeing path.

    prefill:  run the prompt, choose the first token (the root) from the target's last logits
    step:     tree  = drafter.propose(context + [root])        a token tree rooted at the root
              logits = target(tree tokens, positions = length + depth, ancestor mask)
              path, bonus = accept(tree, logits)              greedy: follow the target's argmax;
                                                               sampling: rejection over siblings
              commit the path's KV in place; the drafter observes the path's hidden states; root = bonus

Every emitted token is one the target alone would have produced (greedy) or a sample of exactly the target's
distribution (sampling): the drafter only decides how many come per step.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch

from .target import Target
from .tree import DraftTree, long_tensor


@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    # transformers' repetition penalty (CTRL): before choosing, the logit of every token already in the sequence
    # (prompt included) is divided by it when positive, multiplied when negative; 1.0: none
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class StepEvent:
    tokens: list[int]  # tokens this step adds to the output, in order
    depths: list[int]  # per token: the draft depth it was accepted at (1, 2, ...), 0 = chosen by the target
    proposed: int = 0  # drafted nodes the target verified this step
    tree_depth: int = 0  # depth of the deepest drafted node
    accepted: int = 0  # drafted tokens the target accepted that this step emits (a stop may cut the rest)
    draft_s: float = 0.0
    verify_s: float = 0.0
    elapsed_s: float = 0.0
    prefill: bool = False
    finish: str | None = None  # "eos", "stop" or "length" on the last step


def warp(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Sampling probabilities: softmax(logits / temperature), restricted to the top-p nucleus. The largest logit is
    taken off first (the same softmax), so that a tiny temperature overflows to -inf only for the others, never to
    inf - inf = nan: such a temperature samples the argmax.

    The nucleus always holds the most likely token (transformers' TopPLogitsWarper, min_tokens_to_keep=1): the
    mass before it is 0, below any top_p > 0, but a top_p under float32's smallest number (1e-300) compares as 0
    and would leave nothing to sample from; such a top_p samples the argmax."""
    z = logits.float()
    z = (z - z.max(-1, keepdim=True).values) / max(s.temperature, torch.finfo(torch.float32).tiny)
    probs = torch.softmax(z, dim=-1)
    if s.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        outside = (sorted_p.cumsum(-1) - sorted_p) >= s.top_p  # mass before this token already reaches top_p
        outside[..., 0] = False
        sorted_p[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return probs


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


PROBE_NODES = 4  # drafted nodes a retry verifies after drafting has been skipped
REFRESH_WINDOW = 9  # forwards per tree size whose median refreshes the stored cost table
# A calibration (no stored costs: the first run of a model, dtype and step without a compiled package, whose build
# measured them) stops measuring after this long, once it has two sizes: the sizes it did not reach follow the line
# through the last two it did. Timing 5 forwards of each of up to 8 sizes took about half a second on the bundled
# model in float32, but ~20 s in bfloat16 on a busy two-core machine (oneDNN's narrow products and their first-use
# kernels, each forward waiting on a core another process held), for a reply of a few tokens.
CALIBRATE_S = 1.0


@dataclass
class CostModel:
    """What a step costs on this device, to choose how many draft nodes are worth verifying.

    verify_s[n] is the measured time of a target forward over n new tokens; draft_s an average of the drafter's
    time; calibration the running ratio of accepted tokens to the drafter's own expectation (sum of scores).
    """

    verify_s: dict[int, float] = field(default_factory=dict)
    draft_s: float = 0.0
    calibration: float = 1.0
    by_mode: dict = field(default_factory=dict)  # calibration per sampling mode: greedy accepts far more
    mode: float | None = None  # the sampling mode `calibration` belongs to
    rate: float = 0.0  # recent tokens per second of whole steps
    refreshed: bool = False  # verify_s changed since it was loaded or measured
    recent: dict = field(default_factory=dict)  # size -> its last forward times (refresh)
    padded: bool = False  # the step runs n tokens as the next size of verify_s (compiled): costs are steps
    partial: bool = False  # measured where the context had no room for the larger sizes: never stored
    # costs of every size measured together (a build's, a calibration's; default: verify_s as given): a size this
    # process has not timed follows it, scaled as the sizes it has timed are (see refresh)
    shape: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.shape:
            self.shape = dict(self.verify_s)

    def use_mode(self, mode):
        """Switch to the calibration learned under `mode` (e.g. the temperature), keeping the current one."""
        if self.mode is not None:
            self.by_mode[self.mode] = self.calibration
        self.mode = mode
        self.calibration = self.by_mode.get(mode, 1.0)

    def verify(self, n: int) -> float:
        sizes = sorted(self.verify_s)
        return self._verify_at(n, sizes, bisect.bisect_left(sizes, n))

    def _verify_at(self, n: int, sizes: list[int], j: int) -> float:
        """verify(n), where sizes[j] is the first measured size >= n (j == len(sizes): past the largest). Between
        two sizes: the larger one's cost when padded (the step runs that size), else linear; past the largest:
        the line through the last two."""
        if j == 0:
            return self.verify_s[sizes[0]]
        if j == len(sizes):
            a, b = sizes[-2], sizes[-1]
            return self.verify_s[b] + (self.verify_s[b] - self.verify_s[a]) * (n - b) / (b - a)
        if self.padded:
            return self.verify_s[sizes[j]]
        a, b = sizes[j - 1], sizes[j]
        return self.verify_s[a] + (self.verify_s[b] - self.verify_s[a]) * (n - a) / (b - a)

    def verify_upto(self, most: int) -> list[float]:
        """[verify(n) for n in 0..most] (index 0 unused), the sizes sorted once and walked once."""
        sizes = sorted(self.verify_s)
        out, j = [0.0], 0
        for n in range(1, most + 1):
            while j < len(sizes) and sizes[j] < n:
                j += 1
            out.append(self._verify_at(n, sizes, j))
        return out

    def best_budget(self, scores: list[float], draft_s: float | None = None) -> int:
        """The number of drafted nodes (best scores first) that maximises expected tokens per second of a step whose
        drafting took `draft_s` (default: the recent average). A drafter whose steps differ in cost (the default one
        runs its heads on some steps only: ~5 ms against ~0.1 ms for lookup alone on the bundled model, CPU) gets
        each step sized by its own: an average raised by a few heads steps made lookup's steps verify bigger trees
        than pay (docs/BENCHMARKS.md)."""
        draft_s = self.draft_s if draft_s is None else draft_s
        ranked = sorted(scores, reverse=True)
        cost = self.verify_upto(len(ranked) + 1)
        best_n, best_rate, gain = 0, 1.0 / (draft_s + cost[1]), 1.0
        for n, sc in enumerate(ranked, 1):
            gain += self.calibration * sc
            rate = gain / (draft_s + cost[n + 1])
            if rate > best_rate:
                best_n, best_rate = n, rate
        return best_n

    def min_score(self) -> float:
        """The score below which a drafted node cannot pay for its share of the verify at the recent speed: a
        drafter need not grow such nodes (0 until a step has been timed)."""
        per_node = (self.verify(17) - self.verify(1)) / 16
        return self.rate * per_node / max(self.calibration, 1e-3)

    def monotone(self):
        """Measured times non-decreasing in tree size: timing noise must not make a bigger tree look cheaper."""
        prev = 0.0
        for n in sorted(self.verify_s):
            self.verify_s[n] = prev = max(self.verify_s[n], prev * 1.001)

    def refresh(self, n: int, seconds: float):
        """Fold the time of a real forward over n tokens into the table. A size's cost becomes the median of its
        last REFRESH_WINDOW forwards (once there are 3), which a one-time cost (a kernel built on first use) or a
        moment the machine was busy does not move. Every size not timed so far in this process follows `shape`,
        scaled by how the timed sizes compare with it: a table stored while the machine was slower (or faster)
        comes right everywhere from the sizes in use, and a size the engine avoids because its stored cost is too
        high gets a fair cost again. Padded (compiled), a tree of n tokens is timed as the size it runs as."""
        if self.padded:
            sizes = sorted(self.verify_s)
            j = bisect.bisect_left(sizes, n)
            n = sizes[j] if j < len(sizes) else n
        if n not in self.verify_s or seconds <= 0:
            return
        seen = self.recent.setdefault(n, [])
        seen.append(seconds)
        del seen[:-REFRESH_WINDOW]
        if len(seen) < 3:
            return
        self.verify_s[n] = sorted(seen)[len(seen) // 2]
        timed = [k for k, v in self.recent.items() if len(v) >= 3 and self.shape.get(k, 0) > 0]
        if timed:
            ratios = sorted(self.verify_s[k] / self.shape[k] for k in timed)
            scale = ratios[len(ratios) // 2]
            for k in self.verify_s:
                if k in self.shape and len(self.recent.get(k, ())) < 3:
                    self.verify_s[k] = self.shape[k] * scale
        self.monotone()
        self.refreshed = True

    def observe_step(self, tokens: int, seconds: float):
        if seconds > 0:
            r = tokens / seconds
            self.rate = r if self.rate == 0.0 else 0.9 * self.rate + 0.1 * r

    def observe(self, expected: float, accepted: int, draft_s: float):
        if expected > 0:
            self.calibration = 0.9 * self.calibration + 0.1 * min(accepted / expected, 3.0)
        self.draft_s = draft_s if self.draft_s == 0.0 else 0.9 * self.draft_s + 0.1 * draft_s


class DraftValue:
    """Whether asking the drafter pays at all, from its last WINDOW calls: the tokens they got accepted, each worth
    a plain step's time (what the target would have spent producing it alone), against the time they took to draft.
    While they do not pay, the drafter is asked only now and then: after EXPLORE plain steps, twice as many after
    each such try that did not pay for itself, EXPLORE again after one that did. The wait grows to MOST_WAIT steps,
    or further (up to LONGEST_WAIT) where a try costs so much that tries that often would take more than
    EXPLORE_SHARE of the decoding time: a try after a long wait pays a catch-up on the skipped tokens (the bundled
    model's Clover-2 heads, CPU, sampling: ~3.3 ms, two plain steps' time), so 64 steps apart the tries still cost
    the default drafter ~3% against plain decoding (docs/BENCHMARKS.md).

    Lenient on purpose: what verifying a tree costs beyond a plain step is left out (the cost model weighs it when
    it sizes the tree; sampled-candidate trees are verified whole), so a drafter whose tokens come in bursts (lookup
    copying a passage) keeps being asked through a dry spell; counting the verify too stopped greedy lookup in such
    spells and lost the passages after them (docs/BENCHMARKS.md). And a try is charged at most what a call made at
    consecutive steps costs: after skipped steps a drafter first catches up on the tokens it did not see (the heads'
    augmenting block, a draft model's forward), work that asking at every step spreads over those steps.

    Sampling at temperature 0.8, the bundled model's drafts are almost never accepted (n-gram lookup: ~0.01 tokens a
    call), an empty proposal never reaches the cost model's `idle` rule, and every step paid for a proposal: lookup
    ran at 0.90-0.97x plain decoding, the default drafter at 0.83-0.96x, the draft model at 0.44-0.64x
    (docs/BENCHMARKS.md). Greedy, lookup's calls are worth ~10x their time and this rule does not fire. Kept per
    sampling mode (temperature and penalty, as the cost model's calibration)."""

    WINDOW = 16
    EXPLORE = 8
    MOST_WAIT = 64
    LONGEST_WAIT = 512
    EXPLORE_SHARE = 0.01

    def __init__(self):
        self.calls: list[tuple[int, float]] = []  # (accepted tokens, seconds charged) of the last WINDOW calls
        self.plain_s = 0.0  # a plain step's time, without drafting (0: not measured yet)
        self.fallback_s = 0.0  # the same, estimated (the target's forward of one token), until it is measured
        self.step_cost = 0.0  # the drafting time of a call made right after another (0: not measured yet)
        self.waited = 0  # plain steps since the drafter was last asked (0 while asked at every step)
        self.wait = self.EXPLORE  # plain steps before the next try, while the calls do not pay
        self.try_s = 0.0  # what the last try took, its catch-up included

    def pays(self) -> bool:
        if len(self.calls) < self.WINDOW:
            return True
        worth = sum(a for a, _ in self.calls) * (self.plain_s or self.fallback_s)
        return worth >= sum(c for _, c in self.calls)

    def ask(self, plain_s: float) -> bool:
        """Whether to ask the drafter at this step (plain_s: a plain step's time if none was measured yet)."""
        self.fallback_s = plain_s
        if self.pays() or self.waited >= self.wait:
            return True
        self.waited += 1
        return False

    def skipped(self) -> None:
        """A step that did not ask the drafter for another reason (the cost model's idle back-off)."""
        self.waited += 1

    def add(self, accepted: int, seconds: float) -> None:
        """A call's accepted tokens and its drafting time."""
        tried = self.waited > 0
        if not tried:
            self.step_cost = seconds if self.step_cost == 0.0 else 0.9 * self.step_cost + 0.1 * seconds
        else:
            self.try_s = seconds
            if self.step_cost > 0.0:
                seconds = min(seconds, self.step_cost)
        self.calls.append((accepted, seconds))
        del self.calls[:-self.WINDOW]
        self.waited = 0
        if tried and not self.pays():
            paid = accepted * (self.plain_s or self.fallback_s) >= seconds
            self.wait = self.EXPLORE if paid else min(2 * self.wait, self.most_wait())
        elif not tried:
            self.wait = self.EXPLORE

    def most_wait(self) -> int:
        """The longest wait between tries: MOST_WAIT, or as many plain steps as keep the last try's cost within
        EXPLORE_SHARE of their time (at most LONGEST_WAIT)."""
        plain = self.plain_s or self.fallback_s
        if plain <= 0.0:
            return self.MOST_WAIT
        return int(min(self.LONGEST_WAIT, max(self.MOST_WAIT, self.try_s / (self.EXPLORE_SHARE * plain))))

    def plain_step(self, seconds: float) -> None:
        if seconds > 0.0:
            self.plain_s = seconds if self.plain_s == 0.0 else 0.9 * self.plain_s + 0.1 * seconds


class AcceptanceCurve:
    """The chance that the target accepts a drafted node whose parent it accepted, as a function of the drafter's
    own probability p for the node and its rank among its siblings, learned from every verification.

    A drafter's probabilities are not that chance: distilled heads estimate the target's distribution, while greedy
    decoding accepts exactly the target's argmax. On held-out prompts (the bundled model's Clover-2 and EAGLE heads)
    a top candidate at p = 0.1-0.2 was accepted 43-69% of the time and one at 0.3-0.4 70-80%, while a second candidate
    was accepted mostly 5-20% of the time whatever its p, a third or later one 1-7%; sampling accepts less. Trees grown
    and pruned on the raw product of probabilities spend their budget on siblings and too little on depth. The
    engine keeps one curve per sampling mode and hands it to the drafter, whose tree scores then multiply these
    chances.

    Estimated per rank class (first, second, later) and bin of p: verdicts counted (a node counts when its parent
    was accepted; accepted or not), starting from PRIOR pseudo-verdicts at the identity, made non-decreasing in p
    within a class (pool-adjacent-violators), linear between bin centres and capped at CAP. Each bin keeps at most
    MOST verdicts' weight, so the curve follows the text. Only the nodes of a drafter that reports its ranks and
    probabilities (DraftTree.drafted) are counted or rescored.
    """

    BINS = 20
    RANKS = 3  # the first candidate, the second, any later one
    PRIOR = 3.0
    MOST = 1000.0
    CAP = 0.99
    REFIT = 4  # verifications between two fits

    def __init__(self):
        self.seen = [[0.0] * self.BINS for _ in range(self.RANKS)]
        self.accepted = [[0.0] * self.BINS for _ in range(self.RANKS)]
        # the curve of each rank class at the bin centres
        self.values = [[(b + 0.5) / self.BINS for b in range(self.BINS)] for _ in range(self.RANKS)]
        self.pending = 0

    def __call__(self, p: float, rank: int = 0) -> float:
        values = self.values[min(rank, self.RANKS - 1)]
        x = p * self.BINS - 0.5  # in bin centres
        if x != x:  # NaN: a drafter's score gone wrong is worth nothing
            return 0.0
        if x <= 0.0:  # below the first centre: from 0 at p = 0
            return values[0] * max(x + 0.5, 0.0) * 2.0
        j = int(x)
        if j >= self.BINS - 1:
            return values[-1]
        f = x - j
        return values[j] + f * (values[j + 1] - values[j])

    def observe(self, tree: DraftTree, path: list[int]) -> None:
        """Count the verdicts of one verification: `path` the accepted nodes, root first."""
        if tree.drafted is None:
            return
        on = set(path)
        for i in range(1, len(tree.tokens)):
            if tree.drafted[i] is None or tree.parents[i] not in on:
                continue
            rank, p = tree.drafted[i]
            r, b = min(rank, self.RANKS - 1), min(max(int(p * self.BINS), 0), self.BINS - 1)
            seen, accepted = self.seen[r], self.accepted[r]
            seen[b] += 1.0
            accepted[b] += i in on
            if seen[b] > self.MOST:
                seen[b] *= 0.5
                accepted[b] *= 0.5
        self.pending += 1
        if self.pending >= self.REFIT:
            self.fit()

    def fit(self) -> None:
        self.pending = 0
        for r in range(self.RANKS):
            blocks = []  # [weighted sum, weight, bins] pooled left to right while they decrease
            for b in range(self.BINS):
                centre = (b + 0.5) / self.BINS
                blocks.append([self.accepted[r][b] + self.PRIOR * centre, self.seen[r][b] + self.PRIOR, 1])
                while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                    s, w, n = blocks.pop()
                    blocks[-1][0] += s
                    blocks[-1][1] += w
                    blocks[-1][2] += n
            values = []
            for s, w, n in blocks:
                values += [min(s / w, self.CAP)] * n
            self.values[r] = values


class Engine:
    """Holds a target, a drafter and what the target's cache already holds, and generates from prompts.

    budget: the most drafted nodes per step; with auto_budget the engine measures the target's verify cost for
    several tree sizes once and verifies, each step, only as many of the drafter's best nodes as pay for
    themselves on this device.
    """

    def __init__(self, target: Target, drafter, budget: int = 32, auto_budget: bool = True, costs=None,
                 learn_acceptance: bool = True, skip_unpaid: bool = True):
        self.target = target
        self.drafter = drafter
        self.budget = budget
        self.auto_budget = auto_budget and budget > 0
        self.cost: CostModel | None = None
        # sampling mode -> AcceptanceCurve handed to a drafter that takes one, kept across replies;
        # learn_acceptance=False: drafters score nodes by their own probabilities
        self.curves: dict | None = {} if learn_acceptance else None
        # a store of measured verify costs, if any: load() -> {n: s} or None, save(table), and reference() -> the
        # costs of every size measured together, which untimed sizes follow (or None)
        self.costs = costs
        self.context: list[int] = []  # exactly the tokens in the target's KV cache
        # sampling mode -> DraftValue, kept across replies; None: the drafter is asked at every step the cost model
        # allows (an ablation measuring the trees themselves)
        self.values: dict | None = {} if skip_unpaid else None

    def use_verify_costs(self, table: dict[int, float], padded: bool = False):
        """Size trees from these verify costs from now on (the step changed, e.g. the compiled one came in)."""
        if self.cost is not None:
            self.cost.verify_s, self.cost.padded, self.cost.shape = dict(table), padded, dict(table)
            self.cost.recent.clear()  # timings of the step it replaces
            self.cost.monotone()

    def _device_sync(self):
        if self.target.device.type == "cuda":
            torch.cuda.synchronize()

    def calibrate(self, root: int):
        """The verify cost of several tree sizes: from the store when it has them, else measured here (about half
        a second on a CPU, CALIBRATE_S at most unless a single forward takes longer) and stored for the next
        process."""
        stored = self.costs.load() if self.costs is not None else None
        if stored:
            self.cost = CostModel(verify_s=stored, padded=self.costs.padded, shape=self.costs.reference() or {})
            self.cost.monotone()
            return
        room = self.target.max_context - self.target.length  # the test forwards must fit the context
        sizes = sorted({1, 2, 4, 8, 16, 32, 64, 128} & set(range(1, self.budget + 2)) | {self.budget + 1})
        cost = CostModel(partial=sizes[-1] > room)
        sizes = [n for n in sizes if n <= room]
        start = time.perf_counter()
        for n in sizes:
            tree = DraftTree([root] * n, [-1] + [0] * (n - 1))
            tokens, depths, mask = tree.tensors(self.target.device)
            times = []
            for _ in range(5):
                t = time.perf_counter()
                self.target.forward(tokens, self.target.length + depths, mask)  # nothing is committed
                self._device_sync()
                times.append(time.perf_counter() - t)
                if len(times) >= 2 and t + times[-1] - start > CALIBRATE_S:
                    break
            cost.verify_s[n] = min(times)
            if cost.verify_s[n] > 2.0:  # too slow a device to keep measuring: extrapolate
                break
            if len(cost.verify_s) >= 2 and time.perf_counter() - start > CALIBRATE_S:
                # measured long enough: the sizes not reached follow the last two (and are refreshed as they run)
                for m in sizes[len(cost.verify_s):]:
                    cost.verify_s[m] = max(cost.verify(m), cost.verify_s[n])
                break
        if len(cost.verify_s) == 1:
            cost.verify_s[2] = cost.verify_s[1] * 1.05
        cost.monotone()
        self.cost = cost
        if self.costs is not None and not cost.partial:
            self.costs.save(cost.verify_s)

    def reset(self):
        """Forget the cache contents (the next prompt is prefilled from scratch)."""
        self.context = []
        self.target.reset(0)
        self.drafter.reset(0)

    def generate(self, prompt: list[int], stop: StopCheck, sampling: Sampling = Sampling()) -> Iterator[StepEvent]:
        """Yield one StepEvent per target forward. Interrupting it (Ctrl-C, an error, or closing the generator
        before it finishes) leaves the engine consistent: the next call starts from a clean cache."""
        if not prompt:
            raise ValueError("empty prompt")
        done = False
        try:
            yield from self._generate(prompt, stop, sampling)
            done = True
        finally:
            if not done:
                self.reset()
            if self.cost is not None and self.cost.refreshed and self.costs is not None and not self.cost.partial:
                self.costs.save(self.cost.verify_s)
                self.cost.refreshed = False

    def _generate(self, prompt: list[int], stop: StopCheck, sampling: Sampling) -> Iterator[StepEvent]:
        rng = torch.Generator()
        if sampling.seed is not None:
            rng.manual_seed(sampling.seed)
        else:
            rng.seed()
        device = self.target.device
        # a drafter may read other features than the pre-norm last hidden state (EAGLE-3: three layers' inputs)
        self.target.use_features(getattr(getattr(self.drafter, "first", self.drafter), "feature_layers", None))

        # Reuse what the cache already holds of this prompt; re-run at least the last prompt token.
        same = 0
        for a, b in zip(self.context, prompt):
            if a != b:
                break
            same += 1
        keep = max(min(same, len(prompt) - 1) - 1, 0)
        self.target.reset(keep)
        self.drafter.reset(keep)
        self.context = list(prompt[:keep])

        t0 = time.perf_counter()
        new = torch.tensor(prompt[keep:], dtype=torch.long, device=device)
        hidden, logits = self.target.forward(new, logits_for=slice(-1, None))
        self.target.cache.append(new.numel())
        self.context = list(prompt)
        first = DraftTree.root_only(prompt[-1])
        _, root = accept(first, penalize(logits, first, prompt[:-1], sampling.repetition_penalty), sampling, rng)
        observes = getattr(self.drafter, "observes", True)
        if observes:
            self.drafter.observe(hidden, long_tensor(prompt[keep + 1:] + [root], device))
        finish = stop.push(root)
        self._device_sync()
        yield StepEvent([root], [0], elapsed_s=time.perf_counter() - t0, prefill=True, finish=finish)
        if self.auto_budget and self.cost is None and finish is None and self.drafter.name != "none":
            self.calibrate(root)

        # drafts fare differently at each temperature, and against a penalised target: each learns on its own
        mode = sampling.temperature if sampling.repetition_penalty == 1.0 else (sampling.temperature,
                                                                                 sampling.repetition_penalty)
        if self.cost is not None:
            self.cost.use_mode(mode)
        curve = None
        if hasattr(self.drafter, "curve"):
            if self.curves is not None:
                curve = self.curves.setdefault(mode, AcceptanceCurve())
            self.drafter.curve = curve
        if hasattr(self.drafter, "sampling"):  # a drafter that samples its candidates at temperature > 0
            self.drafter.sampling = sampling
        value = (self.values.setdefault(mode, DraftValue())
                 if self.cost is not None and self.values is not None else None)
        idle = 0  # steps in a row where no drafted node was worth verifying
        while finish is None:
            t0 = time.perf_counter()
            probe = asked = False
            room = max(0, self.target.max_context - self.target.length - 1)  # drafted nodes the context can take
            if self.cost is not None and idle >= 3 and idle % 8:
                tree = DraftTree.root_only(root)  # drafting does not pay here: plain steps, retrying now and then
                idle += 1
                if value is not None:
                    value.skipped()
            elif value is not None and not value.ask(self.cost.verify(1)):
                tree = DraftTree.root_only(root)  # nor do this drafter's calls lately (DraftValue)
            else:
                asked = True
                probe = idle >= 3
                if self.cost is not None and hasattr(self.drafter, "min_score"):
                    self.drafter.min_score = self.cost.min_score()
                tree = self.drafter.propose(self.context + [root], min(self.budget, room))
            t1 = time.perf_counter()
            judged = asked and room > 0  # a call the context left no room for says nothing of the drafter
            if tree.proposals and len(tree) - 1 > room:
                tree = DraftTree.root_only(root)  # sampled candidates are verified all or none (see accept)
                judged = False
            if self.cost is not None and len(tree) > 1 and not tree.proposals:
                # a retry verifies a few nodes even when the estimate says no: only verified drafts teach the
                # calibration, which could otherwise stay too low for good
                n = self.cost.best_budget(tree.scores[1:], t1 - t0)
                tree = tree.prune(n if n or not probe else PROBE_NODES)
                idle = 0 if n else idle + 1
            tree = tree.prune(room)
            tokens, positions, mask = tree.tensors(device, self.target.length)
            tv = time.perf_counter()
            hidden, logits = self.target.forward(tokens, positions, mask)
            if self.costs is not None and self.cost is not None and device.type == "cpu":
                # keeps the stored table current (a GPU forward returns before it is done: not timed there)
                self.cost.refresh(len(tree), time.perf_counter() - tv)
            path, bonus = accept(tree, penalize(logits, tree, self.context, sampling.repetition_penalty), sampling, rng)
            if curve is not None:
                curve.observe(tree, path)
            self.target.cache.commit(path)
            accepted = [tree.tokens[i] for i in path[1:]]
            if observes:  # the accepted path is most often the tree's first nodes: then a view, not a gather
                rows = hidden[:len(path)] if path[-1] == len(path) - 1 else hidden[path]
                self.drafter.observe(rows, long_tensor(accepted + [bonus], device))
            self.context += [root] + accepted
            self._device_sync()
            t2 = time.perf_counter()
            if self.cost is not None:
                self.cost.observe_step(len(accepted) + 1, t2 - t0)
                if len(tree) > 1:
                    self.cost.observe(sum(tree.scores[1:]), len(accepted), t1 - t0)
                if value is not None:
                    # a plain step's time: a step without a tree, or what a step with one took besides drafting and
                    # its tree's verify beyond the root's (the sampling, acceptance and bookkeeping of every step)
                    extra = self.cost.verify(len(tree)) - self.cost.verify(1) if len(tree) > 1 else 0.0
                    value.plain_step(t2 - t0 if not asked else t2 - t1 - extra)
                    if judged:
                        value.add(len(accepted), t1 - t0)

            out, out_depths = [], []
            for depth, tok in enumerate(accepted + [bonus], 1):
                out.append(tok)
                out_depths.append(depth if depth <= len(accepted) else 0)
                finish = stop.push(tok)
                if finish:
                    break
            yield StepEvent(out, out_depths, proposed=len(tree) - 1, tree_depth=max(tree.depths()),
                            accepted=sum(d > 0 for d in out_depths), draft_s=t1 - t0, verify_s=t2 - t1,
                            elapsed_s=t2 - t0, finish=finish)
            root = bonus
