"""`clover train --push-to-hub`: the heads uploaded to a Hub, and when the push fails, exit 2 with one `clover: error:`
line, the heads kept on disk.

Every run uses the real huggingface_hub client in a `clover` subprocess (HF_ENDPOINT / HF_HOME / HF_TOKEN in its
environment, as a user runs it) against a real HTTP server on loopback, never a mock:
  - tests/hub_upload_server.py, a small Hub-compatible server that accepts uploads (no package on PyPI provides
    one: olah is a read-only mirror, hf-local-hub only launches a separate Go binary that it does not ship). It
    keeps what the client sent, so the test checks the exact requests, the repo id, the visibility, the commit
    message and the uploaded bytes, then downloads the files back with hf_hub_download. It runs twice: with
    hf_xet installed (huggingface_hub's streamed upload, the server taking every file as a regular git blob) and
    with HF_HUB_DISABLE_XET=1 (create_commit, model.safetensors through the LFS batch API, as the Hub's default
    .gitattributes puts *.safetensors in LFS); the Xet protocol itself is not served;
  - nothing listening on the port: a connection error, which huggingface_hub raises as httpx's own error;
  - olah (the read-only Hub mirror tests/test_hub.py uses), which refuses the create-repo call with an HTTP error.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import build_model
from helpers import clover_command, free_port, olah_server
from hub_upload_server import HubUploadServer

CLOVER = clover_command()
REPO = "org/heads"
TOKEN = "hf_test_token"
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


def hub_env(endpoint: str, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING", "TRANSFORMERS_"))}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf-home"), HF_TOKEN=TOKEN,
               HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="2",
               COLUMNS="200", NO_COLOR="1", **extra)
    return env


@pytest.fixture()
def train(target, data_file, tmp_path):
    def run(endpoint: str, **extra_env: str) -> tuple[int, str, str, Path]:
        out = tmp_path / "h"
        env = hub_env(endpoint, tmp_path, **extra_env)
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


# ------------------------------------------------------------------------------------------- a successful push

DOWNLOAD = """
import sys
from huggingface_hub import hf_hub_download
for name in sys.argv[2:]:
    print(hf_hub_download(sys.argv[1], name))
"""


@pytest.mark.parametrize("lfs", [False, True], ids=["regular-files", "lfs-safetensors"])
def test_push_uploads_the_heads(train, tmp_path, lfs):
    extra = {"HF_HUB_DISABLE_XET": "1"} if lfs else {}
    with HubUploadServer(lfs_patterns=("*.safetensors",) if lfs else (), token=TOKEN) as hub:
        code, _, err, out = train(hub.url, **extra)
        assert code == 0, err
        assert "Traceback" not in err and "clover: error" not in err, err
        assert f"heads written to {out}" in err and f"pushed to {REPO}" in err, err
        assert hub.errors == [], hub.errors
        local = {name: (out / name).read_bytes() for name in PUSHED}

        # The calls huggingface_hub made, in order (besides the agent-harness registry it reads for its user
        # agent). README.md's metadata is checked first: once by upload_folder, and again by create_commit in
        # the LFS run (huggingface_hub 2.4), so how many times is left open.
        api = f"/api/models/{REPO}"
        validate = ("POST", "/api/validate-yaml")
        expected = [("POST", "/api/repos/create"), ("POST", f"{api}/preupload/main")]
        if lfs:
            oid = hashlib.sha256(local["model.safetensors"]).hexdigest()
            expected += [("POST", f"/{REPO}.git/info/lfs/objects/batch"),
                         ("PUT", f"/lfs-objects/{oid}"),
                         ("POST", f"/{REPO}.git/info/lfs/objects/verify")]
        expected += [("POST", f"{api}/commit/main")]
        calls = [(r, a) for r, a in zip(hub.requests, hub.auth) if r != ("GET", "/api/agent-harnesses")]
        assert [r for r, _ in calls if r != validate] == expected, calls
        first_preupload = [r for r, _ in calls].index(expected[1])
        assert validate in [r for r, _ in calls[1:first_preupload]], calls
        # Every call to the Hub carried the token; the LFS upload URL (S3 on the Hub) gets none.
        assert all(a == f"Bearer {TOKEN}" for r, a in calls if r[0] != "PUT"), calls
        assert all(a is None for r, a in calls if r[0] == "PUT"), calls

        # The repo clover asked for: org/heads, a model repo, no visibility given (the account's default).
        repo = hub.repos[REPO]
        assert repo.create_payload == {"name": "heads", "organization": "org"}
        assert list(hub.repos) == [REPO]
        assert {"content": local["README.md"].decode(), "repoType": "model"} in hub.validated_yaml

        # One commit on main, huggingface_hub's default message, exactly the three files, byte for byte.
        assert len(repo.commits) == 1
        commit = repo.commits[0]
        assert (commit.revision, commit.summary, commit.description) == (
            "main", "Upload folder using huggingface_hub", "")
        assert commit.files == local
        assert repo.files == local
        assert commit.lfs_paths == ({"model.safetensors"} if lfs else set())

        # Downloaded back from the same server with huggingface_hub, as a user would.
        p = subprocess.run([sys.executable, "-c", DOWNLOAD, REPO, *PUSHED], env=hub_env(hub.url, tmp_path),
                           capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert p.returncode == 0, p.stderr
        paths = p.stdout.split()
        assert len(paths) == len(PUSHED)
        for name, path in zip(PUSHED, paths):
            assert Path(path).name == name and Path(path).read_bytes() == local[name], name
        assert hub.errors == [], hub.errors
