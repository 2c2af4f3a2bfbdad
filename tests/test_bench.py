"""`clover bench`: every method on the same prompts, identity with HF greedy, JSON and plot output, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clover_cli.drafters.common import HeadsConfig

from clover_cli.drafters.registry import build_heads, save_heads


def llama_cpp_importable() -> bool:
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
        return True
    except ImportError:
        return False


@pytest.fixture(scope="module")
def model_with_heads(llama_dir, tmp_path_factory):
    """The llama fixture plus random Clover-2, Medusa and EAGLE heads (random heads still must be lossless)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    root = tmp_path_factory.mktemp("bench_heads")
    paths = {}
    for arch in ("clover2", "medusa", "eagle"):
        torch.manual_seed(0)
        heads = build_heads(HeadsConfig.for_target(model.config, architecture=arch, num_heads=3, num_layers=1), model)
        heads.init_from_target(model)
        save_heads(heads, root / arch, "test heads")
        paths[arch] = root / arch
    return llama_dir, paths


def test_bench_json_all_methods_identical(model_with_heads, prompts_file, run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # where the llama.cpp GGUF goes
    model, heads = model_with_heads
    png = tmp_path / "bench.png"
    code, out, err = run_cli("bench", str(model), "--heads", str(heads["clover2"]), "--medusa-heads",
                             str(heads["medusa"]), "--eagle-heads", str(heads["eagle"]), "--prompts",
                             str(prompts_file), "-n", "24", "--json",
                             "--plot", str(png))
    assert code == 0, err
    report = json.loads(out)
    rows = {r["method"]: r for r in report["methods"]}
    peers = ["llama.cpp", "llama.cpp-lookup"] if llama_cpp_importable() else []  # the rows when the extra is here
    assert list(rows) == ["hf", "hf-lookup", "plain", "ngram", "medusa", "eagle", "clover", "clover+ngram"] + peers
    for name, r in rows.items():
        assert r["identical"] is True and r["mismatches"] == [], name
        speculative = name not in ("hf", "hf-lookup", "plain") and name not in peers
        assert r["same_as_plain"] is (True if speculative else None) and r["unlike_plain"] == [], name
        assert r["tokens_per_s"] > 0 and r["new_tokens"] == 3 * 24
        assert {"method", "tokens_per_s", "tau", "speedup_vs_hf", "identical"} <= set(r)
    assert rows["hf"]["speedup_vs_hf"] == 1.0 and rows["plain"]["tau"] == 1.0
    assert rows["ngram"]["tau"] >= 1.0 and rows["clover"]["tau"] >= 1.0 and rows["eagle"]["tau"] >= 1.0
    assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"


def test_bench_with_a_repetition_penalty_compares_with_hf_penalised(model_with_heads, prompts_file, run_cli,
                                                                    monkeypatch):
    """--repetition-penalty: hf generates with the same penalty (transformers' own processor runs), clover's rows
    apply it, and every row is identical to hf."""
    import transformers

    from clover_cli.decode import engine

    model, heads = model_with_heads
    seen = {"hf": [], "clover": []}
    real_call = transformers.RepetitionPenaltyLogitsProcessor.__call__
    real_penalize = engine.penalize
    monkeypatch.setattr(transformers.RepetitionPenaltyLogitsProcessor, "__call__",
                        lambda self, ids, scores: seen["hf"].append(self.penalty) or real_call(self, ids, scores))
    monkeypatch.setattr(engine, "penalize",
                        lambda logits, tree, context, p: seen["clover"].append(p) or real_penalize(logits, tree,
                                                                                                   context, p))
    code, out, err = run_cli("bench", str(model), "--heads", str(heads["clover2"]), "--prompts", str(prompts_file),
                             "-n", "24", "--json", "--methods", "hf,plain,ngram,clover+ngram",
                             "--repetition-penalty", "1.8")
    assert code == 0, err
    report = json.loads(out)
    assert report["repetition_penalty"] == 1.8
    assert all(r["identical"] is True for r in report["methods"]), report["methods"]
    assert seen["hf"] and set(seen["hf"]) == {1.8} and seen["clover"] and set(seen["clover"]) == {1.8}


def test_bench_samples_with_top_p_in_every_row(model_with_heads, prompts_file, run_cli, monkeypatch):
    """--temperature 0.7 --top-p 0.9: hf samples with transformers' top-p warper at 0.9, clover's rows with
    Sampling(top_p=0.9); the report says so."""
    import transformers

    from clover_cli.decode import engine

    model, heads = model_with_heads
    seen = {"hf": [], "clover": []}
    real_warper = transformers.TopPLogitsWarper.__init__
    real_generate = engine.Engine.generate

    def warper(self, top_p, *a, **k):
        seen["hf"].append(top_p)
        real_warper(self, top_p, *a, **k)

    def generate(self, prompt, stop, sampling=engine.Sampling()):
        seen["clover"].append((sampling.temperature, sampling.top_p))
        return real_generate(self, prompt, stop, sampling)

    monkeypatch.setattr(transformers.TopPLogitsWarper, "__init__", warper)
    monkeypatch.setattr(engine.Engine, "generate", generate)
    code, out, err = run_cli("bench", str(model), "--heads", str(heads["clover2"]), "--prompts", str(prompts_file),
                             "-n", "16", "--json", "--methods", "hf,plain,clover+ngram", "--temperature", "0.7",
                             "--top-p", "0.9", "--limit", "2")
    assert code == 0, err
    report = json.loads(out)
    assert report["temperature"] == 0.7 and report["top_p"] == 0.9
    assert seen["hf"] and set(seen["hf"]) == {0.9}
    assert seen["clover"] and set(seen["clover"]) == {(0.7, 0.9)}


def test_bench_prompt_directory_and_methods(model_with_heads, tmp_path, run_cli):
    model, _ = model_with_heads
    d = tmp_path / "p"
    d.mkdir()
    (d / "a.txt").write_text("Say hello.")
    (d / "b.txt").write_text("Count to five.")
    code, out, err = run_cli("bench", str(model), "--prompts", str(d), "--methods", "plain,ngram", "-n", "8",
                             "--json", "--repeats", "2")
    assert code == 0, err
    report = json.loads(out)
    assert [r["method"] for r in report["methods"]] == ["plain", "ngram"]
    assert report["prompts"] == 2 and report["repeats"] == 2
    assert all(r["identical"] is None for r in report["methods"])  # no hf row to compare with
    assert report["methods"][0]["new_tokens"] == 2 * 2 * 8


def test_bench_spec_bench_questions_by_category(model_with_heads, tmp_path, run_cli):
    """Spec-Bench's question.jsonl layout (question_id, category, turns): the first turn of each is the prompt, and
    the report splits τ and tokens/s by category, every prompt in one."""
    model, _ = model_with_heads
    q = tmp_path / "question.jsonl"
    q.write_text("\n".join(json.dumps(row) for row in [
        {"question_id": 81, "category": "writing", "turns": ["Write a short poem about rain.", "Now shorten it."]},
        {"question_id": 82, "category": "writing", "turns": ["Write a haiku about snow."]},
        {"question_id": 201, "category": "math_reasoning", "turns": ["What is 12 times 7?"]},
    ]) + "\n")
    code, out, err = run_cli("bench", str(model), "--prompts", str(q), "--methods", "plain,ngram", "-n", "10",
                             "--json")
    assert code == 0, err
    report = json.loads(out)
    cats = report["by_category"]
    assert list(cats) == ["writing", "math_reasoning"]
    assert cats["writing"]["ngram"]["prompts"] == 2 and cats["math_reasoning"]["plain"]["prompts"] == 1
    assert all(cats[c]["plain"]["tau"] == 1.0 for c in cats)  # plain decoding: one token per step
    assert sum(cats[c]["ngram"]["prompts"] for c in cats) == report["prompts"] == 3
    code, out, err = run_cli("bench", str(model), "--prompts", str(q), "--methods", "plain,ngram", "-n", "10")
    assert code == 0, err
    assert "by category" in out and "math_reasoning" in out


def test_bench_table(model_with_heads, prompts_file, run_cli, monkeypatch):
    """The table; and bench notes its session in the registry (clover ps; clover rm leaves its model alone)."""
    from clover_cli import running

    model, paths = model_with_heads
    heads = paths["clover2"]
    noted = []
    monkeypatch.setattr(running, "register", lambda command, session, sid, writer: noted.append(
        (command, Path(session.resolved.path).resolve(), Path(session.heads_path).resolve())))
    code, out, err = run_cli("bench", str(model), "--prompts", str(prompts_file), "--methods", "hf,plain",
                             "-n", "6", "--limit", "1", "--heads", str(heads))
    assert code == 0, err
    assert "clover bench" in out and "plain" in out and "yes" in out
    assert noted == [("bench", Path(model).resolve(), Path(heads).resolve())]


def test_builtin_prompts_are_heldout_and_categorised():
    from clover_cli.bench import load_prompts
    from clover_cli.data import is_heldout

    rows = load_prompts(None, None)
    assert len(rows) >= 20
    assert {r["category"] for r in rows} == {"multi-turn", "translation", "summarisation", "qa", "math",
                                             "retrieval"}
    assert all(is_heldout(r["id"]) for r in rows)


@pytest.mark.parametrize("args,needle", [
    (["--methods", "eagle3"], "unknown method"),
    (["--methods", "eagle"], "EAGLE heads"),
    (["--methods", "hf-assisted"], "--assistant"),
    (["--methods", "clover"], "Clover-2 heads"),
    (["--prompts", "/nonexistent/prompts.jsonl"], "no such file"),
    (["-n", "0"], "--max-new-tokens"),
    (["--repeats", "0"], "--repeats"),
    (["--temperature", "-1"], "--temperature"),
    (["--repetition-penalty", "0"], "--repetition-penalty"),
    (["--top-p", "0"], "--top-p"),
    (["--repetition-penalty", "1.2", "--methods", "plain,llama.cpp"], "llama.cpp"),
])
def test_bench_bad_input(llama_dir, run_cli, args, needle, prompts_file):
    code, out, err = run_cli("bench", str(llama_dir), "--prompts", str(prompts_file), *args)
    assert code == 2 and out == "" and err.count("\n") == 1 and needle in err, err


def test_bench_malformed_prompts(llama_dir, run_cli, tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
    code, out, err = run_cli("bench", str(llama_dir), "--prompts", str(p))
    assert code == 2 and ":2:" in err and err.count("\n") == 1


@pytest.mark.parametrize("n", range(1, 8))
def test_balanced_order_gives_every_method_every_place_and_every_predecessor_alike(n):
    """The bench interleaves methods prompt by prompt: a run measured a few percent slower first after a prompt
    switch, and right after a run that drafted with the heads at every step; each method must meet each alike."""
    from collections import Counter

    from clover_cli.bench import balanced_order

    period = n if n % 2 == 0 else 2 * n
    orders = [balanced_order(n, k) for k in range(period)]
    assert all(sorted(o) == list(range(n)) for o in orders)
    assert orders == [balanced_order(n, k + 3 * period) for k in range(period)]
    places = Counter((place, m) for o in orders for place, m in enumerate(o))
    assert len(places) == n * n and len(set(places.values())) == 1
    if n > 1:
        after = Counter((a, b) for o in orders for a, b in zip(o, o[1:]))
        assert len(after) == n * (n - 1) and len(set(after.values())) == 1
