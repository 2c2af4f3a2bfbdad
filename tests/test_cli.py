"""The `clover` command line: its commands, `generate --json` on a local directory, and every bad input of the
foundation issue: one line on stderr starting with `clover: error:`, exit code 2, no traceback, nothing on stdout,
no stats record. Runs in-process (see conftest.run_cli); the Hub path is in test_hub.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import build_model, tiny_config
from helpers import offline

COMMANDS = ["models", "download", "list", "rm", "ps", "generate", "chat", "serve", "stats", "train", "bench", "compile"]
JSON_KEYS = {"text", "new_tokens", "steps", "tau", "tokens_per_s", "elapsed_s", "model", "draft"}


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Stats go to a private cache dir; the Hub is offline with an empty cache (no test may touch the network)."""
    return offline(tmp_path, monkeypatch)


def stats_file(tmp_path):
    return tmp_path / "xdg" / "clover" / "stats.jsonl"


@pytest.fixture(scope="session")
def prompt_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("prompts") / "hello.txt"
    p.write_text("Hello! What is the capital of France?\n")
    return p


@pytest.fixture(scope="session")
def short_context_dir(tmp_path_factory):
    """A tiny Llama whose context (64 positions) is shorter than a chat-templated prompt."""
    return build_model(tmp_path_factory.mktemp("short"), "llama", seed=4, max_position_embeddings=64)


def _heads_for(out, **over):
    """Clover-2 heads saved for a tiny Llama built from `over` (a different target than llama_dir's)."""
    from transformers import AutoModelForCausalLM

    from clover_cli.drafters.common import HeadsConfig

    from clover_cli.drafters.registry import build_heads, save_heads

    cfg = tiny_config("llama", over.pop("vocab_size", 320), **over)
    model = AutoModelForCausalLM.from_config(cfg)
    save_heads(build_heads(HeadsConfig.for_target(cfg, num_heads=2, num_layers=1), model), out, "test\n")
    return out


@pytest.fixture(scope="session")
def foreign_heads(tmp_path_factory, llama_dir):
    vocab = json.loads((llama_dir / "config.json").read_text())["vocab_size"]
    root = tmp_path_factory.mktemp("foreign-heads")
    return {"hidden": _heads_for(root / "hidden", vocab_size=vocab, hidden_size=32, intermediate_size=64),
            "vocab": _heads_for(root / "vocab", vocab_size=vocab + 64)}


def assert_one_line_error(result, *needles, tmp=None):
    code, out, err = result
    assert code == 2, result
    assert out == "", "stdout must stay empty on an error"
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("clover: error: "), err
    for n in needles:
        assert n.lower() in lines[0].lower(), (n, lines[0])
    if tmp is not None:
        assert not stats_file(tmp).exists(), "a failed run must not create or append to the stats stream"
    return lines[0]


def gen(run_cli, model, prompt, *extra, stdin=None):
    return run_cli("generate", str(model), "-f", str(prompt), *extra, stdin=stdin)


# --- commands and the happy path ------------------------------------------------------------------------------


def test_help_lists_exactly_the_commands(run_cli):
    code, out, err = run_cli("--help")
    assert code == 0 and err == ""
    section = out.split("Commands", 1)[1]
    listed = re.findall(r"^\W*│ (\w+)\s{2,}", section, flags=re.M) or re.findall(r"^\s{2}(\w+)\s{2,}", section,
                                                                                  flags=re.M)
    assert listed == COMMANDS
    from typer.main import get_command

    from clover_cli.cli import app

    assert sorted(get_command(app).commands) == sorted(COMMANDS)


@pytest.mark.parametrize("words, cword, expected", [
    ("clover s", 1, ["serve", "stats"]), ("clover generate --draft e", 3, ["eagle", "eagle3"]),
    ("clover chat --compile ", 3, ["auto", "on", "off"]), ("clover serve --thr", 2, ["--threads"]),
])
def test_shell_completion_lists_commands_flags_and_choices(words, cword, expected, tmp_path):
    """What bash asks of `clover` when Tab is pressed (the script --install-completion installs sets these)."""
    env = {**os.environ, "_CLOVER_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(cword)}
    done = subprocess.run([sys.executable, "-m", "clover_cli"], env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.split() == expected, done


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_help_shows_the_choices(run_cli, command, monkeypatch):
    """Options with a fixed set of values show it in --help as typer shows a choice type, each value one that the
    option takes (checked before anything loads: test_bad_drafting_options and below); --draft, whose list is too
    wide for the column, names its values in its help."""
    from clover_cli.families import drafts
    from clover_cli.loading import pick_device, pick_dtype
    from clover_cli.options import Options, check_options, compile_mode

    monkeypatch.setenv("COLUMNS", "250")
    code, out, err = run_cli(command, "--help")
    assert code == 0, err
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\W*(--[\w-]+)(?:,--[\w-]+)?\s+(?:-\w\s+)?(<\S+>)", out,
                                                         flags=re.M)}
    shown = {flag: rows[flag][1:-1].split("|") for flag in ("--tree", "--early-stop", "--device", "--dtype",
                                                             "--compile", "--quantize")}
    assert shown == {"--tree": ["dynamic", "static"], "--early-stop": ["fixed", "learned"],
                     "--device": ["auto", "cpu", "cuda", "cuda:N"],
                     "--dtype": ["auto", "float32", "float16", "bfloat16"], "--compile": ["auto", "on", "off"],
                     "--quantize": ["int8", "int4"]}
    DRAFTS = drafts()
    assert rows["--draft"] == "<drafter>" and f"{', '.join(DRAFTS[:-1])} or {DRAFTS[-1]}" in " ".join(
        re.sub(r"[│|]", " ", out).split())
    for value in shown["--tree"]:
        check_options(Options(tree=value))
    for value in shown["--early-stop"]:
        check_options(Options(early_stop=value, tree="dynamic"))
    for value in shown["--quantize"]:
        check_options(Options(quantize=value))
    for value in DRAFTS:
        check_options(Options(draft=value))
    assert [compile_mode(value) for value in shown["--compile"]] == shown["--compile"]
    assert pick_device("cpu").type == "cpu" and pick_device("auto").type in ("cpu", "cuda")
    for value in shown["--dtype"]:
        pick_dtype(value, pick_device("cpu"))


def test_generate_json_on_cpu(run_cli, llama_dir, prompt_path, isolated):
    code, out, err = gen(run_cli, llama_dir, prompt_path, "--draft", "none", "--json", "-n", "8")
    assert code == 0, err
    assert err == "", "--json runs keep stderr quiet"
    assert len(out.splitlines()) == 1
    result = json.loads(out)
    assert JSON_KEYS <= set(result)
    assert 1 <= result["new_tokens"] <= 8
    assert result["steps"] == result["new_tokens"] - 1  # plain decoding: one forward per token after prefill
    assert result["tau"] == pytest.approx(1.0) or result["steps"] == 0
    assert result["model"] == str(llama_dir) and result["draft"] == "none"
    assert result["device"] == "cpu" and result["dtype"] == "float32"
    assert isinstance(result["text"], str)
    assert result["elapsed_s"] > 0 and result["tokens_per_s"] >= 0
    records = [json.loads(line) for line in stats_file(isolated).read_text().splitlines()]
    assert records, "generate appends to the stats stream"

    # -f - reads the same prompt from standard input: same greedy reply.
    code, out2, err = gen(run_cli, llama_dir, "-", "--draft", "none", "--json", "-n", "8",
                          stdin=prompt_path.read_text())
    assert code == 0, err
    assert json.loads(out2)["text"] == result["text"]


def test_flags_as_llama_cpp_users_type_them(run_cli, llama_dir, prompt_path, isolated):
    """-t is threads (llama.cpp's), --temp the temperature, -c the context cap; --top-k 1 and --min-p near 1 sample
    the greedy reply where plain sampling at that temperature does not."""
    import torch

    before = torch.get_num_threads()
    try:
        code, out, err = gen(run_cli, llama_dir, prompt_path, "--json", "-n", "12", "-t", "1", "-c", "200")
        assert code == 0, err
        result = json.loads(out)
        assert result["threads"] == 1 and torch.get_num_threads() == 1
        assert result["context"] == 200
    finally:
        torch.set_num_threads(before)
    greedy = result["text"]

    def sampled(*args):
        code, out, err = gen(run_cli, llama_dir, prompt_path, "--json", "-n", "12", "--temp", "2", "--seed", "4",
                             *args)
        assert code == 0, err
        return json.loads(out)["text"]

    assert sampled() != greedy
    assert sampled("--top-k", "1") == greedy
    assert sampled("--min-p", "0.999") == greedy
    code, out, err = gen(run_cli, llama_dir, prompt_path, "-c", "100")  # the prompt: 151 tokens
    assert code == 2 and out == "" and err.count("\n") == 1 and "context (100)" in err, err


def test_prompt_as_text_or_file(run_cli, llama_dir, prompt_path, isolated, tmp_path, monkeypatch):
    """-p takes the prompt's text (llama-cli's -p, `ollama run MODEL TEXT`), -f a file: the same prompt gives the
    same reply either way. A -p text that names a file is the text, never the file (a note says how to read it);
    -p and -f exclude each other, one of them is needed, and -p - is refused (-f - reads standard input)."""
    args = ("--draft", "none", "--json", "-n", "8")
    code, out, err = gen(run_cli, llama_dir, prompt_path, *args)
    assert code == 0, err
    from_file = json.loads(out)
    text = prompt_path.read_text().removesuffix("\n")
    code, out, err = run_cli("generate", str(llama_dir), "-p", text, *args)
    assert code == 0 and err == "", err
    from_text = json.loads(out)
    assert from_text["text"] == from_file["text"] and from_text["prompt_tokens"] == from_file["prompt_tokens"]
    code, out, err = run_cli("generate", str(llama_dir), "--prompt", text, *args)
    assert code == 0 and json.loads(out)["text"] == from_file["text"], err

    # a file named like the text: the text is the prompt (its few tokens), the file is not read
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("x " * 400)
    code, out, err = run_cli("generate", str(llama_dir), "-p", "notes.txt", *args)
    assert code == 0, err
    assert json.loads(out)["prompt_tokens"] < from_file["prompt_tokens"] < 400
    assert err.strip() == "clover: note: -p/--prompt takes the prompt's text; to read the file of that name give " \
                          "-f notes.txt", err

    stats_file(isolated).unlink()  # the runs above wrote it; the refused ones below must not
    both = run_cli("generate", str(llama_dir), "-p", text, "-f", str(prompt_path), *args)
    assert_one_line_error(both, "exclude each other", tmp=isolated)
    assert_one_line_error(run_cli("generate", str(llama_dir), *args), "-p TEXT or -f FILE", tmp=isolated)
    assert_one_line_error(run_cli("generate", str(llama_dir), "-p", "-", *args), "-f -", tmp=isolated)
    assert_one_line_error(run_cli("generate", str(llama_dir), "-p", "  \n", *args), "empty", tmp=isolated)
    assert_one_line_error(run_cli("generate", str(llama_dir), "-p", "caf\udce9", *args), "not UTF-8",
                          tmp=isolated)  # a Latin-1 byte in argv, as Python decodes it


def test_chat_threads(run_cli, llama_dir, isolated):
    """chat -t N sets torch's threads too (generate's -t: test_flags_as_llama_cpp_users_type_them)."""
    before = torch.get_num_threads()
    want = 3 if before != 3 else 2
    try:
        code, out, err = run_cli("chat", str(llama_dir), "-t", str(want), "-n", "2", "--draft", "none",
                                 "--stats-file", "off", stdin="Hello\n")
        assert code == 0, err
        assert torch.get_num_threads() == want
    finally:
        torch.set_num_threads(before)


def test_chat_template_by_name_or_file(run_cli, llama_dir, prompt_path, tmp_path, isolated):
    """--chat-template NAME|FILE replaces the model's template: the prompt is what that template renders."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    text = prompt_path.read_text().removesuffix("\n")
    template = tmp_path / "brackets.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}{% if add_generation_prompt %}>"
                        "{% endif %}")
    counts = {}
    for choice in (None, "chatml", str(template)):
        code, out, err = gen(run_cli, llama_dir, prompt_path, "--json", "-n", "2", "--draft", "none",
                             "--stats-file", "off", *(["--chat-template", choice] if choice else []))
        assert code == 0, err
        counts[choice] = json.loads(out)["prompt_tokens"]
    assert counts[str(template)] == len(tok(f"[{text}]>", add_special_tokens=False)["input_ids"])
    assert len(set(counts.values())) == 3, counts
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    for choice, needle in (("alpaca", "must be one of"), (str(bad), "not a Jinja template")):
        assert_one_line_error(gen(run_cli, llama_dir, prompt_path, "--chat-template", choice), needle, tmp=isolated)


def test_generate_with_a_repetition_penalty_is_transformers_output(run_cli, llama_dir, prompt_path, isolated):
    """--repetition-penalty: the reply is transformers' greedy generate with the same penalty on the same ids (and
    --json says the penalty); without the option, generate applies none."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from clover_cli.session import Options, Session

    session = Session(Options(model=str(llama_dir), draft="none", compile="off"), quiet=True)
    ids = session.encode_chat([{"role": "user", "content": prompt_path.read_text().rstrip("\n")}])
    model = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    tok = AutoTokenizer.from_pretrained(llama_dir)

    def hf(penalty):
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=24, do_sample=False, repetition_penalty=penalty, pad_token_id=0)
        new = out[0, len(ids):].tolist()
        eos = [i for i, t in enumerate(new) if t == tok.eos_token_id]
        return tok.decode(new[:eos[0]] if eos else new, skip_special_tokens=True)

    replies = {}
    for args, penalty in (([], 1.0), (["--repetition-penalty", "1.8"], 1.8)):
        code, out, err = gen(run_cli, llama_dir, prompt_path, "--draft", "ngram", "--json", "-n", "24", *args)
        assert code == 0, err
        result = json.loads(out)
        assert result["repetition_penalty"] == penalty
        assert result["text"].strip() == hf(penalty).strip()
        replies[penalty] = result["text"]
    assert replies[1.0] != replies[1.8]  # the penalty changed the reply: the comparison above means something


def test_an_alias_default_penalty_applies_unless_one_is_asked(run_cli, prompt_path, monkeypatch):
    """An alias's own repetition penalty (smollm2's 1.1, chosen by measuring its replies) is what generate and chat
    use when none is given; --repetition-penalty (1 too) overrides it."""
    import dataclasses

    from clover_cli import aliases

    monkeypatch.setitem(aliases.ALIASES, "tiny", dataclasses.replace(aliases.ALIASES["tiny"], repetition_penalty=1.4))
    runs = {}
    for args in ([], ["--repetition-penalty", "1.4"], ["--repetition-penalty", "1"]):
        code, out, err = run_cli("generate", "tiny", "-f", str(prompt_path), "--json", "-n", "24", *args)
        assert code == 0, err
        result = json.loads(out)
        runs[tuple(args)] = (result["repetition_penalty"], result["text"])
    assert runs[()] == runs[("--repetition-penalty", "1.4")] and runs[()][0] == 1.4
    assert runs[("--repetition-penalty", "1")][0] == 1.0 and runs[("--repetition-penalty", "1")][1] != runs[()][1]
    code, out, err = run_cli("chat", "tiny", "-n", "8", stdin="hi\n")
    assert code == 0 and "repetition penalty 1.4" in err + out, err + out  # the banner says it


def test_generate_8bit_on_cpu(run_cli, llama_dir, prompt_path):
    """bitsandbytes 0.50 quantizes and runs int8 matmuls on CPU (accelerate places the model)."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("accelerate")
    code, out, err = gen(run_cli, llama_dir, prompt_path, "--load-in-8bit", "--draft", "none", "--json", "-n", "6",
                         "--stats-file", "off")
    assert code == 0, err
    assert err == "", "bitsandbytes' per-matmul warnings must not reach the terminal"
    result = json.loads(out)
    assert result["new_tokens"] >= 1  # int8 changes numerics: no comparison with the fp32 reply


# --- bad prompt files -----------------------------------------------------------------------------------------


def test_streamed_text_stops_where_the_json_text_does(run_cli, llama_dir, prompt_path, monkeypatch):
    """Streaming holds back a stop string (e.g. "USER:") instead of printing it: pick a piece from the middle of
    the greedy reply as the stop string, and the streamed text must end exactly where --json's text ends."""
    from clover_cli import templates

    code, out, err = gen(run_cli, llama_dir, prompt_path, "--draft", "none", "--json", "-n", "24")
    full = json.loads(out)["text"]
    assert code == 0 and len(full.strip()) > 8, full
    start = len(full) // 2
    stop = full[start:start + 3]
    monkeypatch.setitem(templates.STOP_STRINGS, "tokenizer", [stop])
    code, out, err = gen(run_cli, llama_dir, prompt_path, "--draft", "none", "--json", "-n", "24")
    cut = json.loads(out)["text"]
    assert code == 0 and cut == full[:full.index(stop)]
    code, out, err = gen(run_cli, llama_dir, prompt_path, "--draft", "none", "--no-color", "-n", "24")
    assert code == 0, err
    assert stop not in out
    assert out.rstrip("\n") == cut.lstrip(), (out, cut)


@pytest.mark.parametrize("content, needle", [
    (None, "not found"),
    (b"", "empty"),
    (b"  \n\t\n", "empty"),
    (b"hello\x00world", "binary"),
    (b"caf\xe9 au lait", "UTF-8"),
    ("dir", "directory"),
], ids=["missing", "empty", "blank", "binary", "not-utf8", "directory"])
def test_bad_prompt_file(run_cli, llama_dir, tmp_path, isolated, content, needle):
    p = tmp_path / "prompt.txt"
    if content == "dir":
        p.mkdir()
    elif content is not None:
        p.write_bytes(content)
    assert_one_line_error(gen(run_cli, llama_dir, p, "--draft", "none"), needle, tmp=isolated)


def test_bad_prompt_on_stdin(run_cli, llama_dir, isolated):
    assert_one_line_error(gen(run_cli, llama_dir, "-", "--draft", "none", stdin=""), "standard input", "empty",
                          tmp=isolated)


# --- bad model names ------------------------------------------------------------------------------------------


def test_unknown_alias_or_name(run_cli, prompt_path, tmp_path, isolated):
    assert_one_line_error(gen(run_cli, "no-such-model", prompt_path), "unknown model", "no-such-model",
                          tmp=isolated)
    assert_one_line_error(gen(run_cli, "./no/such/dir/here", prompt_path), "no/such/dir/here", tmp=isolated)
    assert_one_line_error(gen(run_cli, prompt_path, prompt_path), "not a model directory", tmp=isolated)
    empty = tmp_path / "empty-model"
    empty.mkdir()
    assert_one_line_error(gen(run_cli, empty, prompt_path), "config.json", tmp=isolated)
    assert_one_line_error(run_cli("download", "no-such-model"), "unknown model", tmp=isolated)


def test_offline_without_cached_copy(run_cli, prompt_path, isolated):
    """HF_HUB_OFFLINE=1 and a repo id never downloaded (the HF cache is an empty tmp dir)."""
    assert_one_line_error(gen(run_cli, "some-org/never-cached", prompt_path), "some-org/never-cached",
                          "HF_HUB_OFFLINE", tmp=isolated)
    assert_one_line_error(run_cli("download", "some-org/never-cached"), "HF_HUB_OFFLINE", tmp=isolated)
    assert_one_line_error(gen(run_cli, "vicuna-7b", prompt_path), "lmsys/vicuna-7b-v1.5", "HF_HUB_OFFLINE",
                          tmp=isolated)
    assert not list((isolated / "hf-cache").rglob("*.safetensors"))


# --- bad heads and drafters -----------------------------------------------------------------------------------


def test_heads_dir_missing(run_cli, llama_dir, prompt_path, tmp_path, isolated):
    missing = tmp_path / "no-such-heads"
    assert_one_line_error(gen(run_cli, llama_dir, prompt_path, "--draft", "clover", "--heads", str(missing)),
                          "heads", "not found", tmp=isolated)
    not_heads = tmp_path / "not-heads"
    not_heads.mkdir()
    assert_one_line_error(gen(run_cli, llama_dir, prompt_path, "--heads", str(not_heads)), "not a heads",
                          tmp=isolated)


@pytest.mark.parametrize("which, needle", [("hidden", "hidden size"), ("vocab", "vocabulary")])
def test_heads_for_another_target(run_cli, llama_dir, prompt_path, foreign_heads, isolated, which, needle):
    for draft in ("clover", "auto"):
        assert_one_line_error(gen(run_cli, llama_dir, prompt_path, "--draft", draft, "--heads",
                                  str(foreign_heads[which]), "--json"), needle, tmp=isolated)


def test_bad_drafter_choices(run_cli, llama_dir, prompt_path, isolated):
    assert_one_line_error(gen(run_cli, llama_dir, prompt_path, "--draft", "clover"), "no clover heads",
                          "--heads", tmp=isolated)
    assert_one_line_error(gen(run_cli, llama_dir, prompt_path, "--draft", "eagle"), "no eagle heads",
                          "--heads", tmp=isolated)
    assert_one_line_error(gen(run_cli, llama_dir, prompt_path, "--draft", "eagle3"), "no eagle3 heads",
                          "--heads", tmp=isolated)
    assert_one_line_error(gen(run_cli, llama_dir, prompt_path, "--draft", "eagle9"), "unknown drafter", "eagle9",
                          tmp=isolated)
    assert_one_line_error(gen(run_cli, llama_dir, prompt_path, "--draft", "none", "--tree-budget", "lots"),
                          "--tree-budget", tmp=isolated)
    assert_one_line_error(gen(run_cli, llama_dir, prompt_path, "--draft", "none", "--tree", "bushy"), "--tree",
                          tmp=isolated)


@pytest.mark.parametrize("args, needle", [
    (["--draft", "eagle9"], "unknown drafter"), (["--tree", "bushy"], "--tree must be"),
    (["--tree-budget", "lots"], "--tree-budget must be"), (["--tree", "static", "--draft", "ngram"], "has none"),
    (["--early-stop", "often"], "--early-stop must be"),
    (["--draft", "model", "--tree", "static", "--early-stop", "learned"], "--early-stop learned needs"),
])
def test_drafting_options_are_refused_before_the_chat_starts(run_cli, monkeypatch, args, needle):
    """An interactive chat shows its prompt before the model loads: a bad drafting option must end the command
    before that, not the prompt the user is typing into."""
    import clover_cli.chat

    monkeypatch.setattr(clover_cli.chat, "run_chat", lambda *a, **k: pytest.fail("the chat started"))
    code, out, err = run_cli("chat", "tiny", *args)
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and needle in lines[0], err


# --- bad sampling settings ------------------------------------------------------------------------------------


@pytest.mark.parametrize("option, value", [
    ("--temperature", "-1"), ("--temperature", "1e9"), ("--temperature", "nan"), ("--temperature", "inf"),
    ("--top-p", "0"), ("--top-p", "1.5"), ("--top-p", "-0.5"), ("--top-p", "nan"),
    ("--max-new-tokens", "0"), ("--max-new-tokens", "-5"), ("--max-new-tokens", str(10**9)),
    ("--seed", "-1"), ("--seed", str(2**70)),
    ("--repetition-penalty", "0"), ("--repetition-penalty", "-1.2"), ("--repetition-penalty", "nan"),
    ("--repetition-penalty", "11"), ("--top-k", "-1"), ("--min-p", "1"), ("--min-p", "-0.1"), ("--min-p", "nan"),
    ("--threads", "0"), ("--ctx-size", "8"),
])
def test_bad_sampling(run_cli, llama_dir, prompt_path, isolated, option, value):
    assert_one_line_error(gen(run_cli, llama_dir, prompt_path, option, value, "--json"), option, tmp=isolated)


@pytest.mark.parametrize("args, needle", [
    (["--temperature", "abc"], "--temperature"),
    (["--max-new-tokens", "1.5"], "--max-new-tokens"),
    (["--no-such-flag"], "--no-such-flag"),
    ([], "-p TEXT or -f FILE"),
], ids=["non-numeric", "non-integer", "unknown-option", "missing-prompt"])
def test_usage_errors(run_cli, llama_dir, prompt_path, isolated, args, needle):
    prompt = ["-f", str(prompt_path)] if args else []
    assert_one_line_error(run_cli("generate", str(llama_dir), *prompt, *args), needle, tmp=isolated)


def test_unknown_command(run_cli):
    assert_one_line_error(run_cli("serveit"), "serveit")


# --- devices, 8 bits, memory ----------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_device_without_cuda(run_cli, llama_dir, prompt_path, isolated):
    assert_one_line_error(gen(run_cli, llama_dir, prompt_path, "--device", "cuda", "--draft", "none"), "cuda",
                          tmp=isolated)
    assert_one_line_error(gen(run_cli, llama_dir, prompt_path, "--device", "cuda:3", "--draft", "none"), "cuda",
                          tmp=isolated)


def test_bad_device_and_dtype(run_cli, llama_dir, prompt_path, isolated):
    assert_one_line_error(gen(run_cli, llama_dir, prompt_path, "--device", "tpu", "--draft", "none"), "tpu",
                          tmp=isolated)
    assert_one_line_error(gen(run_cli, llama_dir, prompt_path, "--dtype", "fp8", "--draft", "none"), "fp8",
                          tmp=isolated)


QUANT_KERNELS = [("--load-in-8bit", "int8_vectorwise_quant"), ("--load-in-4bit", "quantize_4bit")]


@pytest.mark.parametrize("missing", ["starlette", "uvicorn", "prometheus_client"])
def test_serve_without_its_extra_names_it(run_cli, llama_dir, monkeypatch, isolated, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # `import missing` raises ImportError
    assert_one_line_error(run_cli("serve", str(llama_dir), "--port", "0"), missing, "clover-cli[serve]",
                          tmp=isolated)


@pytest.mark.parametrize("flag,kernel", QUANT_KERNELS)
def test_quantized_without_bitsandbytes(run_cli, llama_dir, prompt_path, monkeypatch, isolated, flag, kernel):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", None)
    assert_one_line_error(gen(run_cli, llama_dir, prompt_path, flag, "--draft", "none", "--json"),
                          flag, "bitsandbytes", "clover-cli[quant]", tmp=isolated)


@pytest.mark.parametrize("flag,kernel", QUANT_KERNELS)
def test_quantized_where_bitsandbytes_cannot_run(run_cli, llama_dir, prompt_path, monkeypatch, isolated, flag,
                                                 kernel):
    """bitsandbytes imports, but its kernels fail on this device (no backend for it)."""
    bnb_functional = pytest.importorskip("bitsandbytes.functional")

    def broken(*args, **kwargs):
        raise NotImplementedError(f"No kernel registered for {kernel} on device cpu")

    monkeypatch.setattr(bnb_functional, kernel, broken)
    assert_one_line_error(gen(run_cli, llama_dir, prompt_path, flag, "--draft", "none", "--json"),
                          "bitsandbytes", flag[10:].replace("bit", "-bit"), "cpu", tmp=isolated)


def test_prompt_longer_than_context(run_cli, short_context_dir, prompt_path, isolated):
    for mode in ([], ["--json"]):
        assert_one_line_error(gen(run_cli, short_context_dir, prompt_path, "--draft", "none", *mode), "prompt",
                              "context (64)", tmp=isolated)
    # --raw fits (a few tokens): the reply runs to the end of the context, trees shrinking as room runs out.
    code, out, err = gen(run_cli, short_context_dir, prompt_path, "--draft", "ngram", "--raw", "--tree-budget", "60",
                         "--json", "-n", "500")
    assert code == 0, err
    result = json.loads(out)
    assert result["prompt_tokens"] + result["new_tokens"] == 64 and result["finish"] == "length"


def _oom(*args, **kwargs):
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 23.65 GiB total)")


@pytest.mark.parametrize("json_out", [True, False], ids=["json", "stream"])
def test_cuda_out_of_memory_while_generating(run_cli, llama_dir, prompt_path, monkeypatch, json_out):
    from clover_cli.target import Target

    monkeypatch.setattr(Target, "forward", _oom)
    code, out, err = gen(run_cli, llama_dir, prompt_path, "--draft", "ngram", "--stats-file", "off",
                         *(["--json"] if json_out else []))
    assert_one_line_error((code, out, err), "out of GPU memory")
    assert "20.00 GiB" not in err  # the one line is ours, not torch's paragraph


def test_cuda_out_of_memory_while_loading(run_cli, llama_dir, prompt_path, monkeypatch, isolated):
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", _oom)
    assert_one_line_error(gen(run_cli, llama_dir, prompt_path, "--draft", "none", "--json"), "out of GPU memory",
                          tmp=isolated)


def test_cuda_out_of_memory_elsewhere(run_cli, llama_dir, prompt_path, monkeypatch, isolated):
    """An OOM outside the guarded places (here: building the drafter) still ends in one line, exit 2."""
    from clover_cli.session import Session

    monkeypatch.setattr(Session, "_drafter", _oom)
    assert_one_line_error(gen(run_cli, llama_dir, prompt_path, "--draft", "ngram", "--json"), "out of GPU memory",
                          tmp=isolated)


def test_interrupt_is_one_line_exit_130(run_cli, monkeypatch):
    import clover_cli.hub as hub

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hub, "resolve_model", interrupted)
    code, out, err = run_cli("download", "org/model")
    assert code == 130 and out == ""
    assert err.strip() == "clover: interrupted" and "Traceback" not in err


@pytest.mark.parametrize("made_for, model, warn", [
    ("lmsys/vicuna-7b-v1.5", "lmsys/vicuna-7b-v1.5", False),
    ("lmsys/vicuna-7b-v1.5", "LMSYS/Vicuna-7B-v1.5", False),
    ("lmsys/vicuna-7b-v1.5", "lmsys/vicuna-13b-v1.5", True),
    ("runs/tiny/target", "lmsys/vicuna-7b-v1.5", False),  # a local path says nothing about the model
    ("/abs/target", "org/model", False),
    (None, "org/model", False),
    ("org/model", None, False),  # the model is a local directory
])
def test_heads_made_for_another_hub_model_warns(made_for, model, warn):
    from clover_cli.session import heads_target_mismatch

    assert (heads_target_mismatch(made_for, model) is not None) == warn


def test_a_sessions_long_lived_objects_are_left_out_of_cyclic_collection(llama_dir):
    """The model, tokenizer and drafter live as long as the session: a full pass of Python's cyclic collector over
    them (~390k objects with the bundled model) stalled a reply for ~230 ms now and then, so the session exempts
    what it loaded (gc.freeze); what comes later (a reply's objects) is still watched."""
    import gc

    from clover_cli.decode.verify import Sampling
    from clover_cli.session import Options, Session

    session = Session(Options(model=str(llama_dir), draft="ngram", compile="off"), quiet=True)
    events = list(session.generate(session.encode_raw("Hello there"), 4, Sampling()))
    watched = {id(o) for o in gc.get_objects()}
    loaded = (session, session.model, session.tokenizer, session.engine, session.drafter,
              next(session.model.parameters()))
    assert not any(id(o) in watched for o in loaded)
    assert id(events) in watched  # a list made after the session was: still watched


EXIT_PROBE = """
import atexit, sys, threading, time
from pathlib import Path
from clover_cli.process import main

out = Path(sys.argv[1])
class Finalized:
    def __del__(self):
        (out / "finalized").write_text("yes")
keep = Finalized()  # a module global: only the interpreter's teardown deletes it
atexit.register(lambda: (out / "atexit").write_text("yes"))
def late():
    time.sleep(0.3)
    (out / "thread").write_text("yes")
threading.Thread(target=late).start()  # not a daemon: the exit waits for it
sys.argv = ["clover", *sys.argv[2:]]
main()
"""


@pytest.mark.parametrize("slow", ["", "1"])
@pytest.mark.parametrize("args,code", [(["--version"], 0), (["generate", "--no-such-option"], 2)])
def test_the_program_ends_without_the_interpreters_teardown(tmp_path, slow, args, code):
    """Run as a program, `clover` leaves as soon as its command is done: threads joined, atexit functions run, output
    flushed, exit code kept, but the ~1.3 s in which the interpreter takes every module and object down after torch
    and a model were loaded is skipped (CLOVER_SLOW_EXIT=1 keeps it)."""
    import os
    import subprocess

    env = {**os.environ, "CLOVER_SLOW_EXIT": slow}
    proc = subprocess.run([sys.executable, "-c", EXIT_PROBE, str(tmp_path), *args], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == code, proc.stderr
    assert (proc.stdout if code == 0 else proc.stderr).strip()  # the version, or the one-line usage error
    assert (tmp_path / "atexit").is_file() and (tmp_path / "thread").is_file()
    assert (tmp_path / "finalized").is_file() == bool(slow)
