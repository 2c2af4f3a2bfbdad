"""`clover train`: heads for a small random model it never saw, losslessness with them, and bad input."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import build_model
from helpers import chats_file, train_in_process

CONVERSATIONS = [
    {"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Tell me about the number {i}. Is it even or odd?"},
        {"from": "gpt", "value": f"The number {i} is {'even' if i % 2 == 0 else 'odd'}. "
                                 f"It comes after {i - 1} and before {i + 1}."},
        {"from": "human", "value": "And twice that?"},
        {"from": "gpt", "value": f"Twice {i} is {2 * i}, which is always even."},
    ]}
    for i in range(60)
]


@pytest.fixture(scope="module")
def fresh_model(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("unseen"), "llama", seed=7)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return chats_file(tmp_path_factory, CONVERSATIONS)


@pytest.fixture(scope="module")
def trained(fresh_model, data_file, tmp_path_factory):
    return train_in_process(fresh_model, data_file, tmp_path_factory.mktemp("heads") / "h", "--max-steps", "20",
                            "--heads", "3", "--layers", "1", "--batch-tokens", "2048", "--max-len", "384",
                            "--eval-every", "10")


def test_train_writes_a_loadable_heads_dir(trained):
    cfg = json.loads((trained / "config.json").read_text())
    assert cfg["architecture"] == "clover2" and cfg["num_heads"] == 3 and cfg["num_layers"] == 1
    assert cfg["training"]["steps"] == 20
    assert cfg["training"]["heldout_tau"] is not None and cfg["training"]["heldout_tau"] >= 1.0
    assert len(cfg["training"]["heldout_accuracy"]) == 3
    assert (trained / "model.safetensors").is_file()
    card = (trained / "README.md").read_text()
    assert "held-out" in card and "| 20 |" in card
    # Neither the target's embeddings nor its lm_head are stored.
    from safetensors import safe_open

    with safe_open(str(trained / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert not any("embed" in k or "lm_head" in k for k in keys)


def test_train_notes_its_session(fresh_model, data_file, tmp_path, monkeypatch):
    """A training run is in the registry of running sessions (clover ps), its model safe from clover rm meanwhile."""
    from pathlib import Path

    from clover_cli import running

    noted = []
    monkeypatch.setattr(running, "register", lambda command, session, sid, writer: noted.append(
        (command, Path(session.resolved.path).resolve())))
    train_in_process(fresh_model, data_file, tmp_path / "h", "--max-steps", "1", "--heads", "1", "--layers", "1",
                     "--batch-tokens", "1024", "--max-len", "384", "--eval-every", "1000")
    assert noted == [("train", Path(fresh_model).resolve())]


def test_trained_heads_are_lossless(trained, fresh_model, tmp_path, run_cli):
    prompt = tmp_path / "p.txt"
    texts = {}
    for draft in ("none", "clover"):
        for i, words in enumerate(["Tell me about the number 12.", "Is 7 even or odd?", "Twice 30?"]):
            prompt.write_text(words)
            code, out, err = run_cli("generate", str(fresh_model), "-f", str(prompt), "--draft", draft,
                                     "--heads", str(trained), "--json", "-n", "48", "--stats-file", "off",
                                     "--tree-budget", "12")
            assert code == 0, err
            texts[draft, i] = json.loads(out)
    for i in range(3):
        assert texts["clover", i]["text"] == texts["none", i]["text"]
        assert texts["clover", i]["draft"] == "clover"


def test_medusa_and_feature_cache_and_resume(fresh_model, data_file, tmp_path, run_cli):
    out = tmp_path / "medusa"
    args = ["train", str(fresh_model), "--data", str(data_file), "--arch", "medusa", "--out", str(out),
            "--heads", "2", "--batch-tokens", "2048", "--max-len", "384", "--eval-every", "3", "--cache-features"]
    code, _, err = run_cli(*args, "--max-steps", "3")
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["architecture"] == "medusa"
    assert any((out / "features").glob("shard_*.safetensors"))
    # the features are cached before the first step, which alone the steps' rate and ETA then time
    assert "target features: 1/1 shards cached" in err and err.index("target features") < err.index("step 1/3")
    # Running again without --resume or --overwrite is refused; --resume continues from step 3.
    code, stdout, err = run_cli(*args, "--max-steps", "6")
    assert code == 2 and "--resume" in err and err.count("\n") == 1
    code, _, err = run_cli(*args, "--max-steps", "6", "--resume")
    assert code == 0, err
    assert "resumed from step 3" in err and "target features" not in err  # read from the cache, not computed
    assert json.loads((out / "config.json").read_text())["training"]["steps"] == 6


def test_init_trains_heads_made_before_further(trained, fresh_model, data_file, tmp_path, run_cli):
    """--init starts from the given heads: their shape and draft vocabulary, their weights as the first step's input
    (a step at a vanishing learning rate leaves them as they were; heads built afresh are another thing); the
    result records where it started. Heads of another family, or no heads, are refused in one line."""
    from safetensors.torch import load_file

    before = load_file(str(trained / "model.safetensors"))
    out = tmp_path / "more"
    code, _, err = run_cli("train", str(fresh_model), "--data", str(data_file), "--out", str(out), "--init",
                           str(trained), "--max-steps", "1", "--lr", "1e-12", "--batch-tokens", "2048",
                           "--max-len", "384", "--eval-every", "1000")
    assert code == 0, err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_heads"] == 3 and cfg["num_layers"] == 1  # the init's, not the defaults (5, 2)
    assert cfg["training"]["init"]["from"] == str(trained) and cfg["training"]["init"]["steps"] == 20
    assert f"started from {trained}: 20 steps on" in (out / "README.md").read_text()
    after = load_file(str(out / "model.safetensors"))
    assert after.keys() == before.keys()
    for k in before:  # the draft vocabulary (an integer tensor) kept, every weight where it was
        assert torch.allclose(after[k].float(), before[k].float(), atol=1e-6), k
    fresh = tmp_path / "fresh"
    code, _, err = run_cli("train", str(fresh_model), "--data", str(data_file), "--out", str(fresh), "--heads", "3",
                           "--layers", "1", "--max-steps", "1", "--lr", "1e-12", "--batch-tokens", "2048",
                           "--max-len", "384", "--eval-every", "1000")
    assert code == 0, err
    built = load_file(str(fresh / "model.safetensors"))
    assert any(not torch.allclose(built[k].float(), before[k].float(), atol=1e-3) for k in before)
    # a second run from those: the whole line of runs is kept, latest first
    again = tmp_path / "again"
    code, _, err = run_cli("train", str(fresh_model), "--data", str(data_file), "--out", str(again), "--init",
                           str(out), "--max-steps", "2", "--batch-tokens", "2048", "--max-len", "384",
                           "--eval-every", "1000")
    assert code == 0, err
    line = json.loads((again / "config.json").read_text())["training"]["init"]
    assert (line["from"], line["steps"], line["init"]["from"], line["init"]["steps"]) == (str(out), 1, str(trained), 20)
    card = (again / "README.md").read_text()
    assert card.index(f"- started from {out}: 1 steps on") < card.index(f"- which started from {trained}: 20 steps on")
    for args, needle in [(["--init", str(tmp_path / "none")], "heads directory not found"),
                         (["--init", str(trained), "--arch", "medusa"], "clover2 heads")]:
        code, _, err = run_cli("train", str(fresh_model), "--data", str(data_file), "--out", str(tmp_path / "x"),
                               *args)
        assert code == 2 and needle in err and err.count("\n") == 1, (args, err)


def test_feature_norm_heads_start_quiet_train_resume_and_stay_lossless(fresh_model, data_file, tmp_path, run_cli):
    """--feature-norm (new Clover-2 heads' default): heads that norm the target's hidden state first. Built, they
    start as the target's post-norm feature plus the fused token (their augmenting layer adds nothing yet); trained,
    the config and card say so, a resume with the other option is refused, --init keeps it, and drafting with them
    is lossless. Other families refuse it, and heads made one way cannot be trained further the other way."""
    from clover_cli.drafters.common import HeadsConfig
    from clover_cli.drafters.registry import build_heads
    from clover_cli.target import hidden_states
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(fresh_model, dtype=torch.float32)
    cfg = HeadsConfig.for_target(model.config, num_heads=2, num_layers=1)
    cfg.feature_norm = True
    heads = build_heads(cfg, model)
    heads.init_from_target(model)
    x = torch.tensor([[1, 5, 9, 14, 3]])
    with torch.no_grad():
        pre, post = hidden_states(model, x)
        emb = model.get_input_embeddings()(x)
        pos = torch.arange(5)[None]
        state = heads.augment(pre, emb, heads.rotary(model)(pre, pos), pos)
        assert torch.allclose(heads.feature_norm(pre), post, atol=1e-5)  # started from the target's final norm
        assert torch.allclose(state, heads.norm(heads.fuse(post, emb)), atol=1e-4)  # the layer adds nothing yet
    out = tmp_path / "fn"
    args = ["train", str(fresh_model), "--data", str(data_file), "--out", str(out), "--heads", "2", "--layers", "1",
            "--batch-tokens", "2048", "--max-len", "384", "--eval-every", "1000"]
    code, _, err = run_cli(*args, "--max-steps", "3")
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["feature_norm"] is True
    assert "the hidden state normed first" in (out / "README.md").read_text()
    code, _, err = run_cli(*args, "--no-feature-norm", "--max-steps", "5", "--resume")
    assert code == 2 and "--feature-norm" in err and err.count("\n") == 1, err
    code, _, err = run_cli(*args, "--max-steps", "5", "--resume")
    assert code == 0 and "resumed from step 3" in err, err
    more = tmp_path / "more"
    code, _, err = run_cli("train", str(fresh_model), "--data", str(data_file), "--out", str(more), "--init", str(out),
                           "--max-steps", "1", "--batch-tokens", "2048", "--max-len", "384", "--eval-every", "1000")
    assert code == 0, err
    assert json.loads((more / "config.json").read_text())["feature_norm"] is True
    prompt = tmp_path / "p.txt"
    for words in ["Tell me about the number 12.", "Twice 30?"]:
        prompt.write_text(words)
        texts = []
        for draft in ("none", "clover"):
            code, stdout, err = run_cli("generate", str(fresh_model), "-f", str(prompt), "--draft", draft, "--heads",
                                        str(more), "--json", "-n", "40", "--stats-file", "off", "--tree-budget", "12")
            assert code == 0, err
            texts.append(json.loads(stdout)["text"])
        assert texts[0] == texts[1]
    plain = tmp_path / "plain"
    code, _, err = run_cli(*args[:5], str(plain), "--heads", "1", "--layers", "1", "--max-steps", "1",
                           "--batch-tokens", "2048", "--max-len", "384", "--eval-every", "1000", "--no-feature-norm")
    assert code == 0, err
    assert json.loads((plain / "config.json").read_text())["feature_norm"] is False
    for extra, needle in [(["--arch", "medusa", "--feature-norm"], "--feature-norm"),
                          (["--init", str(plain), "--feature-norm"], "as it is"),
                          (["--init", str(out), "--no-feature-norm"], "norm it first")]:
        code, _, err = run_cli("train", str(fresh_model), "--data", str(data_file), "--out", str(tmp_path / "x"),
                               *extra)
        assert code == 2 and needle in err and err.count("\n") == 1, (extra, err)


def test_regenerated_replies_survive_another_max_conversations(fresh_model, data_file, tmp_path, run_cli,
                                                               monkeypatch):
    """A regeneration stopped (hours of it on a CPU) and started again with --overwrite on the conversations it had
    (fewer --max-conversations) reuses its replies instead of deleting them; a run over more regenerates the rest
    only."""
    from clover_cli.train import loop as train_mod

    out = tmp_path / "regen"
    common = ["train", str(fresh_model), "--data", str(data_file), "--out", str(out), "--heads", "2", "--layers", "1",
              "--max-steps", "1", "--batch-tokens", "2048", "--max-len", "384", "--regenerate"]
    code, _, err = run_cli(*common, "--max-conversations", "6")
    assert code == 0, err
    first = (out / "regenerated.jsonl").read_text().splitlines()
    assert len(first) == 6
    real, asked = train_mod.regenerate, []

    def counting(cfg, model, tokenizer, template, stop_strings, conversations, *a, **k):
        done = len((out / "regenerated.jsonl").read_text().splitlines()) if (out / "regenerated.jsonl").exists() else 0
        asked.append(max(0, len(conversations) - done))
        return real(cfg, model, tokenizer, template, stop_strings, conversations, *a, **k)

    monkeypatch.setattr(train_mod, "regenerate", counting)
    code, _, err = run_cli(*common, "--max-conversations", "4", "--overwrite")
    assert code == 0, err
    assert asked == [0] and (out / "regenerated.jsonl").read_text().splitlines() == first
    code, _, err = run_cli(*common, "--max-conversations", "8", "--overwrite")
    assert code == 0, err
    again = (out / "regenerated.jsonl").read_text().splitlines()
    assert asked == [0, 2] and again[:6] == first and len(again) == 8


def test_regenerate_uses_the_targets_own_replies(fresh_model, data_file, tmp_path, run_cli):
    out = tmp_path / "regen"
    code, _, err = run_cli("train", str(fresh_model), "--data", str(data_file), "--out", str(out), "--heads", "2",
                           "--layers", "1", "--max-steps", "2", "--batch-tokens", "2048", "--max-len", "384",
                           "--max-conversations", "6", "--regenerate")
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    original = {c["conversations"][0]["value"]: c["conversations"][1]["value"] for c in CONVERSATIONS}
    changed = [r for r in rows if r[1]["content"] != original[r[0]["content"]]]
    assert changed, "assistant turns were not replaced"
    assert json.loads((out / "config.json").read_text())["training"]["repetition_penalty"] == 1.0  # not an alias
    # progress with the time taken and what is left (the last line: nothing left)
    assert re.search(r"regenerated 6/6 conversations · [\dmh]+s? elapsed · ETA 0s", err), err


def test_regenerate_in_batches_on_a_cpu_with_the_penalty(fresh_model, data_file, tmp_path, run_cli, monkeypatch):
    """A target as big as BATCHED_CPU_PARAMS is regenerated on a CPU in padded batches of transformers' generate,
    with the repetition penalty asked for, and a padding token that ends no reply (the penalty reads the padding)."""
    from transformers import GenerationMixin

    from clover_cli.train import data as train_data

    monkeypatch.setattr(train_data, "BATCHED_CPU_PARAMS", 0)
    calls = []
    real = GenerationMixin.generate

    def spy(self, *a, **k):
        calls.append({"rows": k["input_ids"].shape[0], "penalty": k.get("repetition_penalty"),
                      "pad": k["pad_token_id"], "eos": k.get("eos_token_id")})
        return real(self, *a, **k)

    monkeypatch.setattr(GenerationMixin, "generate", spy)
    out = tmp_path / "regen-batched"
    code, _, err = run_cli("train", str(fresh_model), "--data", str(data_file), "--out", str(out), "--heads", "2",
                           "--layers", "1", "--max-steps", "1", "--batch-tokens", "2048", "--max-len", "384",
                           "--max-conversations", "6", "--regenerate", "--regen-max-tokens", "24",
                           "--repetition-penalty", "1.3")
    assert code == 0, err
    assert calls and calls[0]["rows"] > 1 and sum(c["rows"] for c in calls) >= 6
    assert all(c["penalty"] == 1.3 and c["pad"] not in (c["eos"] or []) for c in calls)
    rows = [json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    assert json.loads((out / "config.json").read_text())["training"]["repetition_penalty"] == 1.3


def test_interrupt_keeps_the_last_checkpoint(fresh_model, data_file, tmp_path, run_cli, monkeypatch):
    from clover_cli.train import loop as train_mod

    out = tmp_path / "interrupted"
    real = train_mod.heads_loss
    calls = {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 5:  # after the checkpoint at step 2 (eval-every 2), during step 3
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(train_mod, "heads_loss", flaky)
    monkeypatch.setattr(train_mod, "EVAL_PROMPTS", 0)
    code, _, err = run_cli("train", str(fresh_model), "--data", str(data_file), "--out", str(out), "--heads", "2",
                           "--layers", "1", "--max-steps", "10", "--batch-tokens", "2048", "--max-len", "384",
                           "--eval-every", "2")
    assert code == 130
    assert "interrupted at step" in err and "--resume" in err
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["step"] == 2
    assert (out / "checkpoint" / "heads.safetensors").is_file()


@pytest.mark.parametrize("content,needle", [
    (None, "not found"),
    ('{"conversations": [{"from": "human", "value": "hi"}]}\n{not json\n', ":2: malformed JSON"),
    ('{"conversations": [{"from": "human", "value": "hi"}]}\n', "no conversations with assistant turns"),
    ('[{"conversations": 5}]', "expected an object with a 'conversations' list"),
])
def test_bad_data(fresh_model, tmp_path, run_cli, content, needle):
    data = tmp_path / "d.jsonl"
    if content is not None:
        data.write_text(content)
    code, out, err = run_cli("train", str(fresh_model), "--data", str(data), "--out", str(tmp_path / "o"),
                             "--max-steps", "1")
    assert code == 2 and out == ""
    assert err.startswith("clover: error:") and err.count("\n") == 1 and needle in err


def test_bad_out_and_options(fresh_model, data_file, tmp_path, run_cli):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    code, _, err = run_cli("train", str(fresh_model), "--data", str(data_file), "--out", str(foreign))
    assert code == 2 and "not a heads directory" in err and "--overwrite" in err
    assert (foreign / "notes.txt").read_text() == "keep me"
    for args, needle in [(["--arch", "eagle9"], "--arch"), (["--heads", "0"], "--heads"), (["--lr", "-1"], "--lr"),
                         (["--reg-weight", "nan"], "--reg-weight"), (["--resume"], "no checkpoint"),
                         (["--loss-vocab", "some"], "--loss-vocab"), (["--lr-schedule", "flat"], "--lr-schedule"),
                         (["--repetition-penalty", "0"], "--repetition-penalty"),
                         (["--max-len", "64", "--batch-tokens", "32"],
                                                           "--batch-tokens")]:
        code, _, err = run_cli("train", str(fresh_model), "--data", str(data_file), "--out", str(tmp_path / "x"),
                               *args)
        assert code == 2 and needle in err and err.count("\n") == 1, (args, err)


def test_lr_schedules_warm_up_then_decay_or_hold():
    """cosine: from the peak to 0.1x at the last step; constant: the peak to the end (the Clover-2 authors' schedule
    stays near it for a run of this length); both after the same linear warm-up."""
    from clover_cli.train import lr_factor

    for schedule in ("cosine", "constant"):
        assert [lr_factor(schedule, 4, 100, s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    cosine = [lr_factor("cosine", 4, 100, s) for s in range(4, 101)]
    assert cosine[0] == pytest.approx(1.0) and cosine[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(cosine, cosine[1:])) and cosine[48] == pytest.approx(0.55)
    assert [lr_factor("constant", 4, 100, s) for s in range(4, 101)] == [1.0] * 97


def test_progress_lines_show_steps_elapsed_and_eta(capsys):
    """Without a terminal, every 10th step's line says steps done / total, the time elapsed and an ETA from the rate
    of the recent steps (issue #48: `clover train` shows progress with an ETA); a resumed run times only its own."""
    from clover_cli.train.loop import _duration, _Progress

    assert [_duration(s) for s in (0, 42.4, 185, 7620)] == ["0s", "42s", "3m05s", "2h07m"]
    now = [100.0]
    progress = _Progress(total=100, start=40, enabled=True, clock=lambda: now[0])
    last = {"loss": 1.5, "acc": [0.5, 0.25], "tok_s": 1000.0}
    for step in range(41, 71):
        now[0] += 2.0 if step <= 60 else 4.0  # slower for the last 10 steps: the ETA follows the recent rate
        progress.update(step, last)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "step 50/100: loss 1.500 · top-1 0.50 0.25 · 1000 tok/s · 20s elapsed · ETA 1m40s",
        "step 60/100: loss 1.500 · top-1 0.50 0.25 · 1000 tok/s · 40s elapsed · ETA 1m20s",
        "step 70/100: loss 1.500 · top-1 0.50 0.25 · 1000 tok/s · 1m20s elapsed · ETA 1m30s",
    ]
    quiet = _Progress(total=10, start=0, enabled=False)  # other processes than the main one print nothing
    quiet.update(10, last)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("error", [
    torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    MemoryError(),
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory"),
])
@pytest.mark.parametrize("where,needle", [("heads_loss", "--batch-tokens"), ("evaluate", "--batch-tokens"),
                                          ("regenerate", "--regen-max-tokens")])
def test_out_of_memory_suggests_smaller_batches(fresh_model, data_file, tmp_path, run_cli, monkeypatch, error,
                                                where, needle):
    from clover_cli.train import loop as train_mod

    def oom(*a, **k):
        raise error

    monkeypatch.setattr(train_mod, where, oom)
    out = tmp_path / "o"
    code, _, err = run_cli("train", str(fresh_model), "--data", str(data_file), "--out", str(out),
                           "--max-steps", "2", "--batch-tokens", "2048", "--max-len", "384",
                           *(["--regenerate"] if where == "regenerate" else []))
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("clover: error:")]
    assert len(errors) == 1 and needle in errors[0] and "out of" in errors[0] and "Traceback" not in err
    # The run never reached a checkpoint: the --out it created is gone, so the same command can run again.
    assert not out.exists()


def test_an_interrupted_runs_feature_cache_is_kept_and_reused(fresh_model, data_file, tmp_path, run_cli,
                                                               monkeypatch):
    """Stopped before its first checkpoint, a run keeps the target's hidden states it cached (costly: minutes to
    hours on a CPU); the same command says so, and --overwrite with the same options trains from them, not
    recomputing them. Other data (another --max-len) drops them."""
    from clover_cli.train import loop as train_mod

    out = tmp_path / "h"
    real = train_mod.heads_loss
    calls = {"n": 0}

    def stop_first(*a, **k):
        calls["n"] += 1
        if calls["n"] == 1:  # after the first batch's features were cached, before any checkpoint
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(train_mod, "heads_loss", stop_first)
    monkeypatch.setattr(train_mod, "EVAL_PROMPTS", 0)
    common = ["train", str(fresh_model), "--data", str(data_file), "--out", str(out), "--heads", "2", "--layers", "1",
              "--max-steps", "2", "--batch-tokens", "2048", "--max-len", "384", "--eval-every", "5",
              "--cache-features"]
    code, _, err = run_cli(*common)
    assert code == 130, err
    shards = sorted((out / "features").glob("shard_*.safetensors"))
    assert shards and not (out / "checkpoint").exists()
    stamps = [p.stat().st_mtime_ns for p in shards]
    code, _, err = run_cli(*common)
    assert code == 2 and "--overwrite" in err and "feature cache" in err
    code, _, err = run_cli(*common, "--overwrite")
    assert code == 0, err
    assert [p.stat().st_mtime_ns for p in shards] == stamps  # read, not written again
    assert json.loads((out / "config.json").read_text())["training"]["steps"] == 2
    code, _, err = run_cli(*common[:-5], "--max-len", "256", "--eval-every", "5", "--cache-features", "--overwrite")
    assert code == 0, err
    assert all(not p.exists() or p.stat().st_mtime_ns != t for p, t in zip(shards, stamps))  # computed anew


def test_failed_runs_leave_out_reusable(fresh_model, data_file, tmp_path, run_cli):
    out = tmp_path / "h"
    common = ["--out", str(out), "--heads", "2", "--layers", "1", "--max-steps", "1", "--batch-tokens", "2048",
              "--max-len", "384", "--eval-every", "5"]
    code, _, err = run_cli("train", str(tmp_path / "nosuchmodel"), "--data", str(data_file), *common)
    assert code == 2 and "unknown model" in err and not out.exists()
    code, _, err = run_cli("train", str(fresh_model), "--data", str(tmp_path / "missing.json"), *common)
    assert code == 2 and "data file not found" in err and not out.exists()
    out.mkdir()  # an empty directory of the user's own stays, and stays empty
    code, _, err = run_cli("train", str(fresh_model), "--data", str(tmp_path / "missing.json"), *common)
    assert code == 2 and out.is_dir() and not any(out.iterdir())
    code, _, err = run_cli("train", str(fresh_model), "--data", str(data_file), *common)
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["training"]["steps"] == 1


def test_out_that_cannot_be_created(fresh_model, data_file, tmp_path, run_cli):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for out in ("/proc/nope/h", str(blocker / "h")):
        code, stdout, err = run_cli("train", str(fresh_model), "--data", str(data_file), "--out", out,
                                    "--max-steps", "1")
        assert code == 2 and stdout == "" and err.startswith("clover: error:") and err.count("\n") == 1, err
        assert "--out" in err and "Traceback" not in err


def test_device_cuda_n(fresh_model, data_file, tmp_path, run_cli, monkeypatch):
    """--device cuda:N makes GPU N current for a single process; under accelerate launch it is refused."""
    args = ["train", str(fresh_model), "--data", str(data_file), "--out", str(tmp_path / "o"), "--device", "cuda:1"]
    if not torch.cuda.is_available():
        code, _, err = run_cli(*args)
        assert code == 2 and "CUDA is not available" in err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    chosen = []

    def set_device(index):
        chosen.append(index)
        raise KeyboardInterrupt  # stop before anything uses the (pretend) GPU

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    code, _, err = run_cli(*args)
    assert chosen == [1] and code == 130 and not (tmp_path / "o").exists()
    monkeypatch.setenv("LOCAL_RANK", "0")
    code, _, err = run_cli(*args)
    assert code == 2 and "accelerate launch" in err and err.count("\n") == 1 and chosen == [1]


@pytest.mark.parametrize("loss_vocab", ["full", "draft"])
def test_loss_matches_the_direct_soft_cross_entropy(llama_dir, loss_vocab):
    """heads_loss's shortcut (logsumexp - expected output embedding) equals -sum p log q computed directly; with
    --loss-vocab draft both distributions are over the draft vocabulary, the target's renormalised there, and the
    agreement compares token ids."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from clover_cli.drafters.common import HeadsConfig

    from clover_cli.drafters.registry import build_heads
    from clover_cli.target import hidden_states
    from clover_cli.train import TrainConfig, heads_loss

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    heads = build_heads(HeadsConfig.for_target(model.config, "medusa", num_heads=3), model)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randint(3, model.config.vocab_size, (2, 40))
    mask = (torch.rand(2, 40) < 0.6).float()
    vocab = torch.randperm(model.config.vocab_size)[:40]
    heads.draft_vocab = vocab  # drafting uses it either way; the loss only with --loss-vocab draft
    with torch.no_grad():
        pre, post = hidden_states(model, x)
    cfg = TrainConfig(model="m", out="o", reg_weight=0.0, decay=0.5, loss_vocab=loss_vocab)
    total, per_head = heads_loss(heads, "medusa", model, x, mask, pre, post, cfg)
    lm_head = model.get_output_embeddings()
    keep = vocab if loss_vocab == "draft" else torch.arange(model.config.vocab_size)
    expected = 0.0
    for i, out in enumerate(heads.forward_train(post)):
        n = 40 - 2 - i
        m = mask[:, 2 + i:2 + i + n] > 0
        target_logits = lm_head(post[:, 1 + i:1 + i + n][m])
        p = torch.softmax(target_logits[:, keep], -1)
        q_logits = lm_head(out[:, :n][m])[:, keep]
        ce = -(p * F.log_softmax(q_logits, -1)).sum(-1).mean()
        assert abs(per_head[i][0] - ce.item()) < 1e-4
        agree = (keep[q_logits.argmax(-1)] == target_logits.argmax(-1)).float().mean().item()
        assert per_head[i][1] == pytest.approx(agree)
        expected = expected + 0.5 ** i * ce
    assert abs(total.item() - expected.item()) < 1e-4


def test_draft_loss_vocabulary_agrees_in_token_ids(llama_dir):
    """With --loss-vocab draft a head that outputs the target's own next features agrees with the target wherever
    the target's choice is in the draft vocabulary: its choice over the shortlist is mapped back to a token id."""
    from transformers import AutoModelForCausalLM

    from clover_cli.target import hidden_states
    from clover_cli.train import TrainConfig, heads_loss

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    x = torch.randint(3, model.config.vocab_size, (2, 30))
    mask = torch.ones(2, 30)
    with torch.no_grad():
        pre, post = hidden_states(model, x)
        chosen = model.get_output_embeddings()(post).argmax(-1).unique()
    others = torch.tensor([v for v in torch.randperm(model.config.vocab_size).tolist() if v not in chosen.tolist()])

    class Oracle(torch.nn.Module):  # head i's output at t: the target's feature at t+1+i, what it regresses to
        def forward(self, h):
            return [torch.cat([h[:, 1 + i:], h[:, :1 + i]], 1) for i in range(3)]

    heads = Oracle()
    heads.draft_vocab = torch.cat([others[:20], chosen, others[20:40]])  # the chosen ids not first, not in order
    _, per_head = heads_loss(heads, "medusa", model, x, mask, pre, post, TrainConfig(model="m", out="o",
                                                                                      loss_vocab="draft"))
    assert [agree for _, agree, _ in per_head] == [1.0, 1.0, 1.0]


PROBE = """
import atexit, json, os, sys
import torch
from clover_cli.train import loop as train_mod
from clover_cli.process import main

rank, seen, box = int(os.environ["RANK"]), [], {}
collate = train_mod.collate
def probe_collate(ids, masks, rows, device):
    seen.append(list(rows))
    return collate(ids, masks, rows, device)
heads_loss = train_mod.heads_loss
def probe_loss(heads, *a, **k):
    box.setdefault("heads", heads)
    return heads_loss(heads, *a, **k)
def dump():
    heads = box["heads"]
    module = getattr(heads, "module", heads)
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump({"rows": seen, "wrapper": type(heads).__name__,
                   "params": {k: v.double().sum().item() for k, v in module.state_dict().items()}}, f)
atexit.register(dump)
train_mod.collate, train_mod.heads_loss = probe_collate, probe_loss
main(sys.argv[2:])
"""


def test_two_processes_through_accelerate_launch(fresh_model, data_file, tmp_path, run_cli):
    """`accelerate launch` with 2 CPU processes (gloo): DDP-wrapped heads whose gradients stay in sync, each process
    on its own batches, one heads directory written by the main process, lossless with the real engine.

    accelerate's --cpu flag alone starts a single process (several CPU processes need mpirun there); --multi_gpu
    on a machine without GPUs starts them through torchrun, and clover's Accelerator(cpu=True) then uses gloo."""
    import os
    import socket
    import subprocess
    import sys

    pytest.importorskip("accelerate")
    if torch.cuda.is_available():
        pytest.skip("this test runs CPU processes")
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = tmp_path / "ddp"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_ip",
           "127.0.0.1", "--main_process_port", str(port), str(probe), str(tmp_path),
           "train", str(fresh_model), "--data", str(data_file), "--out", str(out), "--device", "cpu",
           "--heads", "3", "--layers", "1", "--max-steps", "4", "--batch-tokens", "1024", "--max-len", "384",
           "--eval-every", "4", "--cache-features"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 processes" in done.stderr and done.stderr.count("heads written to") == 1
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["wrapper"] == "DistributedDataParallel" for r in ranks)
    # Each process trained on its own conversations (the main one then also evaluated); DDP kept the heads
    # identical on both.
    assert len(ranks[1]["rows"]) == 4 and len(ranks[0]["rows"]) > 4
    assert not set(sum(ranks[0]["rows"][:4], [])) & set(sum(ranks[1]["rows"][:4], []))
    assert ranks[0]["params"] == ranks[1]["params"]
    # The feature cache was written once, by shards, with no stray temporary files.
    assert sorted(p.suffix for p in (out / "features").iterdir()) == [".safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["training"]["steps"] == 4 and cfg["training"]["processes"] == 2
    assert (out / "checkpoint" / "state.json").is_file()
    prompt = tmp_path / "p.txt"
    prompt.write_text("Tell me about the number 12.")
    texts = {}
    for draft in ("none", "clover"):
        code, stdout, err = run_cli("generate", str(fresh_model), "-f", str(prompt), "--draft", draft,
                                    "--heads", str(out), "--json", "-n", "32", "--stats-file", "off",
                                    "--tree-budget", "12")
        assert code == 0, err
        texts[draft] = json.loads(stdout)
    assert texts["clover"]["text"] == texts["none"]["text"] and texts["clover"]["draft"] == "clover"


@pytest.mark.parametrize("arch", ["clover", "medusa", "eagle", "eagle3"])
def test_a_checkpoint_records_its_own_arch_and_resumes_with_it(tmp_path, arch):
    """A checkpoint's settings name the --arch it was trained with (an EAGLE run's were recorded as medusa, and its
    --resume refused), and --resume with that --arch passes the check."""
    import torch

    from clover_cli.drafters.common import HeadsConfig
    from clover_cli.errors import CloverError
    from clover_cli.train import TrainConfig
    from clover_cli.train.output import _check_resumable, _save_checkpoint

    family = {"clover": "clover2"}.get(arch, arch)
    heads = torch.nn.Linear(4, 4)
    heads.cfg = HeadsConfig(architecture=family, num_heads=3, num_layers=1)
    opt = torch.optim.AdamW(heads.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    _save_checkpoint(tmp_path, heads, opt, sched, 2, [])
    settings = json.loads((tmp_path / "checkpoint" / "state.json").read_text())["settings"]
    assert settings["arch"] == arch
    _check_resumable(tmp_path / "checkpoint", TrainConfig(model="m", out=tmp_path, arch=arch, num_heads=3,
                                                          num_layers=1))
    other = "medusa" if arch != "medusa" else "eagle"
    with pytest.raises(CloverError, match="was made with --arch " + arch):
        _check_resumable(tmp_path / "checkpoint", TrainConfig(model="m", out=tmp_path, arch=other, num_heads=3,
                                                              num_layers=1))
