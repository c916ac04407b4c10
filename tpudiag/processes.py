"""Whether another process still runs (no torch, no store: the store, the analysis and feeder children and the
uploader all ask), and the background children's priority (``lower_priority``, ``early_start``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import subprocess


def pid_alive(pid: int) -> bool:
    """True while a process with this id exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lower_priority(nice: int) -> str:
    """Make this process a background one that never slows the script: Linux's idle scheduling class
    (``SCHED_IDLE``: it runs only on CPU time nothing else wants, and a waking thread of the script preempts it at
    once), else ``nice``.  Returns which one took.

    ``nice`` alone was not enough: a script whose torch ops run on every core (the default intra-op threads) waits at
    each parallel op for its slowest OpenMP thread, and a worker thread sharing a core with a nice-10 (or nice-19)
    analysis process was scheduled late, op after op: a 1 ms forward of a tiny GPT-2 took 136-300 ms for the steps
    after each trace window while the window's analysis ran (2 cores), and those steps opened ``slow_step`` windows of
    tpudiag's own making.  Under ``SCHED_IDLE`` the same steps ran at about 1 ms.

    The class only works against the script where the two share a scheduling group.  Where Linux groups processes
    by session (``sched_autogroup_enabled``, the default on most distributions) the kernel shares a core between
    groups first, by the groups' weights, and only then weighs a group's tasks by their class or nice: a child in a
    session of its own got a group's share of the script's core whatever its class (half of it at the group's nice
    0; 1.4% at nice 19, as much as a busy feeder or analyst wants).  So the background children start in the
    caller's session, in a process group of their own (``BACKGROUND_GROUP``: the terminal's Ctrl-C, sent to the
    foreground group, and a launcher's signal to the job's process group do not reach them), and there the idle
    class holds them to ~0.3% of a core the script keeps busy.  A child some other caller started in a session of
    its own still makes that session's group nice 19 (``nicer_group``).
    """
    nicer_group()
    if _idle(0):
        return "idle"
    try:
        os.nice(nice)
        return "nice"
    except OSError:
        return "none"


# ``subprocess.Popen(..., process_group=BACKGROUND_GROUP)``: a background child that competes with the script for
# CPU (the window analyst, the store feeder) leads a process group of its own, in the caller's session and so in
# the script's scheduling group (``lower_priority``).  One that must outlive the script's session or keep a share of
# a busy core (the deferred store write, the uploader) starts a session of its own instead.
BACKGROUND_GROUP = 0


def make_background(pid: int, idle: bool = True) -> None:
    """From the parent, at once after starting a background child: (``idle``) the child in the idle class, before
    it has imported anything, and, where it leads a session of its own, its scheduling group at nice 19
    (``lower_priority``)."""
    nicer_group(pid)
    if idle:
        _idle(pid)


# Background children started before the script's code at the script's own priority (``early_start``), until the
# script's first step puts them in the idle class (``end_early_start``).
_early: list[subprocess.Popen[bytes]] = []


def early_start(proc: subprocess.Popen[bytes]) -> None:
    """From the parent, at once after starting a background child before the script's code runs: the child keeps
    the script's priority while it imports what it needs (and lowers itself after: ``lower_priority``), and the
    script's first step lowers it if it has not (``end_early_start``).

    Why (issue 21): in the idle class from its first instruction, a child on a core the script keeps busy gets
    ~0.3% of it, and the ~0.5 s of CPU its imports take (Python, pyarrow, DuckDB) then ran in ~4 ms slices for
    3-4 minutes of the long-run bench loop, each slice costing the loop its caches after it (session 41, one
    process with the children stopped and resumed in turns: 1.5% of the steps while they ran, for 0.6% of the
    core; side by side with a plain run the effect stays within the bench's spread).  Started with the capture,
    they import while the script does
    (its own imports, its model, its data), where a core is shared anyway and no step is timed.  At the script's
    priority they must never run beside its steps: a child importing at normal priority stalled a loop whose ops
    run on OpenMP threads (2 threads on 2 cores: worst step 163-220 ms against 36 ms), hence the first step's
    demotion.  Where the group is a session's own it still goes to nice 19 (``nicer_group``)."""
    nicer_group(proc.pid)
    _early.append(proc)


def end_early_start() -> None:
    """The script's first step: every child still at the script's priority (``early_start``) goes to the idle
    class (a syscall per child, once)."""
    while _early:
        proc = _early.pop()
        if proc.poll() is None:  # not gone (and not reaped: its pid is still its own)
            _idle(proc.pid)


def early_pending() -> bool:
    return bool(_early)


def _idle(pid: int) -> bool:
    """A process (0: this one) in Linux's idle scheduling class; False where there is none or it is refused."""
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        return False
    return True


def nicer_group(pid: int | None = None) -> None:
    """A process's autogroup (its session's scheduling group; this process's by default) at nice 19, where the
    kernel has autogroups (a raise of nice needs no privilege; elsewhere the file is absent or refuses, and nothing
    changes).  Only for a process that leads a session of its own: a group is a whole session's, and the session of
    a process started without one of its own is the user's shell's, with the training job in it."""
    try:
        target = os.getpid() if pid is None else pid
        if os.getsid(target) != target or (pid is not None and os.getsid(0) == pid):
            return  # not a session's leader, or the caller's own session's
        with open(f"/proc/{target}/autogroup", "w") as fh:
            fh.write("19")
    except OSError:
        pass
