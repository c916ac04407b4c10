"""tpudiag's background children (the window analysis, the store feeder) run in Linux's idle scheduling class
(tpudiag.processes.lower_priority): a script using every core is never kept waiting for them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no idle scheduling class on this system")
def test_a_background_child_runs_in_the_idle_class_and_its_parent_is_untouched() -> None:
    code = (
        "import os; from tpudiag.processes import lower_priority; "
        "print(lower_priority(10), os.sched_getscheduler(0) == os.SCHED_IDLE)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["idle", "True"]
    assert os.sched_getscheduler(0) != os.SCHED_IDLE


def test_the_analysis_and_feeder_children_lower_their_priority() -> None:
    """Both children's entry points call it first (a child that skipped it slowed the script: see the helper)."""
    import inspect

    from tpudiag.longrun import analyst
    from tpudiag.store import feeder

    for main in (analyst.main, feeder.main):
        body = inspect.getsource(main)
        assert "lower_priority(" in body.split("while True" if main is analyst.main else "while not")[0]


def _groups_settable() -> bool:
    """Whether a process in a session of its own may set its group's nice here (a container may refuse)."""
    if not os.path.exists("/proc/self/autogroup"):
        return False
    code = "open('/proc/self/autogroup', 'w').write('19'); print(open('/proc/self/autogroup').read().split()[-1])"
    cmd = [sys.executable, "-c", code]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, start_new_session=True)
    return out.stdout.split() == ["19"]


GROUPS = _groups_settable()


def _autogroup_nice(pid: int | str) -> int | None:
    """A process's group nice ("/autogroup-123 nice 19"); None for a process in no group of its own: one whose
    sessions all descend from the system's first without a ``setsid`` (a CI harness's) reads an empty file."""
    with open(f"/proc/{pid}/autogroup") as fh:
        words = fh.read().split()
    return int(words[-1]) if words else None


@pytest.mark.skipif(not GROUPS, reason="no autogroup scheduling here, or its nice cannot be set")
def test_the_analysis_child_is_a_background_group_from_its_start(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Started in a session of its own, the child is a scheduling group of its own under Linux's autogroups: at the
    group's default nice 0 it had half of a core it shared with the training loop, whatever its own class (an
    idle-class analysis child took a 4 ms slice of the loop's core every ~10 ms).  The parent makes its group nice
    19 (and the child idle) as soon as it has started, before the child's imports; its own group is untouched."""
    from tpudiag.longrun import analyst

    own = _autogroup_nice("self")
    worker = analyst.Worker("run-x", tmp_path, tmp_path / "trace")
    (tmp_path / "trace").mkdir()
    worker.kick()
    assert worker.proc is not None and worker.failed is None
    try:
        pid = worker.proc.pid
        assert _autogroup_nice(pid) == 19
        if hasattr(os, "SCHED_IDLE"):
            assert os.sched_getscheduler(pid) == os.SCHED_IDLE
        assert _autogroup_nice("self") == own
    finally:
        worker.stop(wait_s=30)
    assert worker.proc.returncode is not None


@pytest.mark.skipif(not GROUPS, reason="no autogroup scheduling here, or its nice cannot be set")
def test_a_child_in_its_callers_session_leaves_the_sessions_group_alone() -> None:
    """A group is a whole session's: ``lower_priority`` in a process started without a session of its own (the
    user's shell's session, the training job in it) must not make that session nice 19.  Checked from a session of
    the test's own (its group at nice 0 whatever earlier tests did), whose process starts such a child."""
    code = (
        "import subprocess, sys; "
        "subprocess.run([sys.executable, '-c', 'from tpudiag.processes import lower_priority; lower_priority(10)'], "
        "check=True); print(open('/proc/self/autogroup').read().split()[-1])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True, start_new_session=True
    )
    assert out.stdout.split() == ["0"]
