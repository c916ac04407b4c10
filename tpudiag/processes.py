"""Whether another process still runs (no torch, no store: the store, the analysis and feeder children and the
uploader all ask), and the background children's priority (``lower_priority``)."""

from __future__ import annotations

import os


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
