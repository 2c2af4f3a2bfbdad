"""Published heads layouts: the Clover-2 authors' and Medusa's files load into clover's modules and compute exactly
what the authors' code computes; they decode losslessly; bad files are refused in one line.

The reference functions below restate the authors' forward passes from reading their code (GitHub
XiaoBin1992/clover `clover/model/clover2.py`, FasterDecoding/Medusa `medusa/model/medusa_model.py`), written here
independently of clover's modules: plain tensor arithmetic over the file's own tensor names.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import build_model, tiny_config
from helpers import clover_command, hf_greedy, run_engine
from clover_cli.drafters.merged import MergedDrafter
from clover_cli.drafters.clover2 import CloverDrafter
from clover_cli.drafters.medusa import MedusaDrafter, MedusaLevels
from clover_cli.drafters.registry import detect, load
from clover_cli.drafters.ngram import NgramDrafter
from clover_cli.decode.engine import Engine
from clover_cli.decode.verify import StopCheck
from clover_cli.errors import CloverError
from clover_cli.target import Target

VOCAB = 96


# ------------------------------------------------------------------------------------------- the reference, restated

def ref_rms(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def ref_gate(p, name, x, y, heads, eps):
    """ResAttentionBlock: x + v(y) * cos(q(norm x), k(y)) per head, the cosine with eps = rms_norm_eps."""
    lin = lambda part, t: F.linear(t, p[f"{name}.{part}.weight"], p[f"{name}.{part}.bias"])
    q = lin("q", ref_rms(x, p[f"{name}.input_layernorm.weight"], eps))
    k, v = lin("k", y), lin("v", y)
    d = q.shape[-1] // heads
    att = F.cosine_similarity(q.reshape(-1, d), k.reshape(-1, d), eps=eps).reshape(*q.shape[:-1], heads, 1)
    return x + (v.reshape(*v.shape[:-1], heads, d) * att).reshape(q.shape)


def ref_rope(x, positions, base=10000.0):
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2).float() / d))
    ang = positions.float()[:, None] * inv[None]
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + half * sin


def ref_layer(p, i, x, cfg, eps):
    """The reference's LlamaDecoderLayer (index >= 1: it has input_layernorm) with RoPE base 10000, causal over T."""
    T, H = x.shape
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = H // nh
    pre = f"layers.{i}."
    h = ref_rms(x, p[pre + "input_layernorm.weight"], eps)
    q = F.linear(h, p[pre + "self_attn.q_proj.weight"]).view(T, nh, d).transpose(0, 1)
    k = F.linear(h, p[pre + "self_attn.k_proj.weight"]).view(T, nkv, d).transpose(0, 1)
    v = F.linear(h, p[pre + "self_attn.v_proj.weight"]).view(T, nkv, d).transpose(0, 1)
    pos = torch.arange(T)
    q, k = ref_rope(q, pos), ref_rope(k, pos)
    k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
    w = q @ k.transpose(-1, -2) / math.sqrt(d)
    w = w + torch.triu(torch.full((T, T), float("-inf")), 1)
    a = (torch.softmax(w.float(), -1).to(q.dtype) @ v).transpose(0, 1).reshape(T, H)
    x = x + F.linear(a, p[pre + "self_attn.o_proj.weight"])
    h = ref_rms(x, p[pre + "post_attention_layernorm.weight"], eps)
    m = F.linear(F.silu(F.linear(h, p[pre + "mlp.gate_proj.weight"])) * F.linear(h, p[pre + "mlp.up_proj.weight"]),
                 p[pre + "mlp.down_proj.weight"])
    return x + m


def ref_clover_logits(p, cfg, hidden, next_tokens, drafted, lm_head):
    """Clover-2 as the authors run it: hidden [T, H] (the target's pre-norm states), next_tokens [T] (the token after
    each); the heads' logits at the last position for each depth, head i fed the token drafted at depth i-1."""
    eps, heads = cfg["rms_norm_eps"], cfg["num_attention_heads"]
    emb = lambda ids: F.embedding(ids, p["clover_embed_tokens.weight"])
    x = ref_gate(p, "clover_head_mlp_rnn", hidden, emb(next_tokens), heads, eps)
    for i in range(cfg["clover"]["num_layers"]):
        x = ref_layer(p, i, x, cfg, eps)
    s = ref_rms(x, p["clover_norm.weight"], eps)[-1:]
    out = ref_rms(F.linear(s, p["clover_head_mlp.weight"], p["clover_head_mlp.bias"]), p["clover_head_norm.weight"], eps)
    logits = [F.linear(out, lm_head)]
    for i in range(1, cfg["clover"]["num_heads"]):
        e = emb(torch.tensor([drafted[i - 1]]))
        s = ref_gate(p, "clover_head_mlp_rnn2", s, e, heads, eps)
        out = ref_rms(F.linear(torch.cat([s, e], -1), p["clover_head_mlp2.weight"], p["clover_head_mlp2.bias"]),
                      p["clover_head_norm.weight"], eps)
        logits.append(F.linear(out, lm_head))
    return torch.cat(logits)


def ref_medusa_logits(p, post, num_heads, n_blocks, target_lm_head=None):
    """Medusa-1: head i = n residual SiLU blocks (`{i}.{j}.linear`) then its projection `{i}.{n}.weight` (or the
    target's lm_head in the heads-only variant)."""
    out = []
    for i in range(num_heads):
        x = post
        for j in range(n_blocks):
            x = x + F.silu(F.linear(x, p[f"{i}.{j}.linear.weight"], p[f"{i}.{j}.linear.bias"]))
        out.append(F.linear(x, p.get(f"{i}.{n_blocks}.weight", target_lm_head)))
    return torch.cat(out)


# ------------------------------------------------------------------------------------------ published files, made here

def make_target(seed=0, rope_theta=500000.0, eps=1e-5, **over):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config("llama", VOCAB, rope_theta=rope_theta, rms_norm_eps=eps, **over)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def clover_authors_files(out: Path, model, num_heads=4, num_layers=2, seed=0, embed_table=None, lm_head=None,
                         pickled=False, prefix=""):
    """A heads directory as the Clover-2 authors publish it: a Llama config with a "clover" block, tensors under
    their module names (random, big enough to matter), clover_embed_tokens = the target's lm_head, lm_head.weight."""
    g = torch.Generator().manual_seed(seed)
    c = model.config
    H, I = c.hidden_size, c.intermediate_size
    kv = c.num_key_value_heads * (H // c.num_attention_heads)
    r = lambda *shape, s=0.2: torch.randn(*shape, generator=g) * s
    p = {}
    for name in ("clover_head_mlp_rnn", "clover_head_mlp_rnn2"):
        p[f"{name}.input_layernorm.weight"] = 1 + r(H, s=0.1)
        for part in "qkv":
            p[f"{name}.{part}.weight"], p[f"{name}.{part}.bias"] = r(H, H), r(H, s=0.05)
    for i in range(num_layers):
        pre = f"layers.{i}."
        p.update({pre + "self_attn.q_proj.weight": r(H, H), pre + "self_attn.k_proj.weight": r(kv, H),
                  pre + "self_attn.v_proj.weight": r(kv, H), pre + "self_attn.o_proj.weight": r(H, H),
                  pre + "mlp.gate_proj.weight": r(I, H), pre + "mlp.up_proj.weight": r(I, H),
                  pre + "mlp.down_proj.weight": r(H, I), pre + "input_layernorm.weight": 1 + r(H, s=0.1),
                  pre + "post_attention_layernorm.weight": 1 + r(H, s=0.1)})
    p["clover_norm.weight"], p["clover_head_norm.weight"] = 1 + r(H, s=0.1), 1 + r(H, s=0.1)
    p["clover_head_mlp.weight"], p["clover_head_mlp.bias"] = torch.eye(H) + r(H, H), r(H, s=0.05)
    p["clover_head_mlp2.weight"], p["clover_head_mlp2.bias"] = r(H, 2 * H), r(H, s=0.05)
    target_head = model.get_output_embeddings().weight.detach().clone()
    p["clover_embed_tokens.weight"] = (target_head if embed_table is None else embed_table).clone()
    p["lm_head.weight"] = (target_head if lm_head is None else lm_head).clone()
    cfg = c.to_dict()
    cfg.pop("rope_parameters", None)
    cfg.update(architectures=["LlamaForCausalLM"], rope_theta=c.rope_parameters["rope_theta"], rope_scaling=None,
               clover={"num_heads": num_heads, "num_layers": num_layers, "heads_coefficient": 1.0,
                       "decay_coefficient": 0.7})
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, default=str))
    stored = {prefix + k: v.contiguous() for k, v in p.items()}
    if pickled:
        torch.save(stored, out / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(stored, str(out / "model.safetensors"))
    return p, cfg


def medusa_authors_files(out: Path, model, num_heads=5, n_blocks=1, config_heads=2, seed=0, own_proj=True,
                         safetensors=False):
    """A directory as Medusa-1's are published: config.json (with the understated medusa_num_heads of the 7B one)
    and medusa_lm_head.pt: head i's residual block repeated n times (one module: equal tensors), then its own
    vocabulary projection."""
    g = torch.Generator().manual_seed(seed)
    H, V = model.config.hidden_size, model.config.vocab_size
    p = {}
    for i in range(num_heads):
        w, b = torch.randn(H, H, generator=g) * 0.3, torch.randn(H, generator=g) * 0.1
        for j in range(n_blocks):
            p[f"{i}.{j}.linear.weight"], p[f"{i}.{j}.linear.bias"] = w, b
        if own_proj:
            p[f"{i}.{n_blocks}.weight"] = torch.randn(V, H, generator=g) * 2.0
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"medusa_num_heads": config_heads, "medusa_num_layers": n_blocks,
                                                 "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}))
    if safetensors:
        from safetensors.torch import save_file

        save_file({k: v.clone().contiguous() for k, v in p.items()}, str(out / "medusa_lm_head.safetensors"))
    else:
        torch.save(p, out / "medusa_lm_head.pt")
    return p


def pre_norm_hidden(model, ids):
    from clover_cli.target import hidden_states

    pre, post = hidden_states(model, torch.tensor([ids]))
    return pre[0], post[0]


# --------------------------------------------------------------------------------------------------------- the tests

@pytest.mark.parametrize("pickled,prefix,rope_theta,num_layers", [(False, "", 500000.0, 2), (True, "", 10000.0, 1),
                                                                  (False, "ea_layer.", 1e6, 2)])
def test_clover_authors_heads_compute_the_reference(tmp_path, pickled, prefix, rope_theta, num_layers):
    """Loaded through clover's drafter modules (the augmenting block over the cache, in two chunks, then one level per
    depth), the authors' heads give the reference's logits at every depth."""
    model = make_target(rope_theta=rope_theta)
    p, cfg = clover_authors_files(tmp_path / "h", model, num_layers=num_layers, pickled=pickled, prefix=prefix)
    assert detect(tmp_path / "h") == "clover2-authors"
    heads = load(tmp_path / "h", model)
    assert heads.cfg.embed == "lm_head" and heads.cfg.rope_theta == 10000.0 and heads.cfg.layout == "clover2-authors"
    target = Target(model, pack=False)
    drafter = CloverDrafter(heads, target)
    ids = [random.Random(1).randrange(3, VOCAB) for _ in range(13)]
    pre, _ = pre_norm_hidden(model, ids)
    hidden, nxt = pre[:-1], torch.tensor(ids[1:])
    drafter.observe(hidden[:7], nxt[:7])  # the augmenting block catches up in two chunks through its cache
    drafter._catch_up()
    drafter.observe(hidden[7:], nxt[7:])
    drafter._catch_up()
    drafted = [5, 17, 40]
    want = ref_clover_logits(p, cfg, hidden, nxt, drafted, model.get_output_embeddings().weight)
    with torch.no_grad():
        states, tokens = drafter.state[None], torch.tensor([ids[-1]])
        got = []
        for depth in range(heads.cfg.num_heads):
            level = drafter.levels[min(depth, 1)]
            if depth == 0:
                states, out = heads.step(0, states)
            else:
                states, out = heads.step(1, states, level.embed(tokens))
            got.append(model.get_output_embeddings()(out))
            tokens = torch.tensor([drafted[depth]]) if depth < len(drafted) else tokens
    got = torch.cat(got)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def test_clover_authors_heads_differ_without_their_switches(tmp_path):
    """The switches matter: with the target's input embedding, or the target's RoPE base, the logits move (so the
    test above would catch a loader that dropped them)."""
    model = make_target(rope_theta=500000.0)
    p, cfg = clover_authors_files(tmp_path / "h", model)
    ids = list(range(3, 15))
    pre, _ = pre_norm_hidden(model, ids)
    hidden, nxt = pre[:-1], torch.tensor(ids[1:])
    want = ref_clover_logits(p, cfg, hidden, nxt, [5, 6, 7], model.get_output_embeddings().weight)
    for change in ({"embed": "input"}, {"rope_theta": None}):
        heads = load(tmp_path / "h", model)
        for k, v in change.items():
            setattr(heads.cfg, k, v)
        drafter = CloverDrafter(heads, Target(model, pack=False))
        drafter.observe(hidden, nxt)
        drafter._catch_up()
        with torch.no_grad():
            s, out = heads.step(0, drafter.state[None])
            s, out1 = heads.step(1, s, drafter.levels[1].embed(torch.tensor([5])))
        got = model.get_output_embeddings()(torch.cat([out, out1]))
        assert not torch.allclose(got, want[:2], atol=1e-3), change


def test_clover_authors_embedding_table_kept_when_it_is_not_the_targets(tmp_path):
    model = make_target()
    table = torch.randn(VOCAB, model.config.hidden_size)
    p, cfg = clover_authors_files(tmp_path / "h", model, embed_table=table)
    heads = load(tmp_path / "h", model)
    assert heads.cfg.embed == "own" and torch.equal(heads.embed_tokens.weight, table)


@pytest.mark.parametrize("n_blocks,own_proj,safetensors", [(1, True, False), (2, True, True), (1, False, False)])
def test_medusa_authors_heads_compute_the_reference(tmp_path, n_blocks, own_proj, safetensors):
    model = make_target()
    p = medusa_authors_files(tmp_path / "m", model, n_blocks=n_blocks, own_proj=own_proj, safetensors=safetensors)
    assert detect(tmp_path / "m") == "medusa-authors"
    heads = load(tmp_path / "m", model)
    assert heads.cfg.num_heads == 5, "the number of heads comes from the file, not the config's 2"
    assert heads.cfg.blocks == n_blocks and heads.cfg.lm_heads == own_proj
    pre, post = pre_norm_hidden(model, list(range(3, 12)))
    want = ref_medusa_logits(p, post[-1:], 5, n_blocks, model.get_output_embeddings().weight)
    target = Target(model, pack=False)
    levels = MedusaLevels(heads, target, MedusaDrafter(heads, target).project, k=4)
    with torch.no_grad():
        top_p, top_i = levels(pre[-1:])
    ref_p, ref_i = torch.softmax(want, -1).topk(4, -1)
    assert torch.equal(top_i, ref_i)
    assert torch.allclose(top_p, ref_p, atol=1e-5)


def lossless(model, heads, kind, seed):
    rng = random.Random(seed)
    target = Target(model)
    for _ in range(3):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 20))]
        n = rng.randint(5, 30)
        reference = hf_greedy(model, prompt, n)
        drafter = (CloverDrafter if kind == "clover" else MedusaDrafter)(heads, target)
        if rng.random() < 0.5:
            drafter = MergedDrafter(drafter, NgramDrafter())
        engine = Engine(target, drafter, budget=rng.choice([4, 16, 40]), auto_budget=False)
        out, _ = run_engine(engine, prompt, StopCheck(n))
        assert out == reference


@pytest.mark.parametrize("seed", range(3))
def test_published_heads_decode_losslessly(tmp_path, seed):
    model = make_target(seed=seed)
    clover_authors_files(tmp_path / "c", model, seed=seed)
    medusa_authors_files(tmp_path / "m", model, seed=seed, n_blocks=1 + seed % 2)
    lossless(model, load(tmp_path / "c", model), "clover", seed)
    lossless(model, load(tmp_path / "m", model), "medusa", seed)


def test_bad_published_heads_are_refused_in_one_line(tmp_path):
    model = make_target()
    # another model's lm_head
    clover_authors_files(tmp_path / "a", model, lm_head=torch.randn(VOCAB, model.config.hidden_size))
    with pytest.raises(CloverError, match="another model"):
        load(tmp_path / "a", model)
    # another hidden size
    other = make_target(hidden_size=32, intermediate_size=64)
    clover_authors_files(tmp_path / "b", other)
    with pytest.raises(CloverError, match="hidden size 32"):
        load(tmp_path / "b", model)
    medusa_authors_files(tmp_path / "c", other)
    with pytest.raises(CloverError, match="hidden size 32"):
        load(tmp_path / "c", model)
    # another vocabulary (Medusa's own projections say it)
    p = medusa_authors_files(tmp_path / "d", model)
    bad = {k: (torch.randn(80, v.shape[1]) if k.endswith(".1.weight") else v) for k, v in p.items()}
    torch.save(bad, tmp_path / "d" / "medusa_lm_head.pt")
    with pytest.raises(CloverError, match="vocabulary 80"):
        load(tmp_path / "d", model)
    # a stray tensor, a truncated file
    torch.save({**p, "extra": torch.zeros(2)}, tmp_path / "d" / "medusa_lm_head.pt")
    with pytest.raises(CloverError, match="'extra'"):
        load(tmp_path / "d", model)
    clover_authors_files(tmp_path / "g", model)
    data = (tmp_path / "g" / "model.safetensors").read_bytes()
    (tmp_path / "g" / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CloverError, match="unreadable"):
        load(tmp_path / "g", model)
    # an EAGLE directory whose config lacks what the layer needs (tests/test_eagle.py has the rest), an unknown one
    from safetensors.torch import save_file

    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "config.json").write_text(json.dumps({"num_hidden_layers": 1, "hidden_size": 64}))
    save_file({"fc.weight": torch.zeros(64, 128)}, str(tmp_path / "e" / "model.safetensors"))
    assert detect(tmp_path / "e") == "eagle"
    with pytest.raises(CloverError, match="EAGLE's config.json lacks a valid 'vocab_size'"):
        load(tmp_path / "e", model)
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "config.json").write_text("{}")
    with pytest.raises(CloverError, match="not a heads directory"):
        load(tmp_path / "f", model)


class RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


MARKER = "/nonexistent"


def test_a_pickle_that_runs_code_is_refused(tmp_path):
    """medusa_lm_head.pt whose unpickling would run a shell command: refused in one line through the CLI, and the
    command never runs."""
    global MARKER
    model_dir = build_model(tmp_path / "model", "llama", seed=1)
    MARKER = str(tmp_path / "ran")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"medusa_num_heads": 5, "medusa_num_layers": 1}))
    torch.save({"0.0.linear.weight": RunsCode()}, tmp_path / "m" / "medusa_lm_head.pt")
    (tmp_path / "prompt.txt").write_text("hello")
    p = subprocess.run([*clover_command(), "generate", str(model_dir), "-f", str(tmp_path / "prompt.txt"),
                        "-n", "4", "--heads", str(tmp_path / "m"), "--draft", "medusa"],
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                       env=dict(os.environ, CLOVER_COMPILE="off"))
    assert p.returncode != 0
    assert not Path(MARKER).exists(), "unpickling ran the command"
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "refus" in lines[0] and "Traceback" not in p.stderr, p.stderr
