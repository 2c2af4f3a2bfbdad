"""Clover-2 (arXiv 2408.00264): the heads' module, the Clover-2 authors' published layout and its loader, and the
drafter.

Clover-2, as built here (our own code, after the paper and its reference implementation):

    x_t  = target's last-layer hidden state at t, before the final norm        [H]
    e(v) = the target's frozen input embedding of token v                      [H]

    (feature_norm heads: x_t = feature_norm(x_t), an RMSNorm of their own started from the target's final norm)
    fuse:     u_t = x_t + concat_h( cos(q_h, k_h) * v_h ),  q = Wq norm(x_t), k = Wk e(tok_{t+1}), v = Wv e(tok_{t+1})
    augment:  s_t = norm( N decoder layers of the target's own class over u_0..u_t )    (own small KV cache)
    head 0:   o_0 = head_norm(W0 s_t)                               -> logits lm_head(o_0), for tok_{t+2}
    head i>0: s   = rnn(s, e(d_{i-1}))   (the same gated block)    -> o_i = head_norm(W [s; e(d_{i-1})])
              where d_{i-1} is the token drafted at depth i-1; logits lm_head(o_i), for tok_{t+2+i}

`lm_head` and the embedding belong to the target: shared, frozen, never stored in the heads file. Heads made by
the Clover-2 authors' code embed the drafted tokens with the target's lm_head weight instead of its input embedding
(`embed: "lm_head"`), and their augmenting layers use RoPE base 10000 whatever the target's (`rope_theta`). Each o_i is
trained to match the target's post-norm hidden state one step further on, and its logits the target's
distribution there.

The drafter grows a dynamic tree level by level (common.TreeGrower, as Medusa's does). At each depth the `width`
best nodes are expanded through one batched head call; each expanded node's children are the head's top tokens, cut
by the Clover-1 rule (drop a candidate below `min_ratio` of its best sibling) and a top-p cut on the head's
probabilities. A node's score is the product of the head probabilities along its path; the engine keeps the best-
scoring nodes within its budget.

The Clover-2 authors' layout (GitHub XiaoBin1992/clover, e.g. BinXiao/clover-2-vicuna-7b-v1.5): a Llama config with
a "clover" block; model.safetensors (or a pickled pytorch_model.bin). Their `ResAttentionBlock`s are our gates
(`clover_head_mlp_rnn` -> fuse, `clover_head_mlp_rnn2` -> rnn, their `input_layernorm` -> norm), `clover_norm` ->
norm, `clover_head_mlp` -> head0, `clover_head_mlp2` -> head_next, `clover_head_norm` -> head_norm, `layers.*`
unchanged. Drafted tokens are embedded with `clover_embed_tokens` (a frozen copy of the target's lm_head: shared
with the target when it equals it, kept otherwise), the augmenting layers use RoPE base 10000 (their code's fixed
default, whatever the target's), and the gates' cosine takes the config's rms_norm_eps as its eps. The file's
`lm_head.weight` must be the target's.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import CloverError
from ..families import Layout, Spec, Training
from ..packed import packed_linears
from ..target import Target, TreeKVCache, cache_kwarg
from ..tree import DraftTree
from .common import (TARGET_KEYS, DraftProjection, GrowsTree, HeadsConfig, Observed, RMSNorm, TreeGrower, check_size,
                     draft_config, finish_loading, first_file, heads_to_run, near_identity, quiet_residuals,
                     read_config, read_tensors, rotary_for, same_weights, target_layer_class, top_tokens)

ARCHITECTURE = "clover2"  # the heads config's "architecture"
LAYOUT = "clover2-authors"  # the published layout this module reads
FILES = ("model.safetensors", "pytorch_model.bin", "model.pt")
AUTHORS_ROPE_THETA = 10000.0  # the Clover-2 reference's LlamaRotaryEmbedding default; its code never reads the config's


class GatedFusion(nn.Module):
    """Clover's regressive attention block: a per-head cosine gate between the state and a token embedding."""

    def __init__(self, hidden: int, heads: int, eps: float, gate_eps: float = 1e-6):
        super().__init__()
        self.heads, self.gate_eps = heads, gate_eps
        self.norm = RMSNorm(hidden, eps)
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        near_identity(self.q)
        near_identity(self.k)
        nn.init.normal_(self.v.weight, std=0.01)
        nn.init.zeros_(self.v.bias)

    def forward(self, state, emb):
        shape = (*state.shape[:-1], self.heads, -1)
        q = self.q(self.norm(state)).view(shape)
        k = self.k(emb).view(shape)
        v = self.v(emb).view(shape)
        gate = F.cosine_similarity(q.float(), k.float(), dim=-1, eps=self.gate_eps).to(v.dtype)
        return state + (gate.unsqueeze(-1) * v).flatten(-2)


class LmHeadEmbedding(nn.Module):
    """The target's lm_head weight [V, H] read as an embedding table (row v embeds token v): shared, not copied."""

    def __init__(self, lm_head: nn.Module):
        super().__init__()
        self.lm_head = lm_head

    def forward(self, ids):
        return F.embedding(ids, self.lm_head.weight)


class Clover2Heads(nn.Module):
    def __init__(self, cfg: HeadsConfig, target_config, layer_class):
        super().__init__()
        self.cfg = cfg
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        if cfg.feature_norm:
            self.feature_norm = RMSNorm(H, eps)
        self.fuse = GatedFusion(H, cfg.num_gate_heads, eps, cfg.gate_eps)
        dcfg = draft_config(target_config)
        self.layers = nn.ModuleList(layer_class(dcfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(H, eps)
        self.head0 = nn.Linear(H, H)
        self.rnn = GatedFusion(H, cfg.num_gate_heads, eps, cfg.gate_eps)
        self.head_next = nn.Linear(2 * H, H)
        self.head_norm = RMSNorm(H, eps)
        near_identity(self.head0)
        near_identity(self.head_next)
        if cfg.embed == "own":  # the heads' own frozen token table (a published file's that matches no table of
            self.embed_tokens = nn.Embedding(cfg.vocab_size, H)  # the target's)
            self.embed_tokens.weight.requires_grad_(False)

    def init_from_target(self, target_model):
        """Augmenting layers start as copies of the target's last decoder layer; norms from its final norm. With
        feature_norm the layers' residual outputs start at zero (common.quiet_residuals): they read the target's
        post-norm scale, at which its last layer's own additions are many times the input."""
        from ..quantized import float_state_dict
        from ..target import decoder_layers, find_final_norm

        last = float_state_dict(decoder_layers(target_model.base_model)[-1])
        for layer in self.layers:
            layer.load_state_dict(last)
            if self.cfg.feature_norm:
                quiet_residuals(layer)
        final_norm = find_final_norm(target_model.base_model)
        if final_norm is not None and hasattr(final_norm, "weight"):
            with torch.no_grad():
                for norm in (self.norm, self.head_norm, getattr(self, "feature_norm", None)):
                    if norm is not None:
                        norm.weight.copy_(final_norm.weight.float())

    def token_embedding(self, target_model) -> nn.Module:
        """What embeds a token for the heads: the target's input embedding, or its lm_head weight read as one."""
        if self.cfg.embed == "lm_head":
            return LmHeadEmbedding(target_model.get_output_embeddings())
        if self.cfg.embed == "own":
            return self.embed_tokens
        return target_model.get_input_embeddings()

    def rotary(self, target_model) -> nn.Module:
        """The augmenting layers' rotary embedding: the target's, or one of its class with base `rope_theta`."""
        return rotary_for(target_model, self.cfg.rope_theta)

    def augment(self, hidden, next_emb, position_embeddings, position_ids, cache=None, attention_mask=None,
                **attention):
        """hidden, next_emb: [B, T, H]. Returns the augmented state [B, T, H] (causal over T, after the cache; or as
        `attention_mask` and the `attention` keywords tell the attention function: clover_cli/step/graphs.py)."""
        if self.cfg.feature_norm:
            hidden = self.feature_norm(hidden)
        u = self.fuse(hidden, next_emb)
        for layer in self.layers:
            out = layer(u, attention_mask=attention_mask, position_ids=position_ids, **{cache_kwarg(layer): cache},
                        use_cache=cache is not None, position_embeddings=position_embeddings, **attention)
            u = out[0] if isinstance(out, tuple) else out
        return self.norm(u)

    def step(self, depth: int, state, prev_emb=None):
        """Head `depth` (0-based): returns (next recurrent state, output hidden for lm_head)."""
        if depth == 0:
            return state, self.head_norm(self.head0(state))
        state = self.rnn(state, prev_emb)
        return state, self.head_norm(self.head_next(torch.cat([state, prev_emb], -1)))

    def forward_train(self, hidden, input_ids, embed, position_embeddings, position_ids):
        """Teacher-forced outputs of every head: list of [B, T, H]; head i at t predicts token t+2+i.

        hidden: pre-norm target hidden [B, T, H]; input_ids [B, T]. Positions past the end use token 0 and
        must be masked out of the loss.
        """
        T = input_ids.shape[1]
        ids = F.pad(input_ids, (0, self.cfg.num_heads + 1), value=0)
        state = self.augment(hidden, embed(ids[:, 1:T + 1]), position_embeddings, position_ids)
        state, out = self.step(0, state)
        outs = [out]
        for i in range(1, self.cfg.num_heads):
            state, out = self.step(i, state, embed(ids[:, 1 + i:T + 1 + i]))
            outs.append(out)
        return outs

    def forward(self, hidden, input_ids, embed, position_embeddings, position_ids):
        """The training forward (forward_train), so that a DistributedDataParallel wrapper syncs its gradients."""
        return self.forward_train(hidden, input_ids, embed, position_embeddings, position_ids)


def build(cfg: HeadsConfig, target_model) -> nn.Module:
    heads = Clover2Heads(cfg, target_model.config, target_layer_class(target_model))
    heads.draft_vocab = None  # all of the target's vocabulary, unless train/load sets a shortlist
    return heads


# ---------------------------------------------------------------------------------------------------- the drafter

class CloverAugment(torch.nn.Module):
    """What a Clover-2 proposal first catches up on: the augmenting block over the newly committed positions,
    (target hidden [n, H], next tokens [n], positions [n], the heads' cache) -> states [n, H]. Run eager, or exported
    and compiled (clover_cli/step/aot_export.py) with the cache made over its buffers."""

    def __init__(self, heads, target: Target):
        super().__init__()
        self.heads, self.embed, self.rotary = heads, heads.token_embedding(target.model), heads.rotary(target.model)
        self.dtype = next(heads.parameters()).dtype

    def forward(self, hidden, tokens, positions, cache, attention_mask=None, attention=None):
        x = hidden.to(self.dtype)[None]
        emb = self.embed(tokens)[None].to(self.dtype)
        return self.heads.augment(x, emb, self.rotary(x, positions[None]), positions[None], cache=cache,
                                  attention_mask=attention_mask, **(attention or {}))[0]


class CloverLevel(torch.nn.Module):
    """One depth of Clover-2 heads over a level of tree nodes: (states [r, H], the nodes' tokens [r]) -> (next states,
    probabilities [r, k] and token ids [r, k] of each node's k best children). The first depth (head 0) reads the
    state alone; later depths share one set of weights and also read the embedding of the node's token."""

    def __init__(self, heads, target: Target, project: DraftProjection, first: bool, k: int):
        super().__init__()
        self.heads, self.embed, self.out = heads, heads.token_embedding(target.model), project.linear
        self.first, self.k = first, k
        self.dtype = next(heads.parameters()).dtype
        # a buffer (not a plain attribute): a compiled program names it, and reads the drafter's own
        self.register_buffer("token_ids", project.token_ids, persistent=False)
        self.project = project

    def forward(self, states, tokens):
        if self.first:
            states, out = self.heads.step(0, states)
        else:
            states, out = self.heads.step(1, states, self.embed(tokens).to(self.dtype))
        top_p, top_i = top_tokens(self.project(out), self.k, self.token_ids)
        return states, top_p, top_i


class CloverDrafter(GrowsTree):
    """Clover-2 heads growing a dynamic (or static) tree. Per proposal: the augmenting block catches up on what the
    target committed since the last one (CloverAugment), then one CloverLevel per depth. Each of those runs eager,
    or compiled once `attach_programs` gives their compiled twins (same inputs, same outputs)."""

    name = "clover"
    programs_kind = "clover"

    # A catch-up runs the augmenting block over at most this many of the positions committed since the last one:
    # the first proposal of a reply would otherwise run it over the whole prompt (on the bundled model and a CPU,
    # 7-15 ms for 330-570 positions, about as much as ten steps of heads), for drafts that gain little from
    # attending that far back (measured: docs/BENCHMARKS.md). None: every position.
    WINDOW = 64

    def __init__(self, heads, target: Target, window: int | None = WINDOW, **grow):
        heads, self.int8 = heads_to_run(heads, target)
        self.heads = heads
        self.window = window
        self.target = target
        self.grower = TreeGrower(**grow)
        self.dtype = next(heads.parameters()).dtype
        self.project = DraftProjection(target.lm_head, getattr(heads, "draft_vocab", None), int8=self.int8)
        self.cache = TreeKVCache(heads.cfg.num_layers, 256, target.max_context)
        self.augment_block = CloverAugment(heads, target)
        self.levels = (CloverLevel(heads, target, self.project, True, self.grower.topk),
                       CloverLevel(heads, target, self.project, False, self.grower.topk))
        self.programs = None  # compiled twins of (augment_block, levels[0], levels[1]), once attached
        self.state = None
        # what observe() was given and the augmenting block has not run over yet: it runs once, over the last
        # `window` positions of it, when a proposal needs the state (a step whose tree comes from lookup alone
        # skips the heads)
        self.observed = Observed()
        self.max_depth = heads.cfg.num_heads
        self.min_score = 0.0  # set by the engine: nodes scored below it do not pay for their verification

    def attach_programs(self, programs) -> None:
        """Run the compiled twins from now on (clover_cli.step.aot.HeadsPrograms); the cache takes their capacity,
        and its buffers are made now, so that the first catch-up (the prompt) runs compiled too."""
        self.cache.grow_to(programs.capacity)
        param = next(self.heads.parameters())
        self.cache.allocate(self.heads.layers, param.dtype, param.device)
        self.programs = programs

    def reset(self, length: int) -> None:
        self.observed.reset(self.cache, length)
        self.state = None

    def observe(self, hidden, next_tokens) -> None:
        self.observed.add(hidden, next_tokens)
        self.state = None

    @torch.inference_mode()
    @packed_linears()
    def _catch_up(self) -> None:
        taken = self.observed.take(self.window)
        if taken is None:
            return
        hidden, next_tokens, pos = taken
        n = next_tokens.numel()
        self.cache.reserve(n)
        compiled = self.programs is not None and self.programs.fits(self.cache, n)
        block = self.programs.augment if compiled else self.augment_block
        state = block(hidden, next_tokens, pos, self.cache)
        self.cache.append(n)
        self.state = state[-1]

    def _grow(self, builder, context, budget) -> DraftTree:
        levels = self.programs.levels if self.programs is not None else self.levels
        level, states = [0], self.state[None]
        tokens = torch.tensor(context[-1:], device=states.device)
        for depth in range(self.heads.cfg.num_heads):
            new_states, top_p, top_i = levels[min(depth, 1)](states, tokens)
            children = self.grower.expand(builder, level, top_p.tolist(), top_i.tolist(), budget, self.min_score)
            if not children:
                break
            row_of = {node: row for row, node in enumerate(level)}
            states = new_states[[row_of[builder.parents[c]] for c in children]]
            level = children
            tokens = torch.tensor([builder.tokens[i] for i in level], device=states.device)
        return builder.build(budget)


# ------------------------------------------------------------------------------------ the Clover-2 authors' layout


def is_layout(path: Path, raw: dict) -> bool:
    """Whether directory `path` (whose config.json is `raw`) holds heads in the Clover-2 authors' layout."""
    return isinstance(raw.get("clover"), dict)


def _strip_prefix(state: dict) -> dict:
    """Keys as the reference module names them: a wrapper's prefix (e.g. 'ea_layer.') taken off."""
    anchor = next((k for k in state if re.search(r"(^|\.)clover_head_mlp\.", k)), None)
    if anchor is None:
        return state
    prefix = anchor[:anchor.index("clover_head_mlp.")]
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)} if prefix else state


AUTHORS_NAMES = [  # (their module, ours), longest first
    ("clover_head_mlp_rnn2.input_layernorm.", "rnn.norm."), ("clover_head_mlp_rnn2.", "rnn."),
    ("clover_head_mlp_rnn.input_layernorm.", "fuse.norm."), ("clover_head_mlp_rnn.", "fuse."),
    ("clover_head_mlp2.", "head_next."), ("clover_head_mlp.", "head0."),
    ("clover_head_norm.", "head_norm."), ("clover_norm.", "norm."), ("layers.", "layers."),
]


def load(path: Path, target_model, dtype=None) -> torch.nn.Module:
    raw = read_config(path)
    block = raw["clover"]
    try:
        num_heads, num_layers = int(block["num_heads"]), int(block["num_layers"])
        hidden, vocab = int(raw["hidden_size"]), int(raw["vocab_size"])
        gate_heads, eps = int(raw["num_attention_heads"]), float(raw.get("rms_norm_eps", 1e-6))
    except (KeyError, TypeError, ValueError) as e:
        raise CloverError(f"heads {path}: the Clover-2 authors' config.json lacks a valid {e}")
    if not (1 <= num_heads <= 64 and 0 <= num_layers <= 64 and gate_heads >= 1 and hidden % gate_heads == 0):
        raise CloverError(f"heads {path}: the Clover-2 authors' config.json is not valid")
    if raw.get("rope_scaling"):
        raise CloverError(f"heads {path}: augmenting layers with RoPE scaling {raw['rope_scaling']} are not supported")
    check_size(path, hidden, vocab, target_model)
    file = first_file(path, FILES)
    if file is None:
        raise CloverError(f"heads {path} have no weights ({' or '.join(FILES)})")
    state = _strip_prefix(read_tensors(file, "heads"))

    lm_head = target_model.get_output_embeddings().weight
    theirs = state.pop("lm_head.weight", None)
    if theirs is not None and not same_weights(theirs, lm_head):
        raise CloverError(f"heads {path} were made for another model: their lm_head is not this model's")
    table = state.pop("clover_embed_tokens.weight", None)
    if table is None:
        raise CloverError(f"heads {path} have no clover_embed_tokens (the Clover-2 authors' layout has it)")
    embed = ("lm_head" if same_weights(table, lm_head) else
             "input" if same_weights(table, target_model.get_input_embeddings().weight) else "own")

    mapped = {}
    for key, value in state.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue  # a buffer older transformers saved; recomputed here
        new = next((ours + key[len(theirs_):] for theirs_, ours in AUTHORS_NAMES if key.startswith(theirs_)),
                   None)
        mapped[new or key] = value  # an unknown key stays: reported as unexpected
    if embed == "own":
        mapped["embed_tokens.weight"] = table

    cfg = HeadsConfig(architecture="clover2", num_heads=num_heads, num_layers=num_layers, hidden_size=hidden,
                      vocab_size=vocab, num_gate_heads=gate_heads, rms_norm_eps=eps, embed=embed,
                      rope_theta=AUTHORS_ROPE_THETA, gate_eps=eps, layout="clover2-authors",
                      target={k: raw.get(k) for k in TARGET_KEYS},
                      training={k: block.get(k) for k in ("heads_coefficient", "decay_coefficient") if k in block})
    cfg.target["name_or_path"] = raw.get("_name_or_path") or None
    cfg.check_target(target_model.config, str(path), layer=True)
    return finish_loading(build(cfg, target_model), mapped, path, target_model, dtype)


def config_problem(cfg: HeadsConfig) -> str | None:
    """What is wrong with a Clover-2 config beyond what every family's checks catch: its gates split the state."""
    if not (cfg.num_gate_heads >= 1 and cfg.hidden_size % cfg.num_gate_heads == 0):
        return f"num_gate_heads must divide hidden_size {cfg.hidden_size}, not {cfg.num_gate_heads}"
    if not isinstance(cfg.feature_norm, bool):
        return f"feature_norm must be true or false, not {cfg.feature_norm!r}"
    return None


SPEC = Spec(build=build, drafter=CloverDrafter, layout=Layout(LAYOUT, "the Clover-2 authors'", is_layout, load),
            # reads the pre-norm features with the tokens; --layers augmenting layers; with one head its recurrent
            # block idles
            training=Training(features="pre", tokens=True, layers=True, idle_one_head=True),
            copies_layer=True, config_problem=config_problem)
