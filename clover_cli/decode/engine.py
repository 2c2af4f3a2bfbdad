"""The speculative decoding loop: draft a token tree, verify it in one target forward, keep the longest agreeing path.

    prefill:  run the prompt, choose the first token (the root) from the target's last logits
    step:     1. propose  tree = drafter.propose(context + [root])     a token tree rooted at the root, sized by
                                                                       the policy (budget.DraftPolicy)
              2. verify   logits = target(tree tokens, positions = length + depth, ancestor mask)
              3. accept   path, bonus = accept(tree, logits)           greedy: follow the target's argmax;
                                                                       sampling: rejection over siblings
              4. commit   the path's KV stays in the cache, in place
              5. observe  the drafter reads the path's hidden states; the policy learns what the step cost and
                          gave; root = bonus

Every emitted token is one the target alone would have produced (greedy) or a sample of exactly the target's
distribution (sampling, verify.py): the drafter and the policy only decide how many come per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from ..target import Target
from .budget import DraftPolicy, device_sync
from ..tree import DraftTree, long_tensor
from .verify import Sampling, StopCheck, accept, penalize, token_logprobs


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
    # with Sampling.logprobs set, per token: its log-probability under the target and the top alternatives
    # (verify.token_logprobs); else None, and nothing is computed
    logprobs: list | None = None


class Engine:
    """Holds a target, a drafter and what the target's cache already holds, and generates from prompts.

    The policy (budget.DraftPolicy, made from budget, auto_budget, cost_store, learn_acceptance and skip_unpaid)
    decides whether to ask the drafter at a step and how many of its nodes to verify; see its docstring.
    """

    def __init__(self, target: Target, drafter, budget: int = 32, auto_budget: bool = True, cost_store=None,
                 learn_acceptance: bool = True, skip_unpaid: bool = True):
        self.target = target
        self.drafter = drafter
        self.policy = DraftPolicy(budget, auto_budget, cost_store, learn_acceptance, skip_unpaid)
        self.context: list[int] = []  # exactly the tokens in the target's KV cache

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
            self.policy.save()

    def _generate(self, prompt: list[int], stop: StopCheck, sampling: Sampling) -> Iterator[StepEvent]:
        rng = torch.Generator()
        if sampling.seed is not None:
            rng.manual_seed(sampling.seed)
        else:
            rng.seed()
        target, drafter, policy, device = self.target, self.drafter, self.policy, self.target.device
        root, first = self._prefill(prompt, stop, sampling, rng)
        yield first
        finish = first.finish
        policy.begin(target, drafter, sampling, root, finish is not None)
        while finish is None:
            t0 = time.perf_counter()
            room = max(0, target.max_context - target.length - 1)  # drafted nodes the context can take
            # 1. propose: the drafter's tree when asking it pays, cut to the nodes worth verifying
            asked = policy.ask(drafter)
            tree = (drafter.propose(self.context + [root], min(policy.budget, room)) if asked else
                    DraftTree.root_only(root))
            t1 = time.perf_counter()
            tree, judged = policy.size(tree, room, t1 - t0, asked)
            # 2. verify: one target forward over the tree
            tokens, positions, mask = tree.tensors(device, target.length)
            tv = time.perf_counter()
            hidden, logits = target.forward(tokens, positions, mask)
            forward_s = time.perf_counter() - tv if device.type == "cpu" else None  # a GPU's returns before done
            # 3. accept: the longest path the target agrees with, and the target's own next token (bonus)
            path, bonus = accept(tree, penalize(logits, tree, self.context, sampling.repetition_penalty), sampling, rng)
            policy.verified(tree, path, forward_s)
            # 4. commit: the path's KV stays in the cache
            target.cache.commit(path)
            accepted = [tree.tokens[i] for i in path[1:]]
            # 5. observe: the drafter reads the accepted rows (most often the tree's first nodes: a view, not a gather)
            if drafter.observes:
                rows = hidden[:len(path)] if path[-1] == len(path) - 1 else hidden[path]
                drafter.observe(rows, long_tensor(accepted + [bonus], device))
            self.context += [root] + accepted
            device_sync(device)
            t2 = time.perf_counter()
            policy.stepped(tree, len(accepted), asked, judged, t1 - t0, t2 - t0)

            out, depths, finish = _emit(accepted, bonus, stop)
            # token j of the step was chosen from the row of the path's node j (its parent in the tree)
            lp = None if sampling.logprobs is None else token_logprobs(
                logits[long_tensor(path[:len(out)], logits.device)], out, sampling.logprobs)
            yield StepEvent(out, depths, proposed=len(tree) - 1, tree_depth=max(tree.depths()),
                            accepted=sum(d > 0 for d in depths), draft_s=t1 - t0, verify_s=t2 - t1,
                            elapsed_s=t2 - t0, finish=finish, logprobs=lp)
            root = bonus

    def _prefill(self, prompt: list[int], stop: StopCheck, sampling: Sampling, rng) -> tuple[int, StepEvent]:
        """Run the prompt (what the cache already holds of it is reused; at least its last token is re-run) and
        choose the first token, the root of the first tree."""
        target, drafter = self.target, self.drafter
        # a drafter may read other features than the pre-norm last hidden state (EAGLE-3: three layers' inputs)
        target.use_features(drafter.feature_layers)
        same = 0
        for a, b in zip(self.context, prompt):
            if a != b:
                break
            same += 1
        keep = max(min(same, len(prompt) - 1) - 1, 0)
        target.reset(keep)
        drafter.reset(keep)
        self.context = list(prompt[:keep])

        t0 = time.perf_counter()
        new = torch.tensor(prompt[keep:], dtype=torch.long, device=target.device)
        hidden, logits = target.forward(new, logits_for=slice(-1, None))
        target.cache.append(new.numel())
        self.context = list(prompt)
        tree = DraftTree.root_only(prompt[-1])
        _, root = accept(tree, penalize(logits, tree, prompt[:-1], sampling.repetition_penalty), sampling, rng)
        if drafter.observes:
            drafter.observe(hidden, long_tensor(prompt[keep + 1:] + [root], target.device))
        finish = stop.push(root)
        lp = None if sampling.logprobs is None else token_logprobs(logits[-1:], [root], sampling.logprobs)
        device_sync(target.device)
        return root, StepEvent([root], [0], elapsed_s=time.perf_counter() - t0, prefill=True, finish=finish,
                               logprobs=lp)


def _emit(accepted: list[int], bonus: int, stop: StopCheck) -> tuple[list[int], list[int], str | None]:
    """The step's tokens up to the first that ends the reply, each with its draft depth (0: the target's own)."""
    out, depths, finish = [], [], None
    for depth, tok in enumerate(accepted + [bonus], 1):
        out.append(tok)
        depths.append(depth if depth <= len(accepted) else 0)
        finish = stop.push(tok)
        if finish:
            break
    return out, depths, finish
