"""tpudiag's background children (the window analysis, the store feeder) run in Linux's idle scheduling class
(tpudiag.processes.lower_priority): a script using every core is never kept waiting for them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

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


def _session_and_group(pid: int) -> tuple[int, int]:
    return os.getsid(pid), os.getpgid(pid)


def test_the_analysis_and_feeder_children_share_the_scripts_session_in_groups_of_their_own(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The real children: in the caller's session (so in the script's scheduling group under Linux's autogroups,
    where their idle class holds them back), each the leader of a process group of its own (the terminal's Ctrl-C
    and a launcher's signal to the job's group do not reach them), in the idle class from their start."""
    from tpudiag.longrun import analyst
    from tpudiag.model import Run
    from tpudiag.store import feeder

    (tmp_path / "trace").mkdir()
    worker = analyst.Worker("run-x", tmp_path, tmp_path / "trace")
    worker.kick()
    run_dir, spool = tmp_path / "run", tmp_path / "spool"
    run_dir.mkdir()
    spool.mkdir()
    run = Run(id="run-x", name="x", status="running", started_at=0.0)
    loads = feeder.SpoolFeeder(tmp_path / "s.duckdb", run, run_dir, spool, 10.0)
    try:
        assert loads.start() and worker.proc is not None and worker.failed is None and loads.proc is not None
        for pid in (worker.proc.pid, loads.proc.pid):
            assert _session_and_group(pid) == (os.getsid(0), pid)
            if hasattr(os, "SCHED_IDLE"):
                assert os.sched_getscheduler(pid) == os.SCHED_IDLE
        assert os.getpgid(0) != worker.proc.pid and os.sched_getscheduler(0) != getattr(os, "SCHED_IDLE", -1)
    finally:
        worker.stop(wait_s=30)
        loads.stop()
    assert worker.proc.returncode is not None


# A job in a session of its own (as a shell starts one) spins on one core beside a child started as the window
# analyst and the store feeder are (``BACKGROUND_GROUP``, ``make_background``), which spins on the same core; the
# child's share of that core.
SHARE = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from tpudiag.processes import BACKGROUND_GROUP, make_background

    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    child = subprocess.Popen([sys.executable, "-S", "-c", "while True: pass"], process_group=BACKGROUND_GROUP)
    make_background(child.pid)
    end = time.monotonic() + 4.0
    while time.monotonic() < end:
        pass
    fields = open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()
    child_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    own = os.times()
    child.kill()
    child.wait()
    print(child_s / (child_s + own.user + own.system))
    """
)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no idle scheduling class on this system")
def test_a_background_child_takes_almost_nothing_of_a_core_the_script_keeps_busy() -> None:
    """Under autogroups a child in a session of its own took 1.4% of the script's busy core whatever its class (its
    group's share at nice 19, what a busy analyst or feeder takes); in the script's group the idle class holds it
    to ~0.3%.  (Where the kernel has no autogroups both read ~0.3%.)"""
    out = subprocess.run(
        [sys.executable, "-c", SHARE], capture_output=True, text=True, timeout=120, check=True, start_new_session=True
    )
    share = float(out.stdout.split()[-1])
    assert share < 0.008, f"the background child had {100 * share:.2f}% of the script's core"


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
