"""`clover chat`: driven as a user would, through a real pseudo-terminal (pexpect), plus piped standard input and
unit tests of the conversation logic (Ctrl-C, trimming, stop strings, /save and /load) with a scripted session."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from clover_cli.chat.commands import Chat
from clover_cli.chat.conversation import Conversation, fit_context
from clover_cli.render import visible
from clover_cli.reply import Out
from clover_cli.decode.engine import StepEvent
from clover_cli.errors import CloverError

PROMPT = ">>>"
STATS_LINE = r"\d+ tokens · τ"
COLOUR = "\x1b[38;5;"  # the 256-colour escape that paints accepted draft tokens


# ----------------------------------------------------------------------------------- a scripted session


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(chr(i) for i in ids)


class FakeSession:
    """Replays a script of StepEvents (and exceptions) instead of running a model."""

    def __init__(self, script=(), max_context=200):
        self.script = list(script)
        self.resolved = SimpleNamespace(name="fake", path=Path("."))
        self.draft_name = "ngram"
        self.stop_strings = ["USER:"]
        self.tokenizer = FakeTokenizer()
        self.max_context = max_context
        self.engine = SimpleNamespace(budget=4)
        self.compiler = SimpleNamespace(warn=None, poll=lambda: False, just_activated=False, active=False,
                                        describe=lambda: "eager (--compile off)")
        self.prompts = []

    def encode_chat(self, messages):
        return [ord(c) for m in messages for c in m["content"]] + [0]

    def generate(self, ids, max_new_tokens, sampling):
        self.prompts.append(ids)
        for item in self.script:
            if isinstance(item, BaseException):
                raise item
            yield item


def ev(text, depths=None, prefill=False, finish=None):
    toks = [ord(c) for c in text]
    depths = depths or [0] * len(toks)
    accepted = sum(1 for d in depths if d)
    return StepEvent(toks, depths, proposed=accepted + 1, tree_depth=max(depths, default=0), accepted=accepted,
                     elapsed_s=0.01, verify_s=0.009, draft_s=0.001, prefill=prefill, finish=finish)


def make_chat(script, messages=()):
    conv = Conversation()
    conv.messages = [dict(m) for m in messages]
    return Chat(FakeSession(script), conv, Out(colour=False), 50, 0.0, 1.0, None, interactive=True)


EXCHANGE = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "old reply"}]


def test_ctrl_c_keeps_the_partial_reply_marked(capsys):
    chat = make_chat([ev(" H", prefill=True), ev("i!", [1, 0]), KeyboardInterrupt()])
    chat.send("hello")
    out = "".join(capsys.readouterr())  # replies on stdout; notes on stderr when stdout is not a terminal
    assert chat.conv.messages == [{"role": "user", "content": "hello"},
                                  {"role": "assistant", "content": "Hi!", "interrupted": True}]
    assert "Hi! [interrupted]" in out and "stopped by Ctrl-C" in out
    # the next message goes on from the conversation as it stands
    chat.session.script = [ev("ok", prefill=True, finish="eos")]
    chat.send("more")
    assert [m["content"] for m in chat.conv.messages] == ["hello", "Hi!", "more", "ok"]


def test_ctrl_c_before_the_first_token_restores(capsys):
    chat = make_chat([KeyboardInterrupt()], EXCHANGE)
    chat.send("new message")
    assert chat.conv.messages == EXCHANGE
    assert "your message was not kept" in capsys.readouterr().err
    chat.cmd_regen("")  # /regen interrupted before its first token: the old reply comes back
    assert chat.conv.messages == EXCHANGE


def test_error_mid_reply_restores(capsys):
    chat = make_chat([ev("ab", prefill=True), CloverError("out of GPU memory while generating")], EXCHANGE)
    chat.send("again")
    assert chat.conv.messages == EXCHANGE
    assert "error: out of GPU memory while generating" in capsys.readouterr().err


def test_stop_string_is_never_shown(capsys):
    chat = make_chat([ev(" abUS", prefill=True), ev("ER: x", finish="stop")])
    chat.send("hi")
    out = capsys.readouterr().out
    assert chat.conv.messages[-1] == {"role": "assistant", "content": "abUS"[:2]}
    assert out.startswith("ab\n") and "US" not in out


def test_multibyte_characters_stream_whole(llama_dir, capsys):
    """Byte-level tokens that split a character are held back until it is complete; spaces are kept."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    text = " Emoji and accents: café naïve — “quotes” 😀 über"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split())  # some characters span several tokens
    script = [StepEvent(ids[:1], [0], prefill=True)]
    script += [StepEvent(ids[i:i + 3], [1, 2, 0][:len(ids[i:i + 3])], accepted=2) for i in range(1, len(ids), 3)]
    chat = make_chat(script)
    chat.session.tokenizer = tok
    chat.send("hi")
    out = capsys.readouterr().out
    assert out == text.strip() + "\n" and chat.conv.messages[-1]["content"] == text.strip()


def test_trimming_oldest_turns(capsys):
    session = FakeSession()
    conv = Conversation("sys")
    for i in range(3):
        conv.messages += [{"role": "user", "content": f"u{i}" * 10}, {"role": "assistant", "content": "a" * 20}]
    conv.messages.append({"role": "user", "content": "last"})
    ids, dropped = fit_context(conv, session.encode_chat, limit=70)
    assert dropped == 4 and conv.window == 4 and len(ids) <= 70
    assert conv.for_model()[0] == {"role": "system", "content": "sys"}  # the system message always stays
    assert conv.for_model()[1]["content"] == "u2" * 10
    conv.messages[-1]["content"] = "x" * 100
    with pytest.raises(CloverError, match="too long"):
        fit_context(conv, session.encode_chat, limit=70)
    # in a chat: a notice, and the window stays where it moved
    chat = make_chat([ev("ok", prefill=True, finish="eos")], conv.messages[:6])
    chat.session.max_context = 100  # a quarter is kept for the reply: prompts of at most 75 tokens
    chat.send("last")
    assert "left out" in capsys.readouterr().err and chat.conv.window == 4


def test_parse_and_save(tmp_path):
    conv = Conversation("be brief")
    conv.messages = EXCHANGE + [{"role": "user", "content": "ü\nx"},
                                {"role": "assistant", "content": "part", "interrupted": True}]
    p = conv.save(str(tmp_path / "c.json"), "m")
    assert stat.S_IMODE(p.stat().st_mode) == 0o600 and os.listdir(tmp_path) == ["c.json"]
    back = Conversation.load(str(p))
    assert back.messages == conv.messages and back.system == "be brief"
    plain = Conversation.parse([{"role": "system", "content": "s"}, *EXCHANGE])
    assert plain.system == "s" and plain.messages == EXCHANGE
    for bad, why in [({"messages": [{"role": "bot", "content": "x"}]}, "role"),
                     ([EXCHANGE[1]], "expected a user"), ([EXCHANGE[0]], "no reply"),
                     ({"messages": [{"role": "user", "content": 3}, EXCHANGE[1]]}, "content"), (5, "expected")]:
        with pytest.raises(ValueError, match=why):
            Conversation.parse(bad)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CloverError, match="cannot save"):
        conv.save(str(tmp_path / "file" / "c.json"))
    with pytest.raises(CloverError, match="directory"):
        conv.save(str(tmp_path))


def test_visible_and_no_color(monkeypatch):
    assert visible("a\x1b[2Jb\rc\n\td") == "a^[[2Jb^Mc\n\td"
    from clover_cli.render import use_colour

    tty = SimpleNamespace(isatty=lambda: True)
    assert use_colour(False, tty)
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_colour(False, tty)


# ----------------------------------------------------------------------------------- piped standard input


def test_piped_stdin(llama_dir, tmp_path, run_cli, monkeypatch, one_thread):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    saved = tmp_path / "piped.json"
    long = [f"{i} " + "zq7xjv kw9" * 16 for i in range(4)]  # rare byte pairs: about 150 tokens each
    lines = ["Hello there", "", "/foo", "/temp abc", "/load " + str(tmp_path / "missing.json"),
             "//slash message", *long, "/save " + str(saved)]
    code, out, err = run_cli("chat", str(llama_dir), "-n", "12", "--stats-file", str(tmp_path / "s.jsonl"),
                             stdin="\n".join(lines) + "\n")
    assert code == 0, err
    assert "\x1b" not in out and "\x1b" not in err  # not a terminal: plain text
    assert "unknown command /foo" in err and "/temp needs a number" in err and "no such file" in err
    assert len(re.findall(STATS_LINE, err)) == 6
    assert "outgrew the model's context of 512 tokens" in err  # the oldest turns are left out, with a notice
    conv = json.loads(saved.read_text())
    users = ["Hello there", "/slash message", *long]
    assert [m["content"] for m in conv["messages"] if m["role"] == "user"] == users  # /save keeps them all
    replies = [m["content"] for m in conv["messages"] if m["role"] == "assistant"]
    assert len(replies) == 6 and all(r in out for r in replies)
    assert not (tmp_path / "cache" / "clover" / "chat_history").exists()  # no input history for scripts


# ----------------------------------------------------------------------------------- a real terminal


def spawn(args, tmp_path: Path, **env_extra):
    pexpect = pytest.importorskip("pexpect")
    clover = shutil.which("clover") or str(Path(sys.executable).parent / "clover")
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    env.update(TERM="xterm-256color", COLUMNS="120", LINES="40", HOME=str(tmp_path),
               XDG_CACHE_HOME=str(tmp_path / "cache"), PROMPT_TOOLKIT_NO_CPR="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", **env_extra)
    child = pexpect.spawn(clover, args, env=env, encoding="utf-8", codec_errors="replace", timeout=60,
                          dimensions=(40, 120))
    child.logfile_read = open(tmp_path / "terminal.log", "w", encoding="utf-8")
    return child


def command(child, line: str, expect: str) -> str:
    child.send(line + "\r")
    child.expect(expect)
    out = child.before + child.after
    child.expect(PROMPT)
    return out


def reply_text(before: str) -> str:
    """What the chat printed after the prompt handed the terminal back."""
    return before.split("\x1b[?2004l")[-1]


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory):
    """A model with a long context: replies run for thousands of tokens, long enough to interrupt."""
    from conftest import build_model

    return build_model(tmp_path_factory.mktemp("long"), "llama", seed=1, max_position_embeddings=8192)


def test_terminal_session(llama_dir, tmp_path):
    import pexpect

    stats = tmp_path / "stats.jsonl"
    files = {k: tmp_path / f"{k}.json" for k in "abcde"}
    (tmp_path / "bad.json").write_text('{"messages": [')
    (tmp_path / "blocker").write_text("")
    child = spawn(["chat", str(llama_dir), "-n", "24", "--stats-file", str(stats)], tmp_path)
    try:
        child.expect("model " + re.escape(str(llama_dir)))
        child.expect("drafter ngram")
        child.expect("accepted draft tokens: " + re.escape(COLOUR))  # the legend, in colour
        child.expect(PROMPT)

        child.send("Hello there\r")
        child.expect(STATS_LINE)
        assert COLOUR in reply_text(child.before)  # accepted draft tokens arrive coloured
        child.expect(PROMPT)

        child.send("/he")
        child.expect("show this help")  # the completion menu
        child.send("\t")
        child.expect("/help")
        command(child, "", "commands:")

        command(child, "line one\x1b\rline two", STATS_LINE)  # Esc Enter: a new line in the message

        for line, error in [("/foo", "unknown command /foo"), ("/temp abc", "/temp needs a number"),
                            (f"/load {tmp_path / 'missing.json'}", "cannot load .*no such file"),
                            (f"/load {tmp_path / 'bad.json'}", "cannot load .*not valid JSON"),
                            (f"/save {tmp_path / 'blocker' / 'x.json'}", "cannot save to"),
                            ("/draft bogus", "unknown drafter"), ("/undo now", "/undo takes no argument")]:
            command(child, line, "error: " + error)

        command(child, f"/save {files['a']}", r"saved 4 message\(s\)")
        a = json.loads(files["a"].read_text())["messages"]
        assert [m["role"] for m in a] == ["user", "assistant"] * 2
        assert a[0]["content"] == "Hello there" and a[2]["content"] == "line one\nline two"

        command(child, "/undo", r"2 message\(s\) left")
        command(child, f"/save {files['b']}", "saved")
        assert json.loads(files["b"].read_text())["messages"] == a[:2]

        command(child, f"/load {files['a']}", r"loaded 4 message\(s\)")
        command(child, f"/save {files['c']}", "saved")
        assert json.loads(files["c"].read_text())["messages"] == a  # /save and /load round-trip

        command(child, "/regen", STATS_LINE)
        command(child, f"/save {files['d']}", "saved")
        assert json.loads(files["d"].read_text())["messages"] == a  # greedy: the same reply again

        command(child, "/system Be brief.", "system message set")
        command(child, "/system", "system message: Be brief.")
        command(child, "/temp 0.5", r"temperature 0\.5")
        command(child, "/draft none", "drafter: none")
        command(child, "/stats", "acceptance rate")
        command(child, "/reset", "new conversation")

        child.send("never sent")
        child.expect("never sent")
        child.sendintr()  # Ctrl-C at the prompt clears the line
        child.expect(PROMPT)
        command(child, f"/save {files['e']}", r"saved 0 message\(s\)")
        assert json.loads(files["e"].read_text())["system"] == "Be brief."

        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0

    history = tmp_path / "cache" / "clover" / "chat_history"
    assert stat.S_IMODE(history.stat().st_mode) == 0o600
    text = history.read_text()
    assert "+Hello there" in text and "+line one\n+line two" in text and "never sent" not in text

    recs = [json.loads(x) for x in stats.read_text().splitlines()]
    assert recs[0]["kind"] == "session" and recs[0]["command"] == "chat"
    steps = [r for r in recs if r["kind"] == "step"]
    assert sum(1 for r in steps if r.get("prefill")) == 3  # three replies
    assert {r["draft"] for r in steps} == {"ngram"} and all(r["session"] == recs[0]["session"] for r in steps)


def test_prompt_comes_up_before_the_model(llama_dir, tmp_path):
    """In a terminal the prompt is up before torch and the model load (they load behind it): what runs before the
    prompt imports no torch; text being typed when the banner arrives is kept; a wrong model name still fails before
    any prompt, in one line. (test_terminal_ctrl_c sends its first message at once: it waits for the model.)"""
    import pexpect

    before_prompt = ("import sys, clover_cli.cli, clover_cli.chat.repl as c, clover_cli.options as o\n"
                     f"opts = o.Options(model={str(llama_dir)!r})\n"
                     "c._history(None); c._completer(); c._may_download(opts); c._check_local(opts)\n"
                     "c._check_local(o.Options())\n"
                     "assert 'torch' not in sys.modules, 'torch was imported before the prompt'\n")
    subprocess.run([sys.executable, "-c", before_prompt], check=True, env={**os.environ, "HOME": str(tmp_path)})

    child = spawn(["chat", str(llama_dir), "-n", "8", "--stats-file", "off"], tmp_path)
    try:
        child.expect("loading " + re.escape(str(llama_dir)))
        child.expect(PROMPT)
        child.send("Hello")  # typed while the model loads
        child.expect("Ctrl-D or /exit leaves")  # its banner, printed above the prompt once loaded
        child.expect(PROMPT + " Hello")  # the prompt again, with what was typed
        child.send(" there\r")
        child.expect(STATS_LINE)
        command(child, f"/save {tmp_path / 'c.json'}", "saved")
        assert json.loads((tmp_path / "c.json").read_text())["messages"][0]["content"] == "Hello there"
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0

    child = spawn(["chat", str(tmp_path / "no-such-model"), "--stats-file", "off"], tmp_path)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus != 0 and PROMPT not in child.before and "Traceback" not in child.before
    assert "unknown model" in child.before


def test_terminal_ctrl_c(long_dir, tmp_path):
    import pexpect

    saved = tmp_path / "after.json"
    # plain decoding (--draft none), one token per step: thousands of steps, seconds to interrupt them in
    child = spawn(["chat", str(long_dir), "-n", "7000", "--draft", "none", "--no-color", "--stats-file", "off",
                   "--history-file", str(tmp_path / "hist")], tmp_path)
    # the prompt gave the terminal back (or, when the first message waited for the model, its banner was printed),
    # then 40 characters of reply
    started = r"(\x1b\[\?2004l|Ctrl-D or /exit leaves\r\n)[^\x1b]{40}"
    try:
        child.expect(PROMPT)  # sent at once: the model may still be loading
        for message in ("Tell me a long story", "And then?"):
            child.send(message + "\r")
            child.expect(started)
            child.sendintr()
            child.expect(r"\[interrupted\]")
            assert COLOUR not in child.before  # --no-color
            child.expect("stopped by Ctrl-C")
            child.expect(PROMPT)
        command(child, f"/save {saved}", "saved")
        msgs = json.loads(saved.read_text())["messages"]
        assert [m["content"] for m in msgs[::2]] == ["Tell me a long story", "And then?"]
        assert all(m["interrupted"] and m["content"] for m in msgs[1::2])
        command(child, "/undo", r"2 message\(s\) left")
        child.send("/exit\r")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    assert "+Tell me a long story" in (tmp_path / "hist").read_text()


def test_penalty_command_sets_the_repetition_penalty(llama_dir, tmp_path, run_cli, monkeypatch):
    """/penalty P: the next replies are what `clover generate --repetition-penalty P` gives; a bad P is refused in
    one line and changes nothing; /penalty alone shows it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    text = "Tell me about the sea and the sea and the sea"
    (tmp_path / "p.txt").write_text(text)
    lines = ["/penalty 0", "/penalty abc", "/penalty 1.8", "/penalty", text]
    code, out, err = run_cli("chat", str(llama_dir), "-n", "16", "--draft", "ngram", "--stats-file", "off",
                             stdin="\n".join(lines) + "\n")
    assert code == 0, err
    assert err.count("/penalty needs a number") == 2 and err.count("repetition penalty 1.8") == 2
    replies = {}
    for p in ("1.8", "1"):
        code, gen_out, gen_err = run_cli("generate", str(llama_dir), "-f", str(tmp_path / "p.txt"), "-n", "16",
                                         "--draft", "ngram", "--stats-file", "off", "--json",
                                         "--repetition-penalty", p)
        assert code == 0, gen_err
        replies[p] = json.loads(gen_out)["text"].strip()
    assert replies["1.8"] != replies["1"] and replies["1.8"] in out


def test_a_reply_that_ends_in_a_loop_gets_the_penalty_hint_once(tmp_path, run_cli, monkeypatch):
    """The bundled model's greedy replies often end in a loop: the first one that does is followed by one note that
    /penalty exists (and what it costs); none with a penalty set, and the default is no penalty."""
    from clover_cli.reply import ends_in_loop

    assert ends_in_loop([1, 2, 3] * 16) and ends_in_loop([5] * 60) and not ends_in_loop([1, 2, 3] * 15)
    assert not ends_in_loop(list(range(48))) and not ends_in_loop([1, 2] * 23 + [3, 4])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    lines = "/penalty\nTell me about the sea.\nHow do I write a for loop in Python?\n"
    hints = {}
    for args in ([], ["--repetition-penalty", "1.3"]):
        code, out, err = run_cli("chat", "--compile", "off", "--draft", "ngram", "--stats-file", "off", "-n", "128",
                                 *args, stdin=lines)
        assert code == 0, err
        hints[bool(args)] = err.count("/penalty 1.3 makes repetition less likely")
        assert ("repetition penalty 1.3" if args else "repetition penalty 1 (none)") in err
    assert hints == {False: 1, True: 0}


def test_the_banner_says_where_the_heads_come_from(tmp_path):
    """Heads shipped inside clover's package (smollm2's) are said to be so, not to come from the Hub."""
    from types import SimpleNamespace

    from clover_cli.aliases import HEADS_SUBDIR, bundled_heads
    from clover_cli.chat.repl import _heads_source

    def source(heads_path, heads_opt=None):
        session = SimpleNamespace(heads_path=heads_path, draft_name="clover+ngram", opts=SimpleNamespace(heads=heads_opt),
                                  resolved=SimpleNamespace(path=tmp_path / "model"))
        return _heads_source(session)

    assert source(bundled_heads("smollm2")).endswith("(shipped in clover's package)")
    assert source(tmp_path / "model" / HEADS_SUBDIR).endswith("(shipped with the model)")
    assert source(tmp_path / "hub" / "heads").endswith("(from the Hub)")
    assert source(tmp_path / "mine", heads_opt="mine").endswith("(--heads)")
