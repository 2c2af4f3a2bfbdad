"""`clover train --push-to-hub` when the push fails: exit 2, one `clover: error:` line, the heads kept on disk.

Both runs use the real huggingface_hub client in a `clover` subprocess (HF_ENDPOINT / HF_HOME in its environment,
as a user runs it) against a real endpoint on loopback, never a mock:
  - nothing listening on the port: a connection error, which huggingface_hub raises as httpx's own error;
  - olah (the read-only Hub mirror tests/test_hub.py uses), which refuses the create-repo call with an HTTP error.

A successful push is not tested here: no package on PyPI provides a local Hub-compatible server that accepts
uploads (hf-local-hub only launches a separate Go binary that it does not ship).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import build_model
from helpers import clover_command, free_port, olah_server

CLOVER = clover_command()
REPO = "org/heads"
PUSHED = ("config.json", "model.safetensors", "README.md")

# These ids put none in the held-out split, so the evaluation at the last step generates nothing (with one
# held-out conversation, each run takes twice as long).
CONVERSATIONS = [
    {"id": f"p{i}", "conversations": [
        {"from": "human", "value": f"What comes after {i}?"},
        {"from": "gpt", "value": f"After {i} comes {i + 1}, and before it comes {i - 1}."},
    ]}
    for i in range(20)
]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("push-target"), "llama", seed=5)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("push-data") / "chats.json"
    p.write_text(json.dumps(CONVERSATIONS))
    return p


@pytest.fixture()
def train(target, data_file, tmp_path):
    def run(endpoint: str) -> tuple[int, str, str, Path]:
        out = tmp_path / "h"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING", "TRANSFORMERS_"))}
        env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf-home"), HF_TOKEN="hf_test_token",
                   HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="2",
                   COLUMNS="200", NO_COLOR="1")
        p = subprocess.run([*CLOVER, "train", str(target), "--data", str(data_file), "--max-steps", "2",
                            "--out", str(out), "--heads", "2", "--layers", "1", "--batch-tokens", "2048",
                            "--max-len", "384", "--push-to-hub", REPO],
                           env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        return p.returncode, p.stdout, p.stderr, out

    return run


def assert_push_failed(code: int, err: str, out: Path, *needles: str):
    assert code == 2, (code, err)
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("clover: error: ")]
    assert len(errors) == 1 and err.rstrip("\n").endswith(errors[0]), err
    line = errors[0]
    assert line.startswith(f"clover: error: could not push to {REPO}: "), line
    assert line.endswith(f"(the heads are saved in {out})"), line
    for n in needles:
        assert n in line, (n, line)
    # The heads are complete and usable on disk all the same.
    assert f"heads written to {out}" in err
    for name in PUSHED:
        assert (out / name).is_file(), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architecture"] == "clover2" and cfg["num_heads"] == 2 and cfg["training"]["steps"] == 2


def test_push_to_unreachable_hub(train):
    code, _, err, out = train(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    assert_push_failed(code, err, out, "Connection refused")


@pytest.fixture()
def read_only_hub(tmp_path):
    """olah, serving no repositories, offline: a real Hub-compatible server without the write API."""
    yield from olah_server(tmp_path / "olah", REPO)


def test_push_refused_by_the_hub(train, read_only_hub):
    code, _, err, out = train(read_only_hub)
    assert_push_failed(code, err, out, "405", "/api/repos/create")
