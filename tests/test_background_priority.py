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
