"""Issue #49 item 3: `clover list`, `clover rm`, `clover ps` and the compile cache's pruning, on fake caches under
tmp_path (the Hub's, clover's and the compile cache: nothing is downloaded, converted or compiled here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import offline

DAY = 86400.0
COMMIT = "0123456789abcdef0123456789abcdef01234567"  # a Hub snapshot's name: what its compiled packages are keyed by


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOVER_COMPILE_CACHE", str(tmp_path / "xdg" / "clover" / "compiled"))
    for name in ("CLOVER_GGUF_CACHE", "CLOVER_KERNEL_CACHE", "CLOVER_COMPILE_MAX_AGE", "CLOVER_COMPILE_MAX_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return offline(tmp_path, monkeypatch)


def write(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))
    return path


def hub_repo(tmp_path: Path, repo: str, size: int = 5000, commit: str = COMMIT) -> Path:
    """A Hub cache entry as huggingface_hub lays it out: the file in blobs/, a link to it in snapshots/COMMIT/."""
    d = tmp_path / "hf-cache" / f"models--{repo.replace('/', '--')}"
    write(d / "blobs" / "abc123", size)
    (d / "snapshots" / commit).mkdir(parents=True)
    (d / "snapshots" / commit / "model.safetensors").symlink_to("../../blobs/abc123")
    (d / "refs").mkdir()
    (d / "refs" / "main").write_text(commit)
    return d


def compiled(name: str, size: int = 1000, used: float | None = None) -> Path:
    from clover_cli import store

    d = store.cache_root() / name
    write(d / "step.pt2", size)
    (d / "meta.json").write_text("{}")
    if used is not None:
        (d / store.LAST_USED).write_text("")
        os.utime(d / store.LAST_USED, (used, used))
        os.utime(d / "meta.json", (used, used))
    return d


def listed(run_cli) -> dict:
    code, out, err = run_cli("list", "--json")
    assert code == 0, err
    return json.loads(out)


def by_name(listing: dict) -> dict:
    return {e["name"]: e for e in listing["entries"]}


def one_line_error(err: str, needle: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err


# --- clover list --------------------------------------------------------------------------------------------------


def test_list_shows_every_cache_with_sizes_last_use_and_total(tmp_path, run_cli):
    from clover_cli import store

    hub_repo(tmp_path, "owner/model", 5000)
    pkg = compiled(f"{COMMIT}-{'a' * 20}", 1000)
    heads = compiled(f"{COMMIT}-{'a' * 20}-heads-{'b' * 12}", 300)
    write(store.cache_root() / "costs" / f"{COMMIT}-{'a' * 20}-compiled-{'c' * 10}.json", 10)
    converted = store.gguf_cache_root() / f"{'d' * 20}-float32"
    write(converted / "model.safetensors", 700)
    (converted / "clover-gguf.json").write_text(json.dumps({"gguf": "/x/model-Q4.gguf"}))
    write(store.packages_root() / ("e" * 20) / "file.gguf", 400)
    write(store.gguf_cache_root() / "llama-f32.gguf", 50)
    write(store.cache_root() / ".pkg.tmp" / "x", 99)  # a build under way: not listed

    listing = listed(run_cli)
    names = by_name(listing)
    assert names["owner/model"]["kind"] == "model" and names["owner/model"]["bytes"] == 5000 + 40  # blob once, ref
    assert names[pkg.name]["kind"] == "compiled" and names[pkg.name]["of"] == "owner/model"
    assert names[heads.name]["kind"] == "compiled-heads" and names[heads.name]["of"] == "owner/model"
    assert names[converted.name]["kind"] == "gguf" and names[converted.name]["of"] == "model-Q4.gguf"
    assert names["file.gguf"]["kind"] == "package" and names["file.gguf"]["bytes"] == 400
    assert names["llama-f32.gguf"]["kind"] == "export"
    assert names["compiled/costs"]["kind"] == "cache" and names["compiled/costs"]["bytes"] == 10
    assert not any(".pkg.tmp" in n for n in names)
    assert listing["total_bytes"] == sum(e["bytes"] for e in listing["entries"]) > 5000 + 1000 + 700
    assert all(e["last_used"] is not None and abs(e["last_used"] - time.time()) < 600 for e in listing["entries"])
    code, out, err = run_cli("list")
    assert code == 0 and "owner/model" in out and "total" in out and "7 entries" in out, out


def test_a_compiled_packages_last_use_is_its_stamp(tmp_path, run_cli):
    from clover_cli import inuse

    old = time.time() - 10 * DAY
    pkg = compiled(f"mymodel-{'a' * 20}", 100, used=old)
    assert abs(by_name(listed(run_cli))[pkg.name]["last_used"] - old) < 1
    inuse.hold(pkg)  # what loading it does
    try:
        assert abs(by_name(listed(run_cli))[pkg.name]["last_used"] - time.time()) < 60
    finally:
        inuse.release(pkg)


def test_list_with_nothing_cached(run_cli):
    listing = listed(run_cli)
    assert listing["entries"] == [] and listing["total_bytes"] == 0


# --- clover rm ----------------------------------------------------------------------------------------------------


def test_rm_a_repo_takes_its_compiled_programs_and_costs_and_nothing_else(tmp_path, run_cli):
    from clover_cli import store

    repo = hub_repo(tmp_path, "owner/model")
    other = hub_repo(tmp_path, "owner/other", commit="f" * 40)
    pkg = compiled(f"{COMMIT}-{'a' * 20}")
    Path(f"{pkg}.lock").write_text("")
    write(Path(f"{pkg}.log"), 5)
    costs = write(store.cache_root() / "costs" / f"{COMMIT}-{'a' * 20}-compiled-{'c' * 10}.json", 10)
    kept = compiled(f"{'f' * 40}-{'a' * 20}")
    kept_costs = write(store.cache_root() / "costs" / f"{'f' * 40}-{'a' * 20}-compiled-{'c' * 10}.json", 10)
    code, out, err = run_cli("rm", "hf.co/owner/model", "--yes")
    assert code == 0, err
    assert "removed 3 entries" in out, out  # the repo, its package (with its log), its costs; nothing else
    assert not repo.exists() and not pkg.exists() and not costs.exists() and not Path(f"{pkg}.log").exists()
    assert Path(f"{pkg}.lock").exists()  # a lock file outlives its use (store.lock_path)
    assert other.exists() and kept.exists() and kept_costs.exists()
    assert not list(repo.parent.glob(".*removing*"))


def test_rm_compiled_only_keeps_the_model(tmp_path, run_cli):
    repo = hub_repo(tmp_path, "owner/model")
    pkg = compiled(f"{COMMIT}-{'a' * 20}")
    code, out, err = run_cli("rm", "owner/model", "--compiled", "-y")
    assert code == 0, err
    assert repo.exists() and not pkg.exists()


def test_rm_all(tmp_path, run_cli):
    from clover_cli import store

    repo = hub_repo(tmp_path, "owner/model")
    pkg = compiled(f"local-{'a' * 20}")
    write(store.packages_root() / ("e" * 20) / "file.gguf", 400)
    # what clover did not make, though it lies in its caches: neither listed nor removed
    foreign = [write(store.cache_root() / "notes" / "mine.txt", 5), write(store.gguf_cache_root() / "x" / "y", 5),
               write(store.packages_root() / "mine" / "y", 5), write(tmp_path / "hf-cache" / "other" / "y", 5)]
    code, out, err = run_cli("rm", "--all", "--compiled", "-y")
    assert code == 0, err
    assert repo.exists() and not pkg.exists()
    code, out, err = run_cli("rm", "--all", "-y")
    assert code == 0, err
    assert listed(run_cli)["entries"] == [] and not repo.exists()
    assert (tmp_path / "hf-cache").is_dir() and store.cache_root().parent.is_dir()  # the caches' folders stay
    assert all(f.exists() for f in foreign)


def test_rm_all_empties_a_kernel_cache_kept_elsewhere_and_keeps_its_folder(tmp_path, run_cli, monkeypatch):
    kernels = tmp_path / "kernels"
    monkeypatch.setenv("CLOVER_KERNEL_CACHE", str(kernels))
    built = write(kernels / "clover_quant_0123456789abcdef" / "quant.so", 100)
    theirs = write(kernels / "notes.txt", 7)  # not a build of clover's: neither listed nor removed
    assert by_name(listed(run_cli))["kernels"]["bytes"] == 100
    code, out, err = run_cli("rm", "--all", "-y")
    assert code == 0, err
    assert kernels.is_dir() and not built.exists() and theirs.exists()


def test_rm_an_alias_takes_its_package_conversion_and_programs(run_cli):
    from clover_cli import store
    from clover_cli.aliases import ALIASES

    sha = ALIASES["smollm2"].package.sha256[:20]
    download = write(store.packages_root() / sha / "SmolLM2.gguf", 400)
    converted = store.gguf_cache_root() / f"{sha}-float32"
    write(converted / "model.safetensors", 700)
    pkg = compiled(f"{sha}-float32-{'a' * 20}")
    other = compiled(f"local-{'a' * 20}")
    code, out, err = run_cli("rm", "smollm2", "-y")
    assert code == 0, err
    assert not download.exists() and not converted.exists() and not pkg.exists() and other.exists()
    code, out, err = run_cli("rm", "smollm2", "-y")  # a known alias with nothing cached
    assert code == 0 and "nothing of smollm2 is cached" in err, err


def test_rm_a_hub_gguf_repo_takes_the_conversions_of_its_files(tmp_path, run_cli):
    from clover_cli import store

    repo = hub_repo(tmp_path, "owner/model-GGUF")
    blob = (repo / "snapshots" / COMMIT / "model.safetensors").resolve()  # (any file of the repo will do)
    converted = store.gguf_cache_root() / f"{'d' * 20}-float32"
    write(converted / "model.safetensors", 700)
    (converted / "clover-gguf.json").write_text(json.dumps({"gguf": str(blob)}))
    pkg = compiled(f"{converted.name}-{'a' * 20}")
    mine = store.gguf_cache_root() / f"{'e' * 20}-float32"  # a conversion of a file of the user's own
    write(mine / "model.safetensors", 10)
    (mine / "clover-gguf.json").write_text(json.dumps({"gguf": str(tmp_path / "mine.gguf")}))
    code, out, err = run_cli("rm", "hf.co/owner/model-GGUF:Q4_K_M", "-y")
    assert code == 0, err
    assert not repo.exists() and not converted.exists() and not pkg.exists() and mine.exists()


def test_rm_by_the_name_list_shows(run_cli):
    pkg = compiled(f"mymodel-{'a' * 20}")
    other = compiled(f"mymodel-{'b' * 20}")
    code, out, err = run_cli("rm", pkg.name, "-y")
    assert code == 0, err
    assert not pkg.exists() and other.exists()
    code, out, err = run_cli("rm", "mymodel", "-y")  # what list shows in "of": every package of that model
    assert code == 0 and not other.exists(), err


def test_rm_unknown_model_is_one_line_exit_2(run_cli):
    code, out, err = run_cli("rm", "nobody/nothing", "-y")
    assert code == 2
    one_line_error(err, "nobody/nothing")


@pytest.mark.parametrize("args", [(), ("owner/model", "--all")])
def test_rm_needs_one_target(tmp_path, run_cli, args):
    hub_repo(tmp_path, "owner/model")
    code, out, err = run_cli("rm", *args, "-y")
    assert code == 2
    one_line_error(err, "--all")


def test_rm_off_a_terminal_without_yes_refuses(tmp_path, run_cli):
    repo = hub_repo(tmp_path, "owner/model")
    code, out, err = run_cli("rm", "owner/model")
    assert code == 2
    one_line_error(err, "--yes")
    assert repo.exists()


@pytest.mark.parametrize("answer", ["y", "n"])
def test_rm_asks_on_a_terminal(tmp_path, run_cli, monkeypatch, answer):
    from clover_cli import manage

    repo = hub_repo(tmp_path, "owner/model")
    monkeypatch.setattr(manage, "interactive", lambda: True)
    code, out, err = run_cli("rm", "owner/model", stdin=f"{answer}\n")
    assert code == 0, err
    assert "owner/model" in out and "Remove these" in out
    assert repo.exists() == (answer == "n")


def test_rm_never_follows_links_out_of_the_cache(tmp_path, run_cli):
    from clover_cli import store

    outside = tmp_path / "mine"
    precious = write(outside / "weights.safetensors", 100)
    repo = hub_repo(tmp_path, "owner/model")
    (repo / "snapshots" / COMMIT / "linked").symlink_to(outside)  # a link inside an entry to a folder outside
    store.cache_root().mkdir(parents=True, exist_ok=True)
    linked_pkg = store.cache_root() / f"{COMMIT}-{'a' * 20}"
    linked_pkg.symlink_to(outside)  # a link where a package would be: not a package, left alone
    assert linked_pkg.name not in by_name(listed(run_cli))
    code, out, err = run_cli("rm", "owner/model", "-y")
    assert code == 0, err
    assert not repo.exists() and precious.exists() and linked_pkg.is_symlink()


def test_a_failed_removals_leftover_is_swept_by_the_next_one(tmp_path, monkeypatch):
    """A removal renames a folder to .NAME.removing-PID before deleting it; one killed midway leaves that folder.
    The next removal in the same folder sweeps such leftovers of processes that no longer run, and leaves a running
    removal's alone."""
    import subprocess
    import sys

    from clover_cli import cache_files

    root = tmp_path / "cache"
    (root / "a" / "x").mkdir(parents=True)
    (root / "b").mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = root / f".old.removing-{int(gone.stdout)}"
    (stale / "inner").mkdir(parents=True)
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = root / f".busy.removing-{running.pid}"
        live.mkdir()
        cache_files.remove_path(root / "a", [root])
        assert sorted(p.name for p in root.iterdir()) == [live.name, "b"]
    finally:
        running.kill()
        running.wait()


def test_remove_path_refuses_anything_outside_the_caches(tmp_path):
    from clover_cli import cache_files as manage
    from clover_cli.errors import CloverError

    roots = manage.roots()
    outside = write(tmp_path / "mine" / "f", 10)
    with pytest.raises(CloverError):
        manage.remove_path(outside, roots)
    hub = tmp_path / "hf-cache"
    hub.mkdir()
    with pytest.raises(CloverError):
        manage.remove_path(hub, roots)  # a cache's own folder
    escape = hub / "models--x--y"
    escape.symlink_to(tmp_path / "mine")
    with pytest.raises(CloverError):
        manage.remove_path(escape / "f", roots)  # through a link: its real folder is outside
    manage.remove_path(escape, roots)  # the link itself, not what it points to
    assert not escape.is_symlink() and outside.exists()


def test_a_cache_reached_through_a_link_is_still_removed(tmp_path, run_cli, monkeypatch):
    import huggingface_hub.constants as hf_constants

    real = tmp_path / "disk" / "hub"
    real.mkdir(parents=True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub-link"))
    (tmp_path / "hub-link").symlink_to(real)
    d = real / "models--owner--model"
    write(d / "blobs" / "x", 10)
    code, out, err = run_cli("rm", "owner/model", "-y")
    assert code == 0, err
    assert not d.exists() and real.is_dir()


def test_rm_refuses_a_package_in_use(run_cli):
    from clover_cli import inuse

    pkg = compiled(f"mymodel-{'a' * 20}")
    inuse.hold(pkg)
    try:
        assert inuse.in_use(pkg)
        code, out, err = run_cli("rm", pkg.name, "-y")
        assert code == 1
        one_line_error(err, "in use")
        assert pkg.exists()
    finally:
        inuse.release(pkg)
    assert not inuse.in_use(pkg)
    code, out, err = run_cli("rm", pkg.name, "-y")
    assert code == 0 and not pkg.exists(), err


def hold_lock(path: str):
    """Another thread holding a filelock stands for another process (flock locks are per open file)."""
    from filelock import FileLock

    ready, release = threading.Event(), threading.Event()

    def hold():
        with FileLock(path):
            ready.set()
            release.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    assert ready.wait(10)
    return release, thread


def test_rm_refuses_a_package_being_built(run_cli):
    pkg = compiled(f"mymodel-{'a' * 20}")
    release, thread = hold_lock(f"{pkg}.lock")
    try:
        code, out, err = run_cli("rm", "--all", "--compiled", "-y")
        assert code == 1
        one_line_error(err, "being written")
        assert pkg.exists()
    finally:
        release.set()
        thread.join()


def fake_session(tmp_path, path: Path, name: str = "owner/model"):
    from clover_cli.stats import StatsWriter

    session = SimpleNamespace(resolved=SimpleNamespace(name=name, path=path), draft_name="ngram", device="cpu")
    return session, StatsWriter.open(str(tmp_path / "stats.jsonl"))


def test_rm_refuses_a_model_a_session_runs(tmp_path, run_cli):
    from clover_cli import running

    repo = hub_repo(tmp_path, "owner/model")
    session, writer = fake_session(tmp_path, repo / "snapshots" / COMMIT)
    running.start_session("chat", session, writer)
    try:
        code, out, err = run_cli("rm", "owner/model", "-y")
        assert code == 1
        one_line_error(err, f"pid {os.getpid()}")
        assert repo.exists()
    finally:
        running.unregister()
    code, out, err = run_cli("rm", "owner/model", "-y")
    assert code == 0 and not repo.exists(), err


def test_rm_refuses_heads_and_a_draft_model_a_session_loaded(tmp_path, run_cli):
    """A session's --heads and --draft-model repos are in use as its target is: not removed while it runs."""
    from clover_cli import running

    heads, draft = hub_repo(tmp_path, "owner/heads"), hub_repo(tmp_path, "owner/draft")
    session, writer = fake_session(tmp_path, tmp_path / "model-dir")
    session.heads_path, session.draft_model_path = heads / "snapshots" / COMMIT, draft / "snapshots" / COMMIT
    running.start_session("chat", session, writer)
    try:
        for name, repo in (("owner/heads", heads), ("owner/draft", draft)):
            code, out, err = run_cli("rm", name, "-y")
            assert code == 1, name
            one_line_error(err, f"pid {os.getpid()}")
            assert repo.exists()
    finally:
        running.unregister()
    for name, repo in (("owner/heads", heads), ("owner/draft", draft)):
        code, out, err = run_cli("rm", name, "-y")
        assert code == 0 and not repo.exists(), err


# --- clover ps ----------------------------------------------------------------------------------------------------


def test_ps_lists_running_sessions_with_their_tokens_and_skips_dead_ones(tmp_path, run_cli):
    from clover_cli import running, store

    session, writer = fake_session(tmp_path, tmp_path / "model-dir")
    sid = running.start_session("serve", session, writer)
    for n in (3, 4):
        writer.write({"kind": "step", "session": sid, "t": time.time(), "tokens": n})
    writer.write({"kind": "step", "session": "someone", "t": time.time(), "tokens": 100})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = store.sessions_dir() / f"{dead.pid}.json"
    stale.write_text(json.dumps({"pid": dead.pid, "command": "chat", "model": "gone", "started": time.time()}))
    write(store.sessions_dir() / "junk.json", 10)
    try:
        code, out, err = run_cli("ps", "--json")
        assert code == 0, err
        rows = json.loads(out)["sessions"]
        assert [(r["pid"], r["command"], r["model"], r["tokens"]) for r in rows] == \
            [(os.getpid(), "serve", "owner/model", 7)]
        assert 0 <= rows[0]["uptime_s"] < 600
        assert not stale.exists()  # a dead pid's entry is removed when found
        code, out, err = run_cli("ps")
        assert code == 0 and str(os.getpid()) in out and "serve" in out and "owner/model" in out, out
    finally:
        running.unregister()
    code, out, err = run_cli("ps")
    assert code == 0 and "no clover session is running" in out, out


def test_ps_without_a_stats_stream_has_no_token_count(tmp_path, run_cli):
    from clover_cli import running

    session, _ = fake_session(tmp_path, tmp_path / "model-dir")
    running.start_session("generate", session, None)
    try:
        rows = json.loads(run_cli("ps", "--json")[1])["sessions"]
        assert [(r["command"], r["tokens"]) for r in rows] == [("generate", None)]
    finally:
        running.unregister()


# --- pruning the compile cache ------------------------------------------------------------------------------------


def test_prune_removes_packages_unused_for_30_days_but_not_the_new_one(run_cli):
    from clover_cli.cache_files import prune_compiled

    now = time.time()
    old = compiled(f"old-{'a' * 20}", used=now - 31 * DAY)
    old_heads = compiled(f"old-{'a' * 20}-heads-{'b' * 12}", used=now - 40 * DAY)
    recent = compiled(f"recent-{'a' * 20}", used=now - 29 * DAY)
    new = compiled(f"new-{'a' * 20}", used=now - 90 * DAY)  # the one just built (an old stamp: still kept)
    said = []
    removed = prune_compiled(keep=(new,), now=now, log=said.append)
    assert sorted(removed) == sorted([old, old_heads])
    assert recent.exists() and new.exists() and not old.exists() and not old_heads.exists()
    assert len(said) == 2 and all("unused for" in line for line in said), said


def test_a_folder_named_like_a_package_without_meta_json_is_not_clovers(run_cli):
    """A folder in the compile cache named as a package key but holding no meta.json (every build writes one) is
    neither listed nor pruned, however old."""
    from clover_cli import store
    from clover_cli.cache_files import prune_compiled

    mine = store.cache_root() / f"notes-{'c' * 20}"
    write(mine / "keep.txt", 10)
    old = time.time() - 400 * DAY
    os.utime(mine / "keep.txt", (old, old))
    assert prune_compiled(keep=(), log=lambda line: None) == []
    assert (mine / "keep.txt").exists() and mine.name not in by_name(listed(run_cli))


def test_prune_keeps_the_cache_under_its_size_cap_oldest_first(monkeypatch):
    from clover_cli import inuse, store
    from clover_cli.cache_files import prune_compiled

    monkeypatch.setenv("CLOVER_COMPILE_MAX_SIZE", str(2500 / (1 << 30)))  # GiB: 2,500 bytes
    now = time.time()
    pkgs = [compiled(f"m{i}-{'a' * 20}", 1000, used=now - (10 - i) * DAY) for i in range(5)]  # m0 the oldest
    inuse.hold(pkgs[0])  # in use: never removed, however old
    os.utime(pkgs[0] / store.LAST_USED, (now - 10 * DAY,) * 2)  # (loaded long ago: still the oldest)
    try:
        removed = prune_compiled(keep=(pkgs[4],), now=now)
    finally:
        inuse.release(pkgs[0])
    # 5,010 bytes (1,002 a package) over 2,500: m1, m2 and m3 go, oldest first, past m0 (in use), leaving 2,004 with
    # m4 (just built)
    assert removed == [pkgs[1], pkgs[2], pkgs[3]]
    assert pkgs[0].exists() and pkgs[4].exists()


def test_prune_stops_once_under_the_cap_and_skips_a_package_being_built(monkeypatch):
    from clover_cli.cache_files import prune_compiled

    monkeypatch.setenv("CLOVER_COMPILE_MAX_SIZE", str(2500 / (1 << 30)))
    now = time.time()
    pkgs = [compiled(f"m{i}-{'a' * 20}", 1000, used=now - (10 - i) * DAY) for i in range(4)]
    release, thread = hold_lock(f"{pkgs[0]}.lock")  # m0 is being built again by another process
    try:
        removed = prune_compiled(keep=(pkgs[3],), now=now)
    finally:
        release.set()
        thread.join()
    assert removed == [pkgs[1], pkgs[2]]  # 4,008 bytes: two of 1,002 removed, then under the cap
    assert pkgs[0].exists() and pkgs[3].exists()


@pytest.mark.parametrize("value", ["lots", "-1", "nan"])
def test_prune_with_a_bad_limit_warns_and_keeps_the_default(monkeypatch, capsys, value):
    from clover_cli.cache_files import prune_compiled

    monkeypatch.setenv("CLOVER_COMPILE_MAX_AGE", value)
    now = time.time()
    old = compiled(f"old-{'a' * 20}", used=now - 31 * DAY)
    recent = compiled(f"recent-{'a' * 20}", used=now - DAY)
    assert prune_compiled(now=now) == [old] and recent.exists()
    assert "CLOVER_COMPILE_MAX_AGE" in capsys.readouterr().err


def test_zero_means_no_limit(monkeypatch):
    from clover_cli.cache_files import prune_compiled

    monkeypatch.setenv("CLOVER_COMPILE_MAX_AGE", "0")
    monkeypatch.setenv("CLOVER_COMPILE_MAX_SIZE", "0")
    old = compiled(f"old-{'a' * 20}", used=time.time() - 400 * DAY)
    assert prune_compiled() == [] and old.exists()


def test_a_build_prunes_after_it_and_keeps_what_it_built(monkeypatch):
    from clover_cli.step import aot_build

    now = time.time()
    old = compiled(f"old-{'a' * 20}", used=now - 31 * DAY)
    out = compiled(f"new-{'a' * 20}", used=now - 31 * DAY)  # as if just built, its files dated back
    monkeypatch.setattr(aot_build, "build", lambda job, log: {"step": {}})
    said = []
    job = aot_build.Job(Path("/nonexistent/new"), out, 64)
    assert aot_build.build_locked(job, log=said.append) == {"step": {}}
    assert out.exists() and not old.exists()
    assert any("removed the compiled package" in line for line in said), said
    monkeypatch.setattr(aot_build, "build", lambda job, log: {})  # nothing built: nothing pruned
    older = compiled(f"older-{'a' * 20}", used=now - 50 * DAY)
    aot_build.build_locked(job, log=said.append)
    assert older.exists()


def test_loading_a_package_marks_it_used_and_in_use(monkeypatch):
    """Package.load (what a session runs) touches the stamp and holds the package until the process ends (the
    programs themselves are not loaded here: a stand-in takes CompiledStep's place)."""
    from clover_cli import inuse, store
    from clover_cli.cache_files import prune_compiled
    from clover_cli.step import aot

    d = compiled(f"mymodel-{'a' * 20}", 100, used=time.time() - 40 * DAY)
    meta = {"program": store.PROGRAM_VERSION, "capacity": 64, "ranges": {"step.pt2": {"n": [1, 64], "past": [0, 64]}},
            "files": aot.sums(d, ["step.pt2"])}
    (d / "meta.json").write_text(json.dumps(meta))
    monkeypatch.setattr(aot, "CompiledStep", lambda *args: "loaded")
    package = aot.Package.find(d)
    assert package is not None and not inuse.in_use(d)
    try:
        assert package.load() == "loaded"
        assert inuse.in_use(d)
        assert abs(inuse.last_used(d) - time.time()) < 60
        old = time.time() - 40 * DAY
        os.utime(d / store.LAST_USED, (old, old))  # (as if loaded 40 days ago by a session still running)
        assert prune_compiled() == [] and d.exists()
    finally:
        inuse.release(d)
    assert not inuse.in_use(d)
    assert prune_compiled() == [d] and not d.exists()
