"""EAGLE: published files compute what the reference computes, the drafter grows EAGLE-2's tree, decoding with it is
lossless, `clover train --arch eagle` makes heads that `clover generate` uses, and bad files are refused in one line.

The reference below restates EAGLE-1's draft model and EAGLE-2's tree from reading their code (GitHub
SafeAILab/EAGLE, `eagle/model/cnets1.py`: `Model.forward` and `topK_genrate`; `ea_model.py`), written here
independently of clover's modules: plain tensor arithmetic over the file's own tensor names.
"""

from __future__ import annotations

import json
import math
import random
import zlib

import pytest
import torch
import torch.nn.functional as F

from conftest import build_model
from helpers import check_trained_heads_cli, hf_greedy, run_engine
from test_layouts import VOCAB, make_target, pre_norm_hidden, ref_rms, ref_rope
from test_lossless import check_prompts_and_follow_ups, make_model, random_heads
from clover_cli.drafters.eagle import EagleDrafter
from clover_cli.drafters.registry import detect, family, load
from clover_cli.decode.engine import Engine
from clover_cli.decode.verify import StopCheck
from clover_cli.errors import CloverError
from clover_cli.target import Target


# ------------------------------------------------------------------------------------------- the reference, restated

def ref_eagle(p, cfg, features, tokens):
    """EAGLE-1's Model.forward over a whole sequence from position 0, no cache: features [T, H] (the target's
    post-norm states, or the draft's own outputs), tokens [T] (the token after each). Returns the outputs [T, H]."""
    T, H = features.shape
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    d, eps = H // nh, cfg.get("rms_norm_eps", 1e-6)
    base = cfg.get("rope_theta") or 10000.0
    bias = p["fc.bias"] if cfg.get("bias", True) else None
    x = F.linear(torch.cat([F.embedding(tokens, p["embed_tokens.weight"]), features], -1), p["fc.weight"], bias)
    pre = "layers.0."
    q = F.linear(x, p[pre + "self_attn.q_proj.weight"]).view(T, nh, d).transpose(0, 1)  # layer 0: no input norm
    k = F.linear(x, p[pre + "self_attn.k_proj.weight"]).view(T, nkv, d).transpose(0, 1)
    v = F.linear(x, p[pre + "self_attn.v_proj.weight"]).view(T, nkv, d).transpose(0, 1)
    pos = torch.arange(T)
    q, k = ref_rope(q, pos, base), ref_rope(k, pos, base)
    k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
    w = q @ k.transpose(-1, -2) / math.sqrt(d) + torch.triu(torch.full((T, T), float("-inf")), 1)
    a = (torch.softmax(w.float(), -1) @ v).transpose(0, 1).reshape(T, H)
    x = x + F.linear(a, p[pre + "self_attn.o_proj.weight"])
    h = ref_rms(x, p[pre + "post_attention_layernorm.weight"], eps)
    m = F.linear(F.silu(F.linear(h, p[pre + "mlp.gate_proj.weight"])) * F.linear(h, p[pre + "mlp.up_proj.weight"]),
                 p[pre + "mlp.down_proj.weight"])
    return x + m


def ref_path_outputs(p, cfg, features, tokens, path):
    """The draft's outputs along a drafted path: its first token is read with the output at the last committed
    position, each next one with the output of the token before it. Returns [len(path) + 1, H]: the output at the
    last committed position, then one per drafted token."""
    feats, toks = features, tokens
    outs = [ref_eagle(p, cfg, feats, toks)[-1]]
    for t in path:
        feats = torch.cat([feats, outs[-1][None]])
        toks = torch.cat([toks, torch.tensor([t])])
        outs.append(ref_eagle(p, cfg, feats, toks)[-1])
    return torch.stack(outs)


def ref_eagle2_tree(p, cfg, features, tokens, lm_head, top_k, depth, total):
    """EAGLE-2's topK_genrate: the root's top-k tokens; then `depth` times: the top-k of every node of the frontier,
    of which the top-k by cumulative log-probability form the next frontier; finally the `total` best candidates.
    Returns {path of tokens: cumulative log-probability}."""
    last = ref_eagle(p, cfg, features, tokens)[-1]
    top = torch.log_softmax(F.linear(last, lm_head), -1).topk(top_k)
    candidates = {(t,): s for s, t in zip(top.values.tolist(), top.indices.tolist())}
    frontier = list(candidates.items())
    for _ in range(depth):
        new = []
        for path, score in frontier:
            out = ref_path_outputs(p, cfg, features, tokens, path)[-1]
            top = torch.log_softmax(F.linear(out, lm_head), -1).topk(top_k)
            new += [(path + (t,), score + s) for s, t in zip(top.values.tolist(), top.indices.tolist())]
        new.sort(key=lambda c: -c[1])
        candidates.update(new)
        frontier = new[:top_k]
    return dict(sorted(candidates.items(), key=lambda c: -c[1])[:total])


# ------------------------------------------------------------------------------------------ published files, made here

def eagle_files(out, model, bias=None, pickled=True, own_embed=False, seed=0, kv_heads=None, intermediate=None,
                rope_theta=None, eps=1e-6, hidden=None, vocab=None, prefix=""):
    """A directory as EAGLE-1's are published: a one-layer Llama config (optional "bias", no rope_theta means the
    reference's 10000) and pytorch_model.bin (or model.safetensors) with the reference's tensor names, random."""
    g = torch.Generator().manual_seed(seed)
    c = model.config
    H = hidden or c.hidden_size
    V = vocab or c.vocab_size
    nh = c.num_attention_heads
    nkv = kv_heads or nh
    I = intermediate or c.intermediate_size
    d = H // nh
    r = lambda *shape, s=0.1: torch.randn(*shape, generator=g) * s
    p = {"fc.weight": torch.cat([r(H, H, s=0.2), torch.eye(H) + r(H, H)], 1), "fc.bias": r(H, s=0.05),
         "layers.0.self_attn.q_proj.weight": r(nh * d, H), "layers.0.self_attn.k_proj.weight": r(nkv * d, H),
         "layers.0.self_attn.v_proj.weight": r(nkv * d, H), "layers.0.self_attn.o_proj.weight": r(H, nh * d),
         "layers.0.mlp.gate_proj.weight": r(I, H), "layers.0.mlp.up_proj.weight": r(I, H),
         "layers.0.mlp.down_proj.weight": r(H, I), "layers.0.post_attention_layernorm.weight": 1 + r(H, s=0.1)}
    own = r(V, H, s=1.0)
    p["embed_tokens.weight"] = own if own_embed or V != c.vocab_size or H != c.hidden_size else \
        model.get_input_embeddings().weight.detach().clone()
    if bias is False:
        del p["fc.bias"]
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": H,
           "intermediate_size": I, "num_attention_heads": nh, "num_key_value_heads": nkv, "num_hidden_layers": 1,
           "rms_norm_eps": eps, "vocab_size": V, "max_position_embeddings": 2048, "torch_dtype": "float16"}
    if rope_theta is not None:
        cfg["rope_theta"] = rope_theta
    if bias is not None:
        cfg["bias"] = bias
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    stored = {prefix + k: v.contiguous() for k, v in p.items()}
    if pickled:
        torch.save(stored, out / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(stored, str(out / "model.safetensors"))
    return p, cfg


def committed(model, n=13, seed=1):
    ids = [random.Random(seed).randrange(3, VOCAB) for _ in range(n)]
    pre, post = pre_norm_hidden(model, ids)
    return ids, pre[:-1], post[:-1], torch.tensor(ids[1:])  # the pair at position j: (state j, token j+1)


# --------------------------------------------------------------------------------------------------------- the tests

@pytest.mark.parametrize("bias,pickled,own_embed,kv_heads,intermediate,rope_theta,prefix", [
    (None, True, True, None, None, None, ""),  # the Vicuna layout: no "bias" (fc has one), theta 10000
    (False, False, False, 2, 128, 500000.0, ""),  # the LLaMA-3 layout: "bias": false, the target's theta and GQA
    (True, True, False, None, 96, 20000.0, "ea_layer."),  # a layer shaped unlike the target's, a wrapper's prefix
])
def test_published_eagle_computes_the_reference(tmp_path, bias, pickled, own_embed, kv_heads, intermediate,
                                                rope_theta, prefix):
    """Through clover's drafter (its cache filled in two chunks, then tree nodes run in batches with a tree mask),
    the file gives the reference's logits at every draft step, along every branch."""
    model = make_target(rope_theta=500000.0, eps=1e-5)
    p, cfg = eagle_files(tmp_path / "e", model, bias=bias, pickled=pickled, own_embed=own_embed, kv_heads=kv_heads,
                         intermediate=intermediate, rope_theta=rope_theta, prefix=prefix)
    assert detect(tmp_path / "e") == "eagle" and family(tmp_path / "e") == "eagle"
    heads = load(tmp_path / "e", model)
    assert heads.cfg.architecture == "eagle" and heads.cfg.layout == "eagle"
    assert heads.cfg.embed == ("own" if own_embed else "input") and heads.cfg.fc_bias == (bias is not False)
    assert heads.cfg.rope_theta == (rope_theta or 10000.0)
    lm_head = model.get_output_embeddings().weight
    ids, pre, post, nxt = committed(model)
    drafter = EagleDrafter(heads, Target(model, pack=False))
    drafter.observe(pre[:7], nxt[:7])
    drafter._catch_up()
    drafter.observe(pre[7:], nxt[7:])
    drafter._catch_up()
    want = ref_eagle(p, cfg, post, nxt)
    assert torch.allclose(drafter.state, want[-1], atol=1e-4, rtol=1e-4), (drafter.state - want[-1]).abs().max()
    L = drafter.cache.length
    assert L == len(nxt)

    def close(out, path, depth):
        ref = ref_path_outputs(p, cfg, post, nxt, path)[depth]
        got, expect = F.linear(out, lm_head), F.linear(ref, lm_head)
        error = float((got - expect).abs().max()) / max(1.0, float(expect.abs().max()))  # relative to the scale
        assert error < 1e-4, (path, depth, error)

    # two branches, three deep: depth 1 as one batch (a, b), depth 2 as one batch (a's child, b's child, b's other
    # child), depth 3 one node; each sees the committed positions and its own ancestors only
    a, b, a1, b1, b2, b21 = 5, 17, 40, 41, 3, 60
    with torch.no_grad():
        out1 = drafter.extend(drafter.state[None].expand(2, -1), torch.tensor([a, b]), L,
                              torch.zeros(2, 0, dtype=torch.bool))
        close(out1[0], [a], 1)
        close(out1[1], [b], 1)
        sees = torch.tensor([[True, False], [False, True], [False, True]])
        out2 = drafter.extend(out1[[0, 1, 1]], torch.tensor([a1, b1, b2]), L + 1, sees)
        close(out2[0], [a, a1], 2)
        close(out2[1], [b, b1], 2)
        close(out2[2], [b, b2], 2)
        out3 = drafter.extend(out2[2:3], torch.tensor([b21]), L + 2, torch.tensor([[False, True, False, False, True]]))
        close(out3[0], [b, b2, b21], 3)
    drafter.cache.truncate(L)


@pytest.mark.parametrize("top_k,depth,total", [(10, 4, 60), (3, 3, 12)])
def test_drafter_grows_eagle2s_tree(tmp_path, top_k, depth, total):
    """The proposed tree is the reference's: the same `total` best paths, with the same path probabilities."""
    model = make_target(seed=3, rope_theta=10000.0)
    p, cfg = eagle_files(tmp_path / "e", model, seed=3)
    lm_head = model.get_output_embeddings().weight
    ids, pre, post, nxt = committed(model, n=11, seed=5)
    want = ref_eagle2_tree(p, cfg, post, nxt, lm_head, top_k, depth, total)
    heads = load(tmp_path / "e", model)
    heads.cfg.num_heads = depth + 1
    drafter = EagleDrafter(heads, Target(model, pack=False), topk=top_k, width=top_k)
    drafter.observe(pre, nxt)
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
    assert max(len(path) for path in paths) > 2
    assert drafter.cache.length == len(nxt), "the tree's keys and values are dropped"


@pytest.mark.parametrize("family_,seed", [(f, s) for f in ("llama", "mistral", "qwen2") for s in range(2)])
@pytest.mark.parametrize("kind", ["eagle", "eagle-merged"])
def test_eagle_greedy_matches_transformers(family_, seed, kind):
    """Random EAGLE heads, alone and merged with n-gram lookup, on several prompts and budgets, with follow-up
    requests that reuse the cache: exactly transformers' greedy output."""
    rng = random.Random(zlib.crc32(f"{family_}-{kind}-{seed}".encode()))
    model = make_model(family_, seed=seed)
    check_prompts_and_follow_ups(model, Target(model), kind, rng)


def tau(model, heads, prompts, n=24):
    target = Target(model)
    tokens = steps = 0
    for prompt in prompts:
        engine = Engine(target, EagleDrafter(heads, target), budget=16, auto_budget=False)
        out, events = run_engine(engine, prompt, StopCheck(n))
        assert out == hf_greedy(model, prompt, n)
        tokens += len(out) - 1
        steps += len(events) - 1
    return tokens / steps


def test_trained_heads_learn_and_stay_lossless():
    """A few dozen steps of EAGLE's loss on the target's own greedy text: more drafted tokens accepted than the
    untrained heads, and the output stays exactly the target's."""
    from clover_cli.target import hidden_states
    from clover_cli.train import TrainConfig, heads_loss

    model = make_model("llama", seed=2)
    rng = random.Random(0)
    texts = []
    for _ in range(8):
        prompt = [rng.randrange(3, 96) for _ in range(6)]
        texts.append(prompt + hf_greedy(model, prompt, 42))
    x = torch.tensor(texts)
    mask = torch.ones_like(x, dtype=torch.float32)
    with torch.no_grad():
        pre, post = hidden_states(model, x)
    heads = random_heads(model, "eagle", 0, 4, 1)
    before = tau(model, heads.eval(), [t[:10] for t in texts[:3]])
    heads.train()
    opt = torch.optim.AdamW(heads.parameters(), lr=3e-3)
    cfg = TrainConfig(model="m", out="o")
    for _ in range(60):
        loss, _ = heads_loss(heads, "eagle", model, x, mask, pre, post, cfg)
        loss.backward()
        opt.step()
        opt.zero_grad()
    after = tau(model, heads.eval(), [t[:10] for t in texts[:3]])
    assert after > before + 0.3, (before, after)


def test_eagle_loss_is_eagle1s(llama_dir):
    """heads_loss for EAGLE: 10 x SmoothL1(g_t, f_{t+1}) + the soft cross-entropy of lm_head(g_t) against the
    target's distribution at t+1, over positions whose token t+2 is trained on; g_t from f_t and token t+1
    (teacher-forced). In training mode the input features are noised."""
    from transformers import AutoModelForCausalLM

    from clover_cli.target import hidden_states
    from clover_cli.train import TrainConfig, heads_loss

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    heads = random_heads(model, "eagle", 1, 5, 1).eval()
    x = torch.randint(3, model.config.vocab_size, (2, 30))
    mask = (torch.rand(2, 30) < 0.7).float()
    with torch.no_grad():
        pre, post = hidden_states(model, x)
    cfg = TrainConfig(model="m", out="o")
    total, per_head = heads_loss(heads, "eagle", model, x, mask, pre, post, cfg)
    assert len(per_head) == 1
    lm_head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    ce_sum = reg_sum = 0.0
    for row in range(2):  # the reference's forward, one sequence at a time
        p = {k: v for k, v in heads.state_dict().items()}
        p["embed_tokens.weight"] = embed.weight
        cfg_ref = {"num_attention_heads": model.config.num_attention_heads,
                   "num_key_value_heads": model.config.num_key_value_heads,
                   "rms_norm_eps": model.config.rms_norm_eps,
                   "rope_theta": model.config.rope_parameters["rope_theta"]}
        nxt = torch.cat([x[row, 1:], torch.zeros(1, dtype=torch.long)])
        g = ref_eagle(p, cfg_ref, post[row], nxt)
        m = mask[row, 2:] > 0
        student, teacher = g[:-2][m], post[row, 1:-1][m]
        prob = torch.softmax(lm_head(teacher), -1)
        ce = -(prob * F.log_softmax(lm_head(student), -1)).sum(-1)
        reg = F.smooth_l1_loss(student, teacher, reduction="none").mean(-1)
        ce_sum, reg_sum = ce_sum + ce.sum(), reg_sum + reg.sum()
    n = (mask[:, 2:] > 0).sum()
    ce, reg = ce_sum / n, reg_sum / n
    assert abs(total.item() - (ce + 10 * reg).item()) < 1e-4
    heads.train()
    noisy, _ = heads_loss(heads, "eagle", model, x, mask, pre, post, cfg)
    assert abs(noisy.item() - total.item()) > 1e-4


def test_mismatched_or_broken_eagle_files_are_refused(tmp_path):
    model = make_target()
    other = make_target(hidden_size=32, intermediate_size=64)
    eagle_files(tmp_path / "h", other)
    with pytest.raises(CloverError, match="hidden size 32"):
        load(tmp_path / "h", model)
    eagle_files(tmp_path / "v", model, vocab=80)
    with pytest.raises(CloverError, match="vocabulary 80"):
        load(tmp_path / "v", model)
    p, cfg = eagle_files(tmp_path / "b", model, bias=True)
    del p["fc.bias"]
    torch.save(p, tmp_path / "b" / "pytorch_model.bin")
    with pytest.raises(CloverError, match="no fc.bias"):
        load(tmp_path / "b", model)
    p, cfg = eagle_files(tmp_path / "s", model)
    p["layers.0.mlp.down_proj.weight"] = torch.zeros(64, 7)
    torch.save(p, tmp_path / "s" / "pytorch_model.bin")
    with pytest.raises(CloverError, match="do not fit"):
        load(tmp_path / "s", model)
    p, cfg = eagle_files(tmp_path / "x", model)
    torch.save({**p, "layers.0.input_layernorm.weight": torch.ones(64)}, tmp_path / "x" / "pytorch_model.bin")
    with pytest.raises(CloverError, match="input_layernorm"):
        load(tmp_path / "x", model)
    eagle_files(tmp_path / "t", model, pickled=False)
    data = (tmp_path / "t" / "model.safetensors").read_bytes()
    (tmp_path / "t" / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CloverError, match="unreadable"):
        load(tmp_path / "t", model)


def test_eagle_through_the_cli(tmp_path, run_cli):
    """clover train --arch eagle writes heads that clover generate uses (alone and as --draft auto's heads) with the
    target's own output; a mismatched EAGLE file or the wrong --draft is refused in one line, exit 2."""
    from test_train import CONVERSATIONS

    model_dir = build_model(tmp_path / "model", "llama", seed=7)
    data = tmp_path / "chats.json"
    data.write_text(json.dumps(CONVERSATIONS[:24]))
    out = tmp_path / "heads"
    code, _, err = run_cli("train", str(model_dir), "--data", str(data), "--arch", "eagle", "--out", str(out),
                           "--heads", "4", "--max-steps", "6", "--eval-every", "6", "--batch-tokens", "2048",
                           "--max-len", "384")
    assert code == 0, err
    saved = json.loads((out / "config.json").read_text())
    assert saved["architecture"] == "eagle" and saved["num_heads"] == 4 and saved["training"]["steps"] == 6
    assert len(saved["training"]["heldout_accuracy"]) == 1
    assert detect(out) == "clover" and family(out) == "eagle"
    prompt = tmp_path / "p.txt"
    prompt.write_text("Tell me about the number 12.")
    other = tmp_path / "other"
    from transformers import AutoModelForCausalLM

    eagle_files(other, AutoModelForCausalLM.from_pretrained(model_dir), hidden=32)
    check_trained_heads_cli(run_cli, model_dir, out, prompt, "eagle", 32, ("clover", "needs clover2 heads"), other)


@pytest.mark.parametrize("family_", ["llama", "qwen2"])
def test_a_new_eagle_layer_starts_as_the_identity(family_):
    """init_from_target: the draft layer is the target's last decoder layer with its residual outputs (o_proj,
    down_proj) zeroed, so a fresh EAGLE head predicts the feature it is given back (fc's near-identity start): a copy
    of a real model's last layer outputs many times the post-norm feature's size and its training starts lost."""
    from clover_cli.drafters.common import HeadsConfig
    from clover_cli.drafters.registry import build_heads
    from clover_cli.target import decoder_layers

    model = make_model(family_, seed=0)
    with torch.no_grad():  # a last layer whose copy, kept whole, would add a large term to the feature
        for p in decoder_layers(model.base_model)[-1].parameters():
            p.mul_(30.0)
    heads = build_heads(HeadsConfig.for_target(model.config, architecture="eagle", num_heads=1, num_layers=1), model)
    heads.init_from_target(model)
    layer, last = heads.layers[0], decoder_layers(model.base_model)[-1]
    assert torch.equal(layer.self_attn.q_proj.weight, last.self_attn.q_proj.weight)
    assert torch.equal(layer.mlp.gate_proj.weight, last.mlp.gate_proj.weight)
    assert not layer.self_attn.o_proj.weight.any() and not layer.mlp.down_proj.weight.any()
    T = 6
    post = torch.randn(1, T, model.config.hidden_size)
    ids = torch.randint(0, model.config.vocab_size, (1, T))
    pos = torch.arange(T)[None]
    with torch.no_grad():
        out = heads(post, ids, heads.token_embedding(model), heads.rotary(model)(post, pos), pos)[0]
        start = heads.fc(torch.cat([heads.token_embedding(model)(ids.roll(-1, 1)), post], -1))
    assert torch.allclose(out[:, :-1], start[:, :-1], atol=1e-5)
