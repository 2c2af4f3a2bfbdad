"""`clover chat`: an interactive REPL (prompt-toolkit) that streams replies, colouring the tokens the draft proposed
and the target accepted, one colour per draft depth.

Interactive when standard input and output are terminals; otherwise it reads one message (or slash command) per
line, prints plain replies and exits at the end of the input with status 0.

Ctrl-C during a reply stops it. The part already generated is kept in the conversation, marked "[interrupted]" on
screen and `"interrupted": true` in /save files, so the next message continues from what you saw; /regen replaces
it and /undo removes it with your message. If Ctrl-C comes before the first token, the conversation goes back to
what it was before the message (press Up to recall it).
"""

from __future__ import annotations

import json
import math
import os
import stat
import sys
import time
from pathlib import Path

from . import atomic
from .drafters.names import DRAFTS
from .errors import CloverError
from .render import visible

HELP_KEYS = [
    ("Enter", "send the message"),
    ("Esc Enter / Alt-Enter", "new line inside a message"),
    ("Ctrl-C", "while a reply streams: stop it; the partial reply is kept, marked [interrupted] "
               "(/regen redoes it, /undo removes it); before its first token the message is dropped "
               "(Up recalls it). At the prompt: clear the line"),
    ("Ctrl-D", "leave"),
    ("Tab", "complete a slash command"),
]

# name -> (arguments, help)
COMMANDS = {
    "/help": ("", "show this help"),
    "/reset": ("", "start a new conversation (the system message stays)"),
    "/regen": ("", "drop the last reply and generate it again"),
    "/undo": ("", "remove the last exchange: your last message and its reply"),
    "/save": ("FILE", "save the conversation as JSON (atomically)"),
    "/load": ("FILE", "load a conversation saved with /save (or a JSON list of {role, content})"),
    "/system": ("[TEXT | --clear]", "show, set or clear the system message"),
    "/temp": ("[X]", "show or set the sampling temperature, 0 to 10 (0 = greedy)"),
    "/penalty": ("[P]", "show or set the repetition penalty, above 0 and up to 10 (1 = none)"),
    "/draft": ("[NAME]", f"show or switch the drafter: {', '.join(DRAFTS)}"),
    "/stats": ("", "acceptance statistics of this chat so far"),
    "/exit": ("", "leave (also /quit and Ctrl-D)"),
}
ALIASES = {"/quit": "/exit", "/q": "/exit", "/?": "/help"}
MAX_LOAD_BYTES = 64 * 1024 * 1024
SAVE_FORMAT = "clover-chat"


# ------------------------------------------------------------------------------------------- the conversation


class Conversation:
    """The messages (alternating user / assistant, user first) and the system message.

    `window` is the index of the first message still sent to the model: when the conversation outgrows the
    model's context the oldest exchanges are left out (they stay here, and in /save files).
    """

    def __init__(self, system: str | None = None):
        self.system = system
        self.messages: list[dict] = []
        self.window = 0

    def for_model(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": m["role"], "content": m["content"]} for m in self.messages[self.window:]]

    def state(self):
        return [dict(m) for m in self.messages], self.window, self.system

    def restore(self, state):
        messages, self.window, self.system = state
        self.messages = [dict(m) for m in messages]

    def repair(self):
        """Keep the invariant: the conversation ends with a reply (or is empty)."""
        while self.messages and self.messages[-1]["role"] != "assistant":
            self.messages.pop()
        self.window = min(self.window, len(self.messages))
        self.window -= self.window % 2

    def undo(self) -> int:
        n = 0
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
            n += 1
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()
            n += 1
        self.repair()
        return n

    def to_json(self, model: str | None = None) -> dict:
        return {"format": SAVE_FORMAT, "version": 1, "model": model, "saved": round(time.time(), 3),
                "system": self.system, "messages": [dict(m) for m in self.messages]}

    @staticmethod
    def parse(data) -> "Conversation":
        """A conversation from /save's JSON object, or from a plain list of {role, content} messages (an optional
        system message first). ValueError says what is wrong."""
        system = None
        if isinstance(data, dict):
            if "messages" not in data:
                raise ValueError("no 'messages' in it")
            system = data.get("system")
            if system is not None and not isinstance(system, str):
                raise ValueError("'system' must be a string or null")
            items = data["messages"]
        elif isinstance(data, list):
            items = data
        else:
            raise ValueError("expected a JSON object with 'messages', or a list of messages")
        if not isinstance(items, list):
            raise ValueError("'messages' must be a list")
        if items and isinstance(items[0], dict) and items[0].get("role") == "system":
            if system is not None:
                raise ValueError("two system messages")
            system = items[0].get("content")
            if not isinstance(system, str):
                raise ValueError("message 1: 'content' must be a string")
            items = items[1:]
        if system is not None:
            _check_text(system, "the system message")
        conv = Conversation(system or None)
        for i, m in enumerate(items, 1):
            if not isinstance(m, dict):
                raise ValueError(f"message {i} is not an object")
            role, content = m.get("role"), m.get("content")
            want = "user" if i % 2 else "assistant"
            if role not in ("user", "assistant"):
                raise ValueError(f"message {i}: role must be user or assistant, not {role!r}")
            if role != want:
                raise ValueError(f"message {i}: expected a {want} message (turns must alternate, user first)")
            if not isinstance(content, str):
                raise ValueError(f"message {i}: 'content' must be a string")
            _check_text(content, f"message {i}: 'content'")
            msg = {"role": role, "content": content}
            if m.get("interrupted") is True:
                msg["interrupted"] = True
            conv.messages.append(msg)
        if conv.messages and conv.messages[-1]["role"] != "assistant":
            raise ValueError("the last message has no reply (a saved conversation ends with a reply)")
        return conv

    @staticmethod
    def load(path: str) -> "Conversation":
        from .inputs import read_limited

        p = Path(path).expanduser()
        try:
            if p.is_dir():
                raise CloverError(f"cannot load {path}: it is a directory")
            # in chunks up to the cap: a device or a pipe says it holds 0 bytes (/dev/zero), and Ctrl-C stops it
            raw = read_limited(p, MAX_LOAD_BYTES, f"cannot load {path}: it")
        except FileNotFoundError:
            raise CloverError(f"cannot load {path}: no such file")
        except OSError as e:
            raise CloverError(f"cannot load {path}: {e.strerror or e}")
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise CloverError(f"cannot load {path}: not UTF-8 text")
        except (json.JSONDecodeError, RecursionError) as e:
            raise CloverError(f"cannot load {path}: not valid JSON ({getattr(e, 'msg', 'too deeply nested')}"
                              f"{f' at line {e.lineno}' if hasattr(e, 'lineno') else ''})")
        try:
            return Conversation.parse(data)
        except ValueError as e:
            raise CloverError(f"cannot load {path}: {e}")

    def save(self, path: str, model: str | None = None) -> Path:
        """Write to a temporary file in the same directory, then rename it over `path`: never half a file. Only a
        new name or a regular file is written (a device, a FIFO or a symbolic link is refused: atomic.check_replace);
        a new file is private (0600), an existing one keeps its mode."""
        p = Path(path).expanduser()
        if p.is_dir():
            raise CloverError(f"cannot save to {path}: it is a directory")
        data = (json.dumps(self.to_json(model), ensure_ascii=False, indent=1) + "\n").encode()
        try:
            atomic.write_bytes(p, data, mode=0o600, make_parents=False)  # a conversation is private
        except OSError as e:
            raise CloverError(f"cannot save to {path}: {e.strerror or e}")
        return p


def _check_text(text: str, where: str):
    from .inputs import surrogate_problem

    why = surrogate_problem(text, where)
    if why is not None:
        raise ValueError(why)


def release_free_memory() -> None:
    """Give the memory a reply freed back to the system (glibc's malloc_trim; elsewhere nothing). A reply's
    tensors are freed when it ends, but the C allocator keeps most of what was freed for reuse, and as the
    conversation grows its pieces are rarely reused whole: without this a 200-turn chat's resident memory grew by
    about a third (scripts/soak.py). Between replies it costs a few milliseconds of the user's reading time."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim if sys.platform.startswith("linux") else False
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


def fit_context(conv: Conversation, encode, limit: int) -> tuple[list[int], int]:
    """Token ids of the conversation for the model, leaving out the fewest oldest exchanges for the rest to fit in
    `limit` tokens. Returns (ids, messages newly left out). The window only moves forward, so the model's cache of
    the kept prefix stays valid from one reply to the next.

    What is tokenized is at most `limit` x inputs.CHARS_PER_TOKEN characters: the exchanges that would take the
    messages past that are left out before any tokenizing (a /load of megabytes costs no more than a full context),
    and a last message past it alone is refused untokenized.

    The window is found by bisection over whole exchanges: each encoding tried is of a suffix at most as long as
    the rest of the interval plus one that fits, so a long conversation (a /load) costs about two encodings of it
    in all, not one per exchange left out."""
    from .inputs import CHARS_PER_TOKEN, check_text_size

    original = conv.window
    last = original + 2 * ((len(conv.messages) - original) // 2)  # the window that keeps the final message alone
    most = limit * CHARS_PER_TOKEN
    system = len(conv.system or "")
    check_text_size(system + sum(len(m["content"]) for m in conv.messages[last:]), limit, "the message")
    start, chars = last, system + sum(len(m["content"]) for m in conv.messages[last:])
    while start - 2 >= original:  # the most exchanges, from the newest back, within the characters' bound
        more = len(conv.messages[start - 2]["content"]) + len(conv.messages[start - 1]["content"])
        if chars + more > most:
            break
        start, chars = start - 2, chars + more

    def encode_from(window: int) -> list[int]:
        conv.window = window
        return encode(conv.for_model())

    ids = encode_from(start)
    if len(ids) <= limit:
        return ids, start - original
    fits = ids if start == last else encode_from(last)
    if len(fits) > limit:
        conv.window = original
        raise CloverError(f"the message is too long: {len(fits)} tokens with the chat template and system "
                          f"message, and at most {limit} fit (the rest of the context is kept for the reply)")
    lo, hi = start, last  # lo does not fit, hi does
    while hi - lo > 2:
        mid = lo + 2 * ((hi - lo) // 4)
        ids = encode_from(mid)
        if len(ids) <= limit:
            hi, fits = mid, ids
        else:
            lo = mid
    conv.window = hi
    return fits, hi - original


# ------------------------------------------------------------------------------------------- output


class Out:
    """Where things go: replies on standard output; notes, stats lines and errors on the terminal (standard
    output when it is one, else standard error) through rich, plain when colour is off."""

    def __init__(self, colour: bool):
        from rich.console import Console

        self.colour = colour
        self.stream = sys.stdout
        self.sanitize = sys.stdout.isatty()  # a terminal must not obey escape sequences a model writes
        info_file = sys.stdout if sys.stdout.isatty() else sys.stderr
        self.console = Console(file=info_file, highlight=False, soft_wrap=True, emoji=False, markup=False,
                               color_system="256" if colour else None, force_terminal=True if colour else None)

    def write(self, text: str):
        self.stream.write(text)
        self.stream.flush()

    def note(self, text: str, style: str = "dim"):
        """A note, inert: what a user, a file or a model wrote in it (a system message, a path) cannot act on the
        terminal."""
        self.console.print(visible(text), style=style if self.colour else None)

    def error(self, text: str):
        self.console.print(f"error: {visible(text)}", style="red" if self.colour else None)


def _fmt_pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


# ------------------------------------------------------------------------------------------- the chat


class Chat:
    def __init__(self, session, conv: Conversation, out: Out, max_new_tokens: int, temperature: float,
                 top_p: float, seed: int | None, writer=None, stats_path=None, interactive: bool = True,
                 repetition_penalty: float = 1.0):
        from .stats import SessionStats

        self.session, self.conv, self.out = session, conv, out
        self.max_new_tokens, self.temperature, self.top_p, self.seed = max_new_tokens, temperature, top_p, seed
        self.repetition_penalty = repetition_penalty
        self.loop_hinted = False  # said once per chat: a reply ended in a loop, and /penalty exists
        self.writer, self.stats_path, self.interactive = writer, stats_path, interactive
        self.sid = writer.new_session("chat", session) if writer else None
        self.total = SessionStats(self.sid or "", "chat", session.resolved.name, session.draft_name)
        self.generations = 0
        self.interrupts = 0  # Ctrl-C presses caught while replying
        self.replied = self.failed = 0  # replies given, and messages (or /regen) that ended in an error
        self.notices: list[str] = []  # said between replies, never into one (the compiled step's news)
        session.compiler.warn = self.notices.append
        if writer:
            writer.warn = self.notices.append

    # --- replies

    def context_limit(self) -> int:
        """The most prompt tokens: the rest of the context is kept for the reply (up to a quarter of it)."""
        s = self.session
        room = min(self.max_new_tokens, max(16, s.max_context // 4))
        return max(s.max_context - room, s.max_context // 2)

    def send(self, text: str):
        """Add a user message and answer it."""
        before = self.conv.state()
        self.conv.messages.append({"role": "user", "content": text})
        self.respond(before)

    def respond(self, before):
        """Generate a reply to the conversation (which ends with a user message). On an error, or Ctrl-C before
        the first token, the conversation goes back to `before`."""
        from .decode.verify import Sampling
        from .render import Detokenizer
        from .session import strip_stop
        from .stats import SessionStats, step_record

        s = self.session
        try:
            ids, dropped = fit_context(self.conv, s.encode_chat, self.context_limit())
            if dropped:
                left = self.conv.window
                self.out.note(f"(the conversation outgrew the model's context of {s.max_context} tokens: the "
                              f"oldest {left} message(s) are left out from now on; /save still keeps them)",
                              "yellow")
            seed = None if self.seed is None else self.seed + self.generations
            self.generations += 1
            gen = s.generate(ids, self.max_new_tokens, Sampling(self.temperature, self.top_p, seed,
                                                                self.repetition_penalty))
        except CloverError as e:
            self.conv.restore(before)
            self.failed += 1
            self.out.error(str(e))
            return
        except KeyboardInterrupt:
            self.conv.restore(before)
            self.interrupts += 1
            self.out.note("(interrupted)")
            return
        except Exception as e:  # a template that refuses the conversation, for one
            self.conv.restore(before)
            self.failed += 1
            self.out.error(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            return

        stops = s.stop_strings
        detok = Detokenizer(s.tokenizer)
        reply = ReplyPrinter(self.out, stops)
        per = SessionStats()
        tokens = []
        interrupted, failed, finish = False, None, None
        model, draft = s.resolved.name, s.draft_name
        try:
            for ev in gen:
                rec = step_record(self.sid, ev, model, draft)
                if self.writer:
                    self.writer.write(rec)
                per.add(rec)
                self.total.add(rec)
                for tok, depth in zip(ev.tokens, ev.depths):
                    reply.add(detok.push(tok), depth)
                tokens += ev.tokens
                reply.flush()
                finish = ev.finish
        except KeyboardInterrupt:
            interrupted = True
            self.interrupts += 1
        except CloverError as e:
            failed = str(e)
        except BrokenPipeError:
            raise  # the reader went away: clover exits quietly
        except Exception as e:
            failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        finally:
            for _ in range(3):  # the engine resets itself when its generator is closed unfinished
                try:
                    gen.close()
                    break
                except KeyboardInterrupt:
                    interrupted = True

        try:
            text = strip_stop(detok.text(), stops)
            reply.finish(text)
            content = text.strip()
            if failed is not None or (interrupted and not content):
                self.conv.restore(before)
                reply.end_line()
                if failed is not None:
                    self.failed += 1
                    self.out.error(failed + (" (the partial reply was discarded)" if reply.any_output else ""))
                else:
                    self.out.note("[interrupted before the reply began: your message was not kept; "
                                  "Up recalls it]" if self.interactive else "[interrupted]", "yellow")
                return
            self.replied += 1
            msg = {"role": "assistant", "content": content}
            if interrupted:
                msg["interrupted"] = True
            self.conv.messages.append(msg)
            if interrupted:
                reply.write_mark(" [interrupted]")
            reply.end_line()
            if not content and not interrupted:
                self.out.note("(empty reply)")
            self.stats_line(per, finish, interrupted)
            if not self.loop_hinted and self.repetition_penalty == 1.0 and ends_in_loop(tokens):
                self.loop_hinted = True
                self.out.note("(the reply ended repeating itself: /penalty 1.3 makes repetition less likely, and "
                              "drafts are then accepted less often)")
        except KeyboardInterrupt:
            self.conv.repair()
        finally:
            self.say_notices()
            release_free_memory()

    def say_notices(self):
        compiler = self.session.compiler
        compiler.poll()
        if compiler.just_activated:
            compiler.just_activated = False
            self.notices.append("compiled step ready: replies run it from now on")
        for text in self.notices:
            self.out.note(f"({text})")
        self.notices.clear()

    def stats_line(self, per, finish, interrupted):
        tokens = per.tokens + per.replies
        parts = [f"{tokens} tokens"]
        parts.append(f"τ {per.tau:.2f}" if per.tau is not None else "τ n/a")
        parts.append(f"accepted {_fmt_pct(per.acceptance_rate)}")
        parts.append(f"{per.tokens_per_s:.1f} tok/s" if per.tokens_per_s else "n/a tok/s")
        parts.append(self.session.draft_name)
        if interrupted:
            parts.append("stopped by Ctrl-C")
        elif finish == "length":
            parts.append("cut at the length limit")
        self.out.note(" · ".join(parts))

    # --- commands

    def command(self, line: str) -> bool:
        """Run a slash command; False means leave."""
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        name = ALIASES.get(name, name)
        if name not in COMMANDS:
            self.out.error(f"unknown command {name}; /help lists the commands")
            return True
        if name in ("/help", "/reset", "/regen", "/undo", "/stats", "/exit") and arg:
            self.out.error(f"{name} takes no argument")
            return True
        handler = getattr(self, "cmd_" + name[1:])
        result = handler(arg)
        return result is not False

    def cmd_exit(self, arg):
        return False

    def cmd_help(self, arg):
        lines = ["commands:"]
        width = max(len(f"{n} {a}".strip()) for n, (a, _) in COMMANDS.items())
        for n, (a, h) in COMMANDS.items():
            lines.append(f"  {f'{n} {a}'.strip():<{width}}  {h}")
        if self.interactive:
            lines.append("keys:")
            for k, h in HELP_KEYS:
                lines.append(f"  {k:<{width}}  {h}")
        else:
            lines.append("input is read one message per line; a line starting with // sends a message that "
                         "starts with /")
        lines.append("colours: tokens the draft proposed and the model accepted, one colour per draft depth; "
                     "plain text is the model's own token.")
        self.out.note("\n".join(lines), "")

    def cmd_reset(self, arg):
        self.conv.messages, self.conv.window = [], 0
        self.out.note("(new conversation)")

    def cmd_undo(self, arg):
        n = self.conv.undo()
        if not n:
            self.out.error("nothing to undo")
        else:
            self.out.note(f"(removed your last message and its reply; {len(self.conv.messages)} message(s) left)")

    def cmd_regen(self, arg):
        if not self.conv.messages:
            self.out.error("nothing to regenerate")
            return
        before = self.conv.state()
        if self.conv.messages[-1]["role"] == "assistant":
            self.conv.messages.pop()
        if self.conv.window >= len(self.conv.messages):
            self.conv.window = max(0, len(self.conv.messages) - 1)
        self.respond(before)

    def cmd_save(self, arg):
        if not arg:
            self.out.error("usage: /save FILE")
            return
        try:
            p = self.conv.save(arg, self.session.resolved.name)
        except CloverError as e:
            self.out.error(str(e))
            return
        self.out.note(f"(saved {len(self.conv.messages)} message(s) to {p})")

    def cmd_load(self, arg):
        if not arg:
            self.out.error("usage: /load FILE")
            return
        try:
            conv = Conversation.load(arg)
        except CloverError as e:
            self.out.error(str(e))
            return
        self.conv.messages, self.conv.window, self.conv.system = conv.messages, 0, conv.system
        sysnote = " with its system message" if conv.system else ""
        self.out.note(f"(loaded {len(conv.messages)} message(s){sysnote} from {arg})")

    def cmd_system(self, arg):
        if not arg:
            self.out.note(f"system message: {self.conv.system}" if self.conv.system else
                          "(no system message: the chat template's default applies)")
        elif arg == "--clear":
            self.conv.system = None
            self.out.note("(system message cleared)")
        else:
            self.conv.system = arg
            self.out.note("(system message set)")

    def cmd_temp(self, arg):
        if not arg:
            self.out.note(f"temperature {self.temperature:g}" + (" (greedy)" if self.temperature == 0 else ""))
            return
        try:
            t = float(arg)
        except ValueError:
            t = float("nan")
        if not (math.isfinite(t) and 0.0 <= t <= 10.0):
            self.out.error(f"/temp needs a number between 0 and 10, not {arg!r}")
            return
        self.temperature = t
        self.out.note(f"(temperature {t:g}{' (greedy)' if t == 0 else ''})")

    def cmd_penalty(self, arg):
        if arg:
            try:
                p = float(arg)
            except ValueError:
                p = float("nan")
            if not (math.isfinite(p) and 0.0 < p <= 10.0):
                self.out.error(f"/penalty needs a number above 0 and up to 10, not {arg!r}")
                return
            self.repetition_penalty = p
        p = self.repetition_penalty
        self.out.note(f"(repetition penalty {p:g}{' (none)' if p == 1 else ''})")

    def cmd_draft(self, arg):
        if not arg:
            self.out.note(f"drafter: {self.session.draft_name}")
            return
        try:
            self.session.switch_draft(arg)
        except CloverError as e:
            self.out.error(str(e))
            return
        except Exception as e:
            self.out.error(f"cannot switch to {arg}: {type(e).__name__}: {e}".splitlines()[0])
            return
        self.total.note_draft(self.session.draft_name)
        self.out.note(f"(drafter: {self.session.draft_name})")

    def cmd_stats(self, arg):
        t = self.total
        if not t.replies:
            self.out.note("(no replies yet)")
            return
        lines = [f"{t.replies} replies · {t.tokens + t.replies} tokens · {t.steps} steps after prefill",
                 f"acceptance rate {_fmt_pct(t.acceptance_rate)} (share of tokens after each reply's first that "
                 f"the draft proposed and the model accepted)",
                 "τ " + (f"{t.tau:.2f}" if t.tau is not None else "n/a") + " tokens per target forward · "
                 + (f"{t.tokens_per_s:.1f}" if t.tokens_per_s else "n/a") + " tok/s · est. speedup "
                 + (f"{t.speedup:.2f}×" if t.speedup is not None else "n/a")]
        if t.hit_rates:
            lines.append("hit rate by depth: " + "  ".join(f"{d}:{100 * r:.0f}%" for d, r in
                                                           enumerate(t.hit_rates, 1)))
        if t.hist:
            lines.append("accepted per step: " + "  ".join(f"{a}:{c}" for a, c in enumerate(t.hist) if c))
        if self.stats_path:
            lines.append(f"stream: {self.stats_path} (session {self.sid}; live view: clover stats)")
        self.out.note("\n".join(lines), "")


class ReplyPrinter:
    """Streams a reply: colours each character by the depth of the token it came from, holds back text that
    could be the start of a stop string, and skips the reply's leading whitespace (unless skip_space is False)."""

    def __init__(self, out: Out, stops, skip_space: bool = True):
        from .render import paint

        self.paint = paint
        self.out = out
        self.stops = [s for s in stops if s]
        self.text = ""
        self.depths: list[int] = []
        self.printed = 0
        self.started = not skip_space
        self.stopped = False
        self.any_output = False

    def add(self, piece: str, depth: int):
        if piece and not self.stopped:
            self.text += piece
            self.depths.extend([depth] * len(piece))

    def _emit(self, upto: int):
        if not self.started:
            while self.printed < upto and self.text[self.printed].isspace():
                self.printed += 1
            if self.printed < upto:
                self.started = True
        if upto <= self.printed:
            return
        chunks, i = [], self.printed
        while i < upto:
            d = self.depths[i] if i < len(self.depths) else 0
            j = i
            while j < upto and (self.depths[j] if j < len(self.depths) else 0) == d:
                j += 1
            piece = self.text[i:j]
            chunks.append(self.paint(visible(piece) if self.out.sanitize else piece, d, self.out.colour))
            i = j
        self.printed = upto
        self.any_output = True
        self.out.write("".join(chunks))

    def flush(self):
        cut = len(self.text)
        longest = max((len(s) for s in self.stops), default=0)
        for s in self.stops:
            i = self.text.find(s, max(0, self.printed - len(s)))
            if i >= 0:
                cut = min(cut, i)
                self.stopped = True
        if not self.stopped:
            for k in range(min(longest - 1, cut - self.printed), 0, -1):
                tail = self.text[cut - k:cut]
                if any(s.startswith(tail) for s in self.stops):
                    cut -= k
                    break
        self._emit(cut)

    def finish(self, final: str):
        """Print what is left of the final text (the reply decoded whole, stop strings cut)."""
        if final.startswith(self.text[:self.printed]):
            self.text = final
            self.depths = self.depths[:len(final)]
            self._emit(len(final))

    def write_mark(self, mark: str):
        self.out.write(f"\x1b[2;33m{mark}\x1b[0m" if self.out.colour else mark)
        self.any_output = True

    def end_line(self):
        if self.out.colour:
            self.out.write("\x1b[0m")  # in case Ctrl-C cut a coloured piece short
        if self.any_output:
            self.out.write("\n")


# ------------------------------------------------------------------------------------------- input


def _completer():
    from prompt_toolkit.completion import Completer, Completion, PathCompleter
    from prompt_toolkit.document import Document

    paths = PathCompleter(expanduser=True)

    class SlashCompleter(Completer):
        def get_completions(self, document, complete_event):
            text = document.text_before_cursor
            if not text.startswith("/") or "\n" in text:
                return
            if " " not in text:
                for name, (args, help_) in COMMANDS.items():
                    if name.startswith(text):
                        yield Completion(name + (" " if args else ""), start_position=-len(text), display=name,
                                         display_meta=help_)
                return
            cmd, _, rest = text.partition(" ")
            if cmd == "/draft":
                for d in DRAFTS:
                    if d.startswith(rest):
                        yield Completion(d, start_position=-len(rest))
            elif cmd in ("/save", "/load"):
                yield from paths.get_completions(Document(rest, len(rest)), complete_event)

    return SlashCompleter()


def _history(path_arg: str | None):
    """A prompt-toolkit history kept in a private file (--history-file, else the user cache directory); in
    memory only when the default location cannot be written."""
    from prompt_toolkit.history import FileHistory, InMemoryHistory

    class QuietFileHistory(FileHistory):
        def load_history_strings(self):
            """The earlier prompts: only a regular file is read back (a FIFO or /dev/null is a sink, and reading a
            FIFO would wait for a writer)."""
            try:
                if not stat.S_ISREG(os.stat(self.filename).st_mode):
                    return []
            except OSError:
                return []
            return super().load_history_strings()

        def store_string(self, string: str) -> None:
            """prompt-toolkit's format, appended in one write (a file clover creates is private, 0600; an existing
            one keeps its mode)."""
            import datetime

            entry = f"\n# {datetime.datetime.now()}\n" + "".join(f"+{line}\n" for line in string.split("\n"))
            try:
                atomic.append(Path(self.filename), entry.encode("utf-8", errors="replace"), 0o600)
            except OSError:
                pass  # a full disk must not end the chat

    from .stats import cache_dir

    path = Path(path_arg).expanduser() if path_arg else cache_dir() / "chat_history"
    try:
        if path.is_dir():
            raise IsADirectoryError(21, "Is a directory")
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.close(atomic.open_append(path, 0o600))  # a history of prompts is private: made 0600, never chmodded
    except OSError as e:
        if path_arg:
            raise CloverError(f"cannot use the history file {path}: {e.strerror or e}")
        return InMemoryHistory(), None
    return QuietFileHistory(str(path)), path


def _plain_key(key_press) -> bool:
    """A key press that types one printable character."""
    key = key_press.key
    return type(key) is str and len(key) == 1 and key == key_press.data and key.isprintable()


def _bounded_input(limit: int):
    """Key bindings and a validator that keep the prompt's line to `limit` characters, and typing cheap.

    prompt-toolkit saves the whole line to its undo stack before every typed character (unless it repeats the one
    before) and dispatches each one through its key bindings: 100 KB typed, or pasted where the terminal does not
    bracket pastes (or while a reply streamed, before the prompt was up), took ~40 s of CPU and ~5 GB, never given
    back. Here a run of typed characters is one undo step, and the characters already read in are inserted together
    (one dispatch for each read of the terminal, not for each character). A bracketed paste that would take the line
    past `limit` is not inserted, with a note under the prompt; typing past it drops what does not fit, and such a
    line cannot be sent (Ctrl-C clears it)."""
    from prompt_toolkit.filters import emacs_insert_mode, vi_insert_mode
    from prompt_toolkit.key_binding import KeyBindings
    from prompt_toolkit.keys import Keys
    from prompt_toolkit.validation import ValidationError, Validator

    kb = KeyBindings()
    state = {"dropped": False}
    too_long = f"over {limit} characters, the most a message holds: what came after was dropped and this message " \
               f"cannot be sent (Ctrl-C clears it)"

    def insert(event, text: str):
        buf = event.current_buffer
        if not buf.text:
            state["dropped"] = False  # a new line (the prompt's, or one cleared)
        if state["dropped"] or len(buf.text) + len(text) > limit:
            state["dropped"] = True
            buf.validation_error = ValidationError(len(buf.text), too_long)
            event.app.output.bell()
            return
        buf.insert_text(text)

    def run_starts(event) -> bool:  # undo keeps the line before a run of typed characters, not before each one
        previous = event.previous_key_sequence
        return not (len(previous) == 1 and _plain_key(previous[0]))

    @kb.add(Keys.Any, filter=vi_insert_mode | emacs_insert_mode, save_before=run_starts)
    def _type(event):
        text = event.data * event.arg
        queue = getattr(event.key_processor, "input_queue", None)
        if event.arg == 1 and len(event.key_sequence) == 1 and _plain_key(event.key_sequence[0]) and queue:
            more = []
            while queue and _plain_key(queue[0]) and len(more) < limit:
                more.append(queue.popleft().data)
            text += "".join(more)
        insert(event, text)

    @kb.add(Keys.BracketedPaste)
    def _paste(event):
        data = event.data.replace("\r\n", "\n").replace("\r", "\n")  # as prompt-toolkit's own binding does
        buf = event.current_buffer
        if len(buf.text) + len(data) > limit:
            buf.validation_error = ValidationError(len(buf.text), f"a paste of {len(data)} characters was not "
                                                                  f"inserted: a message holds at most {limit}")
            event.app.output.bell()
            return
        buf.insert_text(data)

    class Bounded(Validator):
        def validate(self, document):
            if document.text and (state["dropped"] or len(document.text) > limit):
                raise ValidationError(len(document.text), too_long)

    return kb, Bounded()


def _prompt_session(history, colour: bool):
    from prompt_toolkit import PromptSession
    from prompt_toolkit.output import ColorDepth

    from .inputs import MAX_MESSAGE_CHARS

    kb, validator = _bounded_input(MAX_MESSAGE_CHARS)

    @kb.add("escape", "enter")
    def _newline(event):
        event.current_buffer.insert_text("\n")

    return PromptSession(history=history, completer=_completer(), complete_while_typing=True,
                         key_bindings=kb, validator=validator, validate_while_typing=False,
                         multiline=False, prompt_continuation=lambda width, line, soft: "... ".rjust(width),
                         enable_history_search=False, color_depth=None if colour else ColorDepth.MONOCHROME)


# ------------------------------------------------------------------------------------------- start-up


def _may_download(opts) -> bool:
    from .hub import ALIASES as MODELS, default_model, is_cached, looks_like_repo, will_fetch

    name = opts.model or default_model()
    spec = MODELS.get(name)
    if will_fetch(name, opts.revision, opts.dtype):  # a download or a GGUF's conversion
        return True
    if opts.draft == "model":  # --draft model's model: named, else the alias's own
        draft = opts.draft_model or (spec.draft if spec is not None else None)
        if draft and draft != "bundled" and not Path(draft).expanduser().exists():
            alias = MODELS.get(draft)
            draft_repo = alias.repo if alias is not None else draft if looks_like_repo(draft) else None
            if draft_repo and not is_cached(draft_repo):
                return True
    return bool(opts.heads and not Path(opts.heads).expanduser().exists())


def _check_local(opts):
    """Resolve a model that needs no download (the bundled one, a directory, a name that is none of these): the
    one-line error of a wrong one comes before the prompt. Hub repos and aliases are left to the load."""
    from .hub import ALIASES, default_model, looks_like_repo, resolve_model

    name = opts.model or default_model()
    spec = ALIASES.get(name)
    if (spec is not None and spec.repo is None) or (spec is None and not looks_like_repo(name)) \
            or Path(name).expanduser().exists():
        resolve_model(opts.model, opts.revision, opts.allow_pickle, quiet=True, dtype=opts.dtype)


def _load(opts, out: Out, show_progress: bool):
    from .hub import default_model
    from .session import Session

    name = opts.model or default_model()
    t0 = time.perf_counter()
    if show_progress and not _may_download(opts):  # a download draws its own progress bars instead
        from rich.console import Console

        with Console(stderr=True).status(f"loading {name} …", spinner="dots"):
            session = Session(opts)
    else:
        if show_progress:
            out.note(f"loading {name} …")
        session = Session(opts)
    return session, time.perf_counter() - t0


def _heads_source(session) -> str:
    from .hub import HEADS_SUBDIR

    hp = session.heads_path
    if session.draft_name in ("model", "model-chain"):
        return f"draft model {session.draft_model_name}"
    if session.draft_name in ("self", "self-chain"):
        return "the model itself with layers skipped"
    if hp is None or session.draft_name in ("ngram", "none"):
        return {"ngram": "no draft heads: prompt lookup and tri-gram statistics",
                "none": "plain decoding, no drafting"}.get(session.draft_name, "no draft heads")
    if session.opts.heads:
        return f"heads {hp} (--heads)"
    if Path(hp) == Path(session.resolved.path) / HEADS_SUBDIR:
        return f"heads {hp} (shipped with the model)"
    return f"heads {hp} (from the Hub)"


def placement(session) -> str:
    """Where the model runs: its device, or the devices its --device-map spreads it over."""
    placed = getattr(session.model, "hf_device_map", None)
    if session.opts.device_map is None or not placed:
        return f"device {session.device}"
    layers = {}
    for where in placed.values():
        layers[str(where)] = layers.get(str(where), 0) + 1
    return "device map " + ", ".join(f"{where} ({n} module{'s' * (n > 1)})" for where, n in layers.items())


def weights_bits(session) -> str:
    return "8-bit" if session.load_in_8bit else "4-bit NF4" if session.load_in_4bit else "not quantized"


def _banner(session, out: Out, load_s: float, chat: Chat, history_path, interactive: bool):
    from .render import legend

    dtype = str(session.dtype).replace("torch.", "")
    out.note(f"clover chat · model {session.resolved.name} · {placement(session)} · dtype {dtype} · "
             f"{weights_bits(session)} · loaded in {load_s:.1f}s", "bold")
    out.note(f"drafter {session.draft_name} · {_heads_source(session)}")
    out.note(session.compiler.describe())
    if session.template_notice:
        out.note(session.template_notice, "yellow")
    extra = []
    if chat.stats_path:
        extra.append(f"stats → {chat.stats_path}")
    if history_path:
        extra.append(f"history → {history_path}")
    if chat.repetition_penalty != 1.0:
        extra.insert(0, f"repetition penalty {chat.repetition_penalty:g}")
    out.note(f"context {session.max_context} tokens · replies up to {chat.max_new_tokens} tokens · temperature "
             f"{chat.temperature:g}" + "".join(f" · {e}" for e in extra))
    if out.colour and session.draft_name != "none":
        depth = getattr(session.drafter, "max_depth", 5)  # one draft depth per head, or the n-gram depth
        out.console.file.write(legend(min(int(depth), 8)) + "\n")
    if interactive:
        out.note("Enter sends · Esc Enter adds a line · Ctrl-C stops a reply · /help · Ctrl-D or /exit leaves")


# ------------------------------------------------------------------------------------------- entry point


def ends_in_loop(tokens: list[int], tail: int = 48, longest: int = 16) -> bool:
    """Whether the last `tail` tokens are one block of at most `longest` tokens repeated (what a small model's greedy
    reply often ends in: docs/BENCHMARKS.md counts them so)."""
    t = tokens[-tail:]
    return len(t) == tail and any(all(t[i] == t[i % p] for i in range(tail)) for p in range(1, longest + 1))


def run_chat(opts, system=None, max_new_tokens=256, temperature=0.0, top_p=1.0, seed=None, history_file=None,
             stats_file=None, no_color=False, repetition_penalty=None):
    from .render import use_colour
    from .stats import StatsWriter

    StatsWriter.check(stats_file)  # a --stats-file that cannot be written fails now, not after loading
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    colour = use_colour(no_color, sys.stdout)
    out = Out(colour)
    history, history_path = _history(history_file) if interactive else (None, None)

    def start(progress: bool):
        """Load the model and open the stats stream: the chat, and what prints its banner."""
        session, load_s = _load(opts, out, show_progress=progress)
        writer = StatsWriter.open(stats_file)  # after loading: a run that fails to start leaves no record
        penalty = session.default_penalty if repetition_penalty is None else repetition_penalty
        chat = Chat(session, Conversation(system or None), out, max_new_tokens, temperature, top_p, seed, writer,
                    writer.path if writer else None, interactive, penalty)
        session.compiler.start(background=True)  # auto: replies run eager until the compiled step is built

        def banner():
            _banner(session, out, load_s, chat, history_path, interactive)
            chat.say_notices()
        return chat, banner

    # In a terminal the prompt comes up at once and the model loads behind it (importing torch and transformers is
    # most of a start-up); a download draws progress bars, so it happens before the prompt.
    if interactive and not _may_download(opts):
        from .hub import default_model

        name = opts.model or default_model()
        _check_local(opts)  # a mistyped name fails at once, not after the libraries have loaded
        out.note(f"clover chat · loading {name} … (type away: your first message waits for it)")
        _repl(Loading(lambda: start(progress=False), out, name), _prompt_session(history, colour))
        return
    chat, banner = start(progress=sys.stderr.isatty())
    banner()
    if interactive:
        _repl(chat, _prompt_session(history, colour))
    else:
        _lines(chat)


class Loading:
    """The chat being made in a thread while the prompt is already up. When it is ready while the prompt is shown,
    its banner is printed above the prompt (prompt-toolkit's run_in_terminal keeps what was typed); when a message
    is sent first, `wait` shows a spinner until it is ready. A load that fails ends the prompt with its error."""

    def __init__(self, start, out: Out, name: str):
        import threading

        self.out, self.name = out, name
        self.chat: Chat | None = None
        self.banner = None
        self.error: BaseException | None = None
        self.shown = False
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._app = None
        threading.Thread(target=self._run, args=(start,), name="clover-load", daemon=True).start()

    def _run(self, start):
        try:
            self.chat, self.banner = start()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
            self.error = e
        with self._lock:
            self.done.set()
            app = self._app
        if app is not None:
            app.loop.call_soon_threadsafe(self._ready, app)

    def attach(self):
        """prompt-toolkit's pre_run: the prompt is up; tell it when the chat is ready."""
        from prompt_toolkit.application import get_app

        app = get_app()
        with self._lock:
            self._app = app
            ready = self.done.is_set()
        if ready:
            self._ready(app)

    def detach(self):
        with self._lock:
            self._app = None

    def _ready(self, app):
        """In the prompt's event loop: end the prompt with the error, or print the banner above it."""
        from prompt_toolkit.application import run_in_terminal
        from prompt_toolkit.application.current import set_app

        if not app.is_running or app.future is None or app.future.done():
            return  # the prompt ended meanwhile: wait() takes over
        if self.error is not None:
            app.exit(exception=self.error)
        elif not self.shown:
            self.shown = True
            with set_app(app):
                run_in_terminal(self.banner)

    def wait(self) -> Chat:
        """The chat, once loaded (a spinner meanwhile); its banner printed if it was not yet."""
        if not self.done.is_set():
            from rich.console import Console

            with Console(stderr=True).status(f"loading {self.name} …", spinner="dots"):
                self.done.wait()
        if self.error is not None:
            raise self.error
        if not self.shown:
            self.shown = True
            self.banner()
        return self.chat


def _handle(chat: Chat, text: str) -> bool:
    """One input: a command or a message. False means leave."""
    seen = chat.interrupts
    try:
        if text.startswith("/") and not text.startswith("//"):
            return chat.command(text)
        chat.send(text[1:] if text.startswith("//") else text)
    except KeyboardInterrupt:
        chat.conv.repair()
        chat.interrupts += 1
        if chat.interactive:
            chat.out.note("(interrupted)")
    if chat.interrupts != seen and not chat.interactive:
        raise KeyboardInterrupt  # reading a script: Ctrl-C ends it (exit status 130), not just this reply
    return True


def _repl(chat, prompt):
    """The terminal's loop. `chat` may still be Loading: the prompt is up before the model is; the first message
    (or command) waits for it, and Ctrl-D leaves without waiting."""
    while True:
        loading = chat if isinstance(chat, Loading) else None
        try:
            text = prompt.prompt(">>> ", pre_run=loading.attach if loading else None)
        except KeyboardInterrupt:
            continue  # Ctrl-C at the prompt clears the line
        except EOFError:
            sys.stdout.write("\n")
            return
        finally:
            if loading:
                loading.detach()
        if not text.strip():
            continue
        if loading:
            try:
                chat = loading.wait()
            except KeyboardInterrupt:
                loading.out.note("(not sent: the model was still loading)")
                continue
        if not _handle(chat, text.strip("\n") if text.startswith("/") else text):
            return


def _lines(chat: Chat):
    """Standard input that is not a terminal: one message or command per line, until its end (or /exit). When
    messages were sent and not one got a reply, the run fails (exit status 2): a script learns that it got
    nothing."""
    from .inputs import CHUNK, MAX_MESSAGE_CHARS

    most = 4 * MAX_MESSAGE_CHARS  # bytes of a line: UTF-8 takes at most 4 a character
    stdin, line = sys.stdin.buffer, 0
    while True:
        raw = stdin.readline(most + 1)  # a line at most that long is read: a line of megabytes is not held whole
        if not raw:
            break
        line += 1
        text = None if len(raw) > most else raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if text is None or len(text) > MAX_MESSAGE_CHARS:
            while raw and not raw.endswith(b"\n"):  # the rest of that line, a chunk at a time (Ctrl-C stops it)
                raw = stdin.readline(CHUNK)
            chat.failed += 1
            chat.out.error(f"line {line} is over {MAX_MESSAGE_CHARS} characters, the most a message holds: not sent")
            continue
        if not text.strip():
            continue
        if not _handle(chat, text):
            break
    if chat.failed and not chat.replied:
        n = chat.failed
        raise CloverError(f"{'the message' if n == 1 else f'all {n} messages'} failed (see the errors above): "
                          f"no reply was given")
