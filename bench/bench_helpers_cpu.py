"""What a long capture spends in CPU beside the script's own thread (issue 21): the window analyst and the store
feeder (child processes) and the capture's background threads (the pulse writer, the flusher, the numerics line).

The long-run bench loop (tests/long_scripts/long_loop.py, its planted slow steps and recompile) runs under the
default capture pinned to core 0, beside a plain run on core 1, as ``bench_long_run``'s side-by-side layout: on one
core a helper's CPU is the loop's.  Every thread of the capture's process tree is read from ``/proc`` once a second
until the loop has printed its result (a helper's figure is its last reading; the store write after the
script is not counted), so the parts are told apart by CPU time, which this machine's core-to-core
speed noise (a few percent between two plain runs side by side) does not blur the way it blurs throughput ratios.

    BENCH_LONG_S=300 python -m bench.run helpers_cpu        # the default: five minutes
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

from bench.bench_long_run import _command, _pinned
from bench.common import last_json_line

TICK = os.sysconf("SC_CLK_TCK")


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _part(root: int, pid: int, tid: int, cmdline: list[str]) -> str:
    module = next((a for a in cmdline if a.startswith("tpudiag.")), None)
    if module is not None:
        return module.rsplit(".", 1)[1]  # analyst, feeder
    return "main_thread" if (pid, tid) == (root, root) else "capture_threads" if pid == root else "other"


def _sample(root: int, seen: dict[tuple[int, int], tuple[str, float]]) -> None:
    for pid in _tree(root):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in map(int, tids):
            try:
                fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            seen[(pid, tid)] = (_part(root, pid, tid, cmdline), (int(fields[11]) + int(fields[12])) / TICK)


def main() -> dict[str, object]:
    seconds = float(os.environ.get("BENCH_LONG_S", "300"))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        procs = []
        for core, mode in enumerate(("capture", "plain")):
            with open(work / f"{mode}.out", "w") as out:  # the child keeps its own descriptor
                cmd = _command(mode, work, seconds, core)
                procs.append(
                    subprocess.Popen(cmd, cwd=work, stdout=out, stderr=subprocess.DEVNULL, preexec_fn=_pinned(core))
                )
        capture = procs[0]
        seen: dict[tuple[int, int], tuple[str, float]] = {}
        started = time.monotonic()
        printed = work / "capture.out"
        while capture.poll() is None and "{" not in printed.read_text():  # until the loop has ended
            _sample(capture.pid, seen)
            time.sleep(1.0)
        wall = time.monotonic() - started
        for proc in procs:
            proc.wait()
        runs = {m: last_json_line((work / f"{m}.out").read_text()) for m in ("capture", "plain")}
    cpu: dict[str, float] = {}
    for part, seconds_cpu in seen.values():
        cpu[part] = cpu.get(part, 0.0) + seconds_cpu
    helpers = sum(v for k, v in cpu.items() if k != "main_thread")
    return {
        "seconds": seconds,
        "capture_wall_s": round(wall, 1),
        "cpu_s": {k: round(v, 2) for k, v in sorted(cpu.items())},
        "cpu_pct_of_run": {k: round(100 * v / seconds, 2) for k, v in sorted(cpu.items()) if k != "main_thread"},
        "helpers_and_threads_pct_of_run": round(100 * helpers / seconds, 2),
        "steps": {m: r["steps"] for m, r in runs.items()},
        "throughput_vs_plain_beside_it": round(runs["capture"]["steps"] / runs["plain"]["steps"], 3),
        "note": "CPU seconds of each part of the default capture's process tree (capture pinned to core 0, a plain "
        "run on core 1); throughput here is one pair, within this machine's core-to-core noise",
    }


if __name__ == "__main__":
    from bench.common import write_result

    write_result("helpers_cpu", main())
