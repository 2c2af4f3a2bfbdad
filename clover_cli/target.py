"""The target model: a stock transformers causal LM run through our attention function and KV cache.

`TreeKVCache` is preallocated; a forward writes the new tokens' keys and values after the committed ones, and
`commit(nodes)` moves the accepted tree nodes into place (one gather per layer, no copy of the whole cache).
`tree_attention` is registered with transformers' `AttentionInterface` as "clover_tree": queries are the new tokens,
keys the committed prefix plus the new tokens, and the mask (when given) says which new tokens see which.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from .errors import CloverError
from .packed import pack_linears, packed_linears, stock_linears
from .options import env, kv16

ATTN_NAME = "clover_tree"

# Device types on which tree attention and the KV commit run through the Triton kernels (clover_kernels). CPU keeps
# the torch path; the kernel tests add "cpu" under TRITON_INTERPRET=1 to exercise this wiring without a GPU.
# CLOVER_TRITON=0 turns the kernels off.
TRITON_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
TREE_BITS_KWARG = "clover_tree_bits"  # packed tree mask that Target.forward hands to every attention call
# Given by the static step (step/graphs.py): the mask is whole, over a fixed span of the buffers; the value is
# (query positions, key positions, committed + new keys), for layers with a sliding window
STATIC_KWARG = "clover_static"
# set on the modules of a model whose linears round their activations to int8 (quantized.apply): its attention then
# runs clover_kernels.attention.exact_rows on the CPU, each row the same bits whatever the batch
EXACT_ROWS = "clover_exact_rows"
# set on a model (quantized.apply: a GGUF's or --quantize's integers with int8 activations) whose KV cache holds
# float16 keys and values, as llama.cpp keeps them: half the bytes a step's attention reads. Its attention widens
# them exactly (exact_rows), so a verify and a one-token step still see the same numbers. CLOVER_KV16=0: float32.
KV_FLOAT16 = "clover_kv_float16"
_kernels = None


def triton_kernels(device: torch.device):
    """The clover_kernels module when its Triton kernels are to run on `device`, else None (imported lazily)."""
    global _kernels
    if device.type not in TRITON_DEVICE_TYPES or env("CLOVER_TRITON", "1") == "0":
        return None
    if _kernels is None:
        try:
            import clover_kernels

            _kernels = clover_kernels if clover_kernels.triton_available() else False
        except ImportError:
            _kernels = False
    return _kernels or None


# On CUDA, torch's default SDPA choice (cuDNN's attention on an H200, torch 2.11) builds an execution plan for every
# new key length: in eager decoding, where each step has one more key, that cost ~40 ms a step (a 1-token step of a
# 4-layer 7B-shaped model: 42 ms against 2.9-3.4 ms with the other backends; scripts/sdpa_backends.py).
GPU_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(query, key, value, **kwargs):
    """F.scaled_dot_product_attention, on CUDA without the cuDNN backend (GPU_BACKENDS)."""
    if query.device.type != "cuda":
        return F.scaled_dot_product_attention(query, key, value, **kwargs)
    with sdpa_kernel(GPU_BACKENDS):
        return F.scaled_dot_product_attention(query, key, value, **kwargs)


def head_size(config) -> int | None:
    """The model's attention head size: its config's head_dim, else hidden size / heads."""
    size = getattr(config, "head_dim", None)
    heads = getattr(config, "num_attention_heads", None)
    return size or (config.hidden_size // heads if heads else None)


def tree_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                   position_ids=None, **kwargs):
    """query [B, Hq, n, D]; key/value [B, Hkv, L+n, D], the last n being the new tokens.

    attention_mask: None for plain causal attention over the new tokens, else a bool [B|1, 1, n, L+n] mask (True =
    may attend). A sliding window, when the model has one, is applied from the tokens' positions.

    With `clover_tree_bits` (the mask's tree part packed by Target.forward, which passes it only where the Triton
    kernels run) and no active sliding window, the Triton tree-attention kernel runs instead of SDPA. `softcap`
    (Gemma-2's attention logit soft-capping: scores -> softcap * tanh(scores / softcap)) runs the attention as plain
    products, which SDPA cannot cap.
    """
    n, total = query.shape[2], key.shape[2]
    past = total - n
    bits = kwargs.get(TREE_BITS_KWARG)
    softcap = kwargs.get("softcap")
    # exact_rows reads one mask for the whole batch: a batch with masks of its own (padding) runs SDPA
    exact = (getattr(module, EXACT_ROWS, False) and query.device.type == "cpu" and query.dtype == torch.float32
             and not (module.training and dropout) and (attention_mask is None or attention_mask.shape[0] == 1))
    if not exact and key.dtype != query.dtype:  # a float16 cache (KV_FLOAT16) read by another attention
        key, value = key.to(query.dtype), value.to(query.dtype)
    if STATIC_KWARG in kwargs:  # a static step: the mask says everything, up to a sliding window
        mask, (query_positions, key_positions, end) = attention_mask, kwargs[STATIC_KWARG]
        if sliding_window is not None:  # as below: only once there are more keys than the window
            mask = mask & (((query_positions[:, None] - key_positions[None, :]) < sliding_window)
                           | (end <= sliding_window))
        if exact:
            return _exact_rows(query, key, value, mask, scaling, softcap), None
        if softcap is not None:
            return _softcapped_attention(query, key, value, mask, scaling, softcap).transpose(1, 2).contiguous(), None
        out = sdpa(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous(), None
    if (bits is not None and softcap is None and attention_mask is not None and query.shape[0] == 1
            and not (module.training and dropout) and (sliding_window is None or total <= sliding_window)):
        kernels = triton_kernels(query.device)
        if kernels is not None:
            out = kernels.tree_attention_triton(query, key, value, bits, past, scaling)
            return out.transpose(1, 2).contiguous(), None  # already contiguous: no copy
    mask = attention_mask
    if mask is not None and mask.dtype != torch.bool:
        mask = mask > -1  # additive float mask from another caller: 0 = visible
    if sliding_window is not None and total > sliding_window:
        qpos = (position_ids[0] if position_ids is not None else torch.arange(past, total, device=query.device))
        kpos = torch.cat([torch.arange(past, device=query.device), qpos])
        window = (qpos[:, None] - kpos[None, :]) < sliding_window
        if mask is None:
            mask = (qpos[:, None] >= kpos[None, :]) & window
        else:
            mask = mask & window
    if exact:  # None: causal after the committed keys, as below
        return _exact_rows(query, key, value, mask, scaling, softcap), None
    is_causal = False
    if mask is None:
        if n > 1 and past == 0:
            is_causal = True
        elif n > 1:
            mask = torch.ones(n, total, dtype=torch.bool, device=query.device).tril(past)
    if softcap is not None:
        if is_causal:
            mask = torch.ones(n, total, dtype=torch.bool, device=query.device).tril(past)
        return _softcapped_attention(query, key, value, mask, scaling, softcap).transpose(1, 2).contiguous(), None
    out = sdpa(
        query, key, value, attn_mask=mask, is_causal=is_causal, scale=scaling,
        dropout_p=dropout if module.training else 0.0, enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def _exact_rows(query, key, value, mask, scaling, softcap):
    """clover_kernels.attention.exact_rows ([B, n, Hq, D]): each row's attention the same bits whatever the batch, for
    models whose activations are rounded to int8 (quantized.EXACT_ROWS)."""
    from clover_kernels.attention import exact_rows

    return exact_rows(query, key, value, mask, scaling, softcap or 0.0)


def _softcapped_attention(query, key, value, mask, scaling, softcap):
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.tanh(torch.matmul(query, key.transpose(-1, -2)) * scale / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value)


AttentionInterface.register(ATTN_NAME, tree_attention)


class TreeKVLayer(CacheLayerMixin):
    """One layer's keys and values in a preallocated buffer [1, Hkv, capacity, D]; the owner holds the length."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: "TreeKVCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states, value_states):
        shape = (1, key_states.shape[1], self.owner.capacity, key_states.shape[3])
        self.keys = torch.zeros(shape, dtype=self.owner.kv_dtype or key_states.dtype, device=key_states.device)
        self.values = torch.zeros(shape, dtype=self.owner.kv_dtype or value_states.dtype, device=value_states.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, n = self.owner.length, key_states.shape[2]
        # narrow, not slicing: exact lengths (slices clamp), so the compiled program's sizes stay symbolic
        self.keys.narrow(2, start, n).copy_(key_states)
        self.values.narrow(2, start, n).copy_(value_states)
        return self.keys.narrow(2, 0, start + n), self.values.narrow(2, 0, start + n)

    @torch.inference_mode()
    def grow(self, capacity: int):
        if self.is_initialized:
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = old.new_zeros((*old.shape[:2], capacity, old.shape[3]))
                new[:, :, :old.shape[2]] = old
                setattr(self, name, new)

    @torch.inference_mode()
    def commit(self, start: int, index: torch.Tensor):
        if self.is_initialized:
            k = index.numel()
            index = index.to(self.keys.device)  # layers placed by a device map live on several devices
            self.keys[:, :, start:start + k] = self.keys.index_select(2, start + index)
            self.values[:, :, start:start + k] = self.values.index_select(2, start + index)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return self.owner.capacity


class TreeKVCache(Cache):
    """KV cache for tree verification: `length` committed tokens, new tokens written after them per forward."""

    def __init__(self, num_layers: int, capacity: int, max_capacity: int, kv_dtype: torch.dtype | None = None):
        super().__init__(layers=[TreeKVLayer(self) for _ in range(num_layers)])
        self.kv_dtype = kv_dtype  # what the buffers hold (None: the dtype of the first keys and values written)
        self.length = 0
        self.capacity = capacity
        self.max_capacity = max_capacity
        self._pointer_table = None  # K/V buffer addresses for the one-launch Triton commit
        self._buffers = None  # (capacity, buffers()) once every layer's exist

    @classmethod
    def over(cls, keys: list[torch.Tensor], values: list[torch.Tensor], length) -> "TreeKVCache":
        """A cache over existing buffers (one [1, Hkv, capacity, D] pair per layer) holding `length` tokens: what
        the compiled program (clover_cli/step/aot.py) writes into, the live cache's own buffers."""
        capacity = keys[0].shape[2]
        cache = cls(len(keys), capacity, capacity, keys[0].dtype)
        for layer, k, v in zip(cache.layers, keys, values):
            layer.keys, layer.values, layer.is_initialized = k, v, True
        cache.length = length
        return cache

    def allocate(self, layers, dtype: torch.dtype, device) -> None:
        """Make every layer's buffers now, as the first forward through these decoder `layers` would: a compiled
        program takes only a cache whose buffers exist. Left to that forward when a layer's attention does not say
        its key/value heads and head size."""
        shapes = []
        for layer in layers if layers is not None and len(layers) == len(self.layers) else ():
            attn = getattr(layer, "self_attn", None)
            head_dim = getattr(attn, "head_dim", None)
            k_proj = getattr(attn, "k_proj", None)
            if isinstance(k_proj, torch.nn.Linear) and isinstance(head_dim, int) and head_dim > 0:
                kv_heads = k_proj.out_features // head_dim  # what it computes (OPT's config names heads it lacks)
            else:
                kv_heads = getattr(getattr(attn, "config", None), "num_key_value_heads", None)
            if not (isinstance(kv_heads, int) and isinstance(head_dim, int)):
                return
            shapes.append((1, kv_heads, self.capacity, head_dim))
        for cache_layer, shape in zip(self.layers, shapes):
            if not cache_layer.is_initialized:
                cache_layer.lazy_initialization(torch.empty(shape, dtype=dtype, device=device),
                                                torch.empty(shape, dtype=dtype, device=device))

    def buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """Every layer's key and value buffers, or None before the first forward allocates them. Kept once all
        exist, until the capacity changes (growing is the only thing that replaces them): asked at every step."""
        if self._buffers is not None and self._buffers[0] == self.capacity:
            return self._buffers[1]
        if not all(layer.is_initialized for layer in self.layers):
            return None
        out = [layer.keys for layer in self.layers], [layer.values for layer in self.layers]
        self._buffers = (self.capacity, out)
        return out

    def reserve(self, n_new: int):
        """Make room for n_new more tokens, growing the buffers (doubling) up to the model's context."""
        need = self.length + n_new
        if need <= self.capacity:
            return
        if need > self.max_capacity:
            raise CloverError(f"the conversation needs {need} tokens but the model's context is {self.max_capacity}")
        self.grow_to(min(self.max_capacity, max(need, 2 * self.capacity)))

    def grow_to(self, capacity: int):
        """Buffers of `capacity` tokens from now on (the committed ones copied over); never shrinks."""
        if capacity > self.capacity:
            self.capacity = capacity
            for layer in self.layers:
                layer.grow(capacity)

    def append(self, n: int):
        """Keep the n tokens just written (a prefill or a single-path step)."""
        self.length += n

    def commit(self, nodes: list[int]):
        """Keep the written tokens at offsets `nodes` (ascending, starting at 0) as the next committed tokens.

        Nodes 0..k (a path drafted first) are already in place: nothing moves. Otherwise, where the Triton kernels
        run, all layers' keys and values move in one launch (clover_kernels.kv_commit).
        """
        if nodes and nodes[-1] != len(nodes) - 1 and self.layers[0].is_initialized:
            index = torch.tensor(nodes, dtype=torch.long, device=self.layers[0].keys.device)
            if not self._commit_triton(index):
                for layer in self.layers:
                    layer.commit(self.length, index)
        self.length += len(nodes)

    def _commit_triton(self, nodes: torch.Tensor) -> bool:
        kernels = triton_kernels(nodes.device)
        if kernels is None or not nodes.numel() or not all(layer.is_initialized for layer in self.layers):
            return False
        if self._pointer_table is None:
            self._pointer_table = kernels.PointerTable()
        try:
            kernels.kv_commit_triton([layer.keys for layer in self.layers], [layer.values for layer in self.layers],
                                     self.length, nodes, nodes.numel(), table=self._pointer_table)
        except ValueError:  # layers of different shapes, dtypes or devices: one gather per layer instead
            return False
        return True

    def truncate(self, length: int):
        self.length = min(self.length, length)


def kv_dtype(model) -> torch.dtype | None:
    """The dtype of the model's KV cache: float16 where the model says so (KV_FLOAT16), runs clover's attention
    (which reads float16 keys and values) and CLOVER_KV16 is not 0, else None (the model's own: what its attention
    computes)."""
    if (getattr(model, KV_FLOAT16, False) and model.config._attn_implementation == ATTN_NAME
            and kv16()):
        return torch.float16
    return None


class Float16KV(DynamicCache):
    """transformers' own cache holding each key and value rounded to float16 and widened back (exactly), as clover's
    float16 cache holds them (KV_FLOAT16): transformers' generate with it runs the target clover runs (bench's hf
    rows, the tests' reference)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(key_states.half().float(), value_states.half().float(), layer_idx, *args, **kwargs)


def generate_cache(model) -> dict:
    """The keyword argument giving transformers' generate the cache clover's own matches for this model: Float16KV
    where clover's cache is float16, else none (transformers' default)."""
    return {cache_kwarg(model): Float16KV(config=model.config)} if kv_dtype(model) == torch.float16 else {}


def context_limit(config, max_context: int | None = None) -> int:
    """The longest conversation in tokens: the model's position limit (4096 when it states none), or less."""
    limit = getattr(config, "max_position_embeddings", None) or 4096
    return min(limit, max_context) if max_context else limit


def input_device(model) -> torch.device:
    """Where the model's input ids go: its input embedding's device, or with accelerate offloading it to the CPU or
    disk (weights on the meta device until a forward), the device its hook runs it on."""
    embed = model.get_input_embeddings()
    hooked = [embed] if embed.weight.device.type != "meta" else [embed, *model.modules()]  # a parent's hook runs it
    for module in hooked:
        where = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
        if where is not None:
            return torch.device("cuda", where) if isinstance(where, int) else torch.device(where)
    return embed.weight.device


def decoder_layers(base) -> torch.nn.ModuleList | None:
    """The model's stack of decoder layers, wherever it lives (`layers`, `h`, `decoder.layers`, ...): the module
    list with one entry per hidden layer."""
    count = getattr(base.config, "num_hidden_layers", None)
    stacks = [m for m in base.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count and count]
    return stacks[0] if stacks else None


def rotary_embedding(base):
    """A function (x, position_ids) -> the (cos, sin) the model's decoder layers take, from its shared rotary
    embedding module (for models that keep one per layer type, e.g. Gemma-3, the last layer's type); None when the
    model has no rotary embedding (learned or ALiBi positions)."""
    rotary = getattr(base, "rotary_emb", None)
    if not isinstance(rotary, torch.nn.Module):
        found = [m for m in base.children() if "rotary" in type(m).__name__.lower()]
        rotary = found[0] if found else None
    if rotary is None:
        return None
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        layer_type = (getattr(base.config, "layer_types", None) or [None])[-1]
        return lambda x, positions: rotary(x, positions, layer_type)
    return rotary


def find_final_norm(base):
    """The norm the last decoder layer's output goes through before the lm_head (`norm`, `ln_f`,
    `final_layer_norm`, ...): the last norm module of the base model outside its decoder layers."""
    norm = getattr(base, "norm", None)
    if isinstance(norm, torch.nn.Module):
        return norm
    layers = decoder_layers(base)
    inside = {id(m) for m in layers.modules()} if layers is not None else set()
    norms = [m for m in base.modules() if id(m) not in inside and "norm" in type(m).__name__.lower()
             and not isinstance(m, torch.nn.ModuleList)]
    return norms[-1] if norms else None


class Target:
    """A causal LM with our cache. forward() returns (pre-norm hidden, logits) of the new tokens.

    With a compiled program attached (`attach_program`, clover_cli/step/), forward() runs it instead of the
    eager modules whenever it fits: same inputs, same cache buffers, same outputs.
    """

    def __init__(self, model, max_context: int | None = None, initial_capacity: int = 1024, pack: bool | str = True):
        self.model = model
        self.config = model.config
        why = refusal(model)
        if why:
            raise CloverError(f"clover cannot run {self.config.model_type} models exactly: {why}")
        if model.config._attn_implementation != ATTN_NAME:
            try:
                model.set_attn_implementation(ATTN_NAME)
            except (ValueError, NotImplementedError):
                pass  # a model that keeps its own attention: check_exact compares its numbers with clover's cache
        self.base = model.base_model
        self.lm_head = model.get_output_embeddings()
        self.embed_tokens = model.get_input_embeddings()
        self.device = input_device(model)
        if pack:  # CPU linears only, used only inside forward(); elsewhere (hf's generate) as they were;
            pack_linears(model, lazy=pack == "lazy")  # "lazy": when an eager forward first needs them
        self.max_context = context_limit(self.config, max_context)
        self.cache = TreeKVCache(self.config.num_hidden_layers, min(initial_capacity, self.max_context),
                                 self.max_context, kv_dtype(model))
        self.program = None  # the compiled step, once attached
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._cache_kwarg = cache_kwarg(model)
        self._pre_norm = None
        norm = find_final_norm(self.base)
        if norm is None:
            raise CloverError(f"clover cannot run {self.config.model_type} models: no final norm found (the drafters "
                              f"read the hidden state before it)")
        norm.register_forward_pre_hook(self._capture)
        self.feature_layers: tuple[int, ...] | None = None  # use_features: layers whose inputs forward() returns
        self._feature_hooks: list = []
        self._features: dict[int, torch.Tensor] = {}

    def _capture(self, module, args):
        self._pre_norm = args[0]

    def use_features(self, layers) -> None:
        """From now on forward() returns, instead of the pre-norm last hidden state, cat of the hidden states
        ENTERING decoder layers `layers` ([n, len(layers) * H]; EAGLE-3's fused features), captured in the eager
        forward (the compiled step is not used meanwhile). None: back to the pre-norm state."""
        layers = tuple(layers) if layers else None
        if layers == self.feature_layers:
            return
        for handle in self._feature_hooks:
            handle.remove()
        self._feature_hooks, self._features, self.feature_layers = [], {}, layers
        if layers is None:
            return
        stack = decoder_layers(self.base)
        if stack is None or max(layers) >= len(stack):
            raise CloverError(f"the drafter reads layers {list(layers)} of a model with "
                              f"{self.config.num_hidden_layers}")

        def capture(index):
            def hook(module, args, kwargs):
                self._features[index] = args[0] if args else kwargs["hidden_states"]
            return hook

        self._feature_hooks = [stack[i].register_forward_pre_hook(capture(i), with_kwargs=True)
                               for i in sorted(set(layers))]

    @property
    def length(self) -> int:
        return self.cache.length

    def attach_program(self, program) -> None:
        """Run `program` (a compiled step for this model) from now on; its KV capacity becomes the cache's, and its
        buffers are made now, so that the first prefill runs compiled too."""
        self.cache.grow_to(program.capacity)
        self.cache.allocate(decoder_layers(self.model.base_model), next(self.model.parameters()).dtype, self.device)
        self.program = program

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, logits_for: slice | None = None):
        """Run the new `tokens` (1-D) after the committed ones.

        positions: absolute positions (default: consecutive after the committed tokens). tree_mask: bool [n, n],
        which new tokens each new token may see (default causal). Returns pre-norm hidden [n, H] and logits.
        """
        n = tokens.numel()
        self.cache.reserve(n)
        past = self.cache.length
        if positions is None:
            positions = torch.arange(past, past + n, device=self.device)
        if self.program is not None and self.feature_layers is None and self.program.fits(self.cache, n):
            return self.program(self.cache, tokens, positions, tree_mask, logits_for)
        mask = None
        extra = {}
        if tree_mask is not None:
            mask = torch.ones(1, 1, n, past + n, dtype=torch.bool, device=self.device)
            mask[0, 0, :, past:] = tree_mask
            kernels = triton_kernels(self.device)
            if kernels is not None:  # packed once here, used by every layer's attention
                extra[TREE_BITS_KWARG] = kernels.pack_tree_mask(tree_mask)
        with packed_linears():
            return self.run(tokens, positions, mask, self.cache, logits_for, **extra)

    def run(self, tokens, positions, mask, cache, rows, **extra):
        """The model's own forward over `tokens` with our cache: (pre-norm hidden [n, H], logits of `rows` (a slice
        or index tensor; all tokens when None)). The logits are the model's own, after whatever it does past its
        lm_head (Gemma-2's soft-capping, Granite's scaling): sampling draws from exactly the target's distribution.
        Shared by the eager path and the compiled program."""
        self._pre_norm = None
        keep = rows
        if isinstance(rows, slice):
            keep = 1 if rows == slice(-1, None) else torch.arange(tokens.shape[0], device=tokens.device)[rows]
        args = {"input_ids": tokens[None], "position_ids": positions[None], self._cache_kwarg: cache,
                "attention_mask": mask, "use_cache": True, **extra}
        if self._keeps_logits:
            out = self.model(**args, logits_to_keep=0 if keep is None else keep)
            logits = out.logits[0]
        else:  # a model without logits_to_keep computes them all
            logits = self.model(**args).logits[0]
            logits = logits if rows is None else logits[rows]
        pre, self._pre_norm = self._pre_norm[0], None
        if self.feature_layers is not None:
            pre = torch.cat([self._features[i][0].to(self.device) for i in self.feature_layers], -1)
            self._features = {}
        # with layers on several devices (a device map) the drafters get the states where the inputs live
        return pre.to(self.device), logits.float()

    def reset(self, length: int = 0):
        self.cache.truncate(length)


@functools.cache
def _cache_kwarg_of(cls) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def cache_kwarg(module) -> str:
    """The name a transformers forward (a model's or a decoder layer's) takes its KV cache under: `cache` from
    transformers 5.24 on (which deprecates `past_key_values`), `past_key_values` before it."""
    return _cache_kwarg_of(type(module))


RECURRENT_LAYERS = ("conv", "mamba", "linear", "recurrent", "ssm", "rwkv", "delta", "mlstm", "slstm")


def refusal(model) -> str | None:
    """Why clover cannot run this model exactly, found from its structure (None: nothing found; check_exact then
    compares its numbers). A recurrent state (state-space or convolution layers) lives outside the key/value
    cache: a rejected draft token would stay in it."""
    config = model.config
    alibi = getattr(config, "alibi", False) or getattr(getattr(config, "attn_config", None), "alibi", False)
    if alibi or config.model_type == "bloom":
        return ("it adds ALiBi position biases to attention, built from its own mask and not from the positions "
                "of a draft tree")
    kinds = [str(t).lower() for t in (getattr(config, "layer_types", None) or [])]
    odd = sorted({t for t in kinds if any(r in t for r in RECURRENT_LAYERS) or "attention" not in t})
    if odd or "cache_params" in inspect.signature(model.forward).parameters:
        what = ", ".join(odd) if odd else "state-space"
        return (f"its {what} layers keep a recurrent state outside the key/value cache, which clover's tree "
                f"verification cannot roll back")
    return None


@torch.inference_mode()
def check_exact(target: "Target", tolerance: float | None = None) -> None:
    """Refuse, in one line, a model that clover's attention and cache do not run exactly: a prompt and a small
    tree (two branches, depth 2) through Target.forward must give the logits the model's own forward gives on each
    branch's whole sequence (its reference "eager" attention, no cache). Catches a model that ignores the attention
    function it is given and builds its own mask (ALiBi), one whose cache holds more than keys and values, and
    anything the model does differently from what clover assumes."""
    model, config = target.model, target.config
    why = refusal(model)  # a model that keeps its own attention (takes no attention function): the numbers decide
    if why:
        raise CloverError(f"clover cannot run {config.model_type} models exactly: {why}")
    g = torch.Generator().manual_seed(0)
    vocab = config.vocab_size
    ids = torch.randint(min(3, vocab - 1), vocab, (8,), generator=g).tolist()
    prefix, tree = ids[:5], [ids[5], ids[6], ids[7], ids[6]]  # root, two children, a grandchild
    parents = [-1, 0, 0, 1]
    paths = [[0], [0, 1], [0, 2], [0, 1, 3]]
    dev = target.device
    program, target.program = target.program, None  # the eager step is checked (the compiled one against it)
    from clover_kernels.quant import float_activations

    # linears that round their activations to int8 multiply floats here: the rounding would turn the reference's
    # float32 noise into real differences; what is checked is the attention and the cache
    try:
        with float_activations():
            target.reset(0)
            with stock_linears():  # what is checked is the attention and cache: no packing for it (it may be lazy)
                target.forward(torch.tensor(prefix, device=dev))
                target.cache.append(len(prefix))
                from .tree import DraftTree

                tokens, depths, mask = DraftTree(tree, parents).tensors(dev)
                _, ours = target.forward(tokens, len(prefix) + depths, mask)
            batch = torch.tensor([prefix + [tree[i] for i in path] + [0] * (3 - len(path)) for path in paths],
                                 device=dev)
            own = config._attn_implementation
            try:
                if own == ATTN_NAME:
                    model.set_attn_implementation("eager")
                reference = model(input_ids=batch, use_cache=False).logits.float()
            finally:
                if own == ATTN_NAME:
                    model.set_attn_implementation(ATTN_NAME)
    except (CloverError, MemoryError, torch.cuda.OutOfMemoryError):
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise CloverError(f"clover cannot run {config.model_type} models: its forward fails with clover's cache "
                          f"and tree attention ({type(e).__name__}: {first})")
    finally:
        target.reset(0)
        target.program = program
    want = torch.stack([reference[row, len(prefix) + len(path) - 1] for row, path in enumerate(paths)])
    got = ours[[path[-1] for path in paths]]
    scale = max(1.0, float(want.abs().max()))
    error = float((got - want).abs().max()) / scale
    quantized = getattr(model, "hf_quantizer", None) is not None  # 8-/4-bit: its products depend on the row count
    exact_floats = ours.dtype == torch.float32 and not quantized and next(model.parameters()).dtype == torch.float32
    # a float16 cache (KV_FLOAT16) rounds keys and values: SmolLM2's Q4_1 file 2.6e-4 with it, 1.3e-6 without
    half_cache = target.cache.kv_dtype == torch.float16
    limit = tolerance if tolerance is not None else (5e-2 if not exact_floats else 1e-2 if half_cache else 1e-3)
    if not error <= limit:
        if quantized:  # the quantization is to blame, not the architecture
            how = "quantized" if not getattr(config, "quantization_config", None) else \
                f"quantized ({type(config.quantization_config).__name__.removesuffix('Config')})"
            raise CloverError(f"clover cannot run this model exactly {how} on {target.device.type}: a draft tree's "
                              f"logits differ from a plain forward's by {error:.2g} (relative); run it without "
                              f"--load-in-8bit/--load-in-4bit")
        raise CloverError(f"clover cannot run {config.model_type} models exactly: with clover's attention and cache "
                          f"its logits differ from its own by {error:.2g} (relative); refusing rather than drafting "
                          f"wrong tokens")


def hidden_states(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Last-layer hidden states of a batch (no cache, causal): (before the final norm, after it), [B, T, H].

    Right padding is harmless: with causal attention no real token sees the padding after it.
    """
    base = model.base_model
    norm = find_final_norm(base)
    seen = {}
    handle = norm.register_forward_pre_hook(lambda m, a: seen.__setitem__("pre", a[0])) if norm else None
    try:
        out = base(input_ids=input_ids, use_cache=False)
    finally:
        if handle is not None:
            handle.remove()
    post = out.last_hidden_state
    return seen.get("pre", post), post
