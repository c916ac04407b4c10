"""The capture's line to its background children (tpudiag/wake_line.py), with real processes: a poke wakes the
child at once, the capture's death wakes it at once (also when the script forked while the line was open), and a
child without a line sleeps its timeout as the poll it replaces."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

# A child that waits on its line (60 s timeout) and prints how it woke and after how long.
WAITER = textwrap.dedent(
    """
    import sys, time
    from tpudiag.wake_line import ParentLine
    line = ParentLine()
    print("ready", line.open, flush=True)
    t = time.monotonic()
    line.wait(float(sys.argv[1]), float(sys.argv[1]))
    print("woke", round(time.monotonic() - t, 2), line.open, flush=True)
    """
)

# The capture's side: a line, the waiter on it, then (argv) poke it, or fork a child that outlives us and die.
HOLDER = textwrap.dedent(
    """
    import os, sys, time
    from tpudiag.wake_line import start_child
    waiter, line = start_child([sys.executable, "-c", sys.argv[1], "60"], stdout=sys.stdout)
    time.sleep(1.0)
    if sys.argv[2] == "poke":
        line.poke()
        waiter.wait()
    else:
        if sys.argv[2] == "fork" and os.fork() == 0:
            time.sleep(30)  # a DataLoader worker, say: alive after its parent died
            os._exit(0)
        print("holder", os.getpid(), flush=True)
        time.sleep(60)
    """
)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def _holder(mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, WAITER, mode], stdout=subprocess.PIPE, text=True, env=_env(),
        start_new_session=True,
    )  # fmt: skip


def _woke(proc: subprocess.Popen[str]) -> tuple[float, bool]:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("woke"):
            _, seconds, still_open = line.split()
            return float(seconds), still_open == "True"
        if line.startswith("holder"):
            os.kill(int(line.split()[1]), signal.SIGKILL)  # the capture dies without a word
    raise AssertionError("the waiter never woke")


def test_a_poke_wakes_the_child_at_once() -> None:
    proc = _holder("poke")
    seconds, still_open = _woke(proc)
    proc.wait(timeout=30)
    assert seconds < 5.0  # ~1 s: the holder's pause before its poke; the waiter's timeout is 60 s
    assert still_open


def test_the_capture_dying_wakes_the_child_at_once() -> None:
    proc = _holder("die")
    seconds, still_open = _woke(proc)
    proc.wait(timeout=30)
    assert seconds < 5.0
    assert not still_open  # end-of-file: the child looks at its parent's pid and leaves


def test_a_fork_of_the_script_does_not_keep_the_line_open() -> None:
    proc = _holder("fork")
    seconds, still_open = _woke(proc)
    assert seconds < 5.0  # without the at-fork close the forked child held the write end for 30 s
    os.killpg(proc.pid, signal.SIGKILL)  # the forked child
    proc.wait(timeout=30)
    assert not still_open


def test_a_child_without_a_line_sleeps_its_timeout() -> None:
    t = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", WAITER, "0.5"], stdin=subprocess.DEVNULL, capture_output=True, text=True, env=_env(),
        check=True,
    ).stdout  # fmt: skip
    assert "ready False" in out
    assert time.monotonic() - t >= 0.5


# A script under capture: small steps until both children run, a pause for their first work, then how often each
# woke (voluntary context switches) over 4 s of the script's steps with nothing for them to do.
IDLE_CHILDREN = textwrap.dedent(
    """
    import json, os, time
    import torch
    from tests.capture_children import children

    def wakes(pid):
        with open(f"/proc/{pid}/status") as fh:
            return int(fh.read().split("\\nvoluntary_ctxt_switches:")[1].split()[0])

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)

    def steps(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            opt.zero_grad(); model(x).sum().backward(); opt.step(); time.sleep(0.002)

    deadline = time.monotonic() + 60
    while len(children()) < 2 and time.monotonic() < deadline:
        steps(0.5)
    kids = {name: pid for name, (pid, _) in children().items()}
    steps(3.0)  # their start and first work: the first window's analysis, the feeder's first load
    before = {name: wakes(pid) for name, pid in kids.items()}
    steps(4.0)
    print(json.dumps({name: wakes(pid) - before[name] for name, pid in kids.items()}))
    """
)


def test_idle_children_sleep_on_their_line_instead_of_polling(tmp_path: Path) -> None:
    script = tmp_path / "idle_children.py"
    script.write_text(IDLE_CHILDREN)
    env = _env()
    env.pop("TPUDIAG_FLUSH_S", None)  # the feeder loads at the first flush (10 s) and 10 s after that
    out = subprocess.run(
        [sys.executable, "-m", "tpudiag", "capture", "--db", str(tmp_path / "t.duckdb"), "--collect", "trace",
         str(script)], capture_output=True, text=True, env=env, timeout=180, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    woke = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    assert set(woke) == {"analyst", "feeder"}
    # Polling, the analyst woke 4 times a second (16 here) and the feeder 5 (20); on its line the analyst looks at
    # its files every 5 s, the feeder for a reader's request every second.
    assert woke["analyst"] <= 3, woke
    assert woke["feeder"] <= 8, woke
