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
    """
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return "idle"
    except (AttributeError, OSError):
        pass
    try:
        os.nice(nice)
        return "nice"
    except OSError:
        return "none"
