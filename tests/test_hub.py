"""The Hub path, end to end, against a real Hub-compatible server (olah) on loopback serving local git mirrors.

The server mirrors these repositories, all built here:
  org/model    branch v1: tiny Llama (seed 1) + a pickled pytorch_model.bin that must never be downloaded;
               main (one commit later): a different tiny Llama (seed 2, one layer)
  org/heads    Clover-2 heads (random) for that target
  org/binonly  a tiny Llama with pickled weights only
  TinyLlama/TinyLlama-1.1B-Chat-v1.0   a tiny Llama under the name of the `tinyllama` alias
  lmsys/vicuna-7b-v1.5 + BinXiao/clover-2-vicuna-7b-v1.5     the `vicuna-7b` alias: a tiny Llama and heads in the
               Clover-2 authors' layout (model.safetensors, and a pickled copy that must not be fetched)
  lmsys/vicuna-7b-v1.3 + yuhuili/EAGLE-Vicuna-7B-v1.3 + FasterDecoding/medusa-vicuna-7b-v1.3   the
               `vicuna-7b-v1.3` alias: heads in EAGLE's and Medusa's layouts, pickled only (pytorch_model.bin,
               medusa_lm_head.pt: read tensors-only)
  double7/vicuna-68m   the Vicuna aliases' draft model: a one-layer Llama with the same tokenizer

`clover` runs as a subprocess with HF_ENDPOINT / HF_HOME in its environment (huggingface_hub reads them at import),
exactly as a user runs it. Commands that import torch cost ~5 s each, so there are only four of them.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import build_model
from helpers import clover_command, olah_server


CLOVER = clover_command()
PROMPT = "Hello! What is the capital of France?\n"
SAFE_SUFFIXES = {".json", ".safetensors", ".jinja", ".txt", ".md", ".model", ".tiktoken"}


def _git(repo: Path, *args: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t", GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def _commit(repo: Path, message: str) -> str:
    # Forget the index first: git trusts a file whose size, inode and mtime/ctime seconds match its index entry,
    # and a replaced file (same size, its inode reused, written in the same second) would keep the old content:
    # the "v2" commit then carried v1's config.json (a flaky failure of the tests below)
    if _git(repo, "ls-files"):
        _git(repo, "rm", "-q", "-r", "--cached", ".")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


def _replace_files(repo: Path, src: Path):
    for f in repo.iterdir():
        if f.name != ".git":
            shutil.rmtree(f) if f.is_dir() else f.unlink()
    for f in src.iterdir():
        shutil.copy2(f, repo / f.name)


def _make_heads(model_dir: Path, out: Path):
    from transformers import AutoModelForCausalLM

    from clover_cli.drafters.common import HeadsConfig

    from clover_cli.drafters.registry import build_heads, save_heads

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(3)
    heads = build_heads(HeadsConfig.for_target(model.config, num_heads=3, num_layers=1), model)
    heads.init_from_target(model)
    save_heads(heads, out, "test heads\n")
    return out


class Hub:
    def __init__(self, root: Path, url: str, refs: dict[str, Path], commits: dict[str, str]):
        self.root, self.url, self.refs, self.commits = root, url, refs, commits
        self.home = root / "hf-home"  # the HF cache every test below shares
        self.xdg = root / "xdg"

    def env(self, **extra) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING", "TRANSFORMERS_"))}
        env.update(HF_ENDPOINT=self.url, HF_HOME=str(self.home), XDG_CACHE_HOME=str(self.xdg),
                   HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="2",
                   COLUMNS="200", NO_COLOR="1")
        env.update(extra)
        return env

    def run(self, *args: str, **extra) -> tuple[int, str, str]:
        p = subprocess.run([*CLOVER, *args], env=self.env(**extra), capture_output=True, text=True, timeout=300,
                           stdin=subprocess.DEVNULL)
        return p.returncode, p.stdout, p.stderr

    def cache_files(self, repo: str) -> set[str]:
        folder = self.home / "hub" / ("models--" + repo.replace("/", "--")) / "snapshots"
        return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} if folder.is_dir() else set()


@pytest.fixture(scope="session")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    models = root / "mirrors" / "models"
    refs = {"v1": build_model(root / "ref-v1", "llama", seed=1),
            "v2": build_model(root / "ref-v2", "llama", seed=2, num_hidden_layers=1)}
    commits = {}

    repo = models / "org" / "model"
    repo.mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "main")
    _replace_files(repo, refs["v1"])
    torch.save({"bait": torch.zeros(4)}, repo / "pytorch_model.bin")  # must never be fetched
    commits["v1"] = _commit(repo, "v1")
    _git(repo, "branch", "v1")
    _replace_files(repo, refs["v2"])
    torch.save({"bait": torch.zeros(4)}, repo / "pytorch_model.bin")
    commits["v2"] = _commit(repo, "v2")
    assert _git(repo, "show", "v1:config.json") != _git(repo, "show", "main:config.json")

    heads = models / "org" / "heads"
    _make_heads(refs["v1"], heads)
    _git(heads, "init", "-q", "-b", "main")
    _commit(heads, "heads")

    binonly = models / "org" / "binonly"
    build_model(binonly, "llama", seed=1)
    from safetensors.torch import load_file

    torch.save(load_file(str(binonly / "model.safetensors")), binonly / "pytorch_model.bin")
    (binonly / "model.safetensors").unlink()
    _git(binonly, "init", "-q", "-b", "main")
    _commit(binonly, "pickled weights only")

    alias = models / "TinyLlama" / "TinyLlama-1.1B-Chat-v1.0"
    alias.mkdir(parents=True)
    _replace_files(alias, refs["v1"])
    _git(alias, "init", "-q", "-b", "main")
    _commit(alias, "tiny stand-in")

    from test_eagle import eagle_files
    from test_layouts import clover_authors_files, medusa_authors_files
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(refs["v1"])
    for model_repo, heads_repo, make in [
            ("lmsys/vicuna-7b-v1.5", "BinXiao/clover-2-vicuna-7b-v1.5",
             lambda out: clover_authors_files(out, target, num_heads=3, num_layers=1)),
            ("lmsys/vicuna-7b-v1.3", "FasterDecoding/medusa-vicuna-7b-v1.3",
             lambda out: medusa_authors_files(out, target)),
            ("lmsys/vicuna-7b-v1.3", "yuhuili/EAGLE-Vicuna-7B-v1.3", lambda out: eagle_files(out, target))]:
        repo = models / model_repo
        if not repo.exists():
            repo.mkdir(parents=True)
            _replace_files(repo, refs["v1"])
            _git(repo, "init", "-q", "-b", "main")
            _commit(repo, "tiny stand-in")
        repo = models / heads_repo
        make(repo)
        if (repo / "model.safetensors").is_file():  # a pickled copy beside it: never fetched
            from safetensors.torch import load_file

            torch.save(load_file(str(repo / "model.safetensors")), repo / "pytorch_model.bin")
        _git(repo, "init", "-q", "-b", "main")
        _commit(repo, "published heads stand-in")

    from conftest import small_draft

    draft = models / "double7" / "vicuna-68m"  # the Vicuna aliases' draft model: a one-layer stand-in
    small_draft(draft, refs["v1"])
    _git(draft, "init", "-q", "-b", "main")
    _commit(draft, "draft model stand-in")

    for url in olah_server(root, "org/model"):
        yield Hub(root, url, refs, commits)


@pytest.fixture(scope="session")
def prompt_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("prompt") / "prompt.txt"
    p.write_text(PROMPT)
    return p


@pytest.fixture(scope="session")
def local_text(prompt_file, hub):
    """What `clover generate` answers from the reference directories, in-process (the expected Hub results)."""
    from clover_cli.process import main

    def answer(ref: str) -> str:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as e:
            main(["generate", str(hub.refs[ref]), "-f", str(prompt_file), "--draft", "none", "--json",
                  "-n", "12", "--stats-file", "off"])
        assert e.value.code == 0
        return json.loads(buf.getvalue())["text"]

    return {ref: answer(ref) for ref in ("v1", "v2")}


@pytest.fixture(scope="session")
def downloaded(hub):
    """`clover download org/model` once; later tests rely on the cached copy."""
    return hub.run("download", "org/model")


def assert_one_line_error(code, out, err, *needles):
    assert code == 2, (code, out, err)
    assert out == ""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("clover: error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_download_fetches_only_safe_files(hub, downloaded):
    code, out, err = downloaded
    assert code == 0, err
    snap = hub.commits["v2"]
    assert out.strip() == f"org/model: {hub.home / 'hub' / 'models--org--model' / 'snapshots' / snap}"
    assert re.search(r"^source: the Hub \(org/model\), \d+ KiB on disk$", err, re.M), err
    files = hub.cache_files("org/model")
    names = {Path(f).name for f in files}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert all(Path(f).suffix in SAFE_SUFFIXES for f in files), files
    assert not [f for f in hub.cache_files("org/model") if f.endswith(".bin")], "pickled weights were downloaded"
    # The cache is the standard one: huggingface_hub finds the file there.
    config = json.loads((hub.home / "hub" / "models--org--model" / "snapshots" / snap / "config.json").read_text())
    assert config["num_hidden_layers"] == 1  # main is the v2 commit

    # A commit id as --revision gets that commit's snapshot.
    code, out, err = hub.run("download", "org/model", "--revision", hub.commits["v1"])
    assert code == 0, err
    assert out.strip().endswith(hub.commits["v1"])
    v1_config = Path(out.split(": ", 1)[1].strip()) / "config.json"
    assert json.loads(v1_config.read_text())["num_hidden_layers"] == 2
    assert not [f for f in hub.cache_files("org/model") if f.endswith(".bin")]


def test_generate_through_the_hub(hub, downloaded, prompt_file, local_text):
    code, out, err = hub.run("generate", "org/model", "-f", str(prompt_file), "--draft", "none", "--json",
                             "-n", "12")
    assert code == 0, err
    assert "Traceback" not in err
    assert len(out.splitlines()) == 1
    result = json.loads(out)
    assert result["model"] == "org/model" and result["draft"] == "none"
    assert result["new_tokens"] >= 1
    assert result["text"] == local_text["v2"]
    assert local_text["v1"] != local_text["v2"], "the two revisions must answer differently for this test"
    # The default stats stream went to the user cache directory (XDG_CACHE_HOME), not anywhere else.
    assert (hub.xdg / "clover" / "stats.jsonl").is_file()


def test_revision_and_heads_from_the_hub(hub, prompt_file, local_text):
    code, out, err = hub.run("generate", "org/model", "--revision", "v1", "--heads", "org/heads", "--draft",
                             "clover", "-f", str(prompt_file), "--json", "-n", "12", "--stats-file", "off")
    assert code == 0, err
    result = json.loads(out)
    assert result["draft"] == "clover"
    assert result["text"] == local_text["v1"]  # the v1 commit's weights (lossless greedy with any heads)
    heads = Path(result["heads"])
    assert heads.parent.parent.name == "models--org--heads"
    assert heads.is_relative_to(hub.home)
    assert {"config.json", "model.safetensors"} <= {p.name for p in heads.iterdir()}
    cached = hub.home / "hub" / "models--org--model" / "refs" / "v1"
    assert cached.read_text().strip() == hub.commits["v1"]


def test_unknown_repo_and_revision(hub):
    code, out, err = hub.run("download", "org/no-such-model")
    assert_one_line_error(code, out, err, "org/no-such-model", "not found")
    code, out, err = hub.run("download", "org/model", "--revision", "no-such-branch")
    assert_one_line_error(code, out, err, "org/model", "no-such-branch")
    code, out, err = hub.run("download", "org/model", "--heads", "org/no-such-heads")
    assert_one_line_error(code, out, err, "org/no-such-heads")
    assert not hub.cache_files("org/no-such-model")


def test_offline(hub, downloaded, prompt_file, local_text):
    assert downloaded[0] == 0
    code, out, err = hub.run("generate", "org/model", "-f", str(prompt_file), "--draft", "none", "--json",
                             "-n", "12", "--stats-file", "off", HF_HUB_OFFLINE="1",
                             HF_ENDPOINT="http://127.0.0.1:9")  # nothing listens there: offline must not ask
    assert code == 0, err
    assert json.loads(out)["text"] == local_text["v2"]
    code, out, err = hub.run("download", "org/never-downloaded", HF_HUB_OFFLINE="1")
    assert_one_line_error(code, out, err, "org/never-downloaded", "HF_HUB_OFFLINE")
    assert not hub.cache_files("org/never-downloaded")


def test_unreachable_hub(hub):
    code, out, err = hub.run("download", "org/model", "--revision", "v1", HF_ENDPOINT="http://127.0.0.1:9",
                             HF_HOME=str(hub.root / "empty-home"))
    assert_one_line_error(code, out, err, "org/model")


def test_pickled_weights_need_allow_pickle(hub, prompt_file):
    code, out, err = hub.run("download", "org/binonly")
    assert_one_line_error(code, out, err, "--allow-pickle")
    assert not [f for f in hub.cache_files("org/binonly") if f.endswith(".bin")]
    code, out, err = hub.run("generate", "org/binonly", "--allow-pickle", "-f", str(prompt_file), "--draft",
                             "none", "--json", "-n", "4", "--stats-file", "off")
    assert code == 0, err
    assert json.loads(out)["new_tokens"] >= 1
    assert {Path(f).name for f in hub.cache_files("org/binonly")} >= {"pytorch_model.bin", "config.json"}


def model_rows(out: str) -> dict[str, list[str]]:
    """`clover models` rows by alias: the row's words (the last one is the local-cache column)."""
    from clover_cli.aliases import ALIASES

    return {line.split()[0]: line.split() for line in out.splitlines() if line.split() and line.split()[0] in ALIASES}


def test_models_shows_cached(hub):
    code, out, err = hub.run("models")
    assert code == 0, err
    rows = model_rows(out)
    assert rows["tinyllama"][-1] == "-"
    code, out, err = hub.run("download", "tinyllama")
    assert code == 0, err
    code, out, err = hub.run("models")
    assert code == 0, err
    rows = model_rows(out)
    assert re.fullmatch(r"Hub cache, \d+ KiB", " ".join(rows["tinyllama"][-4:])), rows["tinyllama"]  # size on disk
    assert rows["vicuna-7b"][-1] == "-"


@pytest.mark.parametrize("alias,heads_repo,draft,flags", [
    ("vicuna-7b", "BinXiao/clover-2-vicuna-7b-v1.5", "clover+ngram", []),
    ("vicuna-7b-v1.3", "yuhuili/EAGLE-Vicuna-7B-v1.3", "eagle+ngram", []),
    ("vicuna-7b-v1.3", "FasterDecoding/medusa-vicuna-7b-v1.3", "medusa", ["--draft", "medusa"])])
def test_alias_downloads_the_published_heads(hub, prompt_file, local_text, alias, heads_repo, draft, flags):
    """`clover generate ALIAS` with no other flag fetches the target and the heads published for it (in their
    authors' layout: the first the alias lists, or the --draft's) and decodes losslessly with them; a pickled file
    is fetched only where nothing else exists."""
    code, out, err = hub.run("generate", alias, "-f", str(prompt_file), "--json", "-n", "12",
                             "--stats-file", "off", *flags)
    assert code == 0, err
    result = json.loads(out)
    assert result["draft"] == draft
    assert result["text"] == local_text["v1"]
    assert Path(result["heads"]).parent.parent.name == "models--" + heads_repo.replace("/", "--")
    names = {Path(f).name for f in hub.cache_files(heads_repo)}
    if draft.startswith("clover"):
        assert "model.safetensors" in names and "pytorch_model.bin" not in names
    else:
        assert names & {"medusa_lm_head.pt", "pytorch_model.bin"}


def test_download_fetches_the_alias_draft_model(hub, prompt_file, local_text):
    """`clover download ALIAS` fetches the alias's draft model too, which `--draft model` then uses with no
    --draft-model, offline, and exactly (the target's own greedy text)."""
    code, out, err = hub.run("download", "vicuna-7b")
    assert code == 0, err
    assert "draft model:" in out and "models--double7--vicuna-68m" in out
    names = {Path(f).name for f in hub.cache_files("double7/vicuna-68m")}
    assert {"config.json", "model.safetensors"} <= names
    code, out, err = hub.run("generate", "vicuna-7b", "--draft", "model", "-f", str(prompt_file), "--json",
                             "-n", "12", "--stats-file", "off", HF_HUB_OFFLINE="1",
                             HF_ENDPOINT="http://127.0.0.1:9")  # nothing listens there: all of it was fetched
    assert code == 0, err
    result = json.loads(out)
    assert result["draft"] == "model" and result["text"] == local_text["v1"]


def test_models_lists_every_published_drafter(hub):
    code, out, err = hub.run("models")
    assert code == 0, err
    text = " ".join(out.split())
    for shown in ("BinXiao/clover-2-vicuna-7b-v1.5 (Clover-2)", "yuhuili/EAGLE-Vicuna-7B-v1.3 (EAGLE), "
                  "FasterDecoding/medusa-vicuna-7b-v1.3 (Medusa)", "BinXiao/clover-2-llama-3-8b-instruct (Clover-2), "
                  "yuhuili/EAGLE-LLaMA3-Instruct-8B (EAGLE)"):
        assert shown in text, shown
