"""Adding a heads family touches its own file and its one line in clover_cli/families.py, nothing else (issue #51).

A toy family is registered at runtime: this test module is its file (it ends in SPEC, as drafters/<family>.py do; its
heads are Medusa's module under another architecture name), and the `toy` fixture adds its line to the table. With
no other module changed, --draft toy passes the option checks, `clover train --arch toy` is accepted, its heads are
built, saved, detected, loaded and drafted by the registry, trained by heads_loss, carded by the model card, and a
`clover generate --draft toy` session runs them, exactly (the same text as plain decoding).
"""

from __future__ import annotations

import json
import random
import sys

import pytest
import torch

from clover_cli import families
from clover_cli.drafters import medusa
from clover_cli.families import Family, Spec, Training
from helpers import hf_greedy, run_engine


class ToyDrafter(medusa.MedusaDrafter):
    name = "toy"
    programs_kind = None  # no compiled programs: its heads run eager


SPEC = Spec(build=medusa.build, drafter=ToyDrafter, training=Training(card_name="Toy-1"))  # no published layout
TOY = Family("toy", "toy", "Toy", __name__, "a family only these tests know")


@pytest.fixture
def toy(monkeypatch):
    assert sys.modules[__name__].SPEC is SPEC  # the module path in TOY imports this module
    monkeypatch.setattr(families, "FAMILIES", (*families.FAMILIES, TOY))
    return TOY


@pytest.fixture(scope="module")
def model(llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_dir).eval()


def toy_heads(model, seed: int = 0):
    from clover_cli.drafters.common import HeadsConfig
    from clover_cli.drafters.registry import build_heads

    torch.manual_seed(seed)
    heads = build_heads(HeadsConfig.for_target(model.config, "toy", num_heads=3, num_layers=0), model)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return heads.eval()


def test_the_table_decides_which_drafters_there_are():
    """Without its line in the table the toy family is unknown everywhere."""
    from clover_cli.errors import CloverError
    from clover_cli.options import Options, check_options
    from clover_cli.train.config import TrainConfig, validate

    with pytest.raises(CloverError, match="unknown drafter 'toy'"):
        check_options(Options(draft="toy"))
    with pytest.raises(CloverError, match="--arch must be clover, medusa, eagle or eagle3, not 'toy'"):
        validate(TrainConfig(model="m", out="o", arch="toy"))


def test_draft_and_arch_take_a_new_family(toy, run_cli, tmp_path):
    from clover_cli.bench import all_methods, heads_rows
    from clover_cli.options import Options, check_options
    from clover_cli.train.config import TrainConfig, validate
    from clover_cli.train.output import _heads_settings

    assert "toy" in families.drafts() and families.heads_drafts()["toy"] == "toy"
    check_options(Options(draft="toy"))
    validate(TrainConfig(model="m", out="o", arch="toy"))
    assert _heads_settings("toy", 3, 2) == {"arch": "toy", "heads": 3}  # what its checkpoints record
    # the command lines: --draft toy and --arch toy pass their checks (the next option's check refuses)
    code, _, err = run_cli("generate", "-p", "hi", "--draft", "toy", "--tree", "bogus")
    assert code == 2 and "--tree must be dynamic or static" in err and "drafter" not in err
    code, _, err = run_cli("train", "m", "--out", str(tmp_path / "out"), "--arch", "toy", "--heads", "0")
    assert code == 2 and "--heads must be between 1 and 16" in err
    code, _, err = run_cli("train", "m", "--out", str(tmp_path / "out"), "--arch", "bogus")
    assert code == 2 and "--arch must be clover, medusa, eagle, eagle3 or toy, not 'bogus'" in err
    # what else lists the families: clover models, clover bench's rows (the first family's, clover, last)
    from clover_cli.aliases import ModelSpec

    assert ModelSpec("x", None, None, heads=(("toy", "org/toy-heads"),)).heads_text() == "org/toy-heads (Toy)"
    assert heads_rows() == ["medusa", "eagle", "toy", "clover", "clover+ngram"]
    assert "toy" in all_methods()


def test_heads_round_trip_train_and_draft(toy, model, tmp_path):
    """Built, trained (heads_loss by its SPEC.training), saved with its card, detected, loaded and drafted by the
    registry; its drafter's output is exactly the target's greedy output."""
    from clover_cli.decode.engine import Engine
    from clover_cli.decode.verify import StopCheck
    from clover_cli.drafters import registry
    from clover_cli.target import Target, hidden_states
    from clover_cli.train import TrainConfig, heads_loss
    from clover_cli.train.publish import model_card

    heads = toy_heads(model)
    assert heads.cfg.architecture == "toy"
    x = torch.randint(3, model.config.vocab_size, (2, 32))
    mask = torch.ones(2, 32)
    with torch.no_grad():
        pre, post = hidden_states(model, x)
    cfg = TrainConfig(model="m", out="o", arch="toy")
    total, per_head = heads_loss(heads, "toy", model, x, mask, pre, post, cfg)
    same, _ = heads_loss(heads, "medusa", model, x, mask, pre, post, cfg)  # the same module, trained alike
    assert len(per_head) == 3 and total.item() == pytest.approx(same.item())

    out = tmp_path / "toy-heads"
    registry.save_heads(heads, out, model_card(heads.cfg, "tiny-llama", []))
    assert json.loads((out / "config.json").read_text())["architecture"] == "toy"
    assert "# Toy-1 draft heads for tiny-llama" in (out / "README.md").read_text()
    assert registry.detect(out) == "clover" and registry.family(out) == "toy" and registry.is_heads_dir(out)
    loaded = registry.load(out, model)
    assert loaded.cfg.architecture == "toy"
    for (name, a), (_, b) in zip(heads.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b.to(a.dtype)), name

    target = Target(model)
    drafter = registry.drafter_for(loaded, target)
    assert isinstance(drafter, ToyDrafter) and registry.drafter_class("toy") is ToyDrafter
    rng = random.Random(0)
    prompt = [rng.randrange(3, model.config.vocab_size) for _ in range(12)]
    got, _ = run_engine(Engine(target, drafter, budget=12, auto_budget=False), prompt, StopCheck(20))
    assert got == hf_greedy(model, prompt, 20)


def test_a_session_drafts_with_the_new_family(toy, model, llama_dir, tmp_path, run_cli):
    """`clover generate --draft toy --heads DIR`: the session checks the heads are toy heads and drafts with them;
    the text is plain decoding's."""
    from clover_cli.drafters import registry
    from clover_cli.train.publish import model_card

    heads = toy_heads(model, seed=1)
    out = tmp_path / "toy-heads"
    registry.save_heads(heads, out, model_card(heads.cfg, "tiny-llama", []))
    texts = {}
    for draft in ("none", "toy", "medusa"):
        code, stdout, err = run_cli("generate", str(llama_dir), "-p", "Count with me: 1, 2, 3", "--draft", draft,
                                    "--heads", str(out), "--json", "-n", "24", "--stats-file", "off")
        texts[draft] = (code, stdout, err)
    assert texts["toy"][0] == 0, texts["toy"][2]
    assert json.loads(texts["toy"][1])["text"] == json.loads(texts["none"][1])["text"]
    assert json.loads(texts["toy"][1])["draft"] == "toy"
    # heads of the toy family are not Medusa's: --draft medusa refuses them in one line
    code, _, err = texts["medusa"]
    assert code != 0 and "--draft medusa needs medusa heads" in err and "holds toy heads" in err


def test_the_table_imports_nothing():
    """clover_cli/families.py imports neither torch nor a family's file (options.py reads it before torch loads)."""
    import subprocess

    code = ("import sys, clover_cli.families as f; f.drafts(); f.heads_drafts(); "
            "loaded = sorted(m for m in sys.modules if m.startswith(('clover_cli', 'torch'))); print(loaded)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['clover_cli', 'clover_cli.families']"
