"""The measurement scripts run (on a tiny shape on the CPU), so they work when a GPU session needs them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # compiled builds, a server bench


def test_gpu_bench_dry_run_on_cpu():
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_bench.py"), "--shape", "tiny", "--device", "cpu",
                        "--repeats", "2", "--context", "32", "--new-tokens", "8"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert set(report["verify_vs_1"]) == {"1", "16", "32", "64", "128"}
    assert report["plain_ms_per_token"] > 0 and report["draft_ms"] > 0 and report["hf_ms_per_token"] > 0
    assert 0 < report["roofline_share"]
    # the static step (uncaptured on a CPU) and the heads' static calls ran beside the eager ones
    assert set(report["verify_vs_1_static"]) == set(report["verify_vs_1_eager"])
    assert report["draft_ms_static"] > 0 and report["catch_up_3_ms_static"] > 0
    assert report["bundled_outputs_identical_float32"] is True


def compare_heads(tmp_path, *options) -> dict:
    """scripts/compare_heads.py on the bundled model's heads, 2 prompts of 12 tokens, one thread: its JSON report."""
    out = tmp_path / "cmp.json"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_heads.py"),
                        str(ROOT / "clover_cli" / "bundled" / "tiny" / "heads"), "--limit", "2", "-n", "12",
                        "--threads", "1", *options, "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    return json.loads(out.read_text())


def test_compare_heads_on_one_tree_rule(tmp_path):
    report = compare_heads(tmp_path, "--tree", "eagle2", "--grow", "width=6,min_ratio=0.5", "--window", "none")
    assert report["tree"] == "eagle2" and report["window"] == "none"
    assert report["grow"] == {"topk": 10, "width": 6, "min_ratio": 0.5, "top_p": 1.0}  # --grow over --tree's rule
    (name,) = [m for m in report["methods"] if m != "plain"]
    row = report["methods"][name]
    assert row["identical_to_plain"] and row["all"]["prompts"] == 2 and row["all"]["tau"] > 1


def test_compare_heads_samples_at_a_temperature(tmp_path):
    """--temperature: each run samples (no identity with plain decoding to check); τ still counted."""
    report = compare_heads(tmp_path, "--temperature", "0.7", "--top-p", "0.9")
    assert report["temperature"] == 0.7 and report["top_p"] == 0.9
    (name,) = [m for m in report["methods"] if m != "plain"]
    row = report["methods"][name]
    assert row["identical_to_plain"] is None and row["all"]["prompts"] == 2 and row["all"]["tau"] >= 1


def test_verify_cost_compares_the_eager_and_compiled_steps(tmp_path, llama_dir):
    """On a small random model (the bundled one's compiled step takes minutes to build; the script is the same)."""
    from clover_cli import packed

    png = tmp_path / "cost.png"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "verify_cost.py"), "--rounds", "1", "--repeats", "2",
                        "--context", "32", "--model", str(llama_dir), "--plot", str(png),
                        "--settings", "auto,compiled"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "CLOVER_COMPILE_SIZES": ""})  # one program, for every size: quicker
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout[:p.stdout.rindex("}") + 1])
    assert report["model"] == str(llama_dir)
    assert report["auto_is_packed"] == packed.supported()
    assert report["compiled_is_compiled"] is True and report["auto_is_compiled"] is False
    sizes = {"1", "2", "3", "4", "6", "8", "12", "16", "24", "32", "48", "64"}
    assert set(report["auto_ms"]) == set(report["compiled_ms"]) == sizes
    assert set(report["compiled_speedup"]) == sizes  # against the eager step as clover runs it
    assert report["compiled_vs_1"]["1"] == 1.0 and report["compiled_weights"] == "float"
    assert all(v > 0 for v in report["compiled_ms"].values())
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_serve_bench_small_run():
    """scripts/serve_bench.py end to end on the bundled model, small: its report holds the identity and
    concurrency checks (not its timings, which belong to docs/BENCHMARKS.md)."""
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "serve_bench.py"), "--prompts", "1", "--repeats", "1",
                        "--max-tokens", "12", "--clients", "3", "--requests", "2", "--concurrent-max-tokens", "8",
                        "--rounds", "2", "--compile", "off", "--json"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    speed, many = report["speed"], report["concurrency"]
    assert speed["runs"] == 1 and speed["all_identical"] is True
    assert all(r["tokens"] > 0 and r["server_decode_tok_s"] > 0 for r in speed["rows"])
    assert [(r["requests"], r["errors"], r["complete"], r["identical_to_serial"]) for r in many["rounds"]] \
        == [(6, 0, 6, 6)] * 2
    assert len(many["rss_mib_after_serial_then_each_round"]) == 3


def test_draft_ablation_small_run(tmp_path):
    """scripts/draft_ablation.py on the bundled target and draft, one prompt, eager: every variant's row, each
    greedy output identical to plain decoding; the equal-length MCSD baseline verifies more nodes than its chain."""
    out = tmp_path / "ablation.json"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "draft_ablation.py"), "--draft-model",
                        str(ROOT / "clover_cli" / "bundled" / "tiny" / "draft"), "--limit", "1", "-n", "16",
                        "--tree-budget", "24", "--compile", "off", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    report = json.loads(out.read_text())
    rows = {r["variant"]: r for r in report["rows"]}
    assert len(rows) == 7 and report["prompts"] == 1 and report["step"].startswith("eager")
    assert all(r["identical_to_plain"] is True for r in rows.values())
    assert all(r["tau"] >= 1 and r["tokens_per_s"] > 0 for r in rows.values())
    mcsd, chain = rows["mcsd k=3, equal lengths (8 deep)"], rows["chain, 8 deep (--tree static)"]
    assert mcsd["nodes_per_step"] > chain["nodes_per_step"]


def test_ab_bench_alternates_the_first_side_and_pairs_rounds():
    """scripts/ab_bench.py: the side that runs first alternates (a fixed order read the machine's second-run bonus
    as a gain), and each method is summarised over the rounds both sides ran."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ab_bench", ROOT / "scripts" / "ab_bench.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    assert [ab.first_side(r)[0] for r in range(4)] == ["old", "new", "old", "new"]
    runs = [{"side": "old", "round": 0, "rows": {"plain": 100.0, "ngram": 200.0}},
            {"side": "new", "round": 0, "rows": {"plain": 110.0, "ngram": 190.0}},
            {"side": "new", "round": 1, "rows": {"plain": 130.0, "ngram": 210.0}},
            {"side": "old", "round": 1, "rows": {"plain": 100.0, "ngram": 200.0}},
            {"side": "old", "round": 2, "rows": {"plain": 999.0}}]  # a round new did not run: left out
    s = ab.summarize(runs)
    assert s["plain"] == {"old": 100.0, "new": 120.0, "ratio": 1.2, "paired_median": 1.2, "new_ahead": 2, "rounds": 2}
    assert s["ngram"]["ratio"] == 1.0 and s["ngram"]["new_ahead"] == 1
    assert ab.env_pairs(["CLOVER_KV16=0", "A=b=c", "EMPTY="]) == {"CLOVER_KV16": "0", "A": "b=c", "EMPTY": ""}
    for bad in ("CLOVER_KV16", "=1"):
        with pytest.raises(SystemExit, match="is not NAME=VALUE"):
            ab.env_pairs([bad])


@pytest.mark.parametrize("folder", ["clover_kernels", "kernels"])
def test_ab_bench_runs_each_checkouts_own_kernels(tmp_path, folder):
    """scripts/ab_bench.py: a side's clover_cli and clover_kernels both come from its own checkout, whether its
    kernels live in clover_kernels/ or, in a checkout from before the folder took its package's name, in kernels/
    (not importable as clover_kernels by PYTHONPATH alone: the installed clover's kernels answered instead, and both
    sides ran the same kernels)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ab_bench", ROOT / "scripts" / "ab_bench.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    checkout = tmp_path / "old"
    (checkout / "clover_cli").mkdir(parents=True)
    (checkout / folder).mkdir()
    (checkout / "clover_cli" / "__init__.py").write_text("")
    (checkout / folder / "__init__.py").write_text("")
    root = ab.import_root(checkout, tmp_path / "shims")
    assert ab.import_root(checkout, tmp_path / "shims") == root  # again: the same folder, links kept
    code = "import clover_cli, clover_kernels; print(clover_cli.__file__); print(clover_kernels.__file__)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/",
                       env={**os.environ, "PYTHONPATH": str(root)})
    assert p.returncode == 0, p.stderr
    cli, kernels = (Path(line).resolve() for line in p.stdout.split())
    assert cli == (checkout / "clover_cli" / "__init__.py").resolve()
    assert kernels == (checkout / folder / "__init__.py").resolve()


def test_attention_cost_prints_a_row_per_row_count():
    """scripts/attention_cost.py: one table row per row count, each with positive times for both KV dtypes and SDPA."""
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "attention_cost.py"), "--context", "40", "--rows", "1,3",
                        "--rounds", "2", "--repeats", "2", "--threads", "1"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    rows = [line.strip("| ").split(" | ") for line in p.stdout.splitlines()[3:]]
    assert [int(r[0]) for r in rows] == [1, 3]
    assert all(float(v) > 0 for r in rows for v in r[1:])


def test_linear_dtypes_prints_a_row_per_row_count():
    """scripts/linear_dtypes.py: what this CPU offers for bfloat16, then one table row per row count, each with a
    positive time and rate for both dtypes."""
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "linear_dtypes.py"), "--threads", "1"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("cpu capability ") and "mkldnn bf16" in lines[0]
    rows = [line.strip("| ").split(" | ") for line in lines[3:]]
    assert [int(r[0]) for r in rows] == [1, 16, 64, 256, 1024]
    assert all(float(v) > 0 for r in rows for v in r[1:])


def test_train_throughput_on_the_bundled_model():
    """scripts/train_throughput.py on the bundled model, small shapes: two feature-extraction rates and three heads
    steps, all positive."""
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_throughput.py"), "tiny", "--heads", "2",
                        "--layers", "1", "--draft-vocab", "0", "--len", "32", "--batch", "2", "--threads", "1"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    rates = [line.split(": ") for line in p.stdout.splitlines()]
    assert [k for k, _ in rates] == ["features"] * 2 + ["heads step"] * 3
    assert all(float(v.split()[0]) > 0 and v.endswith("tokens/s") for _, v in rates)


def test_weights_agreement_counts_identical_replies():
    """scripts/weights_agreement.py on the bundled model with --quantize int8 against its float32 weights: a report
    of the prompts compared (not how many agree: that is for docs/BENCHMARKS.md)."""
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "weights_agreement.py"), "tiny", "--weights", "int8",
                        "--limit", "2", "-n", "8"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["prompts"] == 2 and report["weights"].startswith("int8 (int8 x")
    assert report["against"].startswith("float") and 0 <= report["identical"] <= 2
    assert report["identical"] + len(report["parted"]) == 2


def test_weight_kernels_times_every_kernel():
    """scripts/weight_kernels.py, one layer, 1 and 2 rows: a row per kernel, each timed (the figures are for
    docs/BENCHMARKS.md)."""
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "weight_kernels.py"), "--layers", "1", "--rows", "1,2",
                        "--threads", "1"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    rows = [line for line in p.stdout.splitlines() if line.startswith("| ") and "kernel" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["float32", "bfloat16", "aten int8pack", "aten int4pack (g32)",
                                                      "clover Q4_1", "clover Q8_0"]
    assert all(len(r.split("|")) == 5 for r in rows)


def test_quant_kernel_ab_times_two_versions(tmp_path):
    """scripts/quant_kernel_ab.py with the working tree's kernel against a copy of it: both built, one row timed."""
    copy = tmp_path / "copy.cpp"
    copy.write_text((ROOT / "clover_kernels" / "quant_cpu.cpp").read_text())
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "quant_kernel_ab.py"), str(copy),
                        str(ROOT / "clover_kernels" / "quant_cpu.cpp"), "--rows", "1", "--rounds", "1", "--threads", "1",
                        "--act8", "b"],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert re.search(r"rows  1: A +[\d.]+  B +[\d.]+  B/A [\d.]+", p.stdout), p.stdout
    assert "int8 activations: b" in p.stdout
