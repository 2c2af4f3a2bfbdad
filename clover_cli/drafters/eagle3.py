"""EAGLE-3's draft model (arXiv 2503.01840) with EAGLE-2's dynamic tree: the module, the published layout's detection
and loader, and the drafter. Our own code, after the paper and reading its reference (GitHub SafeAILab/EAGLE,
`eagle/model/cnets.py`: `Model`, `LlamaDecoderLayeremb`; `modeling_llama_kv.py` for the features it reads).

Unlike EAGLE-1 it reads three of the target's features, fused, and drafts from its own reduced vocabulary:

    F_t  = cat(h^a_t, h^b_t, h^c_t): the target's hidden states ENTERING decoder layers a, b, c at t (L layers:
           a = 2, b = L // 2, c = L - 3, the reference's choice), [3 H]
    e(v) = the target's input embedding of token v (or the file's own `embed_tokens`)
    x_t  = fc(F_t)                    (Linear 3H -> H, no bias) for a committed position; for a drafted one, x is
                                      the draft's own output g at its parent (fc is not applied to it)
    a    = attn(cat(input_layernorm(e(tok_{t+1})), hidden_norm(x_t)))   q/k/v read 2H; RoPE base `rope_theta`
           (10000 when the config names none); its own KV cache
    y    = x_t + a;   g_t = y + mlp(post_attention_layernorm(y))
    logits over the draft vocabulary: lm_head(norm(g_t)) [V_d];  draft index i is target token i + d2t[i]

Drafting: as EAGLE-1's (drafters/eagle.py): each drafted node runs one position further on from its parent's g,
attending to the committed positions and its own ancestors; EAGLE-2's rule grows the tree.

The target supplies F through the drafter's `feature_layers`: the engine asks the target (Target.use_features) to
capture those layers' inputs in its eager forward and pass cat of them, [n, 3H], as `hidden` to observe(). The
compiled step does not capture them: with an EAGLE-3 drafter the target runs eager (still exactly the target).

Published files (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): config.json, a one-layer Llama config with
`draft_vocab_size` (and optionally `target_hidden_size`, `rope_theta`), and model.safetensors or a pickled
pytorch_model.bin holding `fc.weight` [H, 3H], `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}`,
`midlayer.self_attn.{q,k,v,o}_proj`, `midlayer.mlp.{gate,up,down}_proj`, `norm.weight`, `lm_head.weight` [V_d, H],
`d2t` [V_d] and `t2d` [V] (absent when V_d = V) and optionally `embed_tokens.weight`.
clover's own format (`clover train --arch eagle3`) stores the same module under `"architecture": "eagle3"`; its
draft vocabulary is the --draft-vocab most frequent tokens of the training replies (all of them when the
vocabulary is smaller), in d2t/t2d as the published files keep it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import CloverError
from ..families import Layout, Spec, Training
from ..target import Target, tree_attention
from .eagle import EagleDrafter, _strip_prefix  # the same wrapper prefix as EAGLE-1's files
from .common import (HeadsConfig, RMSNorm, finish_loading, first_file, near_identity, read_config, read_tensors,
                     same_weights)

ARCHITECTURE = "eagle3"
LAYOUT = "eagle3"
FILES = ("model.safetensors", "pytorch_model.bin")  # safetensors first, where a directory has both
REFERENCE_ROPE_THETA = 10000.0  # the reference's rotary base when its config names none
DEPTH = 8  # levels drafted: the reference's EAGLE-3 default depth 7 after the root's children
TOPK = 10  # EAGLE-2: children per expanded node, and nodes expanded per depth
MIN_LAYERS = 7  # the reference's three layers (2, L // 2, L - 3) are distinct from 7 layers on


def feature_layers(num_layers: int, strict: bool = False) -> tuple[int, int, int]:
    """The decoder layers whose inputs EAGLE-3 fuses: (2, L // 2, L - 3). A target shallower than MIN_LAYERS
    (clover's own heads only: `strict` refuses it) gets them clamped into range, some repeated."""
    if num_layers < MIN_LAYERS:
        if strict:
            raise CloverError(f"EAGLE-3 reads the target's layers 2, L/2 and L-3: a target of {num_layers} layers "
                              f"has no three distinct ones (at least {MIN_LAYERS} needed)")
        return tuple(sorted(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)))
    return 2, num_layers // 2, num_layers - 3


def _rope(x, positions, theta: float):
    """Rotary embedding of x [B, heads, T, d] at positions [T] (rotate-half, the reference's LlamaRotaryEmbedding)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device).float() / d))
    ang = positions.float()[:, None] * inv[None]
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + half * sin


class Eagle3Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, theta: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.theta = heads, kv_heads, head_dim, theta
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x, positions, cache=None, mask=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rope(q, positions, self.theta), _rope(k, positions, self.theta)
        if cache is not None:
            k, v = cache.layers[0].update(k, v)
        out, _ = tree_attention(self, q, k, v, mask, scaling=self.head_dim ** -0.5)
        return self.o_proj(out.reshape(B, T, -1))


class Eagle3MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = ACT2FN[act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """The reference's LlamaDecoderLayeremb: attention over cat(normed embedding, normed state), then the MLP."""

    def __init__(self, hidden: int, layer: dict, theta: float):
        super().__init__()
        eps = layer["rms_norm_eps"]
        self.hidden_norm = RMSNorm(hidden, eps)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Eagle3Attention(hidden, layer["num_attention_heads"], layer["num_key_value_heads"],
                                         layer["head_dim"], theta)
        self.mlp = Eagle3MLP(hidden, layer["intermediate_size"], layer.get("hidden_act", "silu"))

    def forward(self, x, emb, positions, cache=None, mask=None):
        h = torch.cat([self.input_layernorm(emb), self.hidden_norm(x)], -1)
        y = x + self.self_attn(h, positions, cache, mask)
        return y + self.mlp(self.post_attention_layernorm(y))


def layer_settings(target_config) -> dict:
    """clover's own EAGLE-3 layer: the target's attention shape, intermediate size, eps and activation."""
    tc = target_config
    heads = tc.num_attention_heads
    return {"num_attention_heads": heads, "num_key_value_heads": getattr(tc, "num_key_value_heads", None) or heads,
            "head_dim": tc.hidden_size // heads, "intermediate_size": tc.intermediate_size,
            "rms_norm_eps": float(getattr(tc, "rms_norm_eps", 1e-6)), "hidden_act": getattr(tc, "hidden_act", "silu")}


def _layer_problem(layer: dict, hidden: int) -> str | None:
    """What is wrong with an EAGLE-3 layer's settings (a config read from a file), or None."""
    from transformers.activations import ACT2FN

    for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
        value = layer.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"{key} must be a positive whole number, not {value!r}"
    eps = layer.get("rms_norm_eps")
    if not isinstance(eps, (int, float)) or not 0 < eps < 1:
        return f"rms_norm_eps must be in (0, 1), not {eps!r}"
    if layer["num_attention_heads"] % layer["num_key_value_heads"]:
        return "num_key_value_heads must divide num_attention_heads"
    if layer.get("hidden_act", "silu") not in ACT2FN:
        return f"unknown hidden_act {layer.get('hidden_act')!r}"
    if hidden < 1:
        return f"hidden_size must be positive, not {hidden}"
    return None


class Eagle3Head(nn.Module):
    """EAGLE-3's draft model (see the module docstring). cfg.hidden_size is the target's; cfg.layer holds the
    layer's settings (and "hidden_size" where the draft's differs from the target's)."""

    def __init__(self, cfg: HeadsConfig, target_config=None, layer_class=None):
        super().__init__()
        self.cfg = cfg
        if not cfg.layer:
            cfg.layer = layer_settings(target_config)
        Ht = cfg.hidden_size
        H = int(cfg.layer.get("hidden_size", Ht))
        why = _layer_problem(cfg.layer, H)
        if why:
            raise CloverError(f"EAGLE-3 heads: their layer settings are not valid ({why})")
        self.hidden = H
        theta = float(cfg.rope_theta if cfg.rope_theta is not None else REFERENCE_ROPE_THETA)
        self.fc = nn.Linear(3 * Ht, H, bias=False)
        self.midlayer = Eagle3Layer(H, cfg.layer, theta)
        self.norm = RMSNorm(H, cfg.layer["rms_norm_eps"])
        vd = cfg.draft_vocab_size or cfg.vocab_size
        self.lm_head = nn.Linear(H, vd, bias=False)
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool) if vd == cfg.vocab_size else
                             torch.zeros(cfg.vocab_size, dtype=torch.bool))
        if cfg.embed == "own":
            self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
            self.embed_tokens.weight.requires_grad_(False)
        self.draft_vocab = None  # the draft vocabulary is d2t's, not the heads' shortlist (save_heads stores none)

    def feature_layers(self, num_layers: int) -> tuple[int, int, int]:
        return feature_layers(num_layers, strict=self.cfg.layout != "clover")

    def use_vocab(self, ids: torch.Tensor | None) -> None:
        """Draft from these target token ids (None: all): d2t and t2d as the reference keeps them, ascending."""
        if ids is None:
            return
        ids = ids.sort().values.to(self.d2t.device)
        if ids.numel() != self.lm_head.weight.shape[0]:
            raise ValueError("the draft vocabulary does not match the lm_head")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def target_ids(self) -> torch.Tensor:
        """[V_d]: the target token of every draft index."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def init_from_target(self, target_model):
        """fc starts as the highest feature, the MLP and post-attention norm as the target's last layer's, norm as its
        final norm, lm_head as the target's rows of the draft vocabulary."""
        from ..target import decoder_layers, find_final_norm

        H = self.hidden
        near_identity(self.fc, in_block=2 * self.cfg.hidden_size)
        last = decoder_layers(target_model.base_model)[-1]
        with torch.no_grad():
            for name in ("gate_proj", "up_proj", "down_proj"):
                src = getattr(getattr(last, "mlp", None), name, None)
                dst = getattr(self.midlayer.mlp, name)
                if src is not None and src.weight.shape == dst.weight.shape:
                    dst.weight.copy_(src.weight.float())
            post = getattr(last, "post_attention_layernorm", None)
            if post is not None and getattr(post, "weight", None) is not None and post.weight.shape == (H,):
                self.midlayer.post_attention_layernorm.weight.copy_(post.weight.float())
            final = find_final_norm(target_model.base_model)
            if final is not None and getattr(final, "weight", None) is not None and final.weight.shape == (H,):
                self.norm.weight.copy_(final.weight.float())
            lm = target_model.get_output_embeddings().weight
            if lm.shape[1] == H:
                self.lm_head.weight.copy_(lm.detach()[self.target_ids().to(lm.device)].float())

    def token_embedding(self, target_model) -> nn.Module:
        return self.embed_tokens if self.cfg.embed == "own" else target_model.get_input_embeddings()

    def draft(self, x, emb, positions, cache=None, mask=None, fused: bool = False):
        """x: [B, T, 3H] fused target features (`fused`) or [B, T, H] the draft's own outputs; emb [B, T, H] the
        embedding of the token after each; positions [T]. Returns g [B, T, H]: causal over T after the cache, or as
        `mask` says (bool [1, 1, T, past + T])."""
        if fused:
            x = self.fc(x)
        return self.midlayer(x, emb, positions, cache, mask)

    def logits(self, g):
        """Draft-vocabulary logits [..., V_d] of outputs g."""
        return self.lm_head(self.norm(g))

    def forward_train(self, features, input_ids, embed, positions):
        """Teacher-forced: features [B, T, 3H] the fused target features, input_ids [B, T]. Returns [g], g [B, T, H]
        (g at t predicts token t+2; the last position reads token 0 and must be masked out)."""
        T = input_ids.shape[1]
        nxt = F.pad(input_ids, (0, 1), value=0)[:, 1:T + 1]
        x = features.to(self.fc.weight.dtype)
        return [self.draft(x, embed(nxt).to(x.dtype), positions, fused=True)]

    def forward(self, features, input_ids, embed, positions):
        """The training forward (forward_train), so that a DistributedDataParallel wrapper syncs its gradients."""
        return self.forward_train(features, input_ids, embed, positions)


def build(cfg: HeadsConfig, target_model) -> nn.Module:
    return Eagle3Head(cfg, target_model.config)


class _Project:
    """What EagleDrafter.propose calls to rank a level's children: draft-vocabulary logits, with the target id of
    every column in `token_ids`."""

    def __init__(self, heads):
        self.heads, self.token_ids = heads, heads.target_ids()

    def __call__(self, g):
        return self.heads.logits(g)


class Eagle3Drafter(EagleDrafter):
    """EAGLE-3's model drafting EAGLE-2's dynamic tree (or the static one): EagleDrafter's tree growing, with the
    fused three-layer features in, fc applied to committed positions only, and the draft vocabulary out."""

    name = "eagle3"

    def __init__(self, heads, target: Target, **grow):
        self.feature_layers = heads.feature_layers(target.config.num_hidden_layers)
        super().__init__(heads, target, **grow)

    def _model_parts(self, heads, target: Target) -> None:
        """The draft vocabulary's projection and the token embedding (no final norm: the fused features are the
        target's inner layers'; the rotary embedding is the heads' own)."""
        self.project = _Project(heads)
        self.embed = heads.token_embedding(target.model)

    def _run(self, feature, tokens, positions, mask=None, fused: bool = False):
        emb = self.embed(tokens).to(self.dtype)[None]
        x = feature.to(self.dtype)[None]
        return self.heads.draft(x, emb, positions, self.cache, mask, fused=fused)[0]

    def _committed_feature(self, hidden):
        """The target's fused features, as they are (fc runs inside the model, on committed positions only)."""
        if hidden.shape[-1] != 3 * self.heads.cfg.hidden_size:
            raise CloverError(f"EAGLE-3 needs the target's fused features ({3 * self.heads.cfg.hidden_size} wide), "
                              f"got {hidden.shape[-1]}: the target was not asked for its layers {self.feature_layers}")
        return hidden

    def _run_committed(self, feature, tokens, positions):
        return self._run(feature, tokens, positions, fused=True)


# ----------------------------------------------------------------------------------------- the published layout

def is_layout(path, raw: dict) -> bool:
    """Whether directory `path` (whose config.json is `raw`) holds EAGLE-3 weights in the published layout: a
    one-layer config with `draft_vocab_size`, or weights with the reference's `midlayer`."""
    from safetensors import safe_open


    file = first_file(path, FILES)
    if raw.get("num_hidden_layers") != 1 or file is None:
        return False
    if "draft_vocab_size" in raw:
        return True
    try:
        if file.suffix == ".safetensors":
            with safe_open(str(file), "pt") as f:
                names = set(f.keys())
        else:
            from ..torchload import load as torch_load

            names = set(torch_load(file, "heads", mmap=True))  # mapped, not read: only the names are needed
    except Exception:  # damaged: EAGLE-1's check decides, and its loader says what is wrong
        return False
    return any(k.startswith("midlayer.") or ".midlayer." in k for k in names)


def load(path, target_model, dtype=None) -> nn.Module:
    """EAGLE-3 heads from a directory in the published layout, built for `target_model`; CloverError in one line."""

    raw = read_config(path)
    try:
        hidden, vocab = int(raw["hidden_size"]), int(raw["vocab_size"])
        draft_vocab = int(raw.get("draft_vocab_size") or vocab)
        target_hidden = int(raw.get("target_hidden_size") or hidden)
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        intermediate = int(raw["intermediate_size"])
        eps = float(raw.get("rms_norm_eps", 1e-6))
        theta = float(raw.get("rope_theta") or REFERENCE_ROPE_THETA)
    except (KeyError, TypeError, ValueError) as e:
        raise CloverError(f"heads {path}: EAGLE-3's config.json lacks a valid {e}")
    if not (heads >= 1 and kv_heads >= 1 and hidden % heads == 0 and heads % kv_heads == 0 and intermediate >= 1
            and 1 <= draft_vocab <= vocab):
        raise CloverError(f"heads {path}: EAGLE-3's config.json is not valid (attention heads {heads}, key/value "
                          f"heads {kv_heads}, hidden size {hidden}, draft vocabulary {draft_vocab} of {vocab})")
    if raw.get("rope_scaling"):
        raise CloverError(f"heads {path}: an EAGLE-3 layer with RoPE scaling {raw['rope_scaling']} is not supported")
    tc = target_model.config.to_dict()
    if (target_hidden, vocab) != (tc.get("hidden_size"), tc.get("vocab_size")):
        raise CloverError(f"heads {path} were made for hidden size {target_hidden} and vocabulary {vocab}; this model "
                          f"has {tc.get('hidden_size')} and {tc.get('vocab_size')}")
    feature_layers(int(tc.get("num_hidden_layers") or 0), strict=True)  # a target too shallow: one line
    file = first_file(path, FILES)
    state = _strip_prefix(read_tensors(file, "heads"))
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}  # recomputed here
    if draft_vocab == vocab:  # the reference drops d2t and t2d then: the identity
        state.setdefault("d2t", torch.zeros(vocab, dtype=torch.long))
        state.setdefault("t2d", torch.ones(vocab, dtype=torch.bool))
    for name, want in (("d2t", (draft_vocab,)), ("t2d", (vocab,))):
        t = state.get(name)
        if t is None:
            raise CloverError(f"heads {path}: {file.name} has no {name} (a draft vocabulary of {draft_vocab} needs it)")
        if tuple(t.shape) != want or t.is_floating_point():
            raise CloverError(f"heads {path}: {name} in {file.name} is {list(t.shape)} {t.dtype}, not {list(want)}")
    state["d2t"] = state["d2t"].long()
    state["t2d"] = state["t2d"].bool()
    ids = torch.arange(draft_vocab) + state["d2t"]
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise CloverError(f"heads {path}: d2t in {file.name} maps draft tokens outside the vocabulary of {vocab}")

    table = state.pop("embed_tokens.weight", None)
    embed = "input"
    if table is not None and not same_weights(table, target_model.get_input_embeddings().weight):
        if tuple(table.shape) != (vocab, hidden):
            raise CloverError(f"heads {path}: their token embedding is {list(table.shape)}, not [{vocab}, {hidden}]")
        embed = "own"
        state["embed_tokens.weight"] = table
    elif table is None and hidden != target_hidden:
        raise CloverError(f"heads {path}: a draft hidden size {hidden} unlike the target's {target_hidden} needs "
                          f"the file's own embed_tokens")
    layer = {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
             "intermediate_size": intermediate, "rms_norm_eps": eps, "hidden_act": raw.get("hidden_act", "silu")}
    if hidden != target_hidden:
        layer["hidden_size"] = hidden
    cfg = HeadsConfig(architecture="eagle3", num_heads=DEPTH, num_layers=1, hidden_size=target_hidden,
                      vocab_size=vocab, draft_vocab_size=0 if draft_vocab == vocab else draft_vocab,
                      num_gate_heads=heads, rms_norm_eps=eps, embed=embed, rope_theta=theta, fc_bias=False,
                      layer=layer, layout="eagle3", target={"name_or_path": raw.get("_name_or_path") or None})
    return finish_loading(Eagle3Head(cfg), state, path, target_model, dtype)


# ----------------------------------------------------------------------------------------------------- training

def layer_inputs(model, input_ids, layers) -> torch.Tensor:
    """cat of the hidden states entering decoder layers `layers` of a batch (no cache, causal): [B, T, 3H]."""
    from ..target import decoder_layers

    stack = decoder_layers(model.base_model)
    seen: dict[int, torch.Tensor] = {}

    def capture(index):
        def hook(module, args, kwargs):
            seen[index] = args[0] if args else kwargs["hidden_states"]
        return hook

    handles = [stack[i].register_forward_pre_hook(capture(i), with_kwargs=True) for i in sorted(set(layers))]
    try:
        model.base_model(input_ids=input_ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return torch.cat([seen[i] for i in layers], -1)


def eagle3_loss(heads, model, x, mask, post, cfg):
    """clover's EAGLE-3 training loss, teacher-forced (no training-time test): g_t from the fused features F_t and
    token t+1 is trained on (1) the soft cross-entropy of its draft-vocabulary logits against the target's
    distribution at t+1 restricted to the draft vocabulary (renormalised), and (2) `reg_weight` x SmoothL1(g_t,
    fc(F_{t+1})), fc's output one position on held fixed: what a drafted node reads in place of fc(F) at the next
    depth. Over positions whose token t+2 is trained on. Returns (loss, [(loss, top-1 agreement, positions)])."""
    inner = getattr(heads, "module", heads)  # under DistributedDataParallel
    B, T = x.shape
    layers = inner.feature_layers(model.config.num_hidden_layers)
    with torch.no_grad():
        feats = layer_inputs(model, x, layers).float()
    pos = torch.arange(T, device=x.device)
    g = heads(feats, x, inner.token_embedding(model), pos)[0]
    n = T - 2
    m = mask[:, 2:] > 0 if n > 0 else None
    if m is None or not m.any():
        return 0.0 * g.float().sum(), [(0.0, 0.0, 0)]
    student = g[:, :n][m]
    lm_head = model.get_output_embeddings()
    ids = inner.target_ids()
    with torch.no_grad():
        t_logits = lm_head(post[:, 1:1 + n][m].to(lm_head.weight.dtype)).float()
        t_arg = t_logits.argmax(-1)
        t_prob = torch.softmax(t_logits[:, ids], -1)
        del t_logits
        wanted = inner.fc(feats[:, 1:1 + n][m].to(inner.fc.weight.dtype)).float()
    s_logits = inner.logits(student).float()
    ce = -(t_prob * F.log_softmax(s_logits, -1)).sum(-1).mean()
    reg = F.smooth_l1_loss(student.float(), wanted, reduction="none").mean(-1).mean()
    loss = ce + cfg.reg_weight * reg
    acc = (ids[s_logits.argmax(-1)] == t_arg).float().mean().item()
    return loss, [(loss.item(), acc, int(m.sum()))]


SPEC = Spec(build=build, drafter=Eagle3Drafter,
            # tried before EAGLE-1's layout: an EAGLE-3 file passes its test too
            layout=Layout(LAYOUT, "EAGLE-3's", is_layout, load, before="eagle"),
            training=Training(one_model=True, own_vocab=True, loss=eagle3_loss),
            bench_row="eagle")  # clover bench's eagle row runs EAGLE-1 or EAGLE-3 heads, whichever --eagle-heads are
