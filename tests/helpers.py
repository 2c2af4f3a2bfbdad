"""Test drafters and reference decoding shared by the engine tests, and the set-up several test files share."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from clover_cli.tree import DraftTree, TreeBuilder
from clover_cli.drafters.base import Drafter


class OracleDrafter(Drafter):
    """Proposes random trees that follow a known continuation with probability `p_right` per node.

    It knows `reference` (the target's own greedy continuation after `prompt_len` tokens), so accepted paths get
    long and the engine's commit, bonus and stop logic are exercised at every depth, with random siblings
    around the right path and random tree shapes.
    """

    name = "oracle"

    def __init__(self, reference: list[int], prompt_len: int, vocab: int, p_right: float, seed: int):
        self.reference, self.prompt_len, self.vocab, self.p_right = reference, prompt_len, vocab, p_right
        self.rng = random.Random(seed)

    def reset(self, length):
        pass

    def observe(self, hidden, next_tokens):
        pass

    def propose(self, context, budget):
        builder = TreeBuilder(context[-1])
        start = len(context) - self.prompt_len  # index in reference of the token after the root
        right = {0: True}
        n = self.rng.randint(0, budget)
        for _ in range(n):
            parent = self.rng.randrange(len(builder.tokens))
            depth = 0
            p = parent
            while p:
                depth += 1
                p = builder.parents[p]
            taken = {builder.tokens[c] for c in range(1, len(builder.tokens)) if builder.parents[c] == parent}
            idx = start + depth
            if right[parent] and idx < len(self.reference) and self.rng.random() < self.p_right:
                tok = self.reference[idx]
            else:
                tok = self.rng.randrange(self.vocab)
            if tok in taken:
                continue
            node = builder.add(parent, tok, builder.scores[parent] * 0.9)
            right[node] = right[parent] and idx < len(self.reference) and tok == self.reference[idx]
        return DraftTree(builder.tokens, builder.parents, builder.scores)


def hf_greedy(model, prompt: list[int], n: int, eos=None) -> list[int]:
    """transformers' own greedy generate: the reference every speculative run must equal.

    Without `eos` no token stops generation (the model's default EOS is switched off, rather than suppressed
    with min_new_tokens, which would change the greedy choice). The attention mask is given explicitly: left to
    itself, transformers would mask prompt tokens that happen to equal the pad id. A model whose clover cache holds
    float16 keys and values (kv_dtype) generates with its cache rounded the same way (target.Float16KV).
    """
    from clover_cli.target import generate_cache

    cache = generate_cache(model)
    # transformers fills every unset generation option from the model's own generation config, so the model's
    # EOS is switched off there for the call.
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos
    try:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=eos, pad_token_id=0, **cache)
    finally:
        model.generation_config.eos_token_id = saved
    return out[0, len(prompt):].tolist()


def run_engine(engine, prompt, stop, sampling=None):
    from clover_cli.decode.verify import Sampling

    out, events = [], []
    for ev in engine.generate(prompt, stop, sampling or Sampling()):
        out += ev.tokens
        events.append(ev)
    return out, events


# ------------------------------------------------------------------------------------ processes and servers

def console_script(name: str) -> list[str]:
    """A console script of this environment (next to the interpreter), else on PATH."""
    import shutil
    import sys
    from pathlib import Path

    here = Path(sys.executable).with_name(name)
    found = str(here) if here.is_file() else shutil.which(name)
    assert found, f"{name} is not installed: pip install -e '.[test]'"
    return [found]


def clover_command() -> list[str]:
    """The installed `clover` script, else `python -m clover_cli`."""
    import sys
    from pathlib import Path

    here = Path(sys.executable).with_name("clover")
    return [str(here)] if here.is_file() else [sys.executable, "-m", "clover_cli"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def olah_server(root, probe_repo: str):
    """Run olah (a Hub-compatible mirror server) on loopback, serving the git repos under root/mirrors.

    A generator for a fixture: yields the endpoint URL once any HTTP answer comes back for probe_repo.
    """
    import subprocess
    import time
    import urllib.error
    import urllib.request

    for d in ("repos", "mirrors", "logs"):
        (root / d).mkdir(parents=True, exist_ok=True)
    port = free_port()
    cfg = root / "olah.toml"
    cfg.write_text(f'[basic]\nhost = "127.0.0.1"\nport = {port}\nrepos-path = "{root / "repos"}"\n'
                   f'mirrors-path = ["{root / "mirrors"}"]\n[accessibility]\noffline = true\n')
    url = f"http://127.0.0.1:{port}"
    with open(root / "olah.out", "wb") as log:
        proc = subprocess.Popen([*console_script("olah-cli"), "-c", str(cfg), "--log-path", str(root / "logs")],
                                cwd=root, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    urllib.request.urlopen(f"{url}/api/models/{probe_repo}/revision/main", timeout=2).close()
                    break
                except urllib.error.HTTPError:
                    break  # any HTTP answer: the server is up
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("olah did not start:\n" + (root / "olah.out").read_text(errors="replace"))
                    time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def check_trained_heads_cli(run_cli, model_dir, heads, prompt, family: str, n: int, other: tuple[str, str],
                            wrong_size_heads):
    """What a user does with heads `clover train --arch FAMILY` wrote: `clover generate` with --draft none, FAMILY
    and auto gives the same text (auto merges n-gram lookup); asking for another family's drafter with them
    (`other`: that --draft and the words its error must say), heads of another hidden size (`wrong_size_heads`,
    32 wide) and --draft FAMILY without heads each fail in one line."""
    import json

    runs = {}
    for draft in ("none", family, "auto"):
        code, stdout, err = run_cli("generate", str(model_dir), "-f", str(prompt), "--heads", str(heads),
                                    "--draft", draft, "--json", "-n", str(n), "--stats-file", "off")
        assert code == 0, err
        runs[draft] = json.loads(stdout)
    assert runs[family]["text"] == runs["auto"]["text"] == runs["none"]["text"]
    assert runs[family]["draft"] == family and runs["auto"]["draft"] == f"{family}+ngram"

    def one_line(args, needle):
        code, _, err = run_cli(*args)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err

    gen = ("generate", str(model_dir), "-f", str(prompt), "-n", "4", "--stats-file", "off")
    one_line((*gen, "--heads", str(heads), "--draft", other[0]), other[1])
    one_line((*gen, "--heads", str(wrong_size_heads), "--draft", family), "hidden size 32")
    one_line((*gen, "--draft", family), f"no {family} heads")


def offline(tmp_path: Path, monkeypatch) -> Path:
    """Stats and caches under tmp_path/xdg, no CLOVER_STATS_FILE, the Hub offline with an empty cache under
    tmp_path/hf-cache (no test may touch the network). Returns tmp_path."""
    import huggingface_hub.constants as hf_constants

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("CLOVER_STATS_FILE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    return tmp_path


def save_small_heads(model_dir: Path, out: Path, card: str) -> Path:
    """Untrained Clover-2 heads (2 heads, 1 layer) for the model in `model_dir`, saved to `out` with model card
    `card`."""
    from transformers import AutoModelForCausalLM

    from clover_cli.drafters.common import HeadsConfig
    from clover_cli.drafters.registry import build_heads, save_heads

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    save_heads(build_heads(HeadsConfig.for_target(model.config, num_heads=2, num_layers=1), model), out, card)
    return out


def chats_file(tmp_path_factory, conversations: list) -> Path:
    """`conversations` written as training data (a JSON list) in a fresh directory."""
    p = tmp_path_factory.mktemp("data") / "chats.json"
    p.write_text(json.dumps(conversations))
    return p


def train_in_process(model_dir: Path, data: Path, out: Path, *args: str) -> Path:
    """`clover train` of `model_dir` on `data` into `out`, in process, with `args`; it must exit 0. Returns out."""
    from clover_cli.process import main

    with pytest.raises(SystemExit) as e:
        main(["train", str(model_dir), "--data", str(data), "--out", str(out), *args])
    assert e.value.code == 0
    return out
