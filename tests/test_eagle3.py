"""EAGLE-3: published files compute what the reference computes, the drafter grows EAGLE-2's tree over the draft
vocabulary, decoding with it is lossless, a Hub repo in the published layout works through `clover generate
llama3.1-8b`, `clover train --arch eagle3` makes heads that decode exactly, and bad files are refused in one line.

The reference below restates EAGLE-3's draft model from reading its code (GitHub SafeAILab/EAGLE,
`eagle/model/cnets.py`: `Model.forward`, `LlamaDecoderLayeremb`, `topK_genrate`; `modeling_llama_kv.py`: the target's
hidden states entering layers 2, L//2 and L-3, concatenated in that order), written here independently of clover's
modules: plain tensor arithmetic over the file's own tensor names.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
import torch.nn.functional as F

from conftest import build_model
from helpers import check_trained_heads_cli, hf_greedy, run_engine
from test_layouts import VOCAB, make_target, ref_rms, ref_rope
from clover_cli.drafters.merged import MergedDrafter
from clover_cli.drafters.eagle3 import Eagle3Drafter
from clover_cli.drafters.registry import detect, family, load
from clover_cli.drafters.ngram import NgramDrafter
from clover_cli.decode.engine import Engine
from clover_cli.decode.verify import StopCheck
from clover_cli.errors import CloverError
from clover_cli.target import Target

LAYERS = 8  # the target's depth: the reference's layers 2, 4 and 5


# ------------------------------------------------------------------------------------------- the reference, restated

def ref_target_features(model, ids):
    """The reference target's `all_hidden_states`: the states entering layers idx in {2, L//2, L-3}, in idx order,
    concatenated: [T, 3H]. Collected by running the decoder layers one by one."""
    base = model.base_model
    L = len(base.layers)
    x = base.embed_tokens(torch.tensor([ids]))
    pos = torch.arange(len(ids))[None]
    rope = base.rotary_emb(x, pos)
    mask = torch.full((len(ids), len(ids)), float("-inf")).triu(1)[None, None]
    kept = []
    with torch.no_grad():
        for idx, layer in enumerate(base.layers):
            if idx == L - 3 or idx == L // 2 or idx == 2:
                kept.append(x)
            x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope)
            x = x[0] if isinstance(x, tuple) else x
    return torch.cat(kept, -1)[0]


def ref_model(p, cfg, x, tokens):
    """Model.forward over a whole sequence from position 0, no cache: x [T, H] (fc(features) for committed positions,
    the draft's own outputs for drafted ones), tokens [T] target ids (the token after each). Returns [T, H]."""
    T, H = x.shape
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    d, eps = H // nh, cfg.get("rms_norm_eps", 1e-6)
    base = cfg.get("rope_theta") or 10000.0
    pre = "midlayer."
    emb = ref_rms(F.embedding(tokens, p["embed_tokens.weight"]), p[pre + "input_layernorm.weight"], eps)
    h = torch.cat([emb, ref_rms(x, p[pre + "hidden_norm.weight"], eps)], -1)
    q = F.linear(h, p[pre + "self_attn.q_proj.weight"]).view(T, nh, d).transpose(0, 1)
    k = F.linear(h, p[pre + "self_attn.k_proj.weight"]).view(T, nkv, d).transpose(0, 1)
    v = F.linear(h, p[pre + "self_attn.v_proj.weight"]).view(T, nkv, d).transpose(0, 1)
    pos = torch.arange(T)
    q, k = ref_rope(q, pos, base), ref_rope(k, pos, base)
    k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
    w = q @ k.transpose(-1, -2) / math.sqrt(d) + torch.triu(torch.full((T, T), float("-inf")), 1)
    a = (torch.softmax(w.float(), -1) @ v).transpose(0, 1).reshape(T, nh * d)
    y = x + F.linear(a, p[pre + "self_attn.o_proj.weight"])
    z = ref_rms(y, p[pre + "post_attention_layernorm.weight"], eps)
    m = F.linear(F.silu(F.linear(z, p[pre + "mlp.gate_proj.weight"])) * F.linear(z, p[pre + "mlp.up_proj.weight"]),
                 p[pre + "mlp.down_proj.weight"])
    return y + m


def ref_logits(p, cfg, g):
    """lm_head(norm(g)) over the draft vocabulary."""
    return F.linear(ref_rms(g, p["norm.weight"], cfg.get("rms_norm_eps", 1e-6)), p["lm_head.weight"])


def ref_to_target(p, idx):
    return idx + p["d2t"][idx] if "d2t" in p else idx


def ref_path_outputs(p, cfg, feats, tokens, path):
    """The outputs along a drafted path of target ids: [len(path) + 1, H], the first at the last committed position."""
    x, toks = F.linear(feats, p["fc.weight"]), tokens
    outs = [ref_model(p, cfg, x, toks)[-1]]
    for t in path:
        x = torch.cat([x, outs[-1][None]])
        toks = torch.cat([toks, torch.tensor([t])])
        outs.append(ref_model(p, cfg, x, toks)[-1])
    return torch.stack(outs)


def ref_eagle2_tree(p, cfg, feats, tokens, top_k, depth, total):
    """topK_genrate: the root's top-k; `depth` times the top-k of each frontier node, the top-k of those by cumulative
    log-probability the next frontier; finally the `total` best. Returns {path of target ids: log-probability}."""
    def top(path):
        out = ref_path_outputs(p, cfg, feats, tokens, path)[-1]
        t = torch.log_softmax(ref_logits(p, cfg, out), -1).topk(top_k)
        return [(int(ref_to_target(p, i)), s) for s, i in zip(t.values.tolist(), t.indices)]

    candidates = {(t,): s for t, s in top(())}
    frontier = list(candidates.items())
    for _ in range(depth):
        new = [(path + (t,), score + s) for path, score in frontier for t, s in top(path)]
        new.sort(key=lambda c: -c[1])
        candidates.update(new)
        frontier = new[:top_k]
    return dict(sorted(candidates.items(), key=lambda c: -c[1])[:total])


# ------------------------------------------------------------------------------------------ published files, made here

def eagle3_files(out, model, draft_vocab=48, pickled=False, seed=0, rope_theta=None, kv_heads=None, intermediate=None,
                 hidden=None, vocab=None, own_embed=False, prefix=""):
    """A directory as EAGLE-3's are published: a one-layer Llama config with draft_vocab_size (no rope_theta: the
    reference's 10000) and model.safetensors (or pytorch_model.bin) with the reference's tensor names, random."""
    g = torch.Generator().manual_seed(seed)
    c = model.config
    H, V = hidden or c.hidden_size, vocab or c.vocab_size
    Vd = draft_vocab or V
    nh = c.num_attention_heads
    nkv = kv_heads or c.num_key_value_heads
    I = intermediate or c.intermediate_size
    d = H // nh
    r = lambda *shape, s=0.15: torch.randn(*shape, generator=g) * s
    pre = "midlayer."
    p = {"fc.weight": r(H, 3 * H, s=0.1) + torch.cat([0 * torch.eye(H), 0 * torch.eye(H), torch.eye(H)], 1),
         pre + "hidden_norm.weight": 1 + r(H), pre + "input_layernorm.weight": 1 + r(H),
         pre + "post_attention_layernorm.weight": 1 + r(H),
         pre + "self_attn.q_proj.weight": r(nh * d, 2 * H), pre + "self_attn.k_proj.weight": r(nkv * d, 2 * H),
         pre + "self_attn.v_proj.weight": r(nkv * d, 2 * H), pre + "self_attn.o_proj.weight": r(H, nh * d),
         pre + "mlp.gate_proj.weight": r(I, H), pre + "mlp.up_proj.weight": r(I, H),
         pre + "mlp.down_proj.weight": r(H, I), "norm.weight": 1 + r(H), "lm_head.weight": r(Vd, H, s=1.0)}
    if Vd < V:
        ids = torch.randperm(V, generator=g)[:Vd].sort().values
        p["d2t"] = ids - torch.arange(Vd)
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        p["t2d"] = t2d
    stored = dict(p)
    if own_embed or H != c.hidden_size or V != c.vocab_size:
        stored["embed_tokens.weight"] = r(V, H, s=1.0)
    p["embed_tokens.weight"] = stored.get("embed_tokens.weight", model.get_input_embeddings().weight.detach())
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu", "hidden_size": H,
           "intermediate_size": I, "num_attention_heads": nh, "num_key_value_heads": nkv, "num_hidden_layers": 1,
           "rms_norm_eps": 1e-5, "vocab_size": V, "draft_vocab_size": Vd, "max_position_embeddings": 2048,
           "torch_dtype": "float16", "tie_word_embeddings": False}
    if rope_theta is not None:
        cfg["rope_theta"] = rope_theta
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    stored = {prefix + k: v.contiguous() for k, v in stored.items()}
    if pickled:
        torch.save(stored, out / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(stored, str(out / "model.safetensors"))
    return p, cfg


def target(seed=0, **over):
    return make_target(seed=seed, num_hidden_layers=LAYERS, **over)


def committed(model, n=13, seed=1):
    rng = random.Random(seed)
    ids = [rng.randrange(3, VOCAB) for _ in range(n)]
    feats = ref_target_features(model, ids)
    return ids, feats[:-1], torch.tensor(ids[1:])  # the pair at position j: (features j, token j+1)


# --------------------------------------------------------------------------------------------------------- the tests

def test_target_supplies_the_reference_features():
    """Target.use_features: forward() returns the states entering layers 2, L//2, L-3, as the reference collects."""
    model = target()
    t = Target(model, pack=False)
    t.use_features((2, 4, 5))
    rng = random.Random(0)
    ids = [rng.randrange(3, VOCAB) for _ in range(9)]
    hidden, _ = t.forward(torch.tensor(ids))
    assert torch.allclose(hidden, ref_target_features(model, ids), atol=1e-5)
    t.use_features(None)
    t.reset(0)
    hidden, _ = t.forward(torch.tensor(ids))
    assert hidden.shape[-1] == model.config.hidden_size

    class Program:  # a compiled step that would take every forward: it returns no layer states
        def fits(self, cache, n):
            return True

        def __call__(self, *args):
            raise AssertionError("the compiled step ran")

    t.program = Program()
    t.use_features((2, 4, 5))
    t.reset(0)
    hidden, _ = t.forward(torch.tensor(ids))  # eager: the program is passed over while the features are wanted
    assert torch.allclose(hidden, ref_target_features(model, ids), atol=1e-5)


@pytest.mark.parametrize("draft_vocab,pickled,rope_theta,kv_heads,intermediate,own_embed,prefix", [
    (48, False, None, None, None, False, ""),  # the LLaMA-3.1 layout: a reduced vocabulary, RoPE base 10000
    (None, True, 500000.0, 4, 96, True, "ea_layer."),  # the whole vocabulary (no d2t/t2d), pickled, own table
])
def test_published_eagle3_computes_the_reference(tmp_path, draft_vocab, pickled, rope_theta, kv_heads, intermediate,
                                                 own_embed, prefix):
    model = target(rope_theta=500000.0)
    p, cfg = eagle3_files(tmp_path / "e", model, draft_vocab=draft_vocab, pickled=pickled, rope_theta=rope_theta,
                          kv_heads=kv_heads, intermediate=intermediate, own_embed=own_embed, prefix=prefix)
    assert detect(tmp_path / "e") == "eagle3" and family(tmp_path / "e") == "eagle3"
    heads = load(tmp_path / "e", model)
    assert heads.cfg.architecture == "eagle3" and heads.cfg.embed == ("own" if own_embed else "input")
    ids, feats, nxt = committed(model)
    assert feats.std(0).mean() > 1e-3  # positions differ
    # the module itself, over the whole sequence: the reference's logits to 1e-5 (relative to their scale)
    with torch.no_grad():
        g = heads.draft(feats[None], heads.token_embedding(model)(nxt)[None], torch.arange(len(nxt)), fused=True)[0]
        want = ref_logits(p, cfg, ref_model(p, cfg, F.linear(feats, p["fc.weight"]), nxt))
        assert (heads.logits(g) - want).abs().max() / max(1.0, float(want.abs().max())) < 1e-5
    assert torch.equal(heads.target_ids(), ref_to_target(p, torch.arange(draft_vocab or VOCAB)))
    # through the drafter: its cache filled in two chunks, then tree nodes in batches with a tree mask
    drafter = Eagle3Drafter(heads, Target(model, pack=False))
    assert drafter.feature_layers == (2, 4, 5)
    drafter.observe(feats[:6], nxt[:6])
    drafter._catch_up()
    drafter.observe(feats[6:], nxt[6:])
    drafter._catch_up()
    L = drafter.cache.length
    assert L == len(nxt)

    def close(out, path, depth):
        ref = ref_path_outputs(p, cfg, feats, nxt, path)[depth]
        got, expect = heads.logits(out), ref_logits(p, cfg, ref)
        assert (got - expect).abs().max() / max(1.0, float(expect.abs().max())) < 1e-5, (path, depth)

    close(drafter.state, [], 0)
    a, b, a1, b1, b2 = 5, 17, 40, 41, 3
    with torch.no_grad():
        out1 = drafter.extend(drafter.state[None].expand(2, -1), torch.tensor([a, b]), L,
                              torch.zeros(2, 0, dtype=torch.bool))
        close(out1[0], [a], 1)
        close(out1[1], [b], 1)
        sees = torch.tensor([[True, False], [False, True], [False, True]])
        out2 = drafter.extend(out1[[0, 1, 1]], torch.tensor([a1, b1, b2]), L + 1, sees)
        close(out2[0], [a, a1], 2)
        close(out2[2], [b, b2], 2)
    drafter.cache.truncate(L)


def test_drafter_grows_eagle2s_tree_over_the_draft_vocabulary(tmp_path):
    """The proposed tree is the reference's topK_genrate: the same best paths (target ids, through d2t), with the
    same path probabilities."""
    model = target(seed=3, rope_theta=10000.0)
    p, cfg = eagle3_files(tmp_path / "e", model, seed=3, draft_vocab=40)
    top_k, depth, total = 4, 3, 20
    ids, feats, nxt = committed(model, n=10, seed=5)
    want = ref_eagle2_tree(p, cfg, feats, nxt, top_k, depth, total)
    heads = load(tmp_path / "e", model)
    heads.cfg.num_heads = depth + 1
    drafter = Eagle3Drafter(heads, Target(model, pack=False), topk=top_k, width=top_k)
    drafter.observe(feats, nxt)
    tree = drafter.propose(ids, total)
    paths = {}
    for i in range(1, len(tree)):
        path, node = [], i
        while node:
            path.append(tree.tokens[node])
            node = tree.parents[node]
        paths[tuple(reversed(path))] = tree.scores[i]
    assert set(paths) == set(want)
    for path, score in want.items():
        assert math.isclose(paths[path], math.exp(score), rel_tol=1e-4), path
    assert all(t in set(ref_to_target(p, torch.arange(40)).tolist()) for path in paths for t in path)


def test_eagle3_greedy_matches_transformers(tmp_path):
    """Random published EAGLE-3 heads, alone and merged with n-gram lookup, several prompts and budgets, follow-ups
    that reuse the cache: exactly transformers' greedy output."""
    model = target(seed=4, rope_theta=10000.0)
    p, cfg = eagle3_files(tmp_path / "e", model, seed=4, draft_vocab=64)
    heads = load(tmp_path / "e", model)
    t = Target(model)
    rng = random.Random(7)
    for k in range(4):
        base = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 9))]
        prompt = (base * 2)[:rng.randint(4, 16)]
        n = rng.randint(8, 30)
        drafter = Eagle3Drafter(heads, t, **({} if k % 2 else {"topk": 4, "width": 4}))
        if k == 3:
            drafter = MergedDrafter(drafter, NgramDrafter())
        engine = Engine(t, drafter, budget=rng.choice([4, 16, 40]), auto_budget=False)
        out, events = run_engine(engine, prompt, StopCheck(n))
        assert out == hf_greedy(model, prompt, n), (k, prompt)
        if k == 0:  # what the engine fed the drafter: the target's three layers' inputs at every committed position
            full = prompt + out
            drafter._catch_up()
            feats = ref_target_features(model, full)[:-1]
            want = ref_logits(p, cfg, ref_model(p, cfg, F.linear(feats, p["fc.weight"]), torch.tensor(full[1:]))[-1])
            got = heads.logits(drafter.state)
            assert drafter.cache.length == len(full) - 1
            assert (got - want).abs().max() / max(1.0, float(want.abs().max())) < 1e-4
        follow = prompt + out + [rng.randrange(3, VOCAB)]
        out2, _ = run_engine(engine, follow, StopCheck(8))
        assert out2 == hf_greedy(model, follow, 8)
    assert t.feature_layers == (2, 4, 5)


def test_bad_eagle3_files_are_refused(tmp_path):
    model = target()
    eagle3_files(tmp_path / "h", target(hidden_size=32, intermediate_size=64))
    with pytest.raises(CloverError, match="hidden size 32"):
        load(tmp_path / "h", model)
    eagle3_files(tmp_path / "v", model, vocab=80, draft_vocab=40)
    with pytest.raises(CloverError, match="vocabulary 80"):
        load(tmp_path / "v", model)
    p, _ = eagle3_files(tmp_path / "d", model, draft_vocab=40)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in p.items() if k not in ("d2t", "embed_tokens.weight")},
              str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(CloverError, match="no d2t"):
        load(tmp_path / "d", model)
    p["midlayer.mlp.down_proj.weight"] = torch.zeros(64, 7)
    save_file({k: v.contiguous() for k, v in p.items() if k != "embed_tokens.weight"},
              str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(CloverError, match="do not fit"):
        load(tmp_path / "d", model)
    eagle3_files(tmp_path / "t", model)
    data = (tmp_path / "t" / "model.safetensors").read_bytes()
    (tmp_path / "t" / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CloverError, match="unreadable"):
        load(tmp_path / "t", model)
    eagle3_files(tmp_path / "k", model, pickled=True)
    (tmp_path / "k" / "pytorch_model.bin").write_bytes(b"not a torch file")
    with pytest.raises(CloverError, match="damaged"):
        load(tmp_path / "k", model)
    out = tmp_path / "own"  # clover's own format with a broken layer block
    from clover_cli.drafters.common import HeadsConfig
    from clover_cli.drafters.registry import build_heads, save_heads

    save_heads(build_heads(HeadsConfig.for_target(model.config, architecture="eagle3", num_layers=1), model), out, "")
    saved = json.loads((out / "config.json").read_text())
    assert family(out) == "eagle3" and saved["layer"]["num_attention_heads"] == 4
    saved["layer"]["num_attention_heads"] = "many"
    (out / "config.json").write_text(json.dumps(saved))
    with pytest.raises(CloverError, match="num_attention_heads must be"):
        load(out, model)
    eagle3_files(tmp_path / "s", model)
    with pytest.raises(CloverError, match="at least 7 needed"):
        load(tmp_path / "s", make_target())  # two layers: no three distinct ones to read


def test_eagle3_through_the_cli(tmp_path, run_cli):
    """clover train --arch eagle3 writes heads that clover generate --draft eagle3 (and auto) uses with the target's
    own output; a mismatched file or the wrong --draft is refused in one line, exit 2."""
    from test_train import CONVERSATIONS

    model_dir = build_model(tmp_path / "model", "llama", seed=7)
    data = tmp_path / "chats.json"
    data.write_text(json.dumps(CONVERSATIONS[:16]))
    out = tmp_path / "heads"
    code, _, err = run_cli("train", str(model_dir), "--data", str(data), "--arch", "eagle3", "--out", str(out),
                           "--heads", "4", "--max-steps", "4", "--eval-every", "4", "--batch-tokens", "2048",
                           "--max-len", "256", "--draft-vocab", "50")
    assert code == 0, err
    saved = json.loads((out / "config.json").read_text())
    assert saved["architecture"] == "eagle3" and saved["draft_vocab_size"] == 50 and saved["training"]["steps"] == 4
    assert detect(out) == "clover" and family(out) == "eagle3"
    prompt = tmp_path / "p.txt"
    prompt.write_text("Tell me about the number 12.")
    from transformers import AutoModelForCausalLM

    eagle3_files(tmp_path / "other", AutoModelForCausalLM.from_pretrained(model_dir), hidden=32)
    check_trained_heads_cli(run_cli, model_dir, out, prompt, "eagle3", 24, ("eagle", "needs eagle heads"),
                            tmp_path / "other")


def test_published_eagle3_from_the_hub(tmp_path):
    """`clover generate llama3.1-8b --draft eagle3` through a Hub-compatible server on loopback: it fetches the alias's
    model and its EAGLE-3 repo (pickled only, as published: read tensors-only) and gives the target's own output."""
    import contextlib
    import io
    import os
    import subprocess

    from helpers import clover_command, olah_server
    from test_hub import _commit, _git, _replace_files
    from transformers import AutoModelForCausalLM

    from clover_cli.process import main

    root = tmp_path / "hub"
    ref = build_model(tmp_path / "ref", "llama", seed=5, num_hidden_layers=LAYERS)
    models = root / "mirrors" / "models"
    repo = models / "meta-llama" / "Llama-3.1-8B-Instruct"
    repo.mkdir(parents=True)
    _replace_files(repo, ref)
    _git(repo, "init", "-q", "-b", "main")
    _commit(repo, "tiny stand-in")
    heads = models / "yuhuili" / "EAGLE3-LLaMA3.1-Instruct-8B"
    eagle3_files(heads, AutoModelForCausalLM.from_pretrained(ref), pickled=True, draft_vocab=64)
    _git(heads, "init", "-q", "-b", "main")
    _commit(heads, "published heads stand-in")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Hello! What is the capital of France?\n")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as e:
        main(["generate", str(ref), "-f", str(prompt), "--draft", "none", "--json", "-n", "16",
              "--stats-file", "off"])
    assert e.value.code == 0
    want = json.loads(buf.getvalue())["text"]
    for url in olah_server(root, "meta-llama/Llama-3.1-8B-Instruct"):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING", "TRANSFORMERS_"))}
        env.update(HF_ENDPOINT=url, HF_HOME=str(root / "hf-home"), XDG_CACHE_HOME=str(root / "xdg"),
                   HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1", NO_COLOR="1")
        p = subprocess.run([*clover_command(), "generate", "llama3.1-8b", "--draft", "eagle3", "-f", str(prompt),
                            "--json", "-n", "16", "--stats-file", "off"], env=env, capture_output=True, text=True,
                           timeout=300, stdin=subprocess.DEVNULL)
        assert p.returncode == 0, p.stderr
        result = json.loads(p.stdout)
        assert result["draft"] == "eagle3" and result["text"] == want
        assert "EAGLE3-LLaMA3.1-Instruct-8B" in result["heads"]


def test_trained_eagle3_learns_and_stays_lossless():
    """A few dozen steps of clover's EAGLE-3 loss on the target's own greedy text (draft vocabulary: the 48 most used
    tokens): more drafted tokens accepted than before, and the output stays exactly the target's."""
    from test_lossless import make_model

    from clover_cli.drafters.common import HeadsConfig

    from clover_cli.drafters.registry import build_heads
    from clover_cli.target import hidden_states
    from clover_cli.train import TrainConfig, draft_vocabulary, heads_loss

    model = make_model("llama", seed=2)
    rng = random.Random(0)
    texts = []
    for _ in range(8):
        prompt = [rng.randrange(3, 96) for _ in range(6)]
        texts.append(prompt + hf_greedy(model, prompt, 40))
    x = torch.tensor(texts)
    mask = torch.ones_like(x, dtype=torch.float32)
    with torch.no_grad():
        pre, post = hidden_states(model, x)
    cfg = HeadsConfig.for_target(model.config, architecture="eagle3", num_heads=4, num_layers=1)
    vocab = draft_vocabulary(texts, [[1] * len(t) for t in texts], 96, 48)
    cfg.draft_vocab_size = 48
    torch.manual_seed(0)
    heads = build_heads(cfg, model)
    heads.use_vocab(vocab)
    heads.init_from_target(model)

    def tau():
        target = Target(model)
        tokens = steps = 0
        for t in texts[:3]:
            engine = Engine(target, Eagle3Drafter(heads.eval(), target), budget=16, auto_budget=False)
            out, events = run_engine(engine, t[:10], StopCheck(24))
            assert out == hf_greedy(model, t[:10], 24)
            tokens += len(out) - 1
            steps += len(events) - 1
        return tokens / steps

    before = tau()
    heads.train()
    opt = torch.optim.AdamW(heads.parameters(), lr=3e-3)
    for _ in range(60):
        loss, _ = heads_loss(heads, "eagle3", model, x, mask, pre, post, TrainConfig(model="m", out="o", arch="eagle3"))
        loss.backward()
        opt.step()
        opt.zero_grad()
    after = tau()
    assert after > before + 0.3, (before, after)


def test_eagle3_files_without_draft_vocab_size_are_told_from_eagle1s(tmp_path):
    """A one-layer config without draft_vocab_size: the tensors decide (EAGLE-3's `midlayer`, else EAGLE-1)."""
    from test_eagle import eagle_files

    model = target()
    p, cfg = eagle3_files(tmp_path / "e3", model, draft_vocab=None, pickled=True)
    del cfg["draft_vocab_size"]
    (tmp_path / "e3" / "config.json").write_text(json.dumps(cfg))
    eagle_files(tmp_path / "e1", model, pickled=True)
    assert detect(tmp_path / "e3") == "eagle3" and detect(tmp_path / "e1") == "eagle"
    assert load(tmp_path / "e3", model).cfg.architecture == "eagle3"
