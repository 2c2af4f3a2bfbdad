"""Every architecture clover accepts runs exactly; the others are refused in one line (issue #15).

Tiny random models of many transformers architectures: greedy output identical to transformers' own generate with
each drafter and forced tree sizes, logits equal to the model's own (so sampling draws from the target's exact
distribution), Clover-2 heads where the target's layers allow them (Medusa heads everywhere), and a one-line refusal
for models clover cannot run exactly (recurrent state, ALiBi).
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from clover_cli.drafters.base import NoDrafter
from clover_cli.drafters.clover2 import CloverDrafter
from clover_cli.drafters.medusa import MedusaDrafter
from clover_cli.drafters.ngram import NgramDrafter
from clover_cli.decode.engine import Engine
from clover_cli.decode.verify import StopCheck
from clover_cli.errors import CloverError
from clover_cli.target import Target, check_exact
from clover_cli.tree import DraftTree
from helpers import hf_greedy, run_engine
from test_lossless import random_heads

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# model type -> (transformers model type, config overrides). Soft-capping and scaling are set strong enough to
# change the tokens if clover skipped them.
ACCEPTED = {
    "llama": ("llama", {}),
    "mistral-window": ("mistral", {"sliding_window": 12}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "gemma": ("gemma", {"head_dim": 16}),
    "gemma2-softcap": ("gemma2", {"head_dim": 16, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 0.5,
                                  "final_logit_softcapping": 3.0, "sliding_window": 12}),
    "gemma3": ("gemma3_text", {"head_dim": 16, "sliding_window": 12}),
    "phi3": ("phi3", {}),
    "gpt_neox": ("gpt_neox", {"rotary_pct": 0.5}),
    "stablelm": ("stablelm", {}),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", {"logits_scaling": 4.0, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                            "attention_multiplier": 0.3}),
    "gpt2": ("gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256}),
    "opt": ("opt", {"ffn_dim": 128, "word_embed_proj_dim": 64}),
    "falcon": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2, "alibi": False}),
}
REFUSED = {
    "falcon-alibi": ("falcon", {"alibi": True}, "ALiBi"),
    "mamba": ("mamba", {"state_size": 8, "expand": 2}, "recurrent state"),
    "lfm2": ("lfm2", {"layer_types": ["conv", "full_attention"]}, "recurrent state"),
}
NO_CLOVER_HEADS = {"gpt2", "opt", "falcon"}  # learned positions, or a layer that needs ALiBi inputs


def make(name: str, table=ACCEPTED, vocab: int = VOCAB):
    model_type, over = table[name][:2]
    torch.manual_seed(sum(map(ord, name)))
    cfg = AutoConfig.for_model(model_type, **{**BASE, "vocab_size": vocab, **over})
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # sharper logits: greedy ties are rare
    return model


@pytest.fixture(scope="module")
def models():
    return {name: make(name) for name in ACCEPTED}


def drafter(kind: str, model, target, seed: int):
    if kind == "none":
        return NoDrafter()
    if kind == "ngram":
        return NgramDrafter()
    arch, cls = {"clover": ("clover2", CloverDrafter), "medusa": ("medusa", MedusaDrafter)}[kind]
    return cls(random_heads(model, arch, seed, 3, 1), target, topk=4, width=4)


@pytest.mark.parametrize("name", ACCEPTED)
def test_greedy_is_exact_with_every_drafter(models, name):
    model = models[name]
    target = Target(model)
    check_exact(target)
    rng = random.Random(name)
    kinds = ["none", "ngram", "medusa"] + ([] if name in NO_CLOVER_HEADS else ["clover"])
    for kind in kinds:
        for budget in (4, 24):
            base = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 7))]
            prompt = (base * 3)[:rng.randint(8, 20)]
            reference = hf_greedy(model, prompt, 24)
            engine = Engine(target, drafter(kind, model, target, rng.randrange(1000)), budget=budget,
                            auto_budget=False)
            out, _ = run_engine(engine, prompt, StopCheck(24))
            assert out == reference, (kind, budget)


@pytest.mark.parametrize("name", ACCEPTED)
def test_the_static_step_is_exact_on_every_architecture(models, name):
    """The GPU's static step (clover_cli/step/graphs.py; uncaptured here) passes its own check against the eager step
    and gives transformers' greedy output with each drafter, the heads' per-step modules as static calls too."""
    from clover_cli.step.graphs import attach, check, heads_graphs

    model = models[name]
    target = Target(model)
    step = attach(target, target.max_context)
    assert check(step) is None
    rng = random.Random(f"static-{name}")
    for kind in ["none", "ngram", "medusa"] + ([] if name in NO_CLOVER_HEADS else ["clover"]):
        base = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 7))]
        prompt = (base * 3)[:rng.randint(8, 20)]
        reference = hf_greedy(model, prompt, 24)
        d = drafter(kind, model, target, rng.randrange(1000))
        if kind in ("medusa", "clover"):
            d.attach_programs(heads_graphs(d, target.max_context))
        out, _ = run_engine(Engine(target, d, budget=24, auto_budget=False), prompt, StopCheck(24))
        assert out == reference, kind
        assert target.program is step


@pytest.mark.parametrize("name", ACCEPTED)
def test_tree_logits_are_the_models_own(models, name):
    """The logits of every node of a verified tree equal the model's own forward over that node's path (with its
    reference attention): sampling draws from exactly the target's distribution, soft-capping and scaling included."""
    model = models[name]
    target = Target(model)
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, VOCAB, (9,), generator=g).tolist()
    tokens = torch.randint(3, VOCAB, (6,), generator=g).tolist()
    parents = [-1, 0, 0, 1, 1, 2]
    tree = DraftTree(tokens, parents)
    target.forward(torch.tensor(prefix))
    target.cache.append(len(prefix))
    t, depths, mask = tree.tensors("cpu")
    _, logits = target.forward(t, len(prefix) + depths, mask)
    own = model.config._attn_implementation
    model.set_attn_implementation("eager") if own == "clover_tree" else None
    try:
        for node in range(len(tokens)):
            path, i = [], node
            while i >= 0:
                path.insert(0, tokens[i])
                i = parents[i]
            with torch.no_grad():
                want = model(input_ids=torch.tensor([prefix + path])).logits[0, -1].float()
            assert torch.allclose(logits[node], want, atol=2e-4, rtol=1e-4), node
    finally:
        model.set_attn_implementation(own) if own == "clover_tree" else None


@pytest.mark.parametrize("name", sorted(NO_CLOVER_HEADS))
def test_clover_heads_refused_in_one_line_where_the_layers_do_not_fit(models, name):
    from clover_cli.drafters.common import HeadsConfig
    from clover_cli.drafters.registry import build_heads

    with pytest.raises(CloverError, match="Medusa heads work") as e:
        build_heads(HeadsConfig.for_target(models[name].config), models[name])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", REFUSED)
def test_refused_models_get_one_line(name):
    with pytest.raises(CloverError) as e:
        check_exact(Target(make(name, REFUSED)))
    assert REFUSED[name][2] in str(e.value) and "\n" not in str(e.value)


def test_a_model_that_computes_differently_is_refused(models, monkeypatch):
    """check_exact compares numbers: a model whose forward with clover's cache drifts from its own is refused."""
    import clover_cli.target as target_module

    model = models["llama"]
    target = Target(model)
    real = target_module.Target.run

    def drifting(self, *args, **kwargs):
        pre, logits = real(self, *args, **kwargs)
        return pre, logits * 1.01

    monkeypatch.setattr(target_module.Target, "run", drifting)
    with pytest.raises(CloverError, match="differ from its own"):
        check_exact(target)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A refused model and an accepted one without a chat template, saved with a tokenizer."""
    from conftest import build_tokenizer

    root = tmp_path_factory.mktemp("arch_models")
    out = {}
    for name, table in (("lfm2", REFUSED), ("qwen2", ACCEPTED)):
        tok = build_tokenizer(root / "tokenizer")  # with a chat template: copied below without it
        tok.chat_template = None
        tok.save_pretrained(root / name)
        assert not list((root / name).glob("chat_template*"))
        make(name, table, vocab=len(tok)).save_pretrained(root / name)
        out[name] = root / name
    return out


def test_cli_refuses_in_one_line(saved, tmp_path, run_cli):
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    code, out, err = run_cli("generate", str(saved["lfm2"]), "-f", str(prompt), "--stats-file", "off")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "cannot run lfm2 models exactly" in err


def test_a_model_without_a_chat_template_is_told_which_one_is_used(saved, tmp_path, run_cli):
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    code, out, err = run_cli("generate", str(saved["qwen2"]), "-f", str(prompt), "-n", "4", "--stats-file",
                             "off", "--draft", "none")
    assert code == 0
    assert "has no chat template of its own: using the vicuna_v1.1 template (--raw" in err
    code, out, err = run_cli("generate", str(saved["qwen2"]), "-f", str(prompt), "-n", "4", "--stats-file",
                             "off", "--draft", "none", "--raw")
    assert code == 0 and "chat template" not in err
