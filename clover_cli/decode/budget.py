"""What a step of speculative decoding costs and what drafting is worth, learned as it runs: the budget policy.

The engine holds one DraftPolicy. It owns the sampling mode key (mode_key: greedy, each temperature and each
repetition penalty learn on their own), the verify costs of each tree size (CostModel, loaded from or saved to a
store), whether asking the drafter pays at all (DraftValue), and how often the target accepts a drafted node of a
given probability (AcceptanceCurve). None of it changes which tokens come out, only how many come per step.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

import torch

from ..tree import DraftTree

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



def mode_key(temperature: float, repetition_penalty: float = 1.0):
    """The sampling mode a sampling setup learns under: its costs' calibration, its acceptance curve, what its drafter
    calls are worth (DraftValue) and the default drafter's learned choice (drafters.merged.ChoiceStats, kept on disk per
    mode). Drafts fare differently at each temperature, and against a penalised target: each learns on its own.
    The temperature counts to two decimals, so that a server's requests at 0.8 and 0.80000001 share one (and a
    near-zero temperature, which samples the argmax, greedy decoding's). The key is the temperature alone without
    a penalty (greedy: 0.0), else (temperature, penalty)."""
    t = round(float(temperature), 2)
    return t if repetition_penalty == 1.0 else (t, repetition_penalty)


def mode_parts(mode) -> tuple[float, float]:
    """(temperature, repetition penalty) of a mode_key."""
    return mode if isinstance(mode, tuple) else (mode, 1.0)


class DraftPolicy:
    """Everything the engine decides besides exactness: whether to ask the drafter at a step, how many of its nodes
    to verify, and what the steps teach about both. One per engine, kept across replies.

    budget: the most drafted nodes per step; with auto_budget the target's verify cost is measured for several tree
    sizes once (or read from `cost_store`) and each step verifies only as many of the drafter's best nodes as pay
    for themselves on this device. learn_acceptance=False: drafters score nodes by their own probabilities (no
    AcceptanceCurve). skip_unpaid=False: the drafter is asked at every step the cost model allows (an ablation
    measuring the trees themselves).
    """

    def __init__(self, budget: int = 32, auto_budget: bool = True, cost_store=None, learn_acceptance: bool = True,
                 skip_unpaid: bool = True):
        self.budget = budget
        self.auto_budget = auto_budget and budget > 0
        # what a step costs, measured or loaded in this process (None: no sizing, every drafted node is verified)
        self.cost_model: CostModel | None = None
        # a store of measured verify costs (step.costs.StepCosts), if any: load() -> {n: s} or None, save(table), and
        # reference() -> the costs of every size measured together, which untimed sizes follow (or None)
        self.cost_store = cost_store
        # sampling mode -> AcceptanceCurve handed to a drafter that takes one, kept across replies
        self.curves: dict | None = {} if learn_acceptance else None
        # sampling mode -> DraftValue, kept across replies
        self.values: dict | None = {} if skip_unpaid else None
        # this reply's: its curve, its DraftValue, steps in a row where no drafted node was worth verifying, and
        # whether this step is a retry after such steps (a probe)
        self.curve: AcceptanceCurve | None = None
        self.value: DraftValue | None = None
        self.idle = 0
        self.probe = False

    def forget_drafter(self) -> None:
        """Another drafter from now on: what the last one's calls were worth says nothing of this one's."""
        if self.values is not None:
            self.values = {}

    def use_verify_costs(self, table: dict[int, float], padded: bool = False):
        """Size trees from these verify costs from now on (the step changed, e.g. the compiled one came in)."""
        if self.cost_model is not None:
            cost = self.cost_model
            cost.verify_s, cost.padded, cost.shape = dict(table), padded, dict(table)
            cost.recent.clear()  # timings of the step it replaces
            cost.monotone()

    def calibrate(self, target, root: int):
        """The verify cost of several tree sizes: from the store when it has them, else measured on `target` here
        (about half a second on a CPU, CALIBRATE_S at most unless a single forward takes longer) and stored for the
        next process."""
        stored = self.cost_store.load() if self.cost_store is not None else None
        if stored:
            self.cost_model = CostModel(verify_s=stored, padded=self.cost_store.padded,
                                        shape=self.cost_store.reference() or {})
            self.cost_model.monotone()
            return
        room = target.max_context - target.length  # the test forwards must fit the context
        sizes = sorted({1, 2, 4, 8, 16, 32, 64, 128} & set(range(1, self.budget + 2)) | {self.budget + 1})
        cost = CostModel(partial=sizes[-1] > room)
        sizes = [n for n in sizes if n <= room]
        start = time.perf_counter()
        for n in sizes:
            tree = DraftTree([root] * n, [-1] + [0] * (n - 1))
            tokens, depths, mask = tree.tensors(target.device)
            times = []
            for _ in range(5):
                t = time.perf_counter()
                target.forward(tokens, target.length + depths, mask)  # nothing is committed
                device_sync(target.device)
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
        self.cost_model = cost
        if self.cost_store is not None and not cost.partial:
            self.cost_store.save(cost.verify_s)

    def begin(self, target, drafter, sampling, root: int, finished: bool) -> None:
        """A reply's decoding starts after its prefill (root: its first token): measure the step's costs if this is
        the first reply that drafts, take this sampling mode's calibration, curve and DraftValue, and hand the
        drafter its curve and the sampling setup."""
        if self.auto_budget and self.cost_model is None and not finished and drafter.name != "none":
            self.calibrate(target, root)
        mode = mode_key(sampling.temperature, sampling.repetition_penalty)
        if self.cost_model is not None:
            self.cost_model.use_mode(mode)
        self.curve = None
        if drafter.learns_acceptance:
            if self.curves is not None:
                self.curve = self.curves.setdefault(mode, AcceptanceCurve())
            drafter.curve = self.curve
        drafter.sampling = sampling  # a drafter that samples its candidates at temperature > 0 reads it
        self.value = (self.values.setdefault(mode, DraftValue())
                      if self.cost_model is not None and self.values is not None else None)
        self.idle = 0

    def ask(self, drafter) -> bool:
        """Whether to ask the drafter at this step (False: a plain step, the root alone). Drafting that does not pay
        here (no node worth verifying at the last 3 steps) makes plain steps, retrying now and then; so do a
        drafter's calls that have not paid lately (DraftValue). Before a call, the drafter is told the score below
        which a node cannot pay for its verification (min_score)."""
        self.probe = False
        cost, value = self.cost_model, self.value
        if cost is not None and self.idle >= 3 and self.idle % 8:
            self.idle += 1
            if value is not None:
                value.skipped()
            return False
        if value is not None and not value.ask(cost.verify(1)):
            return False
        self.probe = self.idle >= 3
        if cost is not None:
            drafter.min_score = cost.min_score()
        return True

    def size(self, tree: DraftTree, room: int, draft_s: float, asked: bool) -> tuple[DraftTree, bool]:
        """The part of a proposed tree worth verifying: the best nodes that pay for their share of the verify, at
        most `room` (what the context can take). Sampled candidates are verified all or none (see verify.accept).
        Also whether the call is judged (DraftValue): one the context left no room for says nothing of the
        drafter."""
        judged = asked and room > 0
        if tree.proposals and len(tree) - 1 > room:
            return DraftTree.root_only(tree.tokens[0]), False
        if self.cost_model is not None and len(tree) > 1 and not tree.proposals:
            # a retry verifies a few nodes even when the estimate says no: only verified drafts teach the
            # calibration, which could otherwise stay too low for good
            n = self.cost_model.best_budget(tree.scores[1:], draft_s)
            tree = tree.prune(n if n or not self.probe else PROBE_NODES)
            self.idle = 0 if n else self.idle + 1
        return tree.prune(room), judged

    def verified(self, tree: DraftTree, path: list[int], forward_s: float | None) -> None:
        """The target's verdict on a tree (`path`: the accepted nodes, root first) and its forward's time (None: not
        timed, a GPU forward returns before it is done): the acceptance curve counts the verdicts, and the stored
        cost table is kept current."""
        if self.cost_store is not None and self.cost_model is not None and forward_s is not None:
            self.cost_model.refresh(len(tree), forward_s)
        if self.curve is not None:
            self.curve.observe(tree, path)

    def stepped(self, tree: DraftTree, accepted: int, asked: bool, judged: bool, draft_s: float,
                step_s: float) -> None:
        """What a step gave (`accepted` drafted tokens) and cost (draft_s drafting, step_s in all); `judged`: a call
        that says something of the drafter (one the context left room for, whose tree was verified)."""
        cost = self.cost_model
        if cost is None:
            return
        cost.observe_step(accepted + 1, step_s)
        if len(tree) > 1:
            cost.observe(sum(tree.scores[1:]), accepted, draft_s)
        if self.value is not None:
            # a plain step's time: a step without a tree, or what a step with one took besides drafting and its
            # tree's verify beyond the root's (the sampling, acceptance and bookkeeping of every step)
            extra = cost.verify(len(tree)) - cost.verify(1) if len(tree) > 1 else 0.0
            self.value.plain_step(step_s if not asked else step_s - draft_s - extra)
            if judged:
                self.value.add(accepted, draft_s)

    def save(self) -> None:
        """Store the verify costs refreshed during a reply (a partial measurement is never stored)."""
        cost = self.cost_model
        if cost is not None and cost.refreshed and self.cost_store is not None and not cost.partial:
            self.cost_store.save(cost.verify_s)
            cost.refreshed = False


def device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
