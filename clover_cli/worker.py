"""The engine's side of `clover serve`: requests (Jobs) wait in a FIFO queue for the one thread that runs the engine
(Worker), which generates each request's `n` replies one after another through the reply loop (reply.stream) and
sends what it has back to the request's handler on the event loop, as events:

    ("delta", (index, text))     a streamed piece of reply `index` (stop strings held back, a chat's trailing
                                 whitespace held back until more text follows it)
    ("choice", dict)             reply `index` done: its text, how it ended, its steps, its tokens' logprobs
    ("done", dict)               every reply done: the choices, their steps together, the time queued and taken
    ("error", ApiError)          generation failed
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field, replace

from .api import ApiError, Prompt
from .errors import CloverError, one_line
from .listener import log_error
from .running import start_session

MAX_WAITING = 256  # requests queued behind the running one; more are turned away (503)


@dataclass
class Job:
    """A request waiting for, or running on, the worker; events go back to its handler on the event loop."""

    prompt: Prompt
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)

    def put(self, kind: str, value=None):
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled.set()


class Deltas:
    """The `Out` a ReplyPrinter writes a streamed reply to (stop strings held back): handed out in pieces, with the
    trailing whitespace of a chat reply held back until more text follows it (a chat reply is trimmed)."""

    colour = sanitize = False

    def __init__(self, trim: bool):
        self.text, self.sent, self.trim = "", 0, trim

    def write(self, text: str):
        self.text += text

    def take(self) -> str:
        # what was sent ends in a non-space (or is empty), so only the unsent part need be stripped: a step's cost
        # stays that of its own text, not of the whole reply so far
        end = self.sent + len(self.text[self.sent:].rstrip()) if self.trim else len(self.text)
        piece, self.sent = self.text[self.sent:end], max(self.sent, end)
        return piece


class Logprobs:
    """A total of the reply loop (reply.stream) that keeps each emitted token's logprobs (StepEvent.logprobs)."""

    def __init__(self):
        self.rows: list = []

    def add(self, ev):
        self.rows += ev.logprobs or []


def reply_logprobs(session, tokens: list[int], rows: list, text: str, chat: bool = False) -> list[dict]:
    """The reply's tokens as the API reports them, each {"id", "token", "logprob", "top": [(token, logprob)]}: those
    whose text lies in the reply's `text` (a stop string and the end-of-sequence token cut off, as from the text) or,
    `chat`, in its content, the text stripped (a token of whitespace only before or after it left out; one that
    reaches into it kept)."""
    from .render import Detokenizer

    start, end = (len(text) - len(text.lstrip()), len(text.rstrip())) if chat else (0, len(text))
    detok, shown, out = Detokenizer(session.tokenizer), 0, []
    for tok, (logprob, top) in zip(tokens, rows):
        if shown >= end or tok in session.eos_ids:
            break
        begin = shown
        shown += len(detok.push(tok))
        if shown <= start and not begin == shown >= start:  # wholly before the content (an empty piece: at it)
            continue
        out.append({"id": tok, "token": session.tokenizer.decode([tok]), "logprob": logprob,
                    "top": [(session.tokenizer.decode([t]), lp) for t, lp in top]})
    return out


class Worker:
    """The one thread that runs the engine: jobs in arrival order, one at a time."""

    def __init__(self, session, writer=None):
        self.session, self.writer = session, writer
        self.sid = start_session("serve", session, writer)
        self.metrics = None  # the server's Metrics: each step counted
        self.jobs: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.waiting = 0
        self.running: Job | None = None
        self.served = 0
        self.thread = threading.Thread(target=self._run, name="clover-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> int:
        """Queue a job; returns how many requests are ahead of it."""
        with self.lock:
            if self.waiting >= MAX_WAITING:
                raise ApiError(503, f"the server is busy: {self.waiting} requests are waiting; try again later",
                               code="server_busy", kind="server_error")
            ahead = self.waiting + (self.running is not None)
            self.waiting += 1
            self.jobs.put(job)
        return ahead

    def status(self) -> dict:
        with self.lock:
            return {"running": int(self.running is not None), "waiting": self.waiting, "served": self.served}

    def stop(self):
        self.jobs.put(None)

    def _run(self):
        while True:
            job = self.jobs.get()
            if job is None:
                return
            with self.lock:
                self.waiting -= 1
                if job.cancelled.is_set():  # its client left while it waited
                    continue
                self.running = job
            try:
                self._generate(job)
            except CloverError as e:  # out of memory while generating, for one
                job.put("error", ApiError(500, str(e), code="generation_failed", kind="server_error"))
            except Exception as e:
                log_error(one_line(e, kind=True))
                job.put("error", ApiError(500, f"generation failed ({type(e).__name__})", code="generation_failed",
                                          kind="server_error"))
            finally:
                with self.lock:
                    self.running = None
                    self.served += 1

    def _generate(self, job: Job):
        from .stats import Stats

        p = job.prompt
        started, total, choices = time.perf_counter(), Stats(), []
        for index in range(p.n):
            sampling = p.sampling
            if index and sampling.seed is not None:  # a seed gives each reply its own draws, the same each time
                sampling = replace(sampling, seed=(sampling.seed + index) % 2**63)
            choice = self._reply(job, index, sampling, total)
            if choice is None:
                return
            choices.append(choice)
            job.put("choice", choice)
        job.put("done", {"choices": choices, "stats": total, "queue_s": started - job.arrived,
                         "elapsed_s": time.perf_counter() - started})

    def _reply(self, job: Job, index: int, sampling, total) -> dict | None:
        """One reply of the job (None: its client left)."""
        from .reply import ReplyPrinter, stream

        s, p = self.session, job.prompt
        stops = s.stop_strings + [x for x in p.stops if x not in s.stop_strings]
        sink = Deltas(trim=p.chat)
        printer = ReplyPrinter(sink, stops, skip_space=p.chat)
        logprobs = Logprobs() if sampling.logprobs is not None else None

        def send():
            piece = sink.take()
            if piece and p.stream:
                job.put("delta", (index, piece))

        totals = tuple(t for t in (total, self.metrics, logprobs) if t is not None)
        reply = stream(s, s.generate(p.ids, p.max_tokens, sampling, stops), printer, stops, self.writer, self.sid,
                       totals=totals, cancelled=job.cancelled, on_step=send)
        if reply.cancelled:
            return None
        if self.metrics:
            self.metrics.reply_done(len(p.ids), reply.stats.finish)
        text = reply.text()
        return {"index": index, "text": text.strip() if p.chat else text, "tail": sink.take(),
                "finish": reply.stats.finish, "stats": reply.stats,
                "logprobs": None if logprobs is None else reply_logprobs(s, reply.tokens, logprobs.rows, text, p.chat)}
