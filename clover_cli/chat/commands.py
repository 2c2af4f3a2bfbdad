"""The chat itself: a reply to each message (through the reply loop, reply.stream), the line of figures under it,
and the slash commands."""

from __future__ import annotations

import math

from ..errors import CloverError, one_line
from ..families import drafts
from ..reply import Out, ends_in_loop
from ..running import start_session
from .conversation import Conversation, fit_context

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
    "/draft": ("[NAME]", f"show or switch the drafter: {', '.join(drafts())}"),
    "/stats": ("", "acceptance statistics of this chat so far"),
    "/exit": ("", "leave (also /quit and Ctrl-D)"),
}
ALIASES = {"/quit": "/exit", "/q": "/exit", "/?": "/help"}


def _fmt_pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


class Chat:
    def __init__(self, session, conv: Conversation, out: Out, max_new_tokens: int, temperature: float,
                 top_p: float, seed: int | None, writer=None, stats_path=None, interactive: bool = True,
                 repetition_penalty: float = 1.0, top_k: int = 0, min_p: float = 0.0):
        from ..stats import Stats

        self.session, self.conv, self.out = session, conv, out
        self.max_new_tokens, self.temperature, self.top_p, self.seed = max_new_tokens, temperature, top_p, seed
        self.repetition_penalty, self.top_k, self.min_p = repetition_penalty, top_k, min_p
        self.loop_hinted = False  # said once per chat: a reply ended in a loop, and /penalty exists
        self.writer, self.stats_path, self.interactive = writer, stats_path, interactive
        self.sid = start_session("chat", session, writer)
        self.total = Stats(self.sid or "", "chat", session.resolved.name, session.draft_name)
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
        from ..decode.verify import Sampling
        from ..reply import ReplyPrinter, release_free_memory, stream

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
                                                                self.repetition_penalty, self.top_k, self.min_p))
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
            self.out.error(one_line(e, kind=True))
            return

        reply = ReplyPrinter(self.out, s.stop_strings)
        done = stream(s, gen, reply, s.stop_strings, self.writer, self.sid, totals=(self.total,), catch=True)
        self.interrupts += done.interrupts
        interrupted, failed, per = done.interrupted, done.failed, done.stats

        try:
            text = done.text()
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
            self.stats_line(per, per.finish, interrupted)
            if not self.loop_hinted and self.repetition_penalty == 1.0 and ends_in_loop(done.tokens):
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
        parts = [f"{per.new_tokens} tokens"]
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
            self.out.error(f"cannot switch to {arg}: {one_line(e, kind=True)}")
            return
        self.total.note_draft(self.session.draft_name)
        self.out.note(f"(drafter: {self.session.draft_name})")

    def cmd_stats(self, arg):
        t = self.total
        if not t.replies:
            self.out.note("(no replies yet)")
            return
        lines = [f"{t.replies} replies · {t.new_tokens} tokens · {t.steps} steps after prefill",
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
