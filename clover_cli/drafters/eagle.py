"""EAGLE-1's draft model with EAGLE-2's dynamic tree (arXiv 2401.15077, 2406.16858): the module, the published
layout's detection and loader, and the drafter. Our own code, after the papers and reading their reference
(GitHub SafeAILab/EAGLE, `eagle/model/cnets1.py` and `ea_model.py`).

The draft model works at the level of the target's features, the last hidden state AFTER the final norm:

    f_t  = the target's post-norm last hidden state at t (what its lm_head reads)      [H]
    e(v) = the embedding of token v: the file's own table, or the target's input embedding
    x_t  = fc([e(tok_{t+1}); f_t])                                                     (Linear 2H -> H)
    g_t  = one decoder layer of the target's own class over x_0..x_t, without its input norm (own KV cache)
    g_t is trained to be f_{t+1}; lm_head(g_t) gives the distribution of tok_{t+2}

Drafting is autoregressive in the features: a drafted token d at depth k, drawn from lm_head(g) of its parent, is
run as fc([e(d); g]) one position further on, attending to the committed positions and its own ancestors. EAGLE-2
grows the tree by probability: at each depth the `width` best nodes of that depth by path probability (the product
of the draft's probabilities along the path) are run in one batch, each attending to the cache through a tree mask,
and each gets its `topk` best tokens as children; the engine then keeps the best-scoring nodes within its budget.
The reference's defaults: top-k 10, 10 nodes expanded per depth, depth 5-7, 60 tokens.

Published files (e.g. yuhuili/EAGLE-Vicuna-7B-v1.3, yuhuili/EAGLE-LLaMA3-Instruct-8B): config.json, a one-layer
Llama config (`rope_theta` or the reference's 10000, `rms_norm_eps`, optional `"bias"`: whether fc has a bias, true
when absent), and model.safetensors or a pickled pytorch_model.bin holding `embed_tokens.weight`, `fc.weight`
(+ `fc.bias`), `layers.0.self_attn.{q,k,v,o}_proj.weight`, `layers.0.mlp.{gate,up,down}_proj.weight` and
`layers.0.post_attention_layernorm.weight` (the reference's layer 0 has no input norm). The target's lm_head is
reused. clover's own format (`clover train --arch eagle`) stores the same module under `"architecture": "eagle"`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import CloverError
from ..families import Layout, Spec, Training
from ..packed import packed_linears
from ..target import Target, TreeKVCache, cache_kwarg, find_final_norm
from ..tree import DraftTree
from .common import (STATIC_TREE, DraftProjection, GrowsTree, HeadsConfig, TreeGrower, check_size, draft_config,
                     finish_loading, first_file, heads_to_run, join_pending, keep_pending, near_identity,
                     quiet_residuals, read_config, read_tensors, rotary_for, same_weights, target_layer_class,
                     top_tokens)

ARCHITECTURE = "eagle"
LAYOUT = "eagle"
FILES = ("model.safetensors", "pytorch_model.bin")  # safetensors first, where a directory has both
REFERENCE_ROPE_THETA = 10000.0  # the reference's rotary base when its config names none
DEPTH = 6  # drafting depth of published heads (EAGLE-2's default depth, 6 levels)
TOPK = 10  # EAGLE-2: children per expanded node, and nodes expanded per depth
REG_WEIGHT = 10.0  # training: EAGLE-1 weighs its feature regression 1.0 and its cross-entropy 0.1
NOISE = 0.2  # training: width of the uniform noise EAGLE-1 adds to the input features


class EagleHead(nn.Module):
    """EAGLE-1's draft model on the target's post-norm features (see the module docstring)."""

    def __init__(self, cfg: HeadsConfig, target_config, layer_class):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=cfg.fc_bias)
        near_identity(self.fc, in_block=H)  # starts as the feature itself
        dcfg = draft_config(target_config, cfg.layer)
        if getattr(dcfg, "sliding_window", None) is not None:
            dcfg.sliding_window = None  # the draft layer sees all its positions (its cache holds tree nodes too)
        layer = layer_class(dcfg, 0)
        if isinstance(getattr(layer, "input_layernorm", None), nn.Module):
            layer.input_layernorm = nn.Identity()  # the reference's layer 0 has none: fc's output goes straight in
        self.layers = nn.ModuleList([layer])
        if cfg.embed == "own":  # a published file's own frozen table, where it is not the target's input embedding
            self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
            self.embed_tokens.weight.requires_grad_(False)

    def init_from_target(self, target_model):
        """The layer starts as a copy of the target's last decoder layer (its input norm aside) whose attention and
        MLP add nothing yet: their output projections zeroed (common.quiet_residuals), so the layer passes fc's
        output, the feature itself, unchanged. Copied whole, SmolLM2-135M's last layer added 25x the post-norm
        feature's size (output rms 46 against 1.9; logits up to 1,314): EAGLE's training started at a loss of 820 and
        its top-1 stayed under 0.03 for 170 steps (docs/BENCHMARKS.md, 2026-12-06)."""
        from ..quantized import float_state_dict
        from ..target import decoder_layers

        last = {k: v for k, v in float_state_dict(decoder_layers(target_model.base_model)[-1]).items()
                if not k.startswith("input_layernorm.")}
        self.layers[0].load_state_dict(last, strict=False)
        quiet_residuals(self.layers[0])

    def token_embedding(self, target_model) -> nn.Module:
        return self.embed_tokens if self.cfg.embed == "own" else target_model.get_input_embeddings()

    def rotary(self, target_model) -> nn.Module:
        return rotary_for(target_model, self.cfg.rope_theta, self.cfg.layer)

    def draft(self, feature, token_emb, position_embeddings, position_ids, cache=None, mask=None):
        """feature, token_emb: [B, T, H] (the feature at t and the embedding of the token at t+1). Returns the
        predicted next features [B, T, H]: causal over T after the cache, or as `mask` says (bool [1, 1, T, past+T])."""
        x = self.fc(torch.cat([token_emb, feature], -1))
        layer = self.layers[0]
        out = layer(x, attention_mask=mask, position_ids=position_ids, **{cache_kwarg(layer): cache},
                    use_cache=cache is not None, position_embeddings=position_embeddings)
        return out[0] if isinstance(out, tuple) else out

    def forward_train(self, post, input_ids, embed, position_embeddings, position_ids):
        """Teacher-forced: post [B, T, H] the target's post-norm features, input_ids [B, T]. Returns [g], g [B, T, H]
        (g at t predicts f_{t+1}, hence token t+2; the last position reads token 0 and must be masked out)."""
        T = input_ids.shape[1]
        nxt = nn.functional.pad(input_ids, (0, 1), value=0)[:, 1:T + 1]
        return [self.draft(post, embed(nxt).to(post.dtype), position_embeddings, position_ids)]

    def forward(self, post, input_ids, embed, position_embeddings, position_ids):
        """The training forward (forward_train), so that a DistributedDataParallel wrapper syncs its gradients."""
        return self.forward_train(post, input_ids, embed, position_embeddings, position_ids)


def build(cfg: HeadsConfig, target_model) -> nn.Module:
    heads = EagleHead(cfg, target_model.config, target_layer_class(target_model, "EAGLE heads copy"))
    heads.draft_vocab = None
    return heads


class EagleDrafter(GrowsTree):
    """EAGLE-1's model drafting EAGLE-2's dynamic tree (or the static one). Per proposal: the model catches up on
    what the target committed since the last one (its own KV cache over committed positions), then one batched run
    per depth over the nodes to expand, their keys and values written after the committed ones and dropped again
    when the tree is made."""

    name = "eagle"

    def __init__(self, heads, target: Target, **grow):
        heads, self.int8 = heads_to_run(heads, target)  # 8-bit integers beside a quantized target
        self.heads, self.target = heads, target
        # EAGLE-2's rule: every expanded node gets its top-k tokens, and the best `width` of a depth are expanded;
        # no cut by probability ratio or mass (Clover's grower rule, off here)
        self.grower = TreeGrower(**{"topk": TOPK, "width": TOPK, "min_ratio": 0.0, "top_p": 1.0, **grow})
        self.dtype = next(heads.parameters()).dtype
        self._model_parts(heads, target)
        self.max_depth = heads.cfg.num_heads
        room = self.grower.width * self.max_depth + len(STATIC_TREE)  # tree nodes run in one proposal, at most
        self.cache = TreeKVCache(1, 256, target.max_context + room)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # observed, not yet run (as CloverDrafter's)
        self.state = None  # the model's output at the last committed position: what the root's children come from
        self.committed = 0  # positions in the cache that are committed (tree nodes go after them while drafting)
        self.min_score = 0.0  # set by the engine: nodes scored below it do not pay for their verification

    def _model_parts(self, heads, target: Target) -> None:
        """What the model drafts with besides its weights: the vocabulary projection, the target's final norm (its
        features are post-norm), the token embedding and the rotary embedding."""
        self.project = DraftProjection(target.lm_head, getattr(heads, "draft_vocab", None), int8=self.int8)
        self.norm = find_final_norm(target.base)
        self.embed = heads.token_embedding(target.model)
        self.rotary = heads.rotary(target.model)

    def reset(self, length: int) -> None:
        self.pending = keep_pending(self.cache, self.pending, length)
        self.committed = self.cache.length
        self.state = None

    def observe(self, hidden, next_tokens) -> None:
        self.pending.append((hidden, next_tokens))
        self.state = None

    def _run(self, feature, tokens, positions, mask=None):
        emb = self.embed(tokens).to(self.dtype)[None]
        x = feature.to(self.dtype)[None]
        return self.heads.draft(x, emb, self.rotary(x, positions[None]), positions[None], self.cache, mask)[0]

    def _committed_feature(self, hidden):
        """The model's input at committed positions, from what the target observed there: its post-norm feature."""
        return self.norm(hidden) if self.norm is not None else hidden

    def _run_committed(self, feature, tokens, positions):
        """The model over committed positions (their keys and values stay in the cache)."""
        return self._run(feature, tokens, positions)

    @torch.inference_mode()
    @packed_linears()
    def _catch_up(self) -> None:
        if not self.pending:
            return
        hidden, next_tokens = join_pending(self.pending)
        self.pending = []
        feature = self._committed_feature(hidden)
        n = next_tokens.numel()
        self.cache.reserve(n)
        start = self.cache.length
        out = self._run_committed(feature, next_tokens, torch.arange(start, start + n, device=hidden.device))
        self.cache.append(n)
        self.committed = self.cache.length
        self.state = out[-1]

    @torch.inference_mode()
    @packed_linears()
    def extend(self, feature, tokens, position: int, sees: torch.Tensor):
        """Run n tree nodes at once, all at `position`: feature [n, H] (their parents' outputs), tokens [n], sees
        bool [n, W]: which of the W tree nodes already in the cache each one attends to (its ancestors), besides
        the committed positions and itself. Their keys and values go into the cache after those W. Returns the
        nodes' outputs [n, H]."""
        n = tokens.numel()
        committed = self.committed
        written = self.cache.length - committed
        self.cache.reserve(n)
        device = feature.device
        mask = torch.zeros(1, 1, n, committed + written + n, dtype=torch.bool, device=device)
        mask[0, 0, :, :committed] = True
        mask[0, 0, :, committed:committed + written] = sees
        rows = torch.arange(n, device=device)
        mask[0, 0, rows, committed + written + rows] = True
        out = self._run(feature, tokens, torch.full((n,), position, device=device), mask)
        self.cache.append(n)
        return out

    def _grow(self, builder, context, budget) -> DraftTree:
        slot: dict[int, int] = {}  # tree node -> its place among the tree nodes written into the cache
        level, outputs = [0], self.state[None]
        try:
            for depth in range(self.max_depth):
                top_p, top_i = top_tokens(self.project(outputs), self.grower.topk, self.project.token_ids)
                children = self.grower.expand(builder, level, top_p.tolist(), top_i.tolist(), budget, self.min_score)
                if not children or depth + 1 >= self.max_depth:
                    break
                row_of = {node: row for row, node in enumerate(level)}
                sees = torch.zeros(len(children), len(slot), dtype=torch.bool)
                for r, c in enumerate(children):
                    a = builder.parents[c]
                    while a > 0:  # every drafted ancestor was run (only run nodes have children)
                        sees[r, slot[a]] = True
                        a = builder.parents[a]
                feature = outputs[[row_of[builder.parents[c]] for c in children]]
                tokens = torch.tensor([builder.tokens[c] for c in children], device=feature.device)
                outputs = self.extend(feature, tokens, self.committed + depth, sees.to(feature.device))
                for c in children:
                    slot[c] = len(slot)
                level = children
        finally:
            self.cache.truncate(self.committed)  # the tree's keys and values are not kept
        return builder.build(budget)


# ----------------------------------------------------------------------------------------- the published layout

def is_layout(path, raw: dict) -> bool:
    """Whether directory `path` (whose config.json is `raw`) holds EAGLE-1 weights in the published layout."""
    from safetensors import safe_open

    file = first_file(path, FILES)
    if raw.get("num_hidden_layers") != 1 or file is None:
        return False
    try:
        if file.suffix == ".safetensors":
            with safe_open(str(file), "pt") as f:
                names = set(f.keys())
        else:
            names = set(read_tensors(file, "heads"))
    except Exception:  # a damaged weights file beside a one-layer config: the loader says what is wrong with it
        return True
    return any(k == "fc.weight" or k.endswith(".fc.weight") for k in names)


def _strip_prefix(state: dict) -> dict:
    """Keys as the reference's Model names them: a wrapper's prefix (e.g. 'ea_layer.') taken off."""
    anchor = next((k for k in state if k == "fc.weight" or k.endswith(".fc.weight")), None)
    if anchor is None or anchor == "fc.weight":
        return state
    prefix = anchor[:-len("fc.weight")]
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def load(path, target_model, dtype=None) -> nn.Module:
    """EAGLE heads from a directory in the published layout, built for `target_model`; CloverError in one line."""
    raw = read_config(path)
    try:
        hidden, vocab = int(raw["hidden_size"]), int(raw["vocab_size"])
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        intermediate = int(raw["intermediate_size"])
        eps = float(raw.get("rms_norm_eps", 1e-6))
        theta = float(raw.get("rope_theta") or REFERENCE_ROPE_THETA)
    except (KeyError, TypeError, ValueError) as e:
        raise CloverError(f"heads {path}: EAGLE's config.json lacks a valid {e}")
    if not (heads >= 1 and kv_heads >= 1 and hidden % heads == 0 and heads % kv_heads == 0 and intermediate >= 1):
        raise CloverError(f"heads {path}: EAGLE's config.json is not valid (attention heads {heads}, key/value "
                          f"heads {kv_heads}, hidden size {hidden})")
    if raw.get("rope_scaling"):
        raise CloverError(f"heads {path}: an EAGLE layer with RoPE scaling {raw['rope_scaling']} is not supported")
    check_size(path, hidden, vocab, target_model)
    file = first_file(path, FILES)
    state = _strip_prefix(read_tensors(file, "heads"))
    bias = raw.get("bias", True)  # the reference builds fc with a bias unless its config says "bias": false
    if not isinstance(bias, bool):
        raise CloverError(f"heads {path}: EAGLE's config.json has \"bias\": {bias!r}, not true or false")
    if not bias:
        state.pop("fc.bias", None)  # the reference's fc has none then, and ignores one in the file
    elif "fc.bias" not in state:
        raise CloverError(f"heads {path}: the config says fc has a bias, but {file.name} holds no fc.bias")

    table = state.pop("embed_tokens.weight", None)
    embed = "input"
    if table is not None and not same_weights(table, target_model.get_input_embeddings().weight):
        if table.shape != target_model.get_input_embeddings().weight.shape:
            raise CloverError(f"heads {path}: their token embedding is {list(table.shape)}, this model's is "
                              f"{list(target_model.get_input_embeddings().weight.shape)}")
        embed = "own"
        state["embed_tokens.weight"] = table
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}  # recomputed here
    layer = {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
             "intermediate_size": intermediate, "rms_norm_eps": eps, "hidden_act": raw.get("hidden_act", "silu")}
    cfg = HeadsConfig(architecture="eagle", num_heads=DEPTH, num_layers=1, hidden_size=hidden, vocab_size=vocab,
                      num_gate_heads=heads, rms_norm_eps=eps, embed=embed, rope_theta=theta, fc_bias=bias,
                      layer=layer, layout="eagle", target={"name_or_path": raw.get("_name_or_path") or None})
    return finish_loading(build(cfg, target_model), state, path, target_model, dtype)


SPEC = Spec(build=build, drafter=EagleDrafter, layout=Layout(LAYOUT, "EAGLE's", is_layout, load),
            # one model, teacher-forced on the target's post-norm features, noised, as EAGLE-1 trains
            training=Training(features="post", tokens=True, noise=NOISE, reg_scale=REG_WEIGHT, one_model=True),
            copies_layer=True)
