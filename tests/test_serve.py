"""`clover serve` with real clients over loopback: the `openai` package (streamed and not), curl, raw HTTP, many
concurrent clients, every malformed request of the issue, a client that hangs up; replies compared with `clover
generate` (and `clover chat`) at temperature 0. The app runs in-process on uvicorn in a thread (a free port), and
once as the `clover serve` command in a subprocess."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from test_cli import gen, isolated  # noqa: F401 (autouse: stats and the Hub stay private)

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["Hello! What is the capital of France?", "Tell me about the fox and the dog.", "What is 2 + 3?",
           "def add(a, b):"]
N = 24  # tokens per reply


@contextmanager
def serving(session, **kwargs):
    """A Server for `session` on a free loopback port, run by uvicorn in a thread: yields it with `.url`."""
    from clover_cli.listener import listen, run
    from clover_cli.serve import Server

    server = Server(session, **kwargs)
    sock = listen("127.0.0.1", 0)
    started = []
    thread = threading.Thread(target=run, args=(server, sock, started.append), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (started and started[0].started):
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    server.url = "http://127.0.0.1:%d" % sock.getsockname()[1]
    try:
        yield server
    finally:
        started[0].should_exit = True
        thread.join(10)
        assert not thread.is_alive()


def load(model, **over):
    from clover_cli.session import Options, Session

    return Session(Options(model=str(model), draft=over.pop("draft", "ngram"), **over), quiet=True)


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    from clover_cli.stats import StatsWriter

    stats = tmp_path_factory.mktemp("serve-stats") / "stats.jsonl"
    with serving(load(llama_dir), max_body=64 * 1024, writer=StatsWriter.open(str(stats))) as s:
        s.stats_path = stats
        yield s


@pytest.fixture(scope="module")
def reference(llama_dir, tmp_path_factory):
    """`clover generate --json` of each prompt (chat template, and --raw), as a subprocess would print it."""
    from clover_cli.process import main

    root = tmp_path_factory.mktemp("prompts")
    out = {}
    for i, text in enumerate(PROMPTS):
        path = root / f"{i}.txt"
        path.write_text(text)
        for raw in (False, True):
            args = ["generate", str(llama_dir), "-f", str(path), "--json", "-n", str(N), "--draft", "ngram",
                    "--stats-file", "off"] + (["--raw"] if raw else [])
            out[text, raw] = _json_of(main, args)
    return out


def _json_of(main, args) -> dict:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        with pytest.raises(SystemExit) as e:
            main(args)
    assert e.value.code == 0
    return json.loads(buf.getvalue())


def request(url: str, method: str, path: str, body=None, headers=None, timeout: float = 60):
    """(status, headers, parsed JSON or text) of one HTTP request; body: a dict (sent as JSON) or bytes."""
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = raw.decode()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, parsed


def chat_body(text: str, **extra) -> dict:
    """A chat request, greedy unless `extra` says otherwise (the API's default temperature is 1)."""
    return {"model": extra.pop("model", None), "messages": [{"role": "user", "content": text}], "max_tokens": N,
            "temperature": 0, **extra}


def ask(server, text: str, **extra) -> str:
    status, _, body = request(server.url, "POST", "/v1/chat/completions", chat_body(text, **extra))
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def sse_events(text: str) -> list:
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", text[-300:]
    return [json.loads(e) for e in events[:-1]]


def openai_client(server, key="none"):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


# --- the openai client ----------------------------------------------------------------------------------------


def test_openai_client_chat_is_clover_generate(server, reference):
    client = openai_client(server)
    model = client.models.list().data[0].id
    for text in PROMPTS[:2]:
        want = reference[text, False]
        resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                              max_tokens=N, temperature=0)
        assert resp.choices[0].message.content == want["text"].strip()
        assert resp.choices[0].finish_reason == ("length" if want["finish"] == "length" else "stop")
        assert resp.usage.prompt_tokens == want["prompt_tokens"]
        assert resp.usage.completion_tokens == want["new_tokens"]
        assert resp.usage.total_tokens == want["prompt_tokens"] + want["new_tokens"]
        figures = resp.model_extra["clover"]
        assert figures["draft"] == "ngram" and figures["steps"] >= 1 and figures["verify_s"] > 0
        assert figures["tau"] == pytest.approx((want["new_tokens"] - 1) / figures["steps"], abs=1e-3)
        assert 0 <= figures["acceptance_rate"] <= 1

        pieces, finish, extra, usage = [], None, None, None
        for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                                    max_tokens=N, stream=True, stream_options={"include_usage": True},
                                                    temperature=0):
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
                extra = (chunk.model_extra or {}).get("clover") or extra
            usage = chunk.usage or usage
        assert "".join(pieces) == want["text"].strip()
        assert len([p for p in pieces if p]) > 1, "the reply streamed in pieces"
        assert finish == resp.choices[0].finish_reason and extra["steps"] >= 1  # n-gram statistics grew: fewer
        assert usage.completion_tokens == want["new_tokens"]


def test_openai_client_completions_are_generate_raw(server, reference):
    client = openai_client(server)
    for text in PROMPTS[2:]:
        want = reference[text, True]
        resp = client.completions.create(model=server.model_id, prompt=text, max_tokens=N, temperature=0)
        assert resp.choices[0].text == want["text"]
        assert resp.usage.prompt_tokens == want["prompt_tokens"]
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=server.model_id, prompt=text, max_tokens=N, stream=True, temperature=0) if c.choices)
        assert streamed == want["text"]


def test_a_repetition_penalty_is_clover_generates(server, llama_dir, tmp_path):
    """`repetition_penalty` in a request (as transformers, vLLM and TGI clients send it) gives what `clover generate
    --repetition-penalty` gives; a bad one is a 400."""
    from clover_cli.process import main

    path = tmp_path / "p.txt"
    path.write_text(PROMPTS[1])
    want = _json_of(main, ["generate", str(llama_dir), "-f", str(path), "--json", "-n", str(N), "--draft",
                           "ngram", "--stats-file", "off", "--repetition-penalty", "1.8"])
    plain = _json_of(main, ["generate", str(llama_dir), "-f", str(path), "--json", "-n", str(N), "--draft",
                            "ngram", "--stats-file", "off"])
    assert want["text"] != plain["text"]
    assert ask(server, PROMPTS[1], repetition_penalty=1.8) == want["text"].strip()
    status, _, err = request(server.url, "POST", "/v1/chat/completions", chat_body("hi", repetition_penalty=0))
    assert status == 400 and err["error"]["param"] == "repetition_penalty"


def test_other_servers_sampling_fields(server, reference, capsys, monkeypatch):
    """What llama-server and vLLM clients send: fields clover has (top_k, min_p, repeat_penalty) applied, the others
    accepted, ignored and named in X-Clover-Ignored (streamed too), with a note in the log; a malformed one is a
    400."""
    from clover_cli import listener

    monkeypatch.setattr(listener, "_notes", listener.RateLimit(burst=5))  # notes of earlier tests do not count
    extra = {"mirostat": 2, "typical_p": 0.9, "cache_prompt": True, "presence_penalty": 0, "samplers": ["top_k"],
             "frequency_penalty": 0.5}
    status, headers, body = request(server.url, "POST", "/v1/chat/completions", chat_body(PROMPTS[2], **extra))
    assert status == 200, body
    assert headers["x-clover-ignored"] == "mirostat,typical_p,cache_prompt,samplers,frequency_penalty"
    assert body["choices"][0]["message"]["content"] == reference[PROMPTS[2], False]["text"].strip()
    assert "note: ignored request fields" in capsys.readouterr().err
    status, headers, text = request(server.url, "POST", "/v1/chat/completions",
                                    chat_body(PROMPTS[2], stream=True, tfs_z=1.0))
    assert status == 200 and headers["x-clover-ignored"] == "tfs_z"
    assert "x-clover-ignored" not in request(server.url, "POST", "/v1/chat/completions",
                                             chat_body(PROMPTS[2], presence_penalty=0))[1]
    # applied: llama-server's repeat_penalty is repetition_penalty; top_k 1 is greedy whatever the temperature
    assert ask(server, PROMPTS[1], repeat_penalty=1.8) == ask(server, PROMPTS[1], repetition_penalty=1.8) \
        != ask(server, PROMPTS[1])
    assert ask(server, PROMPTS[2], temperature=1.5, top_k=1) == reference[PROMPTS[2], False]["text"].strip()
    for n_predict, tokens in ((5, 5), (-1, N)):  # llama-server's max_tokens (-1: no limit, max_tokens N holds)
        status, _, body = request(server.url, "POST", "/v1/completions", {"prompt": PROMPTS[3], "temperature": 0,
                                                                          "n_predict": n_predict, **(
                                                                              {"max_tokens": N} if n_predict < 0 else {})})
        assert status == 200 and body["usage"]["completion_tokens"] == tokens, body
    assert request(server.url, "POST", "/v1/completions", {"prompt": "hi", "n_predict": 0})[0] == 400


def test_api_defaults(slow, llama_dir):
    """No temperature: sampled at 1 (OpenAI's default), not greedy; no max_tokens: not cut at 256 but run to the end
    of the context (or an end of sequence); --max-new-tokens sets what a request without max_tokens gets."""
    def reply(**extra):
        body = {"messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": N, **extra}
        status, _, got = request(slow.url, "POST", "/v1/chat/completions", body)
        assert status == 200, got
        return got["choices"][0]["message"]["content"]

    sampled = [reply(seed=seed) for seed in range(3)]
    assert sampled == [reply(seed=seed, temperature=1.0) for seed in range(3)]
    assert any(text != reply(temperature=0) for text in sampled)
    status, _, body = request(slow.url, "POST", "/v1/completions", {"prompt": PROMPTS[3], "temperature": 0})
    assert status == 200, body
    usage, finish = body["usage"], body["choices"][0]["finish_reason"]
    assert finish == "length" and usage["total_tokens"] == slow.session.max_context, body  # this model's greedy
    assert usage["completion_tokens"] > 256  # reply to it never ends
    with serving(load(llama_dir, draft="none"), max_new_tokens=5) as capped:
        status, _, body = request(capped.url, "POST", "/v1/completions", {"prompt": PROMPTS[3], "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] == 5, body
        status, _, body = request(capped.url, "POST", "/v1/completions", {"prompt": PROMPTS[3], "max_tokens": 7})
        assert status == 200 and body["usage"]["completion_tokens"] == 7, body


def test_any_model_name_is_answered_by_the_model_served(server, reference):
    """Clients send names of their own ("gpt-4o", an Ollama tag): the one model served answers, and says its name."""
    status, _, body = request(server.url, "POST", "/v1/chat/completions", chat_body(PROMPTS[0], model="gpt-4o"))
    assert status == 200, body
    assert body["model"] == server.model_id != "gpt-4o"
    assert body["choices"][0]["message"]["content"] == ask(server, PROMPTS[0])


def test_stop_strings(server, reference):
    client = openai_client(server)
    full = reference[PROMPTS[0], False]["text"].strip()
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full
    cut = client.chat.completions.create(model=server.model_id, messages=[{"role": "user", "content": PROMPTS[0]}],
                                         max_tokens=N, stop=[stop], temperature=0)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[:full.index(stop)].strip()
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=server.model_id, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=N, stop=stop,
        stream=True, temperature=0) if c.choices)
    assert streamed == cut.choices[0].message.content, "the stream never shows the stop string"


def test_seeded_sampling(server, slow):
    """A seed repeats a sampled reply when the drafts repeat (they steer which random numbers are used): always
    without a drafter; the n-gram drafter learns from every reply, so there the samples only follow the seed's
    distribution."""
    def sample(where, seed):
        return openai_client(where).chat.completions.create(
            model=where.model_id, max_tokens=N, temperature=1.0, top_p=0.9, seed=seed,
            messages=[{"role": "user", "content": PROMPTS[1]}]).choices[0].message.content

    assert sample(slow, 7) == sample(slow, 7)
    assert len({sample(server, s) for s in range(4)}) > 1


def test_a_conversation_is_clover_chat(server, llama_dir, run_cli):
    """Two turns through the API (the client sends the first reply back) give `clover chat`'s two replies."""
    first = ask(server, PROMPTS[0])
    second = request(server.url, "POST", "/v1/chat/completions", {"max_tokens": N, "temperature": 0, "messages": [
        {"role": "user", "content": PROMPTS[0]}, {"role": "assistant", "content": first},
        {"role": "user", "content": PROMPTS[2]}]})[2]["choices"][0]["message"]["content"]
    code, out, err = run_cli("chat", str(llama_dir), "--draft", "ngram", "-n", str(N), "--stats-file", "off",
                             stdin=f"{PROMPTS[0]}\n{PROMPTS[2]}\n")
    assert code == 0, err
    assert out == f"{first}\n{second}\n"


# --- curl -----------------------------------------------------------------------------------------------------


def curl(*args) -> str:
    done = subprocess.run(["curl", "-sS", "--max-time", "60", *args], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_curl(server, reference):
    want = reference[PROMPTS[3], False]["text"].strip()
    body = json.dumps(chat_body(PROMPTS[3]))
    assert json.loads(curl(server.url + "/v1/chat/completions", "-d", body))["choices"][0]["message"]["content"] \
        == want  # curl -d sends a form content type: the body is read as JSON anyway
    events = sse_events(curl("-N", server.url + "/v1/chat/completions", "-H", "Content-Type: application/json",
                             "-d", json.dumps(chat_body(PROMPTS[3], stream=True))))
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == want
    assert events[-1]["choices"][0]["finish_reason"] and "tau" in events[-1]["clover"]
    models = json.loads(curl(server.url + "/v1/models"))
    assert [m["id"] for m in models["data"]] == [server.model_id]
    health = json.loads(curl(server.url + "/health"))
    assert health["status"] == "ok" and health["queue"]["running"] == 0 and health["queue"]["waiting"] == 0


# --- many clients ---------------------------------------------------------------------------------------------


def test_concurrent_clients_get_the_serial_replies(server, reference):
    """24 clients at once, 3 requests each (streamed and not, chat and completions): every reply is the one
    `clover generate` gives; they were queued (positions reported), and all finish within the time limit."""
    jobs = [(PROMPTS[(c + r) % len(PROMPTS)], (c + r) % 3) for c in range(24) for r in range(3)]

    def one(job):
        text, kind = job
        if kind == 2:
            status, headers, body = request(server.url, "POST", "/v1/completions",
                                            {"prompt": text, "max_tokens": N, "temperature": 0})
            return status, headers, body["choices"][0]["text"]
        status, headers, body = request(server.url, "POST", "/v1/chat/completions",
                                        chat_body(text, stream=kind == 1))
        if kind == 1:
            return status, headers, "".join(e["choices"][0]["delta"].get("content", "") for e in sse_events(body))
        return status, headers, body["choices"][0]["message"]["content"]

    t0 = time.monotonic()
    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(one, jobs, timeout=240))
    assert time.monotonic() - t0 < 240
    for (text, kind), (status, headers, reply) in zip(jobs, results):
        assert status == 200
        want = reference[text, kind == 2]["text"]
        assert reply == (want if kind == 2 else want.strip()), (text, kind)
    positions = [int(h["x-clover-queue-position"]) for _, h, _ in results]
    assert max(positions) > 0, "requests that arrived together waited their turn"
    assert request(server.url, "GET", "/health")[2]["queue"]["waiting"] == 0


# --- bad requests ---------------------------------------------------------------------------------------------

LONG = "the quick brown fox jumps over the lazy dog " * 200  # far over llama_dir's 512 positions

BAD = [
    ("POST", "/v1/chat/completions", b'{"messages": [', 400, "invalid_json"),
    ("POST", "/v1/chat/completions", b"\xff\xfe", 400, "invalid_json"),
    ("POST", "/v1/chat/completions", b"[1, 2]", 400, "invalid_json"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}, 400,
     "unknown_parameter"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 17}, 400, None),
    ("POST", "/v1/completions", {"prompt": "hi", "n": "2"}, 400, None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, 400, None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                      "top_logprobs": 21}, 400, None),
    ("POST", "/v1/completions", {"prompt": "hi", "logprobs": True}, 400, None),
    ("POST", "/v1/completions", {"prompt": "hi", "best_of": 2}, 400, "unsupported_parameter"),
    ("POST", "/v1/chat/completions", {"messages": []}, 400, None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, 400, None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": ["a"] * 5}, 400,
     None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400,
     "context_length_exceeded"),
    ("POST", "/v1/completions", {"prompt": LONG, "stream": True}, 400, "context_length_exceeded"),
    ("POST", "/v1/completions", {"prompt": ""}, 400, None),
    ("POST", "/v1/chat/completions", {"model": 4, "messages": [{"role": "user", "content": "hi"}]}, 400, None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "mirostat": "on"}, 400, None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "typical_p": True}, 400, None),
    ("POST", "/v1/completions", {"prompt": "hi", "cache_prompt": 1}, 400, None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 3}, 400,
     None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "repeat_penalty": 1.1,
                                      "repetition_penalty": 1.2}, 400, None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "repeat_penalty": -1}, 400,
     None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "response_format": {"type": "json_object"}}, 400, "unsupported_parameter"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": "json"},
     400, None),
    # an integer too large for a float (math.isfinite raises on it), for a field clover applies and one it ignores
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 10 ** 400}, 400,
     None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 10 ** 400},
     400, None),
    # a tool call's arguments nested deeper than Python's stack (json.loads raises RecursionError)
    ("POST", "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": "[" * 10_000 + "]" * 10_000}}]},
        {"role": "user", "content": "again"}]}, 400, None),
    ("GET", "/v1/models/gpt-4o", None, 404, "model_not_found"),
    ("GET", "/v1/chat/completions", None, 405, "method_not_allowed"),
    ("POST", "/metrics", None, 405, "method_not_allowed"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "x"}]},
     400, None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "tool", "content": "18"}], "tool_choice": "required"},
     400, "unsupported_parameter"),
    ("GET", "/v2/anything", None, 404, "not_found"),
    ("POST", "/v1/chat/completions", b"{" + b" " * (65 * 1024) + b"}", 413, "request_too_large"),
]


@pytest.mark.parametrize("method,path,body,status,code", BAD,
                         ids=[f"{i}-{b[4]}" for i, b in enumerate(BAD)])
def test_bad_request_gets_a_json_error_and_the_server_goes_on(server, reference, method, path, body, status, code):
    got, headers, err = request(server.url, method, path, body)
    assert got == status, err
    assert headers["content-type"] == "application/json"
    assert set(err) == {"error"} and isinstance(err["error"]["message"], str) and err["error"]["message"]
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["code"] == code
    assert "Traceback" not in err["error"]["message"]
    assert ask(server, PROMPTS[2]) == reference[PROMPTS[2], False]["text"].strip()


def test_chunked_body_over_the_limit(server):
    """No Content-Length: the body is counted as it arrives."""
    host, port = server.url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/chat/completions", body=iter([b"{", b" " * (40 * 1024), b" " * (40 * 1024), b"}"]),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "request_too_large"


def test_api_key(llama_dir, reference):
    with serving(load(llama_dir), api_key="s3cret") as keyed:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Bearer s3cret-and-more"}):
            for method, path, body in (("GET", "/health", None), ("GET", "/v1/models", None),
                                       ("POST", "/v1/chat/completions", chat_body(PROMPTS[0])),
                                       ("GET", "/nowhere", None)):
                status, got, err = request(keyed.url, method, path, body, headers)
                assert status == 401 and err["error"]["code"] == "invalid_api_key", (headers, path)
                assert got["www-authenticate"] == "Bearer"
        openai = pytest.importorskip("openai")
        with pytest.raises(openai.AuthenticationError):
            openai_client(keyed, "wrong").models.list()
        resp = openai_client(keyed, "s3cret").chat.completions.create(
            model=keyed.model_id, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=N, temperature=0)
        assert resp.choices[0].message.content == reference[PROMPTS[0], False]["text"].strip()


# --- several replies, logprobs ---------------------------------------------------------------------------------


def test_n_replies(slow):
    """n replies, indexed 0..n-1, generated one after another: reply i of a seeded request is the single reply of
    seed + i; streamed, each chunk names its reply; usage counts them all."""
    client = openai_client(slow)
    messages = [{"role": "user", "content": PROMPTS[1]}]
    resp = client.chat.completions.create(model="any", messages=messages, max_tokens=N, n=3, seed=5, temperature=1.0)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    singles = [client.chat.completions.create(model="any", messages=messages, max_tokens=N, seed=5 + i,
                                              temperature=1.0) for i in range(3)]
    assert [c.message.content for c in resp.choices] == [r.choices[0].message.content for r in singles]
    assert len({c.message.content for c in resp.choices}) > 1
    assert resp.usage.completion_tokens == sum(r.usage.completion_tokens for r in singles)
    texts, finishes = {}, {}
    for chunk in client.chat.completions.create(model="any", messages=messages, max_tokens=N, n=3, seed=5,
                                                temperature=1.0, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            finishes[c.index] = c.finish_reason or finishes.get(c.index)
    assert [texts[i] for i in range(3)] == [c.message.content for c in resp.choices]
    assert [finishes[i] for i in range(3)] == [c.finish_reason for c in resp.choices]
    done = client.completions.create(model="any", prompt=PROMPTS[3], max_tokens=8, n=2, temperature=0)
    assert [c.index for c in done.choices] == [0, 1] and done.choices[0].text == done.choices[1].text


@pytest.fixture(scope="module")
def recorded(llama_dir):
    """A server (the n-gram drafter: steps of several tokens) whose engine's replies are logged: (prompt ids,
    tokens). A fixed tree budget: the drafter is asked at every step whatever this machine's timings (the auto budget
    may find drafting unpaid on a busy machine, and the tests want speculative steps)."""
    session = load(llama_dir, tree_budget="8")
    generate, runs = session.generate, []

    def logged(prompt, *args, **kwargs):
        runs.append((list(prompt), []))
        for ev in generate(prompt, *args, **kwargs):
            runs[-1][1].extend(ev.tokens)
            yield ev

    session.generate = logged
    with serving(session) as s:
        s.runs = runs
        yield s


def plain_logprobs(model_dir, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log_softmax of a plain transformers forward over prompt + tokens: row j is the distribution of tokens[j]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)], dim=-1)


def test_logprobs_are_the_targets(recorded, llama_dir):
    """logprobs / top_logprobs: the target's own log-probabilities of the tokens emitted (a plain forward's
    log_softmax, within 1e-4), greedy and sampled, speculative steps of several tokens included; the same when
    streamed; completions' logprobs in their own shape."""
    client = openai_client(recorded)
    messages = [{"role": "user", "content": PROMPTS[1]}]
    for temperature in (0.0, 1.0):
        resp = client.chat.completions.create(model="any", messages=messages, max_tokens=40, logprobs=True,
                                              top_logprobs=3, temperature=temperature, seed=3)
        prompt, tokens = recorded.runs[-1]
        content = resp.choices[0].logprobs.content
        assert 0 < len(content) <= len(tokens)
        want = plain_logprobs(llama_dir, prompt, tokens)
        for j, entry in enumerate(content):
            assert entry.logprob == pytest.approx(want[j, tokens[j]].item(), abs=1e-4), j
            top = want[j].topk(3)
            assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
            assert entry.bytes == list(entry.token.encode())
        if resp.choices[0].finish_reason == "length":  # every token emitted is reported
            assert len(content) == len(tokens)
        if temperature == 0.0:
            assert resp.model_extra["clover"]["acceptance_rate"] > 0, "no drafted token was accepted"
            assert all(e.logprob == pytest.approx(e.top_logprobs[0].logprob) for e in content)  # greedy: the argmax
            streamed = [c for c in client.chat.completions.create(
                model="any", messages=messages, max_tokens=40, logprobs=True, top_logprobs=3, temperature=0,
                stream=True) if c.choices and c.choices[0].logprobs]
            assert len(streamed) == 1
            assert [e.logprob for e in streamed[0].choices[0].logprobs.content] == pytest.approx(
                [e.logprob for e in content], abs=1e-5)
    plain = client.chat.completions.create(model="any", messages=messages, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None
    done = client.completions.create(model="any", prompt=PROMPTS[3], max_tokens=12, logprobs=2, temperature=0)
    prompt, tokens = recorded.runs[-1]
    lp = done.choices[0].logprobs
    want = plain_logprobs(llama_dir, prompt, tokens)
    assert lp.token_logprobs == pytest.approx([want[j, t].item() for j, t in enumerate(tokens[:len(lp.tokens)])],
                                              abs=1e-4)
    assert all(len(top) <= 2 for top in lp.top_logprobs) and len(lp.tokens) == 12 == len(tokens)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_chat_logprobs_cover_the_content_not_the_whitespace_stripped_from_it(tmp_path):
    """A chat reply's content is its text stripped: its logprobs leave out the tokens of whitespace before and after
    it (they keep a token that reaches into it); a completion's keep every token of the text."""
    from types import SimpleNamespace

    from clover_cli.worker import reply_logprobs
    from conftest import build_tokenizer

    tok = build_tokenizer(tmp_path)
    session = SimpleNamespace(tokenizer=tok, eos_ids={tok.eos_token_id})
    text = "\n\n the quick brown fox.\n\n \n"
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    rows = [(-0.1 * i, [(i, -0.1 * i)]) for i in range(len(ids))]
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[0].strip() == "" and pieces[-2].strip() == ""  # whitespace-only tokens at both ends
    everything = reply_logprobs(session, ids, rows, text)
    assert "".join(e["token"] for e in everything) == text  # the end-of-sequence token left out
    content = reply_logprobs(session, ids, rows, text, chat=True)
    assert "".join(e["token"] for e in content).strip() == text.strip()
    assert content[0]["token"].strip() and content[-1]["token"].strip()
    first = pieces.index(content[0]["token"])
    assert [e["logprob"] for e in content] == [r[0] for r in rows[first:first + len(content)]]


# --- tools ----------------------------------------------------------------------------------------------------

TOOL_TEMPLATE = """{%- if tools %}<|tools|>
{%- for tool in tools %}
{{ tool.function.name }}: {{ tool.function.description }} {{ tool.function.parameters | tojson }}
{%- endfor %}
Call one as <tool_call>{"name": NAME, "arguments": {...}}</tool_call>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>{% for c in m.tool_calls %}<tool_call>{{ {"name": \
c.function.name, "arguments": c.function.arguments} | tojson }}</tool_call>{% endfor %}
{% else %}<|{{ m.role }}|>{{ m.content }}
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


@pytest.fixture(scope="module")
def tooled(llama_dir, tmp_path_factory):
    """A server whose chat template (--chat-template FILE) shows tools Hermes' way; the random model cannot call
    one, so a reply may be scripted (`.script`: the next reply's text, as the engine's tokens); `.prompts` logs
    the prompts the engine got."""
    from clover_cli.decode.engine import StepEvent

    path = tmp_path_factory.mktemp("template") / "tools.jinja"
    path.write_text(TOOL_TEMPLATE)
    session = load(llama_dir, chat_template=str(path))
    generate, prompts, script = session.generate, [], []

    def scripted(prompt, max_new_tokens, sampling, stop_strings=None):
        prompts.append(session.tokenizer.decode(prompt))
        if not script:
            yield from generate(prompt, max_new_tokens, sampling, stop_strings)
            return
        ids = session.tokenizer(script.pop(0), add_special_tokens=False)["input_ids"]
        yield StepEvent(ids[:1], [0], prefill=True)
        yield StepEvent(ids[1:], [0] * (len(ids) - 1), finish="eos")

    session.generate = scripted
    with serving(session) as s:
        s.prompts, s.script = prompts, script
        yield s


def test_tool_calls(tooled):
    """`tools` reach the chat template; a reply in Hermes' format comes back as OpenAI tool_calls (finish_reason
    tool_calls), streamed too; the tool's result goes back in the conversation; a reply without a call is text."""
    client = openai_client(tooled)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    tooled.script.append("Let me look. " + call)
    resp = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER], max_tokens=N)
    assert "get_weather: The weather in a city now" in tooled.prompts[-1] and '"city"' in tooled.prompts[-1]
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    [got] = choice.message.tool_calls
    assert got.type == "function" and got.function.name == "get_weather" and got.id
    assert json.loads(got.function.arguments) == {"city": "Paris"}

    tooled.script.append(call + call.replace("Paris", "Oslo"))
    chunks = list(client.chat.completions.create(model="m", messages=messages, tools=[WEATHER], max_tokens=N,
                                                 stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert [json.loads(t.function.arguments)["city"] for d in deltas for t in d.tool_calls] == ["Paris", "Oslo"]
    assert [t.index for d in deltas for t in d.tool_calls] == [0, 1]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]

    history = messages + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": got.id, "type": "function", "function": {"name": "get_weather", "arguments": got.function.arguments}}]},
        {"role": "tool", "tool_call_id": got.id, "content": "18 degrees and sunny"}]
    tooled.script.append("It is 18 degrees and sunny in Paris.")
    resp = client.chat.completions.create(model="m", messages=history, tools=[WEATHER], max_tokens=N)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in tooled.prompts[-1]
    assert "<|tool|>18 degrees and sunny" in tooled.prompts[-1]
    assert resp.choices[0].finish_reason == "stop" and not resp.choices[0].message.tool_calls
    assert resp.choices[0].message.content == "It is 18 degrees and sunny in Paris."

    tooled.script.append(call)  # tool_choice none: no tools shown, the reply is text
    resp = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER], tool_choice="none",
                                          max_tokens=N)
    assert "<|tools|>" not in tooled.prompts[-1] and resp.choices[0].message.content == call
    tooled.script.append('<tool_call>{"name": broken</tool_call>')  # not JSON: left as text
    resp = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER], max_tokens=N)
    assert resp.choices[0].finish_reason == "stop" and "broken" in resp.choices[0].message.content


def test_ollama_tool_calls(tooled, server):
    """Ollama's client with tools: the call comes back in Ollama's shape (arguments as an object), streamed too; the
    call and its result go back in the conversation; a template without tools is a 400."""
    ollama = pytest.importorskip("ollama")
    client = ollama_client(tooled)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    tooled.script.append(call)
    resp = client.chat(model="m", messages=messages, tools=[WEATHER])
    assert "get_weather: The weather in a city now" in tooled.prompts[-1]
    [got] = resp.message.tool_calls
    assert got.function.name == "get_weather" and dict(got.function.arguments) == {"city": "Paris"}
    assert resp.message.content == "" and resp.done
    tooled.script.append(call)
    parts = list(client.chat(model="m", messages=messages, tools=[WEATHER], stream=True))
    assert [t.function.name for p in parts for t in (p.message.tool_calls or [])] == ["get_weather"]
    assert parts[-1].done
    tooled.script.append("Sunny.")
    resp = client.chat(model="m", tools=[WEATHER], messages=messages + [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                          "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 degrees", "tool_name": "get_weather"}])
    assert '{"city": "Paris"}' in tooled.prompts[-1] and "<|tool|>18 degrees" in tooled.prompts[-1]
    assert resp.message.content == "Sunny." and not resp.message.tool_calls
    with pytest.raises(ollama.ResponseError) as e:
        ollama_client(server).chat(model="x", messages=messages, tools=[WEATHER])
    assert e.value.status_code == 400 and "does not use tools" in e.value.error


def test_tools_refused(server, tooled):
    """A template that does not show tools, a tool_choice clover cannot force, malformed tools and tool messages:
    400s that say so."""
    user = [{"role": "user", "content": "hi"}]
    status, _, err = request(server.url, "POST", "/v1/chat/completions", chat_body("hi", tools=[WEATHER]))
    assert status == 400 and "does not use tools" in err["error"]["message"] and err["error"]["param"] == "tools"
    for extra in ({"tools": [WEATHER], "tool_choice": "required"},
                  {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                  {"tools": "get_weather"}, {"tools": [{"type": "function"}]},
                  {"tools": [{"type": "code_interpreter"}]}):
        status, _, err = request(tooled.url, "POST", "/v1/chat/completions", {"messages": user, **extra})
        assert status == 400 and err["error"]["message"], extra
    for bad in ({"role": "tool", "content": 5}, {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]},
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{nope"}}]}):
        status, _, err = request(tooled.url, "POST", "/v1/chat/completions", {"messages": user + [bad]})
        assert status == 400 and err["error"]["message"].startswith("messages[1]"), bad
    assert ask(server, PROMPTS[2])


# --- metrics --------------------------------------------------------------------------------------------------


def scrape(url: str) -> dict:
    """GET /metrics parsed by prometheus_client's own parser: {(sample name, labels as a sorted tuple): value}."""
    parser = pytest.importorskip("prometheus_client.parser")
    status, headers, text = request(url, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain"), text
    return {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
            for family in parser.text_string_to_metric_families(text) for smp in family.samples}


def test_metrics(llama_dir):
    """/metrics counts what the responses said: requests by endpoint and status, prompt and generated tokens, target
    steps, drafted tokens, τ and acceptance, the queue, the steps' times."""
    with serving(load(llama_dir, tree_budget="8")) as s:  # drafts at every step, however busy the machine
        before = scrape(s.url)
        assert before[("clover_generated_tokens_total", ())] == 0 and before[("clover_queue_length", ())] == 0
        bodies = [request(s.url, "POST", "/v1/chat/completions", chat_body(text))[2] for text in PROMPTS[:2]]
        bodies.append(request(s.url, "POST", "/v1/completions", {"prompt": PROMPTS[3], "max_tokens": N,
                                                                  "temperature": 0})[2])
        assert request(s.url, "POST", "/v1/chat/completions", {"messages": []})[0] == 400
        assert request(s.url, "GET", "/nowhere/at/all")[0] == 404
        deadline = time.monotonic() + 30  # a reply is sent as its last token is ready; its job ends right after
        while s.worker.status()["running"] and time.monotonic() < deadline:
            time.sleep(0.01)
        got = scrape(s.url)
    def req(endpoint, status):
        return got.get(("clover_requests_total", (("endpoint", endpoint), ("status", status))))

    assert req("/v1/chat/completions", "200") == 2 and req("/v1/completions", "200") == 1
    assert req("/v1/chat/completions", "400") == 1 and req("other", "404") == 1 and req("/metrics", "200") == 1
    figures = [b["clover"] for b in bodies]
    generated = sum(b["usage"]["completion_tokens"] for b in bodies)
    steps = sum(f["steps"] for f in figures)
    assert got[("clover_generated_tokens_total", ())] == generated
    assert got[("clover_prompt_tokens_total", ())] == sum(b["usage"]["prompt_tokens"] for b in bodies)
    assert got[("clover_target_steps_total", ())] == steps == got[("clover_step_seconds_count", ())]
    assert got[("clover_tau", ())] == pytest.approx((generated - len(bodies)) / steps)
    proposed, accepted = got[("clover_draft_tokens_proposed_total", ())], got[("clover_draft_tokens_accepted_total", ())]
    assert proposed >= accepted > 0
    assert got[("clover_acceptance_rate", ())] == pytest.approx(accepted / (generated - len(bodies)))
    assert sum(v for (name, _), v in got.items() if name == "clover_replies_total") == len(bodies)
    assert got[("clover_step_seconds_sum", ())] > 0
    assert got[("clover_queue_length", ())] == 0 and got[("clover_requests_running", ())] == 0


# --- Ollama's API ---------------------------------------------------------------------------------------------


def ollama_client(server):
    ollama = pytest.importorskip("ollama")
    return ollama.Client(host=server.url, timeout=60)


GREEDY = {"temperature": 0, "num_predict": N}


def test_ollama_client(server, reference):
    """Ollama's own client: list, show, chat and generate (streamed and not, raw too) give `clover generate`'s
    replies; the counts are the reply's."""
    client = ollama_client(server)
    assert [m.model for m in client.list().models] == [server.model_id]
    assert [(m.model, m.context_length) for m in client.ps().models] == [(server.model_id,
                                                                          server.session.max_context)]
    assert client.show("llama3:8b").modelinfo["clover.context_length"] == server.session.max_context
    for text in PROMPTS[:2]:
        want = reference[text, False]
        resp = client.chat(model="llama3:8b", messages=[{"role": "user", "content": text}], options=GREEDY)
        assert resp.message.role == "assistant" and resp.message.content == want["text"].strip()
        assert resp.done and resp.done_reason == ("length" if want["finish"] == "length" else "stop")
        assert resp.eval_count == want["new_tokens"] and resp.prompt_eval_count == want["prompt_tokens"]
        parts = list(client.chat(model="x", messages=[{"role": "user", "content": text}], options=GREEDY,
                                 stream=True))
        assert "".join(p.message.content for p in parts) == want["text"].strip()
        assert parts[-1].done and not any(p.done for p in parts[:-1]) and len(parts) > 2
        got = client.generate(model="x", prompt=text, options=GREEDY)
        assert got.response == want["text"].strip() and got.done
        assert "".join(p.response for p in client.generate(model="x", prompt=text, options=GREEDY, stream=True)) \
            == want["text"].strip()
    raw = reference[PROMPTS[3], True]
    assert client.generate(model="x", prompt=PROMPTS[3], raw=True, options=GREEDY).response == raw["text"]
    assert client.generate(model="x", prompt="").done_reason == "load"  # how Ollama clients preload a model


def test_ollama_raw_http(server, reference, slow):
    """Ollama's API by hand: NDJSON by default, its version, the options clover has no feature for named in
    X-Clover-Ignored, Ollama's sampling defaults (temperature 0.8, top_k 40, top_p 0.9)."""
    body = {"model": "m", "messages": [{"role": "user", "content": PROMPTS[2]}],
            "options": {**GREEDY, "num_ctx": 4096, "mirostat": 0}, "keep_alive": "5m"}
    status, headers, text = request(server.url, "POST", "/api/chat", body)
    assert status == 200 and headers["content-type"].startswith("application/x-ndjson")
    assert headers["x-clover-ignored"] == "keep_alive,options.num_ctx,options.mirostat"
    lines = [json.loads(line) for line in text.splitlines()]
    assert "".join(x["message"]["content"] for x in lines) == reference[PROMPTS[2], False]["text"].strip()
    assert lines[-1]["done"] and lines[-1]["eval_count"] > 0 and lines[-1]["total_duration"] > 0
    assert request(server.url, "GET", "/api/version")[2]["version"]
    status, headers, got = request(server.url, "POST", "/api/generate", {"prompt": PROMPTS[2], "stream": False,
                                                                         "options": GREEDY})
    assert status == 200 and got["response"] == reference[PROMPTS[2], False]["text"].strip()
    messages = [{"role": "user", "content": PROMPTS[1]}]

    def sampled(**options):
        status, _, got = request(slow.url, "POST", "/api/chat", {"messages": messages, "stream": False,
                                                                 "options": {"num_predict": N, **options}})
        assert status == 200, got
        return got["message"]["content"]

    assert [sampled(seed=s) for s in range(2)] == [sampled(seed=s, temperature=0.8, top_k=40, top_p=0.9)
                                                   for s in range(2)]
    assert sampled(seed=0) != sampled(seed=0, temperature=0.8, top_k=40, top_p=0.5) or \
        sampled(seed=1) != sampled(seed=1, temperature=0.8, top_k=40, top_p=0.5)


OLLAMA_BAD = [
    ("POST", "/api/chat", b'{"messages": [', 400),
    ("POST", "/api/chat", {"messages": []}, 400),
    ("POST", "/api/chat", {"messages": [{"role": "robot", "content": "hi"}]}, 400),
    ("POST", "/api/chat", {"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, 400),
    ("POST", "/api/chat", {"messages": [{"role": "user", "content": "hi"}], "options": [1]}, 400),
    ("POST", "/api/chat", {"messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": 0}}, 400),
    ("POST", "/api/chat", {"messages": [{"role": "user", "content": "hi"}], "options": {"temperature": "hot"}},
     400),
    ("POST", "/api/chat", {"messages": [{"role": "user", "content": "hi"}], "format": "json"}, 400),
    ("POST", "/api/chat", {"messages": [{"role": "user", "content": "hi"}], "stream": "no"}, 400),
    ("POST", "/api/chat", {"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}, 400),
    ("POST", "/api/chat", {"messages": [{"role": "user", "content": LONG}]}, 400),
    ("POST", "/api/generate", {"prompt": 5}, 400),
    ("POST", "/api/generate", {"prompt": "hi", "raw": "yes"}, 400),
    ("POST", "/api/generate", {"prompt": "hi", "suffix": "end"}, 400),
    ("POST", "/api/show", {"model": 3}, 400),
    ("GET", "/api/chat", None, 405),
    ("GET", "/api/nowhere", None, 404),
]


@pytest.mark.parametrize("method,path,body,status", OLLAMA_BAD, ids=[f"{i}" for i in range(len(OLLAMA_BAD))])
def test_ollama_bad_request_gets_a_json_error(server, reference, method, path, body, status):
    got, headers, err = request(server.url, method, path, body)
    assert got == status, err
    assert headers["content-type"] == "application/json"
    assert set(err) == {"error"} and isinstance(err["error"], str) and err["error"] and "Traceback" not in err["error"]
    assert ask(server, PROMPTS[2]) == reference[PROMPTS[2], False]["text"].strip()


def test_ollama_client_sees_errors(server):
    ollama = pytest.importorskip("ollama")
    with pytest.raises(ollama.ResponseError) as e:
        ollama_client(server).chat(model="x", messages=[{"role": "user", "content": "hi"}], format="json")
    assert e.value.status_code == 400 and "format" in e.value.error


# --- browsers -------------------------------------------------------------------------------------------------


def preflight(url: str, origin: str) -> tuple:
    return request(url, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_pages_on_this_machine(server, reference):
    """A page on localhost, 127.0.0.1 or [::1] (any port, http or https) may call the API, as Ollama allows; any
    other origin's preflight is a 403 and its responses carry no CORS headers."""
    for origin in ("http://localhost:3000", "https://127.0.0.1", "http://[::1]:8080", "HTTP://LOCALHOST:5173"):
        status, headers, _ = preflight(server.url, origin)
        assert status == 204, origin
        assert headers["access-control-allow-origin"] == origin
        assert "POST" in headers["access-control-allow-methods"]
        assert headers["access-control-allow-headers"] == "authorization, content-type"
        status, headers, body = request(server.url, "POST", "/v1/chat/completions", chat_body(PROMPTS[2]),
                                        {"Origin": origin})
        assert status == 200 and headers["access-control-allow-origin"] == origin
        assert "X-Clover-Queue-Position" in headers["access-control-expose-headers"]
        assert body["choices"][0]["message"]["content"] == reference[PROMPTS[2], False]["text"].strip()
    for origin in ("https://evil.example", "http://localhost.evil.example", "http://127.0.0.1.nip.io:80", "null"):
        status, headers, err = preflight(server.url, origin)
        assert status == 403 and err["error"]["code"] == "origin_not_allowed", origin
        assert "access-control-allow-origin" not in headers
        status, headers, _ = request(server.url, "GET", "/v1/models", headers={"Origin": origin})
        assert status == 200 and "access-control-allow-origin" not in headers
    assert "access-control-allow-origin" not in request(server.url, "GET", "/health")[1]  # no Origin: not a browser


def test_cors_origins_named(llama_dir):
    """--cors-origin names more origins (a 401 reaches the page too: the preflight needs no key); `*` allows any."""
    with serving(load(llama_dir), cors_origins=("https://app.example",), api_key="k") as s:
        assert preflight(s.url, "https://app.example")[0] == 204
        assert preflight(s.url, "http://localhost:1")[0] == 204
        assert preflight(s.url, "https://other.example")[0] == 403
        status, headers, _ = request(s.url, "GET", "/v1/models", headers={"Origin": "https://app.example"})
        assert status == 401 and headers["access-control-allow-origin"] == "https://app.example"
    with serving(load(llama_dir), cors_origins=("*",)) as s:
        status, headers, _ = preflight(s.url, "https://anywhere.example")
        assert status == 204 and headers["access-control-allow-origin"] == "https://anywhere.example"


def test_cors_origins_parsed():
    from clover_cli.cors import parse_origins
    from clover_cli.errors import CloverError

    assert parse_origins(["https://A.example/", "*"], " http://b.example:81 ,, ") == \
        ("https://a.example", "*", "http://b.example:81")
    assert parse_origins(None, None) == ()
    for bad in ("example.com", "https://a.example/path", "http://a.example?x", ""):
        with pytest.raises(CloverError, match="--cors-origin"):
            parse_origins([bad], None)
    with pytest.raises(CloverError, match="CLOVER_CORS_ORIGINS"):
        parse_origins([], "https://ok.example,javascript:alert(1)")


# --- clients that hang up -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slow(llama_dir):
    """A server whose target forward takes 10 ms longer (and fails while `.failing` holds something), and a log of
    the replies its engine ran: (prompt length, tokens generated)."""
    session = load(llama_dir, draft="none")
    forward, runs = session.target.forward, []

    generate = session.generate

    def logged(prompt, *args, **kwargs):
        runs.append([len(prompt), 0])
        for ev in generate(prompt, *args, **kwargs):
            runs[-1][1] += len(ev.tokens)
            yield ev

    def slow_forward(*args, **kwargs):
        time.sleep(0.01)
        if failing:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(*args, **kwargs)

    session.target.forward, session.generate = slow_forward, logged
    failing = []
    with serving(session) as s:
        s.runs, s.failing = runs, failing
        yield s


def _idle(server, timeout=10.0):
    deadline = time.monotonic() + timeout
    while request(server.url, "GET", "/health")[2]["queue"]["running"]:
        assert time.monotonic() < deadline, "the engine is still busy"
        time.sleep(0.02)


def test_client_hanging_up_mid_stream_stops_its_reply(slow, llama_dir):
    body = json.dumps({"messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 400, "stream": True,
                       "stop": []}).encode()
    host, port = slow.url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        seen = b""
        while seen.count(b"data: ") < 3:  # the role chunk and two pieces of text
            seen += sock.recv(4096)
    t_gone = time.monotonic()
    _idle(slow)
    assert time.monotonic() - t_gone < 2.0
    assert slow.runs[-1][1] < 60, f"the reply went on after the client left ({slow.runs[-1][1]} of 400 tokens)"
    # the next request is served normally, from a consistent cache: the reply of a fresh engine
    fresh = load(llama_dir, draft="none")
    from clover_cli.decode.verify import Sampling

    ids = fresh.encode_chat([{"role": "user", "content": PROMPTS[1]}])
    want = fresh.decode([t for ev in fresh.generate(ids, N, Sampling()) for t in ev.tokens])
    assert ask(slow, PROMPTS[1]) == want.strip()


def test_client_hanging_up_while_queued_is_never_run(slow, reference):
    """A non-streamed request whose client leaves while another reply runs is dropped from the queue; one whose
    client leaves while it runs stops."""
    host, port = slow.url.split("//")[1].split(":")
    first = threading.Thread(target=request, args=(slow.url, "POST", "/v1/chat/completions",
                                                   chat_body(PROMPTS[0], max_tokens=60)))
    first.start()
    while not request(slow.url, "GET", "/health")[2]["queue"]["running"]:
        time.sleep(0.01)
    before = len(slow.runs)
    body = json.dumps(chat_body(PROMPTS[3], max_tokens=300)).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        time.sleep(0.1)
        assert request(slow.url, "GET", "/health")[2]["queue"]["waiting"] == 1
    first.join(60)
    _idle(slow)
    assert len(slow.runs) == before, "the abandoned request never ran"
    assert request(slow.url, "GET", "/health")[2]["queue"]["waiting"] == 0

    with socket.create_connection((host, int(port)), timeout=30) as sock:  # leaves while its reply runs
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        while len(slow.runs) == before:
            time.sleep(0.01)
        time.sleep(0.1)
    _idle(slow)
    assert slow.runs[-1][1] < 100


# --- the command ----------------------------------------------------------------------------------------------


def test_serve_command(llama_dir, tmp_path, reference):
    """`clover serve` as a user runs it: the banner and its address, the key from CLOVER_API_KEY, browser origins
    from CLOVER_CORS_ORIGINS and --cors-origin, a warning for a public address, the stats stream (`clover stats` lists the server), Ctrl-C ends it cleanly."""
    stats = tmp_path / "stats.jsonl"
    env = {**os.environ, "CLOVER_API_KEY": "k3y", "PYTHONPATH": str(REPO),
           "CLOVER_CORS_ORIGINS": "https://a.example, https://b.example"}
    proc = subprocess.Popen([sys.executable, "-m", "clover_cli", "serve", str(llama_dir), "--host", "0.0.0.0",
                             "--port", "0", "--draft", "ngram", "--stats-file", str(stats), "--cors-origin",
                             "https://c.example"], cwd=REPO, env=env,
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        lines = []
        while not lines or "OpenAI API at" not in lines[-1]:
            line = proc.stderr.readline()
            assert line, "".join(lines)
            lines.append(line)
        assert any("warning: listening on 0.0.0.0" in line for line in lines)
        assert not any("without a key" in line for line in lines)
        port = int(re.search(r"http://[^:]+:(\d+)/v1", lines[-1]).group(1))
        url = f"http://127.0.0.1:{port}"
        assert request(url, "GET", "/health")[0] == 401
        for origin, allowed in (("https://b.example", 204), ("https://c.example", 204), ("https://d.example", 403)):
            assert preflight(url, origin)[0] == allowed, origin
        status, _, body = request(url, "POST", "/v1/chat/completions", chat_body(PROMPTS[0]),
                                  {"Authorization": "Bearer k3y"})
        assert status == 200 and body["choices"][0]["message"]["content"] == reference[PROMPTS[0], False]["text"].strip()
        listed = subprocess.run([sys.executable, "-m", "clover_cli", "stats", "--stats-file", str(stats),
                                 "--json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        sessions = json.loads(listed.stdout)["by_session"]
        assert [(s["command"], s["replies"]) for s in sessions] == [("serve", 1)]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode in (0, 130) and "Traceback" not in err, err


def test_serve_bad_options(run_cli, llama_dir):
    from test_cli import assert_one_line_error

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert_one_line_error(run_cli("serve", str(llama_dir), "--port", str(port)), "cannot listen",
                              f"127.0.0.1:{port}")
    assert_one_line_error(run_cli("serve", str(llama_dir), "--port", "70000"), "--port")
    assert_one_line_error(run_cli("serve", str(llama_dir), "--api-key", " "), "--api-key")
    assert_one_line_error(run_cli("serve", str(llama_dir), "--cors-origin", "https://a.example/x"), "--cors-origin")
    assert_one_line_error(run_cli("serve", str(llama_dir), "--host", "no.such.host.invalid", "--port", "0"),
                          "cannot listen")
    assert_one_line_error(run_cli("serve", str(llama_dir), "--device-map", "auto", "--compile", "on"),
                          "--compile on")


def test_a_failing_generation_is_a_json_error(slow, llama_dir):
    """The engine fails mid-reply (out of GPU memory): a 500 JSON error, or an error event in the stream, one
    line; the next request is served."""
    slow.failing.append(True)
    try:
        status, _, err = request(slow.url, "POST", "/v1/chat/completions", chat_body(PROMPTS[0]))
        assert status == 500 and err["error"]["code"] == "generation_failed"
        assert "out of GPU memory" in err["error"]["message"] and "\n" not in err["error"]["message"]
        status, _, text = request(slow.url, "POST", "/v1/chat/completions", chat_body(PROMPTS[0], stream=True))
        assert status == 200
        assert sse_events(text)[-1]["error"]["code"] == "generation_failed"
    finally:
        slow.failing.clear()
    assert ask(slow, PROMPTS[0], max_tokens=4)


def test_readme_examples(tmp_path):
    """The curl and openai-client examples of the README's "Use it from other programs", run as written against
    the bundled model (on a free port instead of 8000)."""
    pytest.importorskip("openai")
    text = (REPO / "README.md").read_text().split("## Use it from other programs", 1)[1].split("\n## ", 1)[0]
    shell = re.search(r"```bash\n(curl .*?)```", text, re.S).group(1)
    python = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    with serving(load("tiny", draft="auto")) as s:
        port = s.url.rsplit(":", 1)[1]
        streamed = subprocess.run(["bash", "-c", shell.replace("127.0.0.1:8000", f"127.0.0.1:{port}")],
                                  capture_output=True, text=True, timeout=120)
        assert streamed.returncode == 0, streamed.stderr
        events = sse_events(streamed.stdout)
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events).strip()
        script = tmp_path / "example.py"
        script.write_text(python.replace("127.0.0.1:8000", f"127.0.0.1:{port}"))
        ran = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0, ran.stderr
        assert re.search(r"\S.*\n\(τ \d", ran.stdout, re.S), ran.stdout


def test_served_model_name(llama_dir):
    """--served-model-name: the name /v1/models lists and responses carry; a request may name any model."""
    with serving(load(llama_dir), model_id="local-model") as s:
        status, _, body = request(s.url, "GET", "/v1/models")
        assert status == 200 and [m["id"] for m in body["data"]] == ["local-model"], body
        assert request(s.url, "GET", "/v1/models/local-model")[0] == 200
        assert request(s.url, "GET", f"/v1/models/{llama_dir.name}")[0] == 404
        status, _, body = request(s.url, "POST", "/v1/chat/completions", chat_body("hi", model="gpt-4o", max_tokens=4))
        assert status == 200 and body["model"] == "local-model", body
