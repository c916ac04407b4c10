"""A long loop of fast steps (issue 21): plain python, the default ``tpudiag capture`` and ``torch.profiler`` with a
schedule (20 active steps every 3,025), in one run.

Layouts (``BENCH_LAYOUT``).  ``side_by_side`` (the default on two cores or more): each of the capture and the
profiler runs at the same time as a plain run, each process pinned to its own core (the capture's threads and its
deferred writer share its core), then again with the cores swapped; its throughput is the median of its steps over
the plain run's beside it.  Both runs see the same minutes of the machine: on this VM, whose speed drifts 10-30%
between runs minutes apart, runs one after the other cannot resolve a few percent (a 10-minute capture once read
1.096x plain).  ``sequential``: the modes one after the other (``BENCH_ROUNDS`` rounds, default 1, each starting
with the next mode), each round's runs against its own plain run.

The loop is tests/long_scripts/long_loop.py: a 7-layer MLP (AdamW), fixed wall time (``BENCH_LONG_S`` seconds,
default 600), a run of planted slow steps at 40% of the run and a recompile at 70%.  Each mode reports the steps it
got through in that time (throughput), its peak RSS, its longest step; the capture adds what its pulse saw: steps,
tpudiag's own longest time in a step outside windows, the windows by reason, the run folder's size, and whether the
planted anomalies opened their windows.

Targets (issue 21): throughput >= 0.97x plain; peak RSS <= plain + 300 MB and flat; the disk under the cap; no stall
outside windows over 50 ms; the planted anomalies captured.

    BENCH_LONG_S=60 python -m bench.run long_run      # a short version (what a shared machine allows)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import last_json_line
from tpudiag import deferred_store
from tpudiag.store import Store, pending

REPO = Path(__file__).resolve().parents[1]
LOOP = REPO / "tests" / "long_scripts" / "long_loop.py"
THROUGHPUT_TARGET = 0.97
RSS_TARGET_MB = 300
STALL_TARGET_S = 0.05


def _command(mode: str, work: Path, seconds: float, n: int) -> list[str]:
    anomalies = ["--slow-at", f"{seconds * 0.4:g}", "--recompile-at", f"{seconds * 0.7:g}"]
    loop = [str(LOOP), f"{seconds:g}", *anomalies]
    if mode == "plain":
        return [sys.executable, *loop]
    if mode == "profiler":
        folder = work / f"prof{n}"
        folder.mkdir()
        return [sys.executable, *loop, "--torch-profiler", str(folder)]
    return [sys.executable, "-m", "tpudiag", "capture", "--db", str(work / f"b{n}.duckdb"), *loop]


def _run(mode: str, work: Path, seconds: float, n: int) -> dict[str, Any]:
    proc = subprocess.run(_command(mode, work, seconds, n), cwd=work, capture_output=True, text=True, check=True)
    return _results(mode, proc.stdout, work, n, seconds)


def _pinned(core: int) -> Any:
    return lambda: os.sched_setaffinity(0, {core})


def _side_by_side(modes: tuple[str, str], work: Path, seconds: float, n: int) -> list[dict[str, Any]]:
    """Two modes at once, the first pinned to core 0 and the second to core 1 (with all their threads and child
    processes: the capture's deferred writer shares its loop's core), so that both see the same minutes of the
    machine.  Their output goes to files: a pipe read only after the other run ends could fill and stall a loop."""
    logs = [(work / f"out{n + i}.txt", work / f"err{n + i}.txt") for i in range(len(modes))]
    procs = []
    for i, mode in enumerate(modes):
        with open(logs[i][0], "w") as out, open(logs[i][1], "w") as err:
            cmd = _command(mode, work, seconds, n + i)
            procs.append(subprocess.Popen(cmd, cwd=work, stdout=out, stderr=err, text=True, preexec_fn=_pinned(i)))
    for p, (_, err_path) in zip(procs, logs, strict=True):
        if p.wait():
            raise RuntimeError(f"exit {p.returncode}: {err_path.read_text()[-2000:]}")
    return [_results(mode, logs[i][0].read_text(), work, n + i, seconds) for i, mode in enumerate(modes)]


def _pair(text: str) -> tuple[str, str]:
    a, _, b = text.partition(":")
    if sorted((a, b)) not in (["capture", "plain"], ["plain", "profiler"]):
        raise SystemExit(f"BENCH_PAIRS: {text!r} is not plain:capture, capture:plain, plain:profiler or profiler:plain")
    return a, b


def _results(mode: str, stdout: str, work: Path, n: int, seconds: float) -> dict[str, Any]:
    db = work / f"b{n}.duckdb"
    out = last_json_line(stdout)
    if mode == "profiler":
        out["disk_mb"] = round(sum(p.stat().st_size for p in (work / f"prof{n}").iterdir()) / 2**20, 1)
    if mode == "capture":
        pending.settle(Store(db), deferred_store.finish)  # the detached store write, before the next mode
        rep = subprocess.run(
            [sys.executable, "-m", "tpudiag", "report", "--db", str(db), "--json"], capture_output=True, text=True
        )
        data = json.loads(rep.stdout)
        pulse, windows = data["pulse"] or {}, data["windows"] or []
        run_dir = Path(data["run"]["artifacts_dir"])
        reasons: dict[str, int] = {}
        for w in windows:
            reasons[w["reason"]] = reasons.get(w["reason"], 0) + 1
        import duckdb

        with duckdb.connect(str(db), read_only=True) as con:  # where tpudiag's longest own times outside windows were
            top = con.execute(
                "SELECT step, round(own_ns / 1e6, 1), round(dur_ns / 1e6, 1) FROM pulse WHERE window_id IS NULL "
                "ORDER BY own_ns DESC LIMIT 5"
            ).fetchall()
            spent = _capture_seconds(con, seconds, out.get("slow_from"), int(out.get("planted_steps") or 0))
            quiet = _longest_quiet_outside_windows(con, out.get("slow_from"), out.get("recompile_step"))
        out.update(
            tpudiag_top_outside_windows=[{"step": s, "own_ms": o, "step_ms": d} for s, o, d in top],
            longest_quiet_outside_windows_s=quiet,
            pulse_steps=pulse.get("steps"),
            tpudiag_max_outside_windows_s=pulse.get("tpudiag_max_outside_windows_s"),
            step_time_p50_s=pulse.get("step_time_p50_s"),
            step_time_p99_s=pulse.get("step_time_p99_s"),
            windows=reasons,
            disk_mb=round(sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file()) / 2**20, 1),
            store_mb=round(db.stat().st_size / 2**20, 1),
            slow_step_captured=any(
                w["reason"] == "slow_step" and w["top_ops"] and w["top_ops"][0]["name"] == "aten::sort" for w in windows
            ),
            recompile_captured="recompile" in reasons,
            capture_seconds=spent,
        )
    return out


def _longest_quiet_outside_windows(con: Any, slow_from: int | None, recompile_step: int | None) -> float | None:
    """The capture's longest step period (the gap before the step and the step) outside windows after the loop's
    first 5 s, the planted slow steps and the recompile left out: what the loop's own ``longest_quiet_s`` is for
    the plain run, with the windows (which may stall by design) left out too.  A stall of the whole loop shows here
    whoever's it was: a full garbage collection in tpudiag's thread counts in the gap, not in tpudiag's own time."""
    planted = (slow_from, slow_from + 30) if slow_from is not None else (-1, -1)
    compiled = (recompile_step, recompile_step + 1) if recompile_step is not None else (-1, -1)
    row = con.execute(
        "SELECT max(dur_ns + coalesce(gap_ns, 0)) FROM pulse WHERE window_id IS NULL "
        "AND start_ns >= (SELECT min(start_ns) FROM pulse) + 5e9 AND step NOT BETWEEN ? AND ? AND step NOT IN (?, ?)",
        [*planted, *compiled],
    ).fetchone()
    return round(row[0] / 1e9, 4) if row and row[0] is not None else None


def _capture_seconds(con: Any, seconds: float, slow_from: int | None, planted: int) -> dict[str, float | int]:
    """Where the capture's extra time went, in seconds of the loop's ``seconds`` (from its own pulse): the windows'
    steps beyond what as many steps take outside windows (profiler on, every op checked in trigger windows, the
    session's start and stop; the first window apart, since its steps also hold the script's own warm-up), and
    tpudiag's measured own time in steps outside windows (numerics re-checks, readings).  The hooks' frames on every
    step are in neither (``bench_step_hooks`` measures them).

    The planted slow steps (``slow_from`` on, ``planted`` of them) are slow in the plain run too: the windows they
    open trace mostly them, so their time is kept apart (``planted_in_windows_*``; ``_planted_over_plain`` charges
    the capture only what they took beyond the plain run's own planted steps)."""
    median_ns = con.execute("SELECT median(dur_ns + gap_ns) FROM pulse WHERE window_id IS NULL").fetchone()[0] or 0
    lo = slow_from if slow_from is not None else -1
    rows = con.execute(
        "SELECT window_id = 0, step >= ? AND step < ?, count(*), sum(dur_ns + gap_ns) FROM pulse "
        "WHERE window_id IS NOT NULL GROUP BY 1, 2",
        [lo, lo + planted],
    ).fetchall()
    extra: dict[bool, float] = {}
    planted_steps, planted_ns = 0, 0
    for first, is_planted, n, total in rows:
        if is_planted:
            planted_steps, planted_ns = planted_steps + n, planted_ns + (total or 0)
        else:
            extra[bool(first)] = extra.get(bool(first), 0.0) + ((total or 0) - n * median_ns) / 1e9
    own_ns = con.execute("SELECT sum(own_ns) FROM pulse WHERE window_id IS NULL").fetchone()[0] or 0
    figures = {
        "first_window_extra": extra.get(True, 0.0),
        "later_windows_extra": extra.get(False, 0.0),
        "own_outside_windows": own_ns / 1e9,
    }
    out: dict[str, float | int] = {f"{k}_s": round(v, 2) for k, v in figures.items()}
    out.update({f"{k}_pct": round(100 * v / seconds, 2) for k, v in figures.items()})
    out["later_window_steps"] = sum(n for first, is_planted, n, _ in rows if not first and not is_planted)
    out["planted_in_windows_steps"] = planted_steps
    out["planted_in_windows_s"] = round(planted_ns / 1e9, 3)
    return out


def _planted_over_plain(capture: dict[str, Any], plain: dict[str, Any], seconds: float) -> None:
    """The capture's planted slow steps inside windows, beyond what as many took in the plain run beside it."""
    spent = capture.get("capture_seconds")
    if not spent or not plain.get("planted_steps"):
        return
    mean_s = plain["planted_s"] / plain["planted_steps"]
    over = spent["planted_in_windows_s"] - spent["planted_in_windows_steps"] * mean_s
    spent["planted_in_windows_over_plain_s"] = round(over, 2)
    spent["planted_in_windows_over_plain_pct"] = round(100 * over / seconds, 2)


def _slope(samples: list[list[float]]) -> float | None:
    half = samples[len(samples) // 2 :]
    if len(half) < 3:
        return None
    ts = [t for t, _ in half]
    mb = [kb / 1024 for _, kb in half]
    mt, mm = sum(ts) / len(ts), sum(mb) / len(mb)
    var = sum((t - mt) ** 2 for t in ts)
    return round(60 * sum((t - mt) * (m - mm) for t, m in zip(ts, mb, strict=True)) / var, 2) if var else None


def main() -> dict[str, object]:
    seconds = float(os.environ.get("BENCH_LONG_S", "600"))
    rounds = int(os.environ.get("BENCH_ROUNDS", "1"))
    layout = os.environ.get("BENCH_LAYOUT") or ("side_by_side" if len(os.sched_getaffinity(0)) >= 2 else "sequential")
    # Each mode beside a plain run on the other core, then with the cores swapped (``core0:core1`` pairs).
    default_pairs = "plain:capture,capture:plain,plain:profiler,profiler:plain"
    pairs = [_pair(p) for p in os.environ.get("BENCH_PAIRS", default_pairs).split(",")]
    results: dict[str, list[dict[str, Any]]] = {"plain": [], "capture": [], "profiler": []}
    paired: dict[str, list[float]] = {"capture": [], "profiler": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        n = 0
        modes = ("plain", "capture", "profiler")
        for r in range(rounds):
            if layout == "side_by_side":
                for pair in pairs:
                    runs = _side_by_side(pair, work, seconds, n)
                    n += 2
                    by_mode = dict(zip(pair, runs, strict=True))
                    for m, run in by_mode.items():
                        results[m].append(run)
                    mode = next(m for m in pair if m != "plain")
                    paired[mode].append(by_mode[mode]["steps"] / by_mode["plain"]["steps"])
                    _planted_over_plain(by_mode[mode], by_mode["plain"], seconds)
                continue
            # Each round starts with the next mode: a machine that drifts one way over the rounds favours none.
            for mode in modes[r % 3 :] + modes[: r % 3]:
                results[mode].append(_run(mode, work, seconds, n))
                n += 1
            plain = results["plain"][-1]["steps"]
            for mode in modes[1:]:
                paired[mode].append(results[mode][-1]["steps"] / plain)
                _planted_over_plain(results[mode][-1], results["plain"][-1], seconds)
    results = {m: rs for m, rs in results.items() if rs}
    paired = {m: v for m, v in paired.items() if v}
    if "capture" not in results:
        raise SystemExit("BENCH_PAIRS: no pair runs the capture")
    plain_steps = max(r["steps"] for r in results["plain"])
    plain_rss = max(r["rss_end_kb"] for r in results["plain"]) / 1024
    cap = results["capture"][-1]
    summary = {
        "seconds_per_mode": seconds,
        "short_mode": seconds < 600,
        "layout": layout,
        # side_by_side: each run against the plain run beside it, on the other core in the same minutes (the
        # median over both core orders); sequential: each round's runs against that round's plain run (minutes
        # apart: on a VM whose speed drifts 10-30% over an hour, a few percent is within its drift).
        "throughput_vs_plain": {m: round(statistics.median(v), 3) for m, v in paired.items()},
        "paired_throughput_vs_plain": {
            m: {"per_pair": [round(x, 3) for x in v], "median": round(statistics.median(v), 3)}
            for m, v in paired.items()
        },
        "best_run_throughput_vs_plain": {
            m: round(max(r["steps"] for r in rs) / plain_steps, 3) for m, rs in results.items() if m != "plain"
        },
        "peak_rss_over_plain_mb": {
            m: round(max(r["rss_end_kb"] for r in rs) / 1024 - plain_rss, 1)
            for m, rs in results.items()
            if m != "plain"
        },
        "capture_rss_growth_last_two_thirds_mb": round((cap["current_end_kb"] - cap["current_third_kb"]) / 1024, 1),
        # Robust to warm-up and to one-off stalls: the steps of each run's second half, and its median loop period.
        "second_half_throughput_vs_plain": {
            m: round(max(r["second_half_steps"] for r in rs) / max(r["second_half_steps"] for r in results["plain"]), 3)
            for m, rs in results.items()
            if m != "plain"
        },
        "median_period_ms": {m: min(r["median_period_ms"] for r in rs) for m, rs in results.items()},
        # Current RSS over the second half, once a second: a least-squares slope (MB per minute), ~0 when bounded.
        "rss_slope_second_half_mb_per_min": {m: _slope(rs[-1]["rss_samples"]) for m, rs in results.items()},
        "longest_step_s": {m: round(max(r["longest_step_s"] for r in rs), 4) for m, rs in results.items()},
        "capture_tpudiag_max_outside_windows_s": cap["tpudiag_max_outside_windows_s"],
        # The longest stall of the loop whoever's it was (after its first 5 s, planted steps and the recompile left
        # out): plain's from the loop itself, the capture's from its pulse outside windows.
        "longest_quiet_period_s": {
            "plain": max(r["longest_quiet_s"] for r in results["plain"]),
            "capture_outside_windows": max(r["longest_quiet_outside_windows_s"] or 0.0 for r in results["capture"]),
        },
        "capture_tpudiag_top_outside_windows": cap["tpudiag_top_outside_windows"],
        "capture_pulse_covers_every_step": cap["pulse_steps"] == cap["steps"],
        "capture_windows": cap["windows"],
        # Where the capture's time went, from its pulse (the hooks' own frames on every step are bench_step_hooks').
        "capture_seconds": cap["capture_seconds"],
        "capture_disk_mb": cap["disk_mb"],
        "capture_store_mb": cap["store_mb"],
        "anomalies_captured": {"slow_step": cap["slow_step_captured"], "recompile": cap["recompile_captured"]},
        "targets": {
            "throughput_vs_plain": THROUGHPUT_TARGET,
            "peak_rss_over_plain_mb": RSS_TARGET_MB,
            "stall_outside_windows_s": STALL_TARGET_S,
        },
        "runs": {m: [{k: v for k, v in r.items() if k != "rss_samples"} for r in rs] for m, rs in results.items()},
    }
    return summary


if __name__ == "__main__":
    from bench.common import write_result

    write_result("long_run", main())
