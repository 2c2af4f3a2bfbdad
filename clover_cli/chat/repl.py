"""`clover chat`'s terminal side: an interactive REPL (prompt-toolkit) that streams replies, colouring the tokens the draft proposed
and the target accepted, one colour per draft depth.

Interactive when standard input and output are terminals; otherwise it reads one message (or slash command) per
line, prints plain replies and exits at the end of the input with status 0.

Ctrl-C during a reply stops it. The part already generated is kept in the conversation, marked "[interrupted]" on
screen and `"interrupted": true` in /save files, so the next message continues from what you saw; /regen replaces
it and /undo removes it with your message. If Ctrl-C comes before the first token, the conversation goes back to
what it was before the message (press Up to recall it).
"""

from __future__ import annotations

import os
import stat
import sys
import time
from pathlib import Path

from .. import atomic
from ..errors import CloverError
from ..reply import Out, loaded_line
from .commands import COMMANDS, Chat
from .conversation import Conversation


def _completer():
    from prompt_toolkit.completion import Completer, Completion, PathCompleter
    from prompt_toolkit.document import Document

    from ..families import drafts

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
                for d in drafts():
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

    from ..stats import cache_dir

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

    from ..inputs import MAX_MESSAGE_CHARS

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
    from ..aliases import ALIASES as MODELS, default_model
    from ..hub import is_cached, looks_like_repo, will_fetch

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
    from ..aliases import ALIASES, default_model
    from ..hub import looks_like_repo, resolve_model

    name = opts.model or default_model()
    spec = ALIASES.get(name)
    if (spec is not None and spec.repo is None) or (spec is None and not looks_like_repo(name)) \
            or Path(name).expanduser().exists():
        resolve_model(opts.model, opts.revision, opts.allow_pickle, quiet=True, dtype=opts.dtype)


def _load(opts, out: Out, show_progress: bool):
    from ..aliases import default_model
    from ..session import Session

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
    from ..aliases import HEADS_SUBDIR, PACKAGE_FILES

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
    if Path(hp).resolve().is_relative_to(PACKAGE_FILES.resolve()):
        return f"heads {hp} (shipped in clover's package)"
    return f"heads {hp} (from the Hub)"


def _banner(session, out: Out, load_s: float, chat: Chat, history_path, interactive: bool):
    from ..render import legend

    out.note(loaded_line("chat", session, load_s), "bold")
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


def run_chat(opts, system=None, max_new_tokens=256, temperature=0.0, top_p=1.0, seed=None, history_file=None,
             stats_file=None, no_color=False, repetition_penalty=None, top_k=0, min_p=0.0):
    from ..render import use_colour
    from ..stats import StatsWriter

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
                    writer.path if writer else None, interactive, penalty, top_k, min_p)
        session.compiler.start(background=True)  # auto: replies run eager until the compiled step is built

        def banner():
            _banner(session, out, load_s, chat, history_path, interactive)
            chat.say_notices()
        return chat, banner

    # In a terminal the prompt comes up at once and the model loads behind it (importing torch and transformers is
    # most of a start-up); a download draws progress bars, so it happens before the prompt.
    if interactive and not _may_download(opts):
        from ..aliases import default_model

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
    from ..inputs import CHUNK, MAX_MESSAGE_CHARS

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
