"""How many CPU threads a step should use: one per core this process may run on, less the cores other programs keep
busy (a desktop's browser, a build, another model). On 2 cores with one kept busy, two threads made every step wait
for the thread that shares its core with the other program: 44.9 tok/s, against 110.2 with one thread
(docs/BENCHMARKS.md, 2026-12-06). --threads (or OMP_NUM_THREADS) still decides when given.

The load is read from Linux's /proc/stat (elsewhere: no reading, torch's default stays): the CPU time every allowed
core spent busy over an interval, less what this process itself spent in it (getrusage), so a model loading or a
reply decoding is not taken for another program.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass

# a core counts as taken when other programs kept it busy this share of the interval or more: a browser tab's
# bursts (10-30%) leave it to us; a build or another model (90-100%) does not
BUSY_SHARE = 0.6
SHORTEST_S = 0.05  # readings closer than this in time say nothing: the threads stay as they are


def allowed_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _cpu_jiffies(cores: list[int]) -> tuple[int, int] | None:
    """(busy, total) clock ticks of `cores` since boot, summed; None where /proc/stat cannot be read."""
    wanted = {f"cpu{c}" for c in cores}
    busy = total = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if name not in wanted:
                    continue
                ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
                total += sum(ticks)
                busy += sum(ticks) - ticks[3] - ticks[4]
    except (OSError, ValueError, IndexError):
        return None
    return (busy, total) if total else None


def _own_seconds() -> float:
    """CPU seconds this process (all its threads) and its finished children have used."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


@dataclass
class Reading:
    """The machine's CPU ticks and this process's CPU time at one moment."""

    cores: list[int]
    jiffies: tuple[int, int] | None
    own_s: float
    at: float

    @classmethod
    def now(cls) -> Reading:
        cores = allowed_cores()
        return cls(cores, _cpu_jiffies(cores), _own_seconds(), time.monotonic())

    def others_busy(self, later: Reading) -> float | None:
        """How many cores other programs kept busy between this reading and `later` (0.0 .. cores), or None when
        it cannot be told (no /proc/stat, too short an interval, the cores changed)."""
        if self.jiffies is None or later.jiffies is None or later.cores != self.cores:
            return None
        wall = later.at - self.at
        if wall < SHORTEST_S:
            return None
        busy, total = (b - a for a, b in zip(self.jiffies, later.jiffies))
        if total <= 0:
            return None
        # the ticks' share that was busy, in cores, less what this process spent (its seconds over the wall time)
        cores = len(self.cores)
        everyone = cores * busy / total
        mine = (later.own_s - self.own_s) / wall
        return min(float(cores), max(0.0, everyone - mine))


def threads_for(cores: int, others_busy: float | None) -> int:
    """One thread per core the other programs leave free (BUSY_SHARE of a core or more counts as taken), at least
    one; every core when the load is unknown."""
    if others_busy is None:
        return cores
    taken = int(others_busy + (1.0 - BUSY_SHARE))  # 0.6 of a core busy rounds up to one core taken
    return max(1, cores - taken)


def fixed_by_user() -> bool:
    """Whether the thread count was set outside clover (OMP_NUM_THREADS / MKL_NUM_THREADS): left alone then."""
    return any(os.environ.get(name) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"))


class Threads:
    """A session's thread count: `fixed` (--threads) when given, or OMP_NUM_THREADS's; else decided after loading
    and again before each reply, from what other programs did with the cores since the session began or since the
    last reply ended (settle), at most torch's own count (one per physical core)."""

    def __init__(self, fixed: int | None):
        import torch

        self.fixed = fixed is not None or fixed_by_user()
        if fixed is not None:
            torch.set_num_threads(fixed)  # before anything runs (the step costs are keyed by the count)
        self.most = torch.get_num_threads()
        self.since = Reading.now()

    def settle(self) -> bool:
        """Set the count the cores left free allow; True when it changed."""
        import torch

        if self.fixed:
            return False
        now = Reading.now()
        others, self.since = self.since.others_busy(now), now
        if others is None:
            return False
        n = min(self.most, threads_for(len(now.cores), others))
        if n == torch.get_num_threads():
            return False
        torch.set_num_threads(n)
        return True

    def idle(self) -> None:
        """A reply ended: the next settle() reads the time until the next one."""
        self.since = Reading.now()
