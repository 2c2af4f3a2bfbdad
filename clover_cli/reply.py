"""What the front ends (generate, chat, serve) share to give a reply: the one reply loop (`stream`), the printer
that streams a reply (coloured by draft depth, stop strings held back), where output goes (`Out`), a reply cut at
its stop strings, whether it ended in a loop, the lines that say what was loaded and where, and the memory handed
back after a reply."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from .errors import CloverError, one_line
from .render import visible
from .stats import Stats


def strip_stop(text: str, stop_strings) -> str:
    """Cut a reply at the first stop string it contains."""
    cut = len(text)
    for s in stop_strings:
        i = text.find(s)
        if i >= 0:
            cut = min(cut, i)
    return text[:cut]


def ends_in_loop(tokens: list[int], tail: int = 48, longest: int = 16) -> bool:
    """Whether the last `tail` tokens are one block of at most `longest` tokens repeated (what a small model's greedy
    reply often ends in: docs/BENCHMARKS.md counts them so)."""
    t = tokens[-tail:]
    return len(t) == tail and any(all(t[i] == t[i % p] for i in range(tail)) for p in range(1, longest + 1))


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


class Discard:
    """An `Out` that keeps nothing: generate --json's printer writes to it (the reply goes into the JSON)."""

    colour = sanitize = False

    def write(self, text: str):
        pass


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
    if session.weights_note:  # the CPU's quantized linears (clover_cli/quantized.py)
        return f"weights {session.weights_text}"
    return "8-bit" if session.load_in_8bit else "4-bit NF4" if session.load_in_4bit else "not quantized"


def loaded_line(command: str, session, load_s: float) -> str:
    """The first line chat and serve say once the model is loaded: what runs, where, and how long loading took."""
    dtype = str(session.dtype).replace("torch.", "")
    return (f"clover {command} · model {session.resolved.name} · {placement(session)} · dtype {dtype} · "
            f"{weights_bits(session)} · loaded in {load_s:.1f}s")


@dataclass
class Reply:
    """What one run of the reply loop gave: the tokens, their statistics, how it ended; `text()` the reply."""

    detok: object  # render.Detokenizer: the reply's text as it grew
    printer: ReplyPrinter
    stops: list
    stats: Stats = field(default_factory=Stats)  # this reply's steps (finish: how the last one ended)
    tokens: list = field(default_factory=list)
    interrupted: bool = False  # Ctrl-C stopped it (catch=True), while streaming or while the engine was closed
    interrupts: int = 0  # Ctrl-C presses caught while streaming (catch=True)
    failed: str | None = None  # the one-line error that ended it (catch=True)
    cancelled: bool = False  # `cancelled` was set: the loop left at the next step

    def text(self) -> str:
        """The reply decoded whole, cut at the first stop string; the printer shows what it still held of it."""
        text = strip_stop(self.detok.text(), self.stops)
        self.printer.finish(text)
        return text


def stream(session, gen, printer: ReplyPrinter, stops, writer=None, sid: str | None = None, totals: tuple = (),
           cancelled=None, on_step=None, catch: bool = False) -> Reply:
    """The reply loop of generate, chat and serve: run the engine's generator `gen` (session.generate) to its end,
    each step written to the stats stream (`writer`, session `sid`), counted in the reply's Stats and in each of
    `totals`, its tokens decoded and handed to `printer` (which holds back what could start a stop string), then
    `on_step()`. With `cancelled` (a threading.Event) set, it leaves before the next step. The generator is closed
    however the loop ends (closed unfinished, the engine resets itself).

    catch=False (generate, serve): an exception, Ctrl-C included, goes on up. catch=True (chat): Ctrl-C ends the
    reply as interrupted and an error as `failed`, both kept in the Reply (a closed output, BrokenPipeError, still
    goes up); Ctrl-C while the generator is being closed is tried again, up to three times."""
    from .render import Detokenizer
    from .stats import step_record

    reply = Reply(Detokenizer(session.tokenizer), printer, stops)
    model, draft = session.resolved.name, session.draft_name
    try:
        for ev in gen:
            if cancelled is not None and cancelled.is_set():
                reply.cancelled = True
                return reply  # closing the generator resets the engine's cache
            if writer:
                writer.write(step_record(sid, ev, model, draft))
            reply.stats.add(ev)
            for total in totals:
                total.add(ev)
            for tok, depth in zip(ev.tokens, ev.depths):
                printer.add(reply.detok.push(tok), depth)
            reply.tokens += ev.tokens
            printer.flush()
            if on_step is not None:
                on_step()
    except KeyboardInterrupt:
        if not catch:
            raise
        reply.interrupted = True
        reply.interrupts += 1
    except CloverError as e:
        if not catch:
            raise
        reply.failed = str(e)
    except BrokenPipeError:
        raise  # the reader went away: clover exits quietly
    except Exception as e:
        if not catch:
            raise
        reply.failed = one_line(e, kind=True)
    finally:
        if not catch:
            gen.close()
        else:
            for _ in range(3):  # the engine resets itself when its generator is closed unfinished
                try:
                    gen.close()
                    break
                except KeyboardInterrupt:
                    reply.interrupted = True
    return reply
