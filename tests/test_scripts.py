"""The measurement scripts run (on a tiny shape on the CPU), so they work when a GPU session needs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_bench_dry_run_on_cpu():
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_bench.py"), "--shape", "tiny", "--device", "cpu",
                        "--repeats", "2", "--context", "32", "--new-tokens", "8"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert set(report["verify_vs_1"]) == {"1", "16", "32", "64", "128"}
    assert report["plain_ms_per_token"] > 0 and report["draft_ms"] > 0 and report["hf_ms_per_token"] > 0
    assert 0 < report["roofline_share"]


def test_verify_cost_compares_packed_and_stock_linears():
    from clover_cli import packed

    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "verify_cost.py"), "--rounds", "1", "--repeats", "2",
                        "--context", "32"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["packed_is_packed"] == packed.supported() and report["stock_is_packed"] is False
    assert set(report["packed_ms"]) == set(report["stock_ms"]) == {"1", "2", "4", "8", "16", "32"}
    assert all(v > 0 for v in report["packed_ms"].values())
