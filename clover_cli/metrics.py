"""`clover serve`'s GET /metrics: what the server did since it started, in Prometheus' text format (prometheus_client),
one registry per server.

    clover_requests_total{endpoint, status}     HTTP responses (endpoint: the route, "other" for unknown paths)
    clover_prompt_tokens_total                  prompt tokens of the replies generated
    clover_generated_tokens_total               tokens generated (each reply's first included)
    clover_replies_total{finish}                replies generated to their end: eos, stop or length
    clover_target_steps_total                   target forwards after the prefills (one per decoding step)
    clover_draft_tokens_proposed_total          drafted tokens the target verified
    clover_draft_tokens_accepted_total          drafted tokens it accepted that were emitted
    clover_tau                                  tokens per target step since the start (decoding steps)
    clover_acceptance_rate                      the share of the decoding steps' tokens that were drafted ones, since
                                                the start (a response's acceptance_rate)
    clover_queue_length                         requests waiting for the engine
    clover_requests_running                     requests the engine is running (0 or 1)
    clover_step_seconds                         a histogram of the decoding steps' time (draft + verify)
"""

from __future__ import annotations

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/api/chat",
             "/api/generate", "/api/tags", "/api/ps", "/api/show", "/api/version")
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def endpoint(path: str) -> str:
    """A path as a label: the route it is, or "other" (a label per unknown path would grow without end)."""
    if path in ENDPOINTS:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


class Metrics:
    """The server's counters; `add(ev)` takes the engine's steps (a total of the reply loop, reply.stream)."""

    def __init__(self, worker_status):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        from .stats import Stats

        r = self.registry = CollectorRegistry()
        self.totals = Stats()
        self.requests = Counter("clover_requests", "HTTP responses by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("clover_prompt_tokens", "Prompt tokens of the replies generated", registry=r)
        self.generated = Counter("clover_generated_tokens", "Tokens generated", registry=r)
        self.replies = Counter("clover_replies", "Replies generated to their end, by how they ended", ["finish"],
                               registry=r)
        self.steps = Counter("clover_target_steps", "Target forwards after the prefills", registry=r)
        self.proposed = Counter("clover_draft_tokens_proposed", "Drafted tokens the target verified", registry=r)
        self.accepted = Counter("clover_draft_tokens_accepted", "Drafted tokens accepted and emitted", registry=r)
        self.step_s = Histogram("clover_step_seconds", "Time of a decoding step (draft and verify)",
                                buckets=STEP_BUCKETS, registry=r)
        Gauge("clover_tau", "Tokens per target step since the start (decoding steps)",
              registry=r).set_function(lambda: self.totals.tau or 0.0)
        Gauge("clover_acceptance_rate", "Share of the decoding steps' tokens that were drafted, since the start",
              registry=r).set_function(lambda: self.totals.acceptance_rate or 0.0)
        Gauge("clover_queue_length", "Requests waiting for the engine",
              registry=r).set_function(lambda: worker_status()["waiting"])
        Gauge("clover_requests_running", "Requests the engine is running",
              registry=r).set_function(lambda: worker_status()["running"])

    def add(self, ev):
        """One engine step (reply.stream calls it for each)."""
        self.totals.add(ev)
        self.generated.inc(len(ev.tokens))
        if not ev.prefill:
            self.steps.inc()
            self.proposed.inc(ev.proposed)
            self.accepted.inc(ev.accepted)
            self.step_s.observe(ev.elapsed_s)

    def reply_done(self, prompt_tokens: int, finish: str | None):
        self.prompt_tokens.inc(prompt_tokens)
        self.replies.labels(finish or "unknown").inc()

    def page(self) -> tuple[bytes, str]:
        """The text format, and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class CountRequests:
    """ASGI middleware: each HTTP response counted by endpoint and status (401s and preflights included)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint(scope["path"]), str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)
