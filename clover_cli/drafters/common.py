"""What every drafter family shares: the heads config and clover's own file format's keys, the small modules and
helpers their nn.Modules are built from, the tree grower and vocabulary projection their drafters use, and the file
readers their loaders use. Each family (clover2.py, medusa.py, eagle.py) holds its module, its published layout and
its drafter; registry.py says which family a directory is.
"""

from __future__ import annotations

import bisect
import copy
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from ..errors import CloverError
from ..packed import pack_linears, packed_linears
from ..target import TreeKVCache
from ..tree import DraftTree, TreeBuilder
from .base import Drafter


FORMAT_VERSION = 1


DRAFT_VOCAB_KEY = "draft_vocab"  # optional int64 [n]: the token ids heads draft from (most used first)


# The parts of the target's config the heads depend on: a mismatch means the heads cannot run on this target.
TARGET_KEYS = ("model_type", "hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "head_dim")


@dataclass
class HeadsConfig:
    architecture: str = "clover2"  # a family's (families.FAMILIES): or "medusa", "eagle", "eagle3"
    num_heads: int = 5  # EAGLE: the depth of its draft tree (one model, run once per depth)
    num_layers: int = 2  # Clover-2 augmenting block depth
    hidden_size: int = 0
    vocab_size: int = 0
    num_gate_heads: int = 0  # heads of the regressive attention gates (the target's attention heads)
    rms_norm_eps: float = 1e-6
    draft_vocab_size: int = 0  # >0: heads draft only from this many of the target's most used tokens
    embed: str = "input"  # Clover-2: drafted tokens embedded by the target's "input" embedding, its "lm_head" weight,
    #                       or the heads' "own" table
    rope_theta: float | None = None  # Clover-2: the augmenting layers' RoPE base; None: the target's
    gate_eps: float = 1e-6  # Clover-2: the eps of the gates' cosine similarity
    feature_norm: bool = False  # Clover-2: the target's hidden state normed (the heads' own RMSNorm, started from the
    #                             target's final norm) before the regressive attention block; else read as it is
    blocks: int = 1  # Medusa: residual SiLU blocks per head
    lm_heads: bool = False  # Medusa: each head has its own vocabulary projection (else the target's lm_head)
    fc_bias: bool = True  # EAGLE: whether its fc (2H -> H) has a bias
    layer: dict = field(default_factory=dict)  # EAGLE: its decoder layer's settings where they differ from the
    #                                            target's (a published file's own attention heads, eps, ...)
    tree: dict = field(default_factory=dict)  # the tree rule these heads draft best with (TreeGrower's TREE_RULE
    #                                           settings, measured: e.g. docs/BENCHMARKS.md); empty: their family's
    layout: str = "clover"  # the file layout the heads were read from (clover's own, or a published one)
    target: dict = field(default_factory=dict)  # TARGET_KEYS of the target, plus its name and revision
    training: dict = field(default_factory=dict)  # what `clover train` measured and used
    format_version: int = FORMAT_VERSION

    @staticmethod
    def for_target(target_config, architecture="clover2", num_heads=5, num_layers=2, name=None, revision=None):
        tc = target_config.to_dict()
        target = {k: tc.get(k) for k in TARGET_KEYS}
        target.update(name_or_path=name or tc.get("_name_or_path"), revision=revision)
        return HeadsConfig(
            architecture=architecture, num_heads=num_heads, num_layers=num_layers,
            hidden_size=target_config.hidden_size, vocab_size=target_config.vocab_size,
            num_gate_heads=target_config.num_attention_heads,
            rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6), target=target,
        )

    def check_target(self, target_config, where: str, layer: bool = False):
        tc = target_config.to_dict()
        if (self.hidden_size, self.vocab_size) != (tc.get("hidden_size"), tc.get("vocab_size")):
            raise CloverError(f"heads {where} were made for hidden size {self.hidden_size} and vocabulary "
                              f"{self.vocab_size}; this model has {tc.get('hidden_size')} and {tc.get('vocab_size')}")
        # heads that copy the target's decoder layer (`layer`: their family's Spec.copies_layer; Clover-2's augmenting
        # layers, EAGLE's layer): its shape must match too
        for key in TARGET_KEYS if layer else ():
            want, have = self.target.get(key), tc.get(key)
            if want is not None and want != have:
                raise CloverError(f"heads {where} were made for a target with {key}={want}, this model has {have}")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def near_identity(linear: nn.Linear, in_block: int = 0):
    """Identity on input columns [in_block, in_block + out), small noise elsewhere, zero bias."""
    with torch.no_grad():
        nn.init.normal_(linear.weight, std=0.002)
        out = linear.weight.shape[0]
        linear.weight[:, in_block:in_block + out] += torch.eye(out)
        if linear.bias is not None:
            linear.bias.zero_()


# the linears of a decoder layer whose outputs are added to its residual stream (Llama/Mistral/Qwen/Gemma/Phi-3's
# o_proj and down_proj, GPT-2's c_proj)
RESIDUAL_OUTPUTS = ("o_proj", "down_proj", "c_proj")


def quiet_residuals(layer: nn.Module):
    """Zero a copied decoder layer's residual outputs (RESIDUAL_OUTPUTS), so that it starts by passing its input on
    unchanged: a target's last layer, copied whole, can add many times its input's size (SmolLM2-135M's: 25x the
    post-norm feature)."""
    with torch.no_grad():
        for name, module in layer.named_modules():
            if name.rpartition(".")[2] in RESIDUAL_OUTPUTS:  # nn.Linear, or GPT-2's Conv1D
                for tensor in (getattr(module, "weight", None), getattr(module, "bias", None)):
                    if isinstance(tensor, torch.Tensor):
                        tensor.zero_()


def target_layer_class(target_model, what: str = "Clover-2 heads copy"):
    from ..target import decoder_layers, rotary_embedding

    layers = decoder_layers(target_model.base_model)
    problem = None
    if layers is None:
        problem = "no decoder layer stack"
    elif rotary_embedding(target_model.base_model) is None:
        problem = "no rotary embedding"
    else:
        params = inspect.signature(type(layers[-1]).forward).parameters
        required = [name for name, p in list(params.items())[2:] if p.default is p.empty
                    and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if "position_embeddings" not in params or required:
            problem = f"a decoder layer that takes {', '.join(required) or 'no position_embeddings'}"
    if problem:
        raise CloverError(f"{what} the target's last decoder layer and its rotary position embedding; "
                          f"{target_model.config.model_type} models have {problem}, which clover cannot drive "
                          f"(Medusa heads work: --arch medusa)")
    return type(layers[-1])


def draft_config(target_config, overrides: dict | None = None):
    from ..target import ATTN_NAME

    cfg = copy.deepcopy(target_config)
    cfg._attn_implementation = ATTN_NAME
    for key, value in (overrides or {}).items():
        setattr(cfg, key, value)
    return cfg


def rotary_for(target_model, theta: float | None, overrides: dict | None = None) -> nn.Module:
    """The rotary embedding of draft layers: the target's own, or one of its class with base `theta` (and the draft
    layer's own head size, `overrides`) when they differ from the target's."""
    from ..target import rotary_embedding

    own = rotary_embedding(target_model.base_model)
    params = getattr(target_model.config, "rope_parameters", None) or {}
    default = params.get("rope_type", "default") == "default"
    same_theta = theta is None or (default and params.get("rope_theta") == theta)
    if same_theta and not overrides:
        return own
    cfg = draft_config(target_model.config, overrides)
    if theta is not None:
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": float(theta)}
    return type(own)(cfg).to(own.inv_freq.device)


def compute_dtype(target_model):
    dt = target_model.get_input_embeddings().weight.dtype
    return dt if dt.is_floating_point else torch.float16


# ---------------------------------------------------------------------------------------------------- drafting

# The static tree (--tree static): paths of top-k ranks, Medusa/EAGLE style. (1, 0) is the best child of the
# root's second-best child. 24 nodes, 5 deep.
STATIC_TREE = [
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (2, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0), (1, 0, 0, 0),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (0, 0, 0, 1, 0),
]


# A tree rule's settings (TreeGrower's keywords), their types and ranges: children per expanded node (the level
# programs' top-k), nodes expanded per depth (at most the compiled level program's rows, step.aot.MAX_LEVEL_ROWS),
# the sibling-ratio cut and the probability-mass cut.
TREE_RULE = {"topk": (int, 1, 64), "width": (int, 1, 64), "min_ratio": (float, 0.0, 1.0), "top_p": (float, 0.0, 1.0)}


def tree_rule_problem(rule) -> str | None:
    """What is wrong with a tree rule read from a heads config (`tree`), or None."""
    for key, value in rule.items():
        if key not in TREE_RULE:
            return f"tree has an unknown setting {key!r} (one of {', '.join(TREE_RULE)})"
        kind, lo, hi = TREE_RULE[key]
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) \
                or not lo <= value <= hi or (key == "top_p" and value == 0):
            return f"tree's {key} must be {'a number' if kind is float else 'a whole number'} in [{lo}, {hi}]" \
                   f"{' above 0' if key == 'top_p' else ''}, not {value!r}"
    return None


class TreeGrower:
    """Chooses the children of each expanded node: dynamic (by probability) or static (fixed rank paths).

    A child's score is its parent's times the chance that the target accepts it: the drafter's probability for it,
    or, when the engine gives the grower an acceptance curve (`curve`, decode.budget.AcceptanceCurve), what verification
    has shown a candidate of that probability and rank among its siblings to be worth (greedy decoding accepts a
    head's top candidate of probability 0.3 about 70% of the time, its second one about 12% whatever its
    probability). The probability cuts below stay on the drafter's own probabilities.
    """

    def __init__(self, topk: int = 8, width: int = 6, min_ratio: float = 0.25, top_p: float = 0.95,
                 static: bool = False):
        self.topk, self.width, self.min_ratio, self.top_p = topk, width, min_ratio, top_p
        self.static = set(STATIC_TREE) if static else None
        self.paths: dict[int, tuple] = {0: ()}
        self.curve = None  # set by the engine: (probability, rank) -> the chance of acceptance

    def start(self):
        self.paths = {0: ()}

    def expand(self, builder: TreeBuilder, level: list[int], top_p: list, top_i: list, budget: int,
               min_score: float = 0.0) -> list[int]:
        """Add the children of the nodes in `level` (rows of top_p/top_i: each node's best candidate tokens and
        their head probabilities, best first); return the next level's nodes.

        A dynamic tree gets no child scored below min_score (one not worth verifying).
        """
        children, curve = [], self.curve
        for row, parent in enumerate(level):
            base, best, mass = builder.scores[parent], top_p[row][0], 0.0
            if not best > 0.0:  # nothing this row proposes is worth verifying (an all-zero row: see top_tokens)
                continue
            for rank, (p, tok) in enumerate(zip(top_p[row], top_i[row])):
                chance = p if curve is None else curve(p, rank)
                if self.static is not None:
                    path = self.paths[parent] + (rank,)
                    if path not in self.static:
                        continue
                elif p < self.min_ratio * best or mass >= self.top_p or base * chance < min_score:
                    break
                mass += p
                child = builder.add(parent, tok, base * chance, drafted=(rank, p))
                self.paths[child] = self.paths[parent] + (rank,)
                children.append(child)
        if self.static is not None:
            return children
        children.sort(key=lambda i: -builder.scores[i])
        # A child can only make the final tree if it beats the budget-th best node already there, and a node's
        # children score at most what it does: one at that floor is not expanded (with a budget of 1, the level
        # after the first would be run for nothing)
        if len(builder.scores) > budget:  # the root and at least `budget` nodes
            floor = sorted(builder.scores[1:], reverse=True)[budget - 1]
            children = [c for c in children if builder.scores[c] > floor]
        return children[: self.width]


class GrowsTree(Drafter):
    """A drafter whose tree a TreeGrower (`self.grower`) grows: the engine hands it an acceptance curve. Its
    propose() catches up and hands the builder to `_grow` (Medusa, with nothing to catch up on, has its own)."""

    learns_acceptance = True

    @property
    def curve(self):
        return self.grower.curve

    @curve.setter
    def curve(self, value) -> None:
        self.grower.curve = value

    @torch.inference_mode()
    @packed_linears()
    def propose(self, context, budget) -> DraftTree:
        """The tree rooted at context[-1]: empty with no budget, or with no state once the drafter caught up on what
        it observed (`_catch_up`, which sets `self.state`); else the one `_grow` grows."""
        builder = TreeBuilder(context[-1])
        self.grower.start()
        if budget <= 0:
            return builder.build(0)
        self._catch_up()
        if self.state is None:
            return builder.build(0)
        return self._grow(builder, context, budget)


def top_tokens(logits: torch.Tensor, k: int, token_ids: torch.Tensor | None = None):
    """(probabilities, token ids) of the k most likely tokens of each row of `logits` [r, V], best first.
    token_ids maps logit columns to token ids when the heads draft from a shortlist of the vocabulary."""
    # heads gone wrong (NaN or infinite weights) give NaN scores: they count as 0, so such rows draft nothing and the
    # target, which verifies every token, goes on alone
    probs = torch.softmax(logits.float(), dim=-1).nan_to_num_(0.0, 0.0, 0.0)
    top_p, top_i = probs.topk(min(k, probs.shape[-1]), dim=-1)
    if token_ids is not None:
        top_i = token_ids[top_i]
    return top_p, top_i


def heads_to_run(heads: nn.Module, target) -> tuple[nn.Module, bool]:
    """The heads a drafter runs beside `target`, and whether their linears are 8-bit integers. Beside a target of
    integers with int8 activations on a CPU (quantized.runs_quantized): a copy whose linears are (quantized.int8_linears;
    the heads given, which training goes on with, stay as they are), as a heads call is bound by the bytes of its
    weights; else the heads given, their float linears packed for oneDNN."""
    from ..quantized import int8_linears, runs_quantized

    if runs_quantized(target.model):
        heads = copy.deepcopy(heads)
        int8_linears(heads)
        return heads, True
    pack_linears(heads)
    return heads, False


class DraftProjection:
    """The target's frozen lm_head, restricted to the heads' draft vocabulary when they have one.

    Reading the whole [vocabulary x hidden] matrix at every draft depth is what a draft step mostly costs on a CPU;
    a shortlist of the target's most used tokens (as in FR-Spec) reads a fraction of it. Verification always uses
    the full lm_head, so this changes which tokens get proposed, never the output.
    """

    def __init__(self, lm_head, vocab: torch.Tensor | None, int8: bool = False):
        """int8: the shortlist as 8-bit integers (quantized.int8_linear), as heads beside a target of integers run."""
        self.lm_head, self.token_ids = lm_head, None
        if vocab is not None and vocab.numel() < lm_head.weight.shape[0]:
            self.token_ids = vocab.to(lm_head.weight.device)
            bias = getattr(lm_head, "bias", None)
            self.shortlist = torch.nn.Linear(lm_head.weight.shape[1], self.token_ids.numel(), bias=bias is not None,
                                             device="meta")
            self.shortlist.weight = torch.nn.Parameter(lm_head.weight.detach()[self.token_ids], requires_grad=False)
            if bias is not None:
                self.shortlist.bias = torch.nn.Parameter(bias.detach()[self.token_ids], requires_grad=False)
            self.dtype = self.shortlist.weight.dtype  # what the heads' states are cast to before the product
            if int8:
                from ..quantized import int8_linear

                self.shortlist = int8_linear(self.shortlist)  # multiplies float32 activations (rounded to int8)
                self.dtype = torch.float32
            else:
                pack_linears(self.shortlist)

    @property
    def linear(self) -> torch.nn.Module:
        return self.lm_head if self.token_ids is None else self.shortlist

    def __call__(self, out: torch.Tensor) -> torch.Tensor:
        if self.token_ids is None:
            return self.lm_head(out)
        return self.shortlist(out.to(self.dtype))


def keep_pending(cache: TreeKVCache, pending: list, length: int) -> list:
    """A drafter with its own cache over committed positions and observations queued for it (`pending`: (hidden,
    next tokens) pairs) forgets everything from position `length` on: the cache is cut there, or the queue is cut to
    what still lies before it. Returns the queue to keep."""
    keep = length - cache.length
    if keep <= 0:
        cache.truncate(length)
        return []
    return cut_pending(pending, keep)


def cut_pending(pending: list, keep: int) -> list:
    """The first `keep` observations of a queue of (hidden, next tokens) pairs."""
    kept = []
    for hidden, tokens in pending:
        if keep <= 0:
            break
        kept.append((hidden[:keep], tokens[:keep]))
        keep -= tokens.numel()
    return kept


def join_pending(pending: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The queued observations ((hidden, next tokens) pairs, not empty) as one hidden tensor and one token tensor."""
    hiddens, tokens = zip(*pending)
    if len(pending) == 1:
        return hiddens[0], tokens[0]
    return torch.cat(hiddens), torch.cat(tokens)


class Observed:
    """What a drafter with its own cache over committed positions was told (observe) and has run: observations
    queue up (`pending`: (hidden, next tokens) pairs) and run all at once when a proposal needs them.

    A long queue (a prompt, steps the drafter sat out) may run only its last `window` positions: the older ones
    get no slot in the drafter's cache, and its attention does not see them. That is a draft's approximation only
    (the target verifies every token), and the keys it keeps carry their true positions. `slots[i]` is the position
    cache slot i holds."""

    def __init__(self):
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.slots: list[int] = []
        self.next = 0  # the position of the first pending observation

    def add(self, hidden, next_tokens) -> None:
        self.pending.append((hidden, next_tokens))

    def reset(self, cache: TreeKVCache, length: int) -> None:
        """Forget everything from position `length` on: the queue is cut there, or the cache is."""
        if length >= self.next:
            self.pending = cut_pending(self.pending, length - self.next)
            return
        self.pending, self.next = [], length
        del self.slots[bisect.bisect_left(self.slots, length):]
        cache.truncate(len(self.slots))

    def take(self, window: int | None = None):
        """(hidden [n, H], next tokens [n], positions [n]) to run now, and give slots to; None when nothing waits."""
        if not self.pending:
            return None
        hidden, tokens = join_pending(self.pending)
        self.pending = []
        start, n = self.next, tokens.numel()
        self.next += n
        if window is not None and n > window:
            hidden, tokens, start, n = hidden[-window:], tokens[-window:], start + n - window, window
        self.slots.extend(range(start, start + n))
        return hidden, tokens, torch.arange(start, start + n, device=hidden.device)


# ---------------------------------------------------------------------------------------------------- reading files

def read_config(path: Path) -> dict | None:
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def first_file(path: Path, names) -> Path | None:
    return next((path / n for n in names if (path / n).is_file()), None)


def read_tensors(file: Path, what: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors or pickled file, tensors only. Raises CloverError in one line."""
    if file.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(file))
        except (SafetensorError, OSError) as e:
            raise CloverError(f"{what} {file}: unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
    from ..torchload import load

    state = load(file, what)
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise CloverError(f"{what} {file} holds something other than named tensors")
    return state


def finish_loading(heads, state: dict, path: Path, target_model, dtype) -> torch.nn.Module:
    try:
        missing, unexpected = heads.load_state_dict(state, strict=False)
    except RuntimeError as e:
        shape = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), str(e)[:200])
        raise CloverError(f"heads {path} do not fit this model ({shape})")
    if missing or unexpected:
        some = ", ".join((list(missing) + list(unexpected))[:3])
        raise CloverError(f"heads {path} do not match their layout ({len(missing)} missing, {len(unexpected)} "
                          f"unexpected tensors: {some})")
    device = target_model.get_input_embeddings().weight.device
    return heads.to(device=device, dtype=dtype or compute_dtype(target_model)).eval()


def check_size(path: Path, hidden: int, vocab: int, target_model) -> None:
    """A published file's hidden size and vocabulary against the target's: CloverError in one line if they differ."""
    tc = target_model.config.to_dict()
    if (hidden, vocab) != (tc.get("hidden_size"), tc.get("vocab_size")):
        raise CloverError(f"heads {path} were made for hidden size {hidden} and vocabulary {vocab}; this model has "
                          f"{tc.get('hidden_size')} and {tc.get('vocab_size')}")


def same_weights(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two weight matrices are one (up to the rounding of a dtype cast), compared in row blocks."""
    if a.shape != b.shape:
        return False
    for i in range(0, a.shape[0], 4096):
        x, y = a[i:i + 4096].detach().float(), b[i:i + 4096].detach().to("cpu").float()
        if not torch.allclose(x, y, rtol=1e-2, atol=1e-3 * max(float(y.abs().max()), 1e-6)):
            return False
    return True
