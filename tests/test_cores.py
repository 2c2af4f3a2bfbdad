"""The thread count from the cores other programs leave free (clover_cli/cores.py)."""

import subprocess
import sys
import time

import pytest
import torch

from clover_cli import cores
from clover_cli.cores import Reading, Threads, threads_for


def reading(busy, total, own_s, at, cores_=(0, 1)):
    return Reading(list(cores_), (busy, total), own_s, at)


def test_threads_for_leaves_the_cores_others_keep_busy():
    assert threads_for(2, 0.0) == 2
    assert threads_for(2, 0.3) == 2  # a browser's bursts: the core stays ours
    assert threads_for(2, 0.7) == 1
    assert threads_for(2, 1.0) == 1
    assert threads_for(2, 2.0) == 1  # never none
    assert threads_for(8, 2.9) == 5
    assert threads_for(4, None) == 4  # load unknown: every core


def test_others_busy_subtracts_this_process_own_time():
    a = reading(1000, 10_000, 5.0, 100.0)
    # one second later: 150 of 200 ticks busy over two cores (1.5 cores), 0.5 s of it ours -> 1.0 core theirs
    b = reading(1150, 10_200, 5.5, 101.0)
    assert a.others_busy(b) == pytest.approx(1.0)
    # all of the busy time ours: nothing left for the others (never below 0)
    assert a.others_busy(reading(1150, 10_200, 6.6, 101.0)) == 0.0


def test_others_busy_says_nothing_when_it_cannot_tell():
    a = reading(1000, 10_000, 5.0, 100.0)
    assert a.others_busy(reading(1001, 10_002, 5.0, 100.01)) is None  # too short an interval
    assert a.others_busy(reading(1150, 10_200, 5.0, 101.0, cores_=(0,))) is None  # the cores changed
    assert a.others_busy(Reading([0, 1], None, 5.0, 101.0)) is None  # no /proc/stat


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")
def test_a_busy_program_is_seen_on_this_machine():
    """A real reading: another process spinning on a core for half a second shows as (at least most of) a core kept
    busy by others; this process sleeping meanwhile is not counted."""
    spin = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.3)  # the child started
        a = Reading.now()
        time.sleep(0.5)
        b = Reading.now()
    finally:
        spin.kill()
        spin.wait()
    assert a.jiffies is not None
    assert a.others_busy(b) >= 0.6


@pytest.fixture
def keep_threads():
    n = torch.get_num_threads()
    yield n
    torch.set_num_threads(n)


def test_settle_sets_the_count_and_says_so(keep_threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    readings = iter([reading(0, 0, 0.0, 0.0), reading(150, 200, 0.0, 1.0),  # 1.5 cores busy, none ours
                     reading(150, 400, 0.0, 2.0)])  # then quiet
    monkeypatch.setattr(cores.Reading, "now", classmethod(lambda cls: next(readings)))
    threads = Threads(None)
    assert threads.most == 2
    assert threads.settle() and torch.get_num_threads() == 1
    assert threads.settle() and torch.get_num_threads() == 2  # the other program ended: both cores again
    assert not threads.fixed


def test_threads_given_are_kept(keep_threads, monkeypatch):
    readings = iter([reading(0, 0, 0.0, 0.0), reading(200, 200, 0.0, 1.0)])  # both cores busy
    monkeypatch.setattr(cores.Reading, "now", classmethod(lambda cls: next(readings)))
    threads = Threads(2)
    assert torch.get_num_threads() == 2
    assert not threads.settle() and torch.get_num_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    readings = iter([reading(0, 0, 0.0, 0.0), reading(200, 200, 0.0, 1.0)])
    assert not Threads(None).settle() and torch.get_num_threads() == 2


def test_a_session_takes_the_free_cores_after_loading_and_before_each_reply(keep_threads, monkeypatch):
    """A session without --threads: one core kept busy while it loads -> one thread; quiet before the next reply ->
    both cores again, and the step costs of the new count are taken (the cost model dropped, measured or read
    again); with a build beside it (its threads already cut to one) the count is left alone."""
    from clover_cli.decode.verify import Sampling
    from clover_cli.session import Options, Session

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    clock = {"busy": 0, "total": 0, "at": 0.0}

    def advance(busy_cores: float):
        clock["busy"] += int(100 * busy_cores)
        clock["total"] += 200
        clock["at"] += 1.0

    monkeypatch.setattr(cores.Reading, "now", classmethod(
        lambda cls: Reading([0, 1], (clock["busy"], clock["total"]), 0.0, clock["at"])))
    advance(0)
    real_settle = Threads.settle
    monkeypatch.setattr(Threads, "settle", lambda self: (advance(busy), real_settle(self))[1])
    busy = 1.0  # another program on one core while the model loads
    session = Session(Options(model="tiny", draft="ngram", compile="off"), quiet=True)
    assert torch.get_num_threads() == 1
    policy, calibrated = session.engine.policy, []
    real_calibrate = policy.calibrate
    monkeypatch.setattr(policy, "calibrate", lambda *a: (calibrated.append(torch.get_num_threads()),
                                                         real_calibrate(*a)))
    prompt = session.encode_raw("Once upon a time")
    list(session.generate(prompt, 8, Sampling()))
    assert calibrated == [1]
    busy = 0.0  # quiet since that reply
    events = session.generate(prompt, 8, Sampling())
    next(events)
    assert torch.get_num_threads() == 2
    list(events)
    assert calibrated == [1, 2]  # the costs of two threads
    list(session.generate(prompt, 8, Sampling()))
    assert calibrated == [1, 2]  # nothing changed: the same costs
    monkeypatch.setattr(session.compiler, "_threads", 2)  # a build beside the replies holds the count
    busy = 1.0
    list(session.generate(prompt, 8, Sampling()))
    assert torch.get_num_threads() == 2
