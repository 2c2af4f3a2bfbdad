"""Drafting with a separate, smaller causal LM of the same vocabulary (issue #16): `--draft model`.

The draft model runs through the same machinery as the target (clover_cli/target.py): our tree attention and a
preallocated TreeKVCache of its own. The cache holds exactly the committed tokens the draft has seen; each proposal
first compares them with the conversation and truncates at the first difference (a rejected draft, an edited
conversation: the rollback), then runs what is new (the accepted tokens the draft has not run and the new root) in
one forward, with explicit positions. The tree's own nodes are written after the committed tokens while drafting and
dropped when the proposal is made, so the cache never holds a token the target did not commit.

Two tree shapes:

    chain   the draft's top-1 token at every depth, one draft forward per depth (classic speculative decoding)
    mcsd    multi-candidate (MCSD, arXiv 2401.06706 / 2409.10644): the draft's `root_k` best tokens at the root,
            each the start of a branch that the draft continues with its top-1 token; every depth runs all live
            branch tips in ONE batched forward (each tip sees the committed tokens and its own ancestors through a
            tree mask), and each branch stops on its own (a dynamic length) when the draft's probability of its
            next token falls below `stop_below`, when the node would not pay for its verification (the engine's
            min_score), or at the budget or `max_depth`.

A node's score is the product of the draft's probabilities along its path; the engine verifies the best-scoring
nodes it finds worth their cost. The drafted tokens are fixed tokens (the draft's top ones, not samples), which the
engine's verification accepts exactly under sampling too (each child is accepted with the target's remaining
probability of it): the output is the target's, greedy or sampled, whatever the draft proposes.

What MCSD's paper calls target-initialised candidates is, in this engine, the root itself: every step starts from a
token the target chose (its greedy or sampled next token), and the draft extends from there. The target's own
distribution one position further on (the root's children) would need the target's forward over the root, which is
the verification itself; so the root's candidates come from the draft.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import CloverError
from ..packed import packed_linears
from ..target import Target, context_limit
from ..tree import DraftTree, TreeBuilder
from .base import Drafter

TREES = ("mcsd", "chain")
ROOT_K = 3  # MCSD: candidates at the root
MAX_DEPTH = 8  # deepest drafted node
STOP_BELOW = 0.3  # a branch stops where the draft gives its next token less than this probability
ROOT_MIN = 0.05  # a root candidate below this draft probability is not drafted


# ------------------------------------------------------------------------------------------------ finding and loading

def default_draft(spec) -> str | None:
    """The draft model an alias names (its table's `draft` field), or None."""
    return getattr(spec, "draft", None) if spec is not None else None


def resolve_draft_model(name: str | None, target, quiet: bool = False) -> tuple[str, Path]:
    """(the name shown, the local directory) of the draft model: --draft-model (an alias, a local directory, a Hub
    repo id, or a GGUF as every MODEL argument takes one), else the one the target's alias names. CloverError in
    one line when there is none or it is not found."""
    from ..aliases import ALIASES, BUNDLED
    from ..hub import check_weights, download, is_gguf_source, looks_like_repo, resolve_model

    if not name:
        name = default_draft(target.spec)
        if name is None:
            raise CloverError(f"--draft model needs a draft model for {target.name}: pass --draft-model "
                              f"ALIAS|REPO|DIR (a smaller model with the same tokenizer)")
        if name == "bundled":
            path = BUNDLED / "draft"
            if not (path / "config.json").is_file():
                raise CloverError(f"no draft model is bundled for {target.name} in this installation: pass "
                                  f"--draft-model DIR")
            return f"{target.name}'s bundled draft", path
    spec = ALIASES.get(name)
    if spec is not None:
        if spec.repo is None:
            raise CloverError(f"--draft-model {name}: the bundled target itself cannot be its own draft model")
        return name, resolve_model(name, quiet=quiet).path
    if is_gguf_source(name):  # a GGUF file, a folder holding one, REPO:FILE.gguf or REPO:QUANT: converted once
        return name, resolve_model(name, quiet=quiet).path
    local = Path(name).expanduser()
    if local.is_dir():
        check_weights(local, f"draft model {name}", allow_pickle=False)
        return name, local
    if local.exists():
        raise CloverError(f"draft model {name} is a file, not a model directory nor a GGUF file")
    if looks_like_repo(name):
        path = download(name, what="draft model", quiet=quiet)
        check_weights(path, f"draft model {name}", allow_pickle=False)
        return name, path
    raise CloverError(f"draft model not found: {name} (not an alias, a directory, a GGUF file or a Hub repo id)")


def parameter_count(model) -> int:
    """Distinct parameters (a tied lm_head counted once; quantized linears as the weights they hold)."""
    from ..quantized import weight_count

    return weight_count(model)


def _vocab_of(tokenizer) -> dict:
    return dict(tokenizer.get_vocab())


def check_tokenizer(draft_name: str, draft_path: Path, target_name: str, target_tokenizer) -> None:
    """Refuse a draft whose tokenizer maps text to other ids than the target's, in one line naming both."""
    from transformers import AutoTokenizer

    try:
        draft_tok = AutoTokenizer.from_pretrained(str(draft_path))
    except Exception as e:  # a draft directory without (or with a broken) tokenizer
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise CloverError(f"draft model {draft_name}: cannot read its tokenizer to compare it with {target_name}'s "
                          f"({first})") from None
    mine, theirs = _vocab_of(draft_tok), _vocab_of(target_tokenizer)
    if mine != theirs:
        differ = sum(1 for t, i in mine.items() if theirs.get(t) != i) + sum(1 for t in theirs if t not in mine)
        raise CloverError(f"draft model {draft_name} has another tokenizer than {target_name} ({len(mine)} vs "
                          f"{len(theirs)} tokens, {differ} differ): a draft model needs the target's vocabulary")


def load_draft_model(draft_name: str, draft_path: Path, target_name: str, target_model, target_tokenizer,
                     trust_remote_code: bool = False):
    """The draft model in eval mode on the target's device and dtype, after the checks: the same tokenizer, no more
    parameters than the target, readable weights. CloverError in one line otherwise."""
    import warnings

    from transformers import AutoModelForCausalLM

    check_tokenizer(draft_name, draft_path, target_name, target_tokenizer)
    dtype = next(target_model.parameters()).dtype
    device = target_model.get_input_embeddings().weight.device
    if device.type == "meta":
        raise CloverError("--draft model runs beside the target on one device: it cannot follow a --device-map "
                          "that offloads the target's embedding")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(str(draft_path), dtype=dtype, use_safetensors=True,
                                                         trust_remote_code=trust_remote_code)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise CloverError(f"draft model {draft_name}: cannot load it ({type(e).__name__}: {first})") from None
    mine, theirs = parameter_count(model), parameter_count(target_model)
    if mine > theirs:
        raise CloverError(f"draft model {draft_name} has {mine / 1e6:.1f}M parameters, more than {target_name} "
                          f"({theirs / 1e6:.1f}M): a draft model must be smaller than the target")
    return model.to(device).eval()


# ---------------------------------------------------------------------------------------------------- the drafter

def runner(draft_model, target: Target) -> Target:
    """The draft model under clover's attention and cache (a Target), made once per model and target context:
    drafters made afresh (a /draft switch, every bench run) share it, and its cache buffers."""
    made = getattr(draft_model, "_clover_runner", None)
    if made is None or made.max_context != context_limit(draft_model.config, target.max_context):
        made = Target(draft_model, max_context=target.max_context, initial_capacity=256)
        draft_model._clover_runner = made
    return made


class ModelDrafter(Drafter):
    """A draft model proposing a chain or an MCSD tree (see the module docstring)."""

    observes = False  # it runs its own model over the context: nothing of the target's is read

    def __init__(self, draft_model, target: Target, tree: str = "mcsd", root_k: int = ROOT_K,
                 max_depth: int = MAX_DEPTH, stop_below: float = STOP_BELOW, root_min: float = ROOT_MIN,
                 sample: bool = True, learned_stop: bool = False, stop_file: Path | None = None):
        if tree not in TREES:
            raise CloverError(f"unknown draft-model tree {tree!r}; choose one of {', '.join(TREES)}")
        self.tree = tree
        self.name = "model" if tree == "mcsd" else "model-chain"
        self.root_k = root_k if tree == "mcsd" else 1
        self.max_depth, self.stop_below, self.root_min = max_depth, stop_below, root_min
        self.draft = runner(draft_model, target)
        self._whole = False  # whether this proposal runs the whole tree per depth (a compiled step): set per proposal
        # room for the tree's nodes after the last committed position
        self.draft.cache.max_capacity = max(self.draft.cache.max_capacity,
                                            self.draft.max_context + self.root_k * self.max_depth)
        self.draft.reset(0)  # a runner another drafter used before: this one starts from an empty cache
        # logits columns the target can verify (a draft's lm_head may be padded past the shared vocabulary)
        self.vocab = min(self.draft.lm_head.weight.shape[0], target.lm_head.weight.shape[0])
        self.ids: list[int] = []  # the tokens whose keys and values the draft's cache holds, in order
        self.min_score = 0.0  # set by the engine: nodes scored below it do not pay for their verification
        # set by the engine for each generation; at temperature > 0 (and `sample`) the candidates are samples of the
        # draft's distribution at the same temperature, verified q-aware (decode.verify.accept), else its top tokens
        self.sampling = None
        self.sample = sample
        self._rng: torch.Generator | None = None
        self._seeded_for = None
        # learned_stop: a branch ends where the learned chance of acceptance (drafters/early_stop.py, fitted online
        # and kept with the draft model's runner) falls below stop_below, instead of the draft's probability;
        # stop_file: where it is kept between processes (early_stop.store_path), read when the runner has none yet
        self.learned_stop = learned_stop
        self.stop_file = stop_file

    def _early_stop(self, context):
        """The learned early stop (after labelling the last proposal from `context`), or None for the fixed rule."""
        if not self.learned_stop:
            return None
        from .early_stop import EarlyStop

        stop = getattr(self.draft, "_clover_early_stop", None)
        if stop is None:
            stop = self.draft._clover_early_stop = EarlyStop()
            stop.load(self.stop_file)
        stop.learn(context)
        return stop

    def save_learning(self) -> None:
        """Keep the learned early stop on disk (stop_file), for the next process; nothing for the fixed rule."""
        stop = getattr(self.draft, "_clover_early_stop", None)
        if self.learned_stop and stop is not None:
            stop.save(self.stop_file)

    @staticmethod
    def _entropy(probs: torch.Tensor) -> list[float]:
        return (-(probs * probs.clamp_min(1e-12).log()).sum(-1)).reshape(-1).tolist()

    def _chances(self, stop, probs: torch.Tensor, p: list[float], depth: int):
        """(the chance each candidate of `p` (its draft probabilities, rows of `probs`) is accepted, their feature
        rows): the learned model's once it is fitted, the draft's probabilities before."""
        if stop is None:
            return p, None
        ent = self._entropy(probs)
        if len(ent) == 1 and len(p) > 1:
            ent = ent * len(p)  # the root's candidates share one distribution
        rows = [stop.features(pi, e, depth) for pi, e in zip(p, ent)]
        return (stop.predict(rows) if stop.ready else p), rows

    # the draft keeps itself in step from the context it is given: nothing to do on reset/observe
    def reset(self, length: int) -> None:
        if length < len(self.ids):
            self.ids = self.ids[:length]
            self.draft.reset(length)

    def observe(self, hidden, next_tokens) -> None:
        pass

    @property
    def cache(self):
        return self.draft.cache

    def _sync(self, context: list[int], logits: bool = False) -> torch.Tensor | None:
        """Roll the draft's cache back to what it shares with `context`, run the rest (the root at least) and
        return the draft's probabilities (or with `logits`, its logits) of the token after the root; None when the
        context leaves no room."""
        want_logits = logits
        same = 0
        for a, b in zip(self.ids, context):
            if a != b:
                break
            same += 1
        same = min(same, len(context) - 1)  # the root is always run: its distribution is what the tree grows from
        self.draft.reset(same)
        del self.ids[same:]
        new = context[same:]
        if len(context) + 1 > self.draft.max_context:
            return None
        tokens = torch.tensor(new, dtype=torch.long, device=self.draft.device)
        _, out = self.draft.forward(tokens, logits_for=slice(-1, None))
        self.draft.cache.append(len(new))
        self.ids += new
        if want_logits:
            return out[-1, :self.vocab].float()
        return torch.softmax(out[-1, :self.vocab].float(), -1)

    def _extend(self, tokens: torch.Tensor, positions: torch.Tensor, sees: torch.Tensor, committed: int,
                logits: bool = False):
        """Run tree nodes after the committed tokens and the tree nodes already written: each sees the committed
        tokens, the written nodes `sees` marks (its ancestors) and itself. Returns their next-token probabilities."""
        n = tokens.numel()
        written = self.draft.cache.length - committed
        self.draft.cache.reserve(n)
        dev = self.draft.device
        mask = torch.zeros(1, 1, n, committed + written + n, dtype=torch.bool, device=dev)
        mask[0, 0, :, :committed] = True
        mask[0, 0, :, committed:committed + written] = sees
        rows = torch.arange(n, device=dev)
        mask[0, 0, rows, committed + written + rows] = True
        want_logits = logits
        with packed_linears():
            _, out = self.draft.run(tokens, positions, mask, self.draft.cache, None)
        self.draft.cache.append(n)
        if want_logits:
            return out[:, :self.vocab].float()
        return torch.softmax(out[:, :self.vocab].float(), -1)

    def _expand(self, builder, tips: list[int], slot: dict[int, int], depth: int, committed: int,
                logits: bool = False):
        """Run the branch tips of one depth as one batch (_extend), each seeing its ancestors among the tree nodes
        already written; `slot` (tree node -> its place among the written nodes) gains the tips."""
        if self._whole:
            return self._expand_whole(builder, tips, committed, logits)
        sees = torch.zeros(len(tips), len(slot), dtype=torch.bool)
        for r, node in enumerate(tips):
            a = builder.parents[node]
            while a > 0:
                sees[r, slot[a]] = True
                a = builder.parents[a]
        dev = self.draft.device
        tokens = torch.tensor([builder.tokens[t] for t in tips], dtype=torch.long, device=dev)
        positions = torch.full((len(tips),), committed - 1 + depth, dtype=torch.long, device=dev)
        out = self._extend(tokens, positions, sees.to(dev), committed, logits=logits)
        for node in tips:
            slot[node] = len(slot)
        return out

    def _expand_whole(self, builder, tips: list[int], committed: int, logits: bool = False):
        """_expand for a draft with a compiled step: every drafted node so far in one program call (each sees the
        committed tokens and its own ancestors: the tree's mask), the tips' rows returned, nothing kept in the cache.
        The program reads all cached keys as committed, so the tree's earlier nodes cannot stay there as _expand
        writes them; a small draft's step costs about the same for one token or a few dozen."""
        tree = DraftTree(builder.tokens, builder.parents, builder.scores)
        dev = self.draft.device
        tokens = torch.tensor(tree.tokens[1:], dtype=torch.long, device=dev)  # the root is committed already
        positions = committed - 1 + torch.tensor(tree.depths()[1:], dtype=torch.long, device=dev)
        mask = torch.from_numpy(tree.ancestor_mask()[1:, 1:]).to(dev)
        rows = torch.tensor([t - 1 for t in tips], dtype=torch.long, device=dev)
        _, out = self.draft.forward(tokens, positions, mask, logits_for=rows)
        out = out[:, :self.vocab].float()
        return out if logits else torch.softmax(out, -1)

    def _sampling(self):
        """The sampling settings when candidates are to be sampled (temperature > 0), else None; the generator is
        seeded from the generation's seed (a seeded run stays reproducible)."""
        s = self.sampling
        if not self.sample or s is None or s.greedy:
            return None
        if self._rng is None or self._seeded_for is not s:
            self._rng = torch.Generator()
            if s.seed is not None:
                self._rng.manual_seed(s.seed ^ 0x5EED)
            else:
                self._rng.seed()
            self._seeded_for = s
        return s

    @torch.inference_mode()
    def propose(self, context, budget) -> DraftTree:
        s = self._sampling()
        if s is not None:
            return self._propose_sampled(context, budget, s)
        builder = TreeBuilder(context[-1])
        if budget <= 0:
            return builder.build(0)
        stop = self._early_stop(context)
        q = self._sync(context)
        if q is None:
            return builder.build(0)
        committed = self.draft.cache.length  # the root is the last committed token, at position committed - 1
        room = self.draft.max_context - committed
        rows: dict[int, list[float]] = {}  # node -> its features, for the learned early stop to label
        # depth 1: the root's candidates
        top_p, top_i = q.topk(self.root_k)
        chances, feats = self._chances(stop, q[None], top_p.tolist(), 1)
        tips = []
        for r, (p, tok, c) in enumerate(zip(top_p.tolist(), top_i.tolist(), chances)):
            if tips and (p < self.root_min or c < self.min_score):
                break
            tips.append(builder.add(0, tok, c))
            if feats:
                rows[tips[-1]] = feats[r]
            if len(builder.tokens) > budget:
                break
        slot: dict[int, int] = {}  # tree node -> its place among the nodes written into the draft's cache
        # one way for the whole proposal: a compiled step that falls back to eager midway (a CUDA graph that cannot
        # be captured) must not leave later depths looking for nodes the whole-tree calls never wrote
        self._whole = self.draft.program is not None
        try:
            for depth in range(1, min(self.max_depth, room)):
                if not tips or len(builder.tokens) > budget:
                    break
                probs = self._expand(builder, tips, slot, depth, committed)
                best_p, best_i = probs.max(-1)
                chances, feats = self._chances(stop, probs, best_p.tolist(), depth + 1)
                nxt = []
                for r, (node, tok, c) in enumerate(zip(tips, best_i.tolist(), chances)):
                    score = builder.scores[node] * c
                    if c < self.stop_below or score < self.min_score or len(builder.tokens) > budget:
                        continue  # this branch ends here
                    nxt.append(builder.add(node, tok, score))
                    if feats:
                        rows[nxt[-1]] = feats[r]
                tips = nxt
        finally:
            self.draft.reset(committed)  # the tree's keys and values are not kept
        if stop is not None:
            stop.remember(context, builder.parents, builder.tokens, rows)
        return builder.build(budget)

    def _propose_sampled(self, context, budget, s) -> DraftTree:
        """The same tree shapes with sampled candidates: the root's `root_k` children drawn one after another without
        replacement from the draft's distribution q (warped as the target's is: temperature, top-p), each branch
        continued by one draw from q at its tip. Whether a node gets children, and how many, depends only on its own
        q and the nodes drafted before it, never on the values drawn for those children: what q-aware verification
        needs to stay exact. Each node that got children records its q in `proposals`."""
        from ..decode.verify import sample, warp

        builder = TreeBuilder(context[-1])
        proposals: dict[int, torch.Tensor] = {}
        if budget <= 0:
            return builder.build(0)
        logits_q = self._sync(context, logits=True)
        if logits_q is None:
            return builder.build(0)
        committed = self.draft.cache.length
        room = self.draft.max_context - committed
        rng = self._rng

        def draw(q: torch.Tensor, k: int) -> list[int]:
            q = q.clone()
            out = []
            for _ in range(k):
                if q.sum().item() <= 0:
                    break
                tok = sample(q, rng)
                out.append(tok)
                q[tok] = 0.0
            return out

        q = warp(logits_q, s)
        k = min(self.root_k, budget)
        tips = []
        for tok in draw(q, k):
            tips.append(builder.add(0, tok, float(q[tok])))
        if tips:
            proposals[0] = q
        slot: dict[int, int] = {}
        self._whole = self.draft.program is not None  # one way for the whole proposal (see above)
        try:
            for depth in range(1, min(self.max_depth, room)):
                if not tips or len(builder.tokens) > budget:
                    break
                logits = self._expand(builder, tips, slot, depth, committed, logits=True)
                nxt = []
                for row, node in enumerate(tips):
                    q = warp(logits[row], s)
                    top = float(q.max())
                    # the stop rule reads q only: the expected acceptance of the best next token
                    if (top < self.stop_below or builder.scores[node] * top < self.min_score
                            or len(builder.tokens) > budget):
                        continue
                    tok = draw(q, 1)[0]
                    proposals[node] = q
                    nxt.append(builder.add(node, tok, builder.scores[node] * top))
                tips = nxt
        finally:
            self.draft.reset(committed)
        tree = builder.build(budget)  # within the budget by construction: nothing is pruned
        tree.proposals = proposals if len(tree) == len(builder.tokens) else None
        return tree

