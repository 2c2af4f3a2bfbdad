"""A small Hub-compatible HTTP server on loopback that accepts uploads, for testing `clover train --push-to-hub`.

No package on PyPI provides a local Hub server that accepts uploads (olah, used by tests/test_hub.py, is a
read-only mirror; hf-local-hub only launches a separate Go binary that it does not ship), so this implements
just the endpoints that huggingface_hub's `create_repo`, `upload_folder` and `hf_hub_download` call, as the Hub
answers them:

  GET  /api/agent-harnesses                           a registry huggingface_hub 2.x reads for its user agent
  POST /api/repos/create                              {"name", "organization", ["type"], ["visibility"]}
  POST /api/validate-yaml                             README.md's metadata, checked before the upload
  POST /api/models/{repo}/preupload/{rev}             which files go as regular git blobs and which through LFS
  POST /{repo}.git/info/lfs/objects/batch             LFS batch API, "basic" transfer (only for LFS files)
  PUT  /lfs-objects/{oid}                             the basic transfer's upload URL (no auth, like S3)
  POST /{repo}.git/info/lfs/objects/verify            LFS verify action
  POST /api/models/{repo}/commit/{rev}                NDJSON: a header, then `file` (base64) / `lfsFile` lines
  GET  /api/models/{repo}[/revision/{rev}]            model info (upload_folder asks when nothing changed)
  HEAD|GET /{repo}/resolve/{rev}/{path}               download, with X-Repo-Commit and ETag

Which files go through LFS is the server's choice (`lfs_patterns`, fnmatch on the path: the Hub's default
.gitattributes puts *.safetensors there). Uploading an LFS file with hf_xet installed takes the Xet protocol
(a separate CAS service), which this server does not implement: with `lfs_patterns` set, the client needs
HF_HUB_DISABLE_XET=1, which makes huggingface_hub use the LFS batch API above.

Everything the client sent is kept for the test to check: `requests` ((method, path) in order, query strings
left off), `repos[repo_id]` (the create-repo payload, the files at the head of main, the commits) and `auth`
(the Authorization header of every request).
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob: what the Hub returns as the oid / ETag of a regular file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Commit:
    oid: str
    revision: str
    summary: str
    description: str
    parent_commit: str | None
    files: dict[str, bytes]  # the files this commit added or changed
    lfs_paths: set[str]  # which of them came as LFS pointers


@dataclass
class Repo:
    repo_id: str
    create_payload: dict
    files: dict[str, bytes] = field(default_factory=dict)  # head of main
    lfs_paths: set[str] = field(default_factory=set)
    commits: list[Commit] = field(default_factory=list)

    @property
    def head(self) -> str:
        return self.commits[-1].oid if self.commits else "0" * 40

    def oid(self, path: str) -> str:
        data = self.files[path]
        return hashlib.sha256(data).hexdigest() if path in self.lfs_paths else git_blob_sha1(data)


class HubUploadServer:
    """Run with `with HubUploadServer() as hub:`; `hub.url` is the endpoint (HF_ENDPOINT)."""

    def __init__(self, lfs_patterns: tuple[str, ...] = (), token: str | None = "hf_test_token"):
        self.lfs_patterns = lfs_patterns
        self.token = token  # the bearer token write calls must carry (None: any, or none)
        self.repos: dict[str, Repo] = {}
        self.lfs_store: dict[str, bytes] = {}  # sha256 -> content, uploaded through the basic transfer
        self.requests: list[tuple[str, str]] = []
        self.auth: list[str | None] = []
        self.validated_yaml: list[dict] = []  # the bodies of POST /api/validate-yaml
        self.errors: list[str] = []  # requests answered with an error, and why
        self.lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> "HubUploadServer":
        server = self

        class Handler(_Handler):
            hub = server

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hub-upload-server", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(timeout=10)
            self._httpd = None

    def __enter__(self) -> "HubUploadServer":
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def is_lfs(self, path: str) -> bool:
        return any(fnmatch.fnmatch(path, p) for p in self.lfs_patterns)


class HubError(Exception):
    def __init__(self, status: int, message: str, error_code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.error_code = status, message, error_code


class _Handler(BaseHTTPRequestHandler):
    hub: HubUploadServer
    protocol_version = "HTTP/1.1"  # keep-alive, as the Hub; every answer has a Content-Length

    def log_message(self, format, *args):  # quiet
        pass

    # ------------------------------------------------------------------------------------------ plumbing
    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()  # CRLF after each chunk
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _body(self) -> bytes:
        return self.body

    def _json_body(self) -> dict:
        try:
            return json.loads(self.body or b"{}")
        except ValueError as e:
            raise HubError(400, f"invalid JSON body: {e}")

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              content_type: str = "application/json"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj, headers: dict[str, str] | None = None):
        self._send(status, json.dumps(obj).encode(), headers)

    def _require_auth(self):
        token = self.hub.token
        if token is not None and self.headers.get("Authorization") != f"Bearer {token}":
            raise HubError(401, "Invalid credentials in Authorization header")

    def _repo(self, repo_id: str) -> Repo:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            raise HubError(404, "Repository not found", "RepoNotFound")
        return repo

    def _dispatch(self, method: str):
        path = unquote(urlsplit(self.path).path)
        hub = self.hub
        self.body = self._read_body()  # always read, so that an error answer leaves the connection usable
        with hub.lock:
            hub.requests.append((method, path))
            hub.auth.append(self.headers.get("Authorization"))
        routes = [
            ("GET", r"/api/agent-harnesses", self.agent_harnesses),
            ("POST", r"/api/repos/create", self.create_repo),
            ("POST", r"/api/validate-yaml", self.validate_yaml),
            ("POST", rf"/api/models/{REPO}/preupload/(?P<rev>[^/]+)", self.preupload),
            ("POST", rf"/api/models/{REPO}/commit/(?P<rev>[^/]+)", self.commit),
            ("POST", rf"/{REPO}\.git/info/lfs/objects/batch", self.lfs_batch),
            ("POST", rf"/{REPO}\.git/info/lfs/objects/verify", self.lfs_verify),
            ("PUT", r"/lfs-objects/(?P<oid>[0-9a-f]{64})", self.lfs_put),
            ("GET", rf"/api/models/{REPO}(?:/revision/(?P<rev>[^/]+))?", self.model_info),
            ("GET", rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)", self.resolve),
            ("HEAD", rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)", self.resolve),
        ]
        try:
            for m, pattern, fn in routes:
                match = re.fullmatch(pattern, path)
                if m == method and match:
                    with hub.lock:
                        fn(**match.groupdict())
                    return
            raise HubError(404, f"no route for {method} {path}")
        except HubError as e:
            with hub.lock:
                hub.errors.append(f"{method} {path}: {e.status} {e.message}")
            headers = {"X-Error-Message": e.message}
            if e.error_code:
                headers["X-Error-Code"] = e.error_code
            self._json(e.status, {"error": e.message}, headers)
        except Exception as e:  # a bug here: answer 500 rather than hang the client
            with hub.lock:
                hub.errors.append(f"{method} {path}: 500 {e!r}")
            self._json(500, {"error": repr(e)})

    # ------------------------------------------------------------------------------------------ endpoints
    def agent_harnesses(self):
        # huggingface_hub >= 2 fetches this registry (best effort, cached a day in HF_HOME) for its user agent
        self._json(200, {"standardEnvVars": [], "harnesses": {}})

    def validate_yaml(self):
        # upload_folder sends README.md here before anything else. Like the Hub, warn about a card without
        # YAML metadata (the client turns the warnings into a UserWarning); the YAML itself is not checked.
        payload = self._json_body()
        self.hub.validated_yaml.append(payload)
        content = payload.get("content", "")
        warnings = [] if content.startswith("---\n") else [{"message": "empty or missing yaml metadata in repo card"}]
        self._json(200, {"errors": [], "warnings": warnings})

    def create_repo(self):
        self._require_auth()
        payload = self._json_body()
        if payload.get("type") not in (None, "model"):
            raise HubError(400, f"only model repos here, not {payload.get('type')!r}")
        name, org = payload.get("name"), payload.get("organization")
        if not name:
            raise HubError(400, "name is required")
        repo_id = f"{org}/{name}" if org else f"user/{name}"
        url = f"{self.hub.url}/{repo_id}"
        if repo_id in self.hub.repos:
            # the Hub answers 409 with the repo's URL, which create_repo(exist_ok=True) returns
            self._json(409, {"error": "You already created this model repo", "url": url},
                       {"X-Error-Message": "You already created this model repo"})
            return
        self.hub.repos[repo_id] = Repo(repo_id, payload)
        self._json(200, {"url": url, "name": repo_id, "id": hashlib.sha1(repo_id.encode()).hexdigest()[:24]})

    def preupload(self, repo: str, rev: str):
        self._require_auth()
        r = self._repo(repo)
        if rev != "main":
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        files = []
        for f in self._json_body().get("files", []):
            p = f["path"]
            base64.b64decode(f["sample"], validate=True)
            files.append({"path": p, "uploadMode": "lfs" if self.hub.is_lfs(p) else "regular",
                          "shouldIgnore": False, "oid": r.oid(p) if p in r.files else None})
        self._json(200, {"files": files, "commitOid": r.head})

    def lfs_batch(self, repo: str):
        self._require_auth()
        self._repo(repo)
        payload = self._json_body()
        if payload.get("operation") != "upload" or "basic" not in payload.get("transfers", ["basic"]):
            raise HubError(400, "only basic uploads here")
        objects = []
        for o in payload["objects"]:
            obj = {"oid": o["oid"], "size": o["size"], "authenticated": True}
            if o["oid"] not in self.hub.lfs_store:
                obj["actions"] = {
                    "upload": {"href": f"{self.hub.url}/lfs-objects/{o['oid']}", "expires_in": 3600},
                    "verify": {"href": f"{self.hub.url}/{repo}.git/info/lfs/objects/verify",
                               "header": {"Authorization": self.headers.get("Authorization", "")}},
                }
            objects.append(obj)
        self._send(200, json.dumps({"transfer": "basic", "objects": objects}).encode(),
                   content_type="application/vnd.git-lfs+json")

    def lfs_put(self, oid: str):
        data = self._body()
        if hashlib.sha256(data).hexdigest() != oid:
            raise HubError(400, "content does not match its sha256")
        self.hub.lfs_store[oid] = data
        self._send(200)

    def lfs_verify(self, repo: str):
        self._require_auth()
        self._repo(repo)
        o = self._json_body()
        data = self.hub.lfs_store.get(o.get("oid"))
        if data is None or len(data) != o.get("size"):
            raise HubError(404, "object not found")
        self._json(200, {"success": True})

    def commit(self, repo: str, rev: str):
        self._require_auth()
        r = self._repo(repo)
        if rev != "main":
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        if not self.headers.get("Content-Type", "").startswith("application/x-ndjson"):
            raise HubError(400, "expected application/x-ndjson")
        lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "the first line must be the header")
        header = lines[0]["value"]
        parent = header.get("parentCommit")
        if parent is not None and parent != r.head:
            raise HubError(412, "parent commit is not the head of the branch")
        changed: dict[str, bytes] = {}
        lfs: set[str] = set()
        deleted: list[str] = []
        for line in lines[1:]:
            key, v = line.get("key"), line.get("value", {})
            if key == "file":
                if v.get("encoding") != "base64":
                    raise HubError(400, f"unknown encoding {v.get('encoding')!r}")
                changed[v["path"]] = base64.b64decode(v["content"], validate=True)
            elif key == "lfsFile":
                data = self.hub.lfs_store.get(v.get("oid"))
                if v.get("algo") != "sha256" or data is None or len(data) != v.get("size"):
                    raise HubError(422, f"LFS object {v.get('oid')} of {v['path']} was not uploaded")
                changed[v["path"]] = data
                lfs.add(v["path"])
            elif key in ("deletedFile", "deletedFolder"):
                deleted.append(v["path"])
            else:
                raise HubError(400, f"unsupported commit operation {key!r}")
        if not changed and not deleted:
            raise HubError(400, "empty commit")
        for p in deleted:
            for f in [f for f in r.files if f == p or f.startswith(p.rstrip("/") + "/")]:
                del r.files[f]
                r.lfs_paths.discard(f)
        for p, data in changed.items():
            r.files[p] = data
            (r.lfs_paths.add if p in lfs else r.lfs_paths.discard)(p)
        oid = hashlib.sha1(json.dumps([r.head, header, sorted(changed), deleted]).encode()
                           + b"".join(changed[p] for p in sorted(changed))).hexdigest()
        r.commits.append(Commit(oid, rev, header.get("summary", ""), header.get("description", ""), parent,
                                changed, lfs))
        self._json(200, {"success": True, "commitOid": oid, "commitUrl": f"{self.hub.url}/{repo}/commit/{oid}",
                         "pullRequestUrl": None})

    def model_info(self, repo: str, rev: str | None):
        r = self._repo(repo)
        if rev not in (None, "main", r.head):
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        self._json(200, {"id": repo, "modelId": repo, "sha": r.head,
                         "private": r.create_payload.get("visibility") == "private",
                         "siblings": [{"rfilename": p} for p in sorted(r.files)]})

    def resolve(self, repo: str, rev: str, file: str):
        r = self._repo(repo)
        if rev not in ("main", r.head) or not r.commits:
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        if file not in r.files:
            raise HubError(404, "Entry not found", "EntryNotFound")
        data = r.files[file]
        headers = {"X-Repo-Commit": r.head, "ETag": f'"{r.oid(file)}"', "Accept-Ranges": "bytes"}
        if file in r.lfs_paths:
            headers.update({"X-Linked-Etag": f'"{r.oid(file)}"', "X-Linked-Size": str(len(data))})
        self._send(200, data, headers, content_type="application/octet-stream")
