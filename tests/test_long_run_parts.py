"""The long-run parts on their own (issue 21): slow-step detection, the rate limit, the schedule, the disk cap, the
window plan, the numerics sampler's re-checks, the manual trigger's poll, per-step probes, and the report's and
dashboard's readers on hand-built pulse and window records."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.factories import make_event, make_run, store_with
from tpudiag.errors import UsageError
from tpudiag.longrun import analyst, control, manual, probes, schedule, triggers
from tpudiag.model import PulseStep, TraceWindow
from tpudiag.store import Store, longrun_queries


def test_slow_steps_flags_outliers_and_keeps_them_out_of_the_median() -> None:
    slow = triggers.SlowSteps(factor=4.0, min_extra_s=0.005)
    assert not any(slow.check(0.003) for _ in range(40))
    assert slow.median_s == pytest.approx(0.003)
    assert slow.check(0.050)  # 16x the median, 47 ms more
    assert not slow.check(0.011)  # under 4x
    for _ in range(40):
        slow.check(0.050)  # a run of slow steps...
    assert slow.median_s == pytest.approx(0.003)  # ...never becomes the new normal
    tiny = triggers.SlowSteps(factor=4.0, min_extra_s=0.005)
    for _ in range(20):
        tiny.check(0.0001)
    assert not tiny.check(0.001)  # 10x, but only 0.9 ms more: jitter
    # The median of the recent steps, as every path recomputes it (``check``, ``fires``, ``refresh``).
    spread = [0.001 * (1 + i % 5) for i in range(64)]  # 1-5 ms, evenly: median 3 ms
    for path in ("check", "fires", "refresh"):
        steps = triggers.SlowSteps(factor=100.0)
        for d in spread:
            if path == "refresh":
                steps.recent.append(d)
            else:
                getattr(steps, path)(d)
        if path == "refresh":
            assert steps.refresh() == pytest.approx(max(100.0 * 0.003, 0.003 + steps.min_extra_s))
        assert steps.median_s == pytest.approx(0.003), path


def test_an_isolated_outlier_opens_no_window_a_repeated_or_far_one_does() -> None:
    slow = triggers.SlowSteps(factor=4.0, min_extra_s=0.005)
    for _ in range(40):
        slow.fires(0.003)
    # Jitter: single steps of 5-15x the median, far apart.
    jitter = [slow.fires(0.040 if i % 50 == 0 else 0.003) for i in range(1, 500)]
    assert not any(jitter)
    assert slow.fires(0.100)  # 33x the median: far out, alone
    for _ in range(40):
        slow.fires(0.003)
    assert not slow.fires(0.030)  # 10x, alone
    assert slow.fires(0.030)  # ... and again at once: a run of slow steps


def test_rate_limit_spaces_trigger_windows_but_never_holds_a_manual_one() -> None:
    limit = triggers.RateLimit(min_interval_s=30.0, max_per_reason=2)
    assert limit.allow("slow_step", 100.0)
    assert not limit.allow("slow_step", 110.0)
    assert limit.allow("recompile", 111.0)  # another reason is not held by the slow steps
    assert limit.allow("manual", 112.0) and limit.allow("manual", 113.0)
    assert limit.allow("slow_step", 190.0)
    assert not limit.allow("slow_step", 500.0)  # its two are used up
    assert limit.held == {"slow_step": 2}


def test_schedule_parses_both_forms_and_refuses_bad_ones() -> None:
    steps = schedule.parse("wait=100,warmup=1,active=3,repeat=2")
    assert (steps.wait, steps.warmup, steps.active, steps.repeat, steps.every_s) == (100, 1, 3, 2, None)
    assert steps.steps == 4
    start = steps.first_steps
    due = [s for s in range(0, 1000) if steps.due(s, 0, 0.0, 0.0, 0)]
    assert due[:3] == [start + 100, start + 204, start + 308]
    assert not steps.due(start + 100, 0, 0.0, 0.0, cycles=2)  # repeat=2 used up
    timed = schedule.parse(None)
    assert (timed.every_s, timed.active) == (120.0, 5)
    assert not timed.due(50, 20, now_s=100.0, last_end_s=0.0, cycles=0)
    assert timed.due(50, 20, now_s=121.0, last_end_s=0.0, cycles=0)
    assert timed.max_s == 30.0 and steps.max_s is None  # the time form's windows last 30 s at most
    assert timed.wait_s(0.0) == 120.0 and timed.wait_s(50.0) == 450.0  # at least 9x the last window
    assert not timed.due(50, 20, now_s=300.0, last_end_s=0.0, cycles=0, last_len_s=50.0)
    assert timed.due(50, 20, now_s=451.0, last_end_s=0.0, cycles=0, last_len_s=50.0)
    assert schedule.parse("every=60s,active=2,max=10s").max_s == 10.0
    assert schedule.parse("every=60s,max=0").max_s is None
    for bad in ("wait=x", "active=0", "every=10s,wait=3", "bogus=1", "wait", "max=x", "max=-1", "wait=3,max=5s"):
        with pytest.raises(UsageError):
            schedule.parse(bad)


def _file(tmp_path: Path, name: str, size: int) -> Path:
    p = tmp_path / name
    p.write_bytes(b"x" * size)
    return p


def test_disk_cap_prunes_scheduled_windows_first_and_keeps_anomalies(tmp_path: Path) -> None:
    cap = analyst.DiskCap(max_bytes=1000)
    cap.add(0, "first_steps", _file(tmp_path, "w0", 300))
    cap.add(1, "schedule", _file(tmp_path, "w1", 300))
    cap.add(2, "slow_step", _file(tmp_path, "w2", 300))
    cap.add(3, "schedule", _file(tmp_path, "w3", 300))
    assert cap.allows("schedule", busy={3})  # over: window 1 goes (3 is still being analysed)
    assert cap.pruned == [1] and not (tmp_path / "w1").exists() and (tmp_path / "w2").exists()
    cap.add(4, "recompile", _file(tmp_path, "w4", 700))
    assert not cap.allows("schedule", busy=set())  # window 3 pruned too, and still over: no scheduled window
    assert cap.pruned == [1, 3]
    assert cap.allows("nonfinite", busy=set())  # anomalies up to twice the cap
    assert {p.name for p in tmp_path.iterdir()} == {"w0", "w2", "w4"}
    assert analyst.parse_size("1.5GB") == int(1.5 * 2**30) and analyst.parse_size("500m") == 500 * 2**20
    with pytest.raises(UsageError):
        analyst.parse_size("lots")


def _plan(**kw: Any) -> Any:
    from tpudiag.collectors.windows import WindowPlan

    return WindowPlan(
        schedule.parse("every=1000s,active=3"), analyst.DiskCap(), triggers.RateLimit(min_interval_s=10), now_s=0.0,
        **kw,
    )  # fmt: skip


def test_window_plan_first_steps_then_triggers_after_warm_up() -> None:
    control.activate()
    try:
        plan = _plan()
        assert plan.open is not None and plan.open.reason == "first_steps"
        plan.plan(5, 1.0, [("slow_step", "early")], set)
        assert not plan.close_next and plan.next is None  # inside the first window, before warm-up: ignored
        plan.plan(20, 2.0, [], set)
        assert plan.close_next
        plan.closed(20, 2.0)
        plan.plan(150, 3.0, [("slow_step", "step 149 took 40 ms")], set)
        assert plan.next is not None and plan.next.reason == "slow_step" and plan.next.numerics
        assert control.numerics_wanted()  # the numerics collector's hook, right after, watches step 150
        window = plan.opened()
        assert window is not None and (window.first_step, window.end_step, window.window_id) == (150, 155, 1)
        plan.plan(153, 4.0, [("slow_step", "x")], set)  # during the window, within the limit (10 s): held
        plan.plan(155, 5.0, [], set)
        assert plan.close_next and plan.next is None
        assert plan.limit.held == {"slow_step": 1}
        plan.closed(155, 5.0)
        assert window.deadline_s == 3.0 + 30.0  # a trigger's window: its 5 steps or 30 s (slow steps)
        control.request("manual", steps=2, numerics=False, detail="tpudiag trigger")
        plan.plan(160, 6.0, [], set)
        assert plan.next is not None and plan.next.reason == "manual" and plan.next.end_step == 162
        assert plan.next.deadline_s is None  # the steps asked for, however long they take
        assert not control.numerics_wanted()
    finally:
        control.deactivate()


def test_a_scheduled_window_opens_once_per_interval_not_again_as_it_closes() -> None:
    from tpudiag.collectors.windows import WindowPlan

    control.activate()
    try:
        plan = WindowPlan(schedule.parse("every=15s,active=3"), analyst.DiskCap(), triggers.RateLimit(), now_s=0.0)
        opened: list[tuple[str, int]] = []
        now = 0.0
        for step in range(0, 3000):
            now = step * 0.01  # 100 steps a second: 30 s
            plan.plan(step, now, [], set)
            if plan.close_next:
                plan.closed(step, now)
            window = plan.opened()
            if window is not None:
                opened.append((window.reason, window.first_step))
        # The first window (20 steps), then one scheduled window 15 s after it ended: not a second one right after.
        assert opened == [("schedule", 1520)], opened
    finally:
        control.deactivate()


@pytest.mark.parametrize("step_s", [0.01, 1.0, 10.0, 60.0])
def test_the_default_schedule_traces_at_most_a_tenth_of_the_run_whatever_the_step_time(step_s: float) -> None:
    """Windows of 5 steps every 120 s traced 30% of a run of 10 s steps (and 83% of one of 60 s steps), each
    window 50 s to 5 min of trace.  A window now ends after 30 s (one step at least) and the next waits 9x its
    length; fast steps keep their five-step windows every 120 s."""
    from tpudiag.collectors.windows import WindowPlan

    control.activate()
    try:
        plan = WindowPlan(schedule.parse(None), analyst.DiskCap(), triggers.RateLimit(), now_s=0.0)
        traced, lengths, steps = 0.0, [], int(4 * 3600 / step_s)  # four hours
        start: float | None = None
        first_end, first_scheduled = 0.0, None
        for step in range(steps):
            now = step * step_s
            plan.plan(step, now, [], set)
            if plan.close_next:
                window = plan.closed(step, now)
                if window is not None and window.reason == "first_steps":
                    first_end = now
                if window is not None and window.reason == "schedule" and start is not None:
                    traced += now - start
                    lengths.append((now - start, step - window.first_step))
            if plan.opened() is not None:
                start = now
                first_scheduled = now if first_scheduled is None else first_scheduled
        # The first window (20 steps or 60 s) does not delay the schedule: it is the run's start, paid once.
        assert first_scheduled is not None and first_scheduled - first_end <= 120.0 + step_s
        assert lengths, "no scheduled window"
        assert traced / (steps * step_s) <= 0.11
        assert all(seconds <= max(30.0, step_s) and n >= 1 for seconds, n in lengths)
        if step_s < 1:
            assert {n for _, n in lengths} == {5} and len(lengths) >= 100  # every 120 s, five steps each
    finally:
        control.deactivate()


@pytest.mark.parametrize(
    "spec", ["every=3s,active=4", "wait=37,warmup=2,active=3", "wait=5,active=2,repeat=3,skip_first=50"]
)
def test_an_idle_plan_skips_its_steps_and_opens_the_same_windows_as_one_that_asks_every_step(spec: str) -> None:
    """The per-step fast path (``WindowPlan._quiet``): steps before the schedule can be due return at once, and the
    windows are exactly those of a plan that runs in full at every step, through triggers, a manual request and a
    resumed window."""
    from tpudiag.collectors.windows import Window, WindowPlan

    def run(gated: bool) -> tuple[list[tuple[str, int, int | None]], int]:
        control.activate()
        try:
            plan = WindowPlan(schedule.parse(spec), analyst.DiskCap(), triggers.RateLimit(min_interval_s=2), now_s=0.0)
            opened: list[tuple[str, int, int | None]] = []
            quiet = 0
            for step in range(1500):
                now = step * 0.01
                fired = [("slow_step", "x")] if step in (400, 401, 900) else []
                if step == 700:
                    control.request("manual", steps=3, numerics=False)
                if not gated:
                    plan._quiet = None
                quiet += plan._quiet is not None and step < plan._quiet[0]
                plan.plan(step, now, fired, set)
                if plan.close_next:
                    plan.closed(step, now)
                if step == 1100 and plan.open is None and plan.next is None:  # as ``_resume_window`` does
                    plan.next = Window(plan.count, "manual", step, step + 2)
                window = plan.opened()
                if window is not None:
                    opened.append((window.reason, window.first_step, window.end_step))
            return opened, quiet
        finally:
            control.deactivate()

    full, _ = run(gated=False)
    gated, quiet = run(gated=True)
    assert gated == full
    assert {r for r, _, _ in full} >= {"slow_step", "manual"}
    if "wait" in spec:
        assert quiet > 1000  # most steps skipped (the time form's are skipped by time, not by step)


def test_a_new_capture_keeps_the_process_compile_counts_its_pulse_started_from() -> None:
    """``compile_counts`` are "so far in this process": a second capture's ``activate`` must not reset them under the
    pulse, which took its baseline before (its first records read negative compile deltas)."""
    control.activate()
    control.compile_event("compile")
    control.compile_event("recompile", "x")
    before = control.compile_counts()
    control.deactivate()
    control.activate()
    try:
        assert control.compile_counts() == before
        assert not control.STATE.pending and control.STATE.active
    finally:
        control.deactivate()


def test_requests_are_dropped_when_no_capture_runs_and_bad_reasons_refused() -> None:
    control.deactivate()
    assert control.request("manual") is False
    with pytest.raises(ValueError):
        control.request("because")


def test_sampler_rechecks_each_signature_once_in_a_periodic_step_and_boost_checks_all() -> None:
    from tpudiag.collectors.numerics.sampling import Sampler, SamplingOptions

    s = Sampler(SamplingOptions(first_k=1))
    sig = ("aten::tanh", ((4,),))
    assert s.wants(sig) and not s.wants(sig)
    s.begin_step(boost=False, recheck=True)
    assert s.wants(sig) and not s.wants(sig)  # once in the re-check step
    s.begin_step(boost=False, recheck=False)
    assert not s.wants(sig)
    s.begin_step(boost=True, recheck=False)
    assert all(s.wants(sig) for _ in range(5))


def test_a_settled_steps_checks_stop_in_time_and_what_is_left_comes_first_next_time() -> None:
    from tpudiag.collectors.numerics.sampling import CHECK_STEP_S, Sampler, SamplingOptions

    s = Sampler(SamplingOptions(first_k=1))
    sigs = [("aten::op", i) for i in range(10)]
    for sig in sigs:
        assert s.wants(sig) and s.in_time(sig, lambda: 1.0)  # not settled: no step cap at all
    cost = CHECK_STEP_S / 4  # four checks fit in a step

    def periodic_step() -> list[int]:
        s.begin_step(boost=False, recheck=True, capped=True, now=time.perf_counter())
        done = []
        for i, sig in enumerate(sigs):
            if s.wants(sig) and s.in_time(sig, lambda: cost):
                time.sleep(cost * 0.9)  # the check
                done.append(i)
        return done

    first, second, third = periodic_step(), periodic_step(), periodic_step()
    assert 2 <= len(first) <= 4 and first == list(range(len(first))), first
    assert second[0] == len(first), (first, second)  # the round goes on where the last step stopped
    assert sorted(set(first + second + third)) == list(range(min(10, len(first + second + third))))
    # A check no step could afford never holds the round open; a new signature's first check over the time left is
    # refused (a later call takes its place).
    s.begin_step(boost=False, recheck=False, capped=True, now=time.perf_counter())
    new = ("aten::new", 0)
    assert s.wants(new) and not s.in_time(new, lambda: 10.0) and s.wants(new)
    s.begin_step(boost=True, recheck=False, capped=True)
    assert s.wants(new) and s.in_time(new, lambda: 10.0)  # trace windows check everything
    assert not s.too_late(new, 10.0)


def test_a_check_estimated_cheap_is_dropped_when_the_op_itself_outlasted_the_steps_check_time() -> None:
    """The float64 oracle takes at least as long as the op did: an op that ran past the step's check time is not
    checked there, whatever its estimate said (a never-measured 2M-element sort's first check had stalled a
    settled step for 0.44 s outside any window)."""
    from tpudiag.collectors.numerics.sampling import CHECK_STEP_S, Sampler, SamplingOptions

    s = Sampler(SamplingOptions(first_k=1))
    s.begin_step(boost=False, recheck=False, capped=True, now=time.perf_counter())
    big = ("aten::sort", 0)
    assert s.wants(big) and s.in_time(big, lambda: 0.001)  # estimated at 1 ms: admitted
    assert s.too_late(big, 0.2)  # but the op alone took 0.2 s
    assert s.wants(big)  # refused, so a later call takes its place
    small = ("aten::add", 0)
    assert s.wants(small) and s.in_time(small, lambda: 0.001) and not s.too_late(small, CHECK_STEP_S / 10)


def test_background_allowance_grows_with_time() -> None:
    from tpudiag.collectors.numerics.sampling import Background

    bg = Background(pct=1.0)
    assert not bg.affords(0.05, now_s=100.0)  # starts counting now
    assert not bg.affords(0.05, now_s=104.0)  # 1% of 4 s = 40 ms
    assert bg.affords(0.05, now_s=106.0)
    bg.charge(0.05)
    assert not bg.affords(0.05, now_s=108.0)


def test_boost_allowance_keeps_what_a_horizon_holds_whatever_the_run_length() -> None:
    from tpudiag.collectors.numerics.sampling import BOOST_HORIZON_S, BOOST_PCT, Background

    most = BOOST_PCT / 100.0 * BOOST_HORIZON_S
    hour3 = 3 * 3600.0
    boost = Background(pct=BOOST_PCT, since_s=0.0, horizon_s=BOOST_HORIZON_S)
    assert boost.affords(most, now_s=hour3) and not boost.affords(most * 1.5, now_s=hour3)  # not 9 minutes' worth
    boost.charge(most)
    assert not boost.affords(most / 10, now_s=hour3 + 1.0)  # spent: it refills at BOOST_PCT of the time
    assert boost.affords(most / 10, now_s=hour3 + 1.0 + BOOST_HORIZON_S / 10)
    # A step that costs more than the horizon holds still gets its turn, once that much has accrued.
    big = Background(pct=BOOST_PCT, since_s=0.0, horizon_s=BOOST_HORIZON_S)
    assert not big.affords(2 * most, now_s=1.5 * BOOST_HORIZON_S)
    assert big.affords(2 * most, now_s=hour3)
    # Without a horizon (the re-checks' allowance) everything not spent is kept.
    assert Background(pct=BOOST_PCT, since_s=0.0).affords(most * 1.5, now_s=hour3)


def test_poller_reads_each_request_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "r1"
    poller = manual.Poller(manual.trigger_folders(run_dir), 0.0)
    assert not poller.due(0.1) and poller.due(1.0)
    assert poller.poll(1.0) == []  # no folder yet
    manual.write_request(run_dir, steps=4, numerics="all")
    found = poller.poll(2.0)
    assert [(r["steps"], r["numerics"]) for r in found] == [(4, "all")]
    assert poller.poll(3.0) == []
    worker = tmp_path / "runs" / "job" / "workers" / "host-0"  # a rank worker also reads the job's folder
    assert manual.trigger_folders(worker)[1] == tmp_path / "runs" / "job" / "triggers"


def test_probes_give_figures_unknown_as_none_and_a_failing_probe_is_dropped() -> None:
    handle = probes.register("mem", lambda: {"allocated_bytes": 1024, "peak_bytes": None, "label": "x"})  # type: ignore[dict-item]

    def broken() -> dict[str, Any]:
        raise RuntimeError("no")

    bad = probes.register("bad", broken)
    try:
        assert probes.collect() == {"mem.allocated_bytes": 1024, "mem.peak_bytes": None, "mem.label": None}
        assert "bad" not in probes.registered()
    finally:
        handle.remove()
        bad.remove()
    assert probes.collect() is None


def _pulse(run_id: str, step: int, dur_ms: float, window: int | None = None) -> PulseStep:
    return PulseStep(run_id=run_id, step=step, start_ns=step * 10_000_000, dur_ns=int(dur_ms * 1e6), gap_ns=100,
                     own_ns=5_000, window_id=window)  # fmt: skip


def _store_long_run(tmp_path: Path) -> tuple[Store, str]:
    store = Store(tmp_path / "s.duckdb")
    run = make_run(started_at=0.0)
    pulse = [_pulse(run.id, i, 3.0, 0 if i < 3 else None) for i in range(200)]
    pulse[120] = _pulse(run.id, 120, 90.0)
    win0 = TraceWindow(run_id=run.id, window_id=0, reason="first_steps", first_step=0, last_step=2, start_ns=0,
                       end_ns=30_000_000, trace_events=2, first_event_id=0)  # fmt: skip
    win1 = TraceWindow(run_id=run.id, window_id=1, reason="slow_step", first_step=121, last_step=125,
                       start_ns=1_210_000_000, end_ns=1_260_000_000, trace_events=2,
                       first_event_id=analyst.first_event_id(1), detail="step 120: 90 ms",
                       numerics=True)  # fmt: skip
    events = [
        make_event(run.id, 0, "aten::addmm", 0, 2_000),
        make_event(run.id, 1, "aten::relu", 2_000, 1_000),
        make_event(run.id, analyst.first_event_id(1), "aten::sort", 1_210_000_000, 50_000_000),
        make_event(run.id, analyst.first_event_id(1) + 1, "aten::addmm", 1_250_000_000, 2_000),
    ]
    store_with(store, run, {PulseStep: pulse, TraceWindow: [win0, win1], type(events[0]): events})
    return store, run.id


def test_report_sections_read_the_pulse_and_each_windows_own_ops(tmp_path: Path) -> None:
    from tpudiag.longrun.report_section import build_pulse, build_windows, render_pulse, render_windows

    store, run_id = _store_long_run(tmp_path)
    run = {"id": run_id}
    pulse = build_pulse(store, run)
    assert pulse is not None and pulse["steps"] == 200
    assert pulse["step_time_p50_s"] == pytest.approx(0.003)
    assert [s["step"] for s in pulse["slow_steps"]] == [120]
    windows = build_windows(store, run)
    assert windows is not None and [w["reason"] for w in windows] == ["first_steps", "slow_step"]
    assert [o["name"] for o in windows[1]["top_ops"]] == ["aten::sort", "aten::addmm"]
    assert [o["name"] for o in windows[0]["top_ops"]] == ["aten::addmm", "aten::relu"]
    assert windows[1]["start_s"] == pytest.approx(1.21) and windows[1]["numerics"] is True
    text = "\n".join(render_pulse(pulse) + render_windows(windows))
    assert "200 steps" in text and "slow_step" in text and "top op aten::sort" in text
    assert longrun_queries.step_times(store, run_id, max_points=50)[30]["dur_ns"] == 90_000_000  # bucket 120-123


def test_timeline_page_shows_the_pulse_and_windows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from streamlit.testing.v1 import AppTest

    from tests.conftest import REPO

    store, run_id = _store_long_run(tmp_path)
    monkeypatch.setenv("TPUDIAG_DB", str(store.path))
    at = AppTest.from_file(str(REPO / "app" / "main.py"), default_timeout=60)
    at.run()
    at.selectbox(key="run").set_value(run_id)
    at.switch_page("views/timeline.py").run()
    assert not at.exception, at.exception
    assert {m.label: m.value for m in at.metric}["Steps"] == "200"
    assert "slow_step" in str(at.dataframe[0].value)


def _pulse_loop(tmp_path: Path, steps: int, nan: Any, step_s: float = 0.0) -> dict[str, int]:
    """A real PulseRecorder over ``steps`` SGD steps of a small model, the loss NaN where ``nan(step)``; each step
    ``step_s`` long at least.  The first step each trigger reason fired at; the pulse spooled under tmp_path."""
    import torch

    from tpudiag.collectors.pulse import PulseRecorder
    from tpudiag.plugins import CaptureContext
    from tpudiag.spool import Spool

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pulse = PulseRecorder(CaptureContext(run_id="r", run_dir=tmp_path, spool=Spool(tmp_path / "spool")))
    fired_at: dict[str, int] = {}
    x = torch.randn(3, 4)
    for step in range(steps):
        pulse.step_begin((x,), {})
        opt.zero_grad()
        scale = float("nan") if nan(step) else 1.0
        (model(x).sum() * scale).backward()
        opt.step()
        if step_s:
            time.sleep(step_s)
        fired = pulse.step_end(opt)
        for reason, _detail in fired:
            fired_at.setdefault(reason, step)
    pulse.stop()
    return fired_at


def test_pulse_sees_a_non_finite_gradient_a_step_later_and_records_every_step(tmp_path: Path) -> None:
    fired_at = _pulse_loop(tmp_path, 6, lambda step: step == 3)
    assert fired_at.get("nonfinite") == 4  # step 3's gradient, read at step 4's end: no sync in step 3
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "spool" / "pulse")
    cols = [table[c].to_pylist() for c in ("step", "nonfinite", "shapes")]
    rows = sorted(zip(*cols, strict=True))
    assert [r[0] for r in rows] == list(range(6))  # every step, the last one written at stop
    assert rows[3][1] is True and rows[2][1] is False
    assert rows[0][2] == "[[3, 4]]"


def _growth_asks(readings: Iterable[tuple[int, int, bool]], held: bool = False) -> list[int]:
    """The steps at which the memory growth watch (16-step spans) asks for a window, each ask granted, over
    (step, live bytes, whether a trace window covers the step) readings; ``held``: with the memory collector's
    shortcut for held readings."""
    from tpudiag.longrun.growth import GrowthWatch

    watch = GrowthWatch(span=16)
    asked = []
    for step, live, window in readings:
        if held and watch.quiet and live == watch.held and not window:  # the memory collector's shortcut
            watch.quiet -= 1
            watch.pending += 1
            continue
        low = watch.see(live, in_window=window)
        if low is not None:
            asked.append(step)
            watch.granted(low)
    return asked


def test_memory_growth_counts_held_readings_without_a_call_and_asks_at_the_same_steps() -> None:
    # The memory collector counts a step whose held reading decides nothing as pending (no call on ~15 of every
    # 16 fast steps): every ask lands on the step it would land on with every step seen.
    mib = 1 << 20

    def readings(hold: int) -> list[tuple[int, int, bool]]:
        out, live = [], 0
        for step in range(2000):
            if step % hold == 0:  # a new reading every ``hold`` steps, held in between
                live = 400 * mib + max(step - 600, 0) * mib + (80 * mib if step % 300 < 40 else 0)
            out.append((step, live, 900 <= step < 930 or 1500 <= step < 1503))
        return out

    for hold in (1, 5, 16, 35):
        every = _growth_asks(readings(hold))
        assert every and every == _growth_asks(readings(hold), held=True), hold


def test_memory_growth_is_judged_on_a_spans_low_so_transient_peaks_never_ask_for_a_window() -> None:
    mib = 1 << 20

    def live(step: int) -> int:
        live = 400 * mib
        if step % 50 < 5:
            live += 250 * mib  # a trace window's few steps: a transient peak, every 50 steps
        if step >= 300:
            live += (step - 300) * 4 * mib  # a leak: 4 MiB more held every step
        return live

    # The peaks are not marked as windows here: the span's low alone keeps them from asking.
    asked = _growth_asks((step, live(step), False) for step in range(400))
    # Nothing before the leak; the leak asks once it held 100 MiB (1.25 x 400) for a whole span, then again only
    # after as much growth again.
    assert asked and all(s >= 300 for s in asked), asked
    assert asked[0] < 360 and len(asked) <= 2, asked


def test_memory_a_trace_window_leaves_behind_is_not_the_scripts_growth_a_later_leak_is() -> None:
    """Seen on the bench loop: a window with every op checked left the host RSS ~90 MB higher for good, and the
    growth watch opened a ``memory`` window for it (a false alarm)."""
    mib = 1 << 20

    def asked_at(leak_from: int | None) -> list[int]:
        def reading(step: int) -> tuple[int, int, bool]:
            window = 200 <= step < 205
            live = 400 * mib + (150 * mib if window else 0) + (120 * mib if step >= 205 else 0)  # +120 MiB kept
            if leak_from is not None and step >= leak_from:
                live += (step - leak_from) * 4 * mib
            return step, live, window

        return _growth_asks(reading(step) for step in range(600))

    assert asked_at(None) == []
    leak = asked_at(400)
    assert leak and leak[0] >= 400 and leak[0] < 480, leak  # a later leak of the script's is still found


def test_memory_a_leak_that_keeps_opening_windows_is_still_found() -> None:
    """Seen in CI: a leak of 8 MiB a step slowed the steps, ``slow_step`` windows opened 5 steps into it and again
    37 steps later, and the growth across each window was taken for the window's own: no ``memory`` window."""
    mib = 1 << 20

    def asked_at(leak_from: int | None, left_by_window: int) -> list[int]:
        def readings() -> Iterator[tuple[int, int, bool]]:
            kept = 0
            for step in range(20, 200):
                window = step >= 133 and (step - 133) % 37 < 5  # a window every 37 steps from step 133
                if window and (step - 133) % 37 == 4:
                    kept += left_by_window  # each window leaves some memory of its own behind
                live = 400 * mib + kept + (60 * mib if window else 0)
                if leak_from is not None and step >= leak_from:
                    live += (step - leak_from) * 8 * mib
                yield step, live, window

        return _growth_asks(readings())

    assert asked_at(None, 90 * mib) == []  # the windows' leftovers alone: no alarm
    leak = asked_at(130, 90 * mib)
    assert leak and 133 < leak[0] < 175, leak  # before the second window closes
    assert asked_at(130, 0)


def test_thinned_readings_every_step_first_then_one_per_interval() -> None:
    from tpudiag.longrun.stride import Stride

    stride = Stride(every_s=0.01, first_steps=5)
    # The first steps: a reading every step, however close together.
    assert all(stride.due(step, 1.0 + step * 1e-6) for step in range(5))
    # Then 1 ms steps: one reading per 10 ms, never two within it.
    due = [step for step in range(5, 105) if stride.due(step, 1.0 + step * 1e-3)]
    assert 9 <= len(due) <= 11
    assert all(b - a >= 10 for a, b in itertools.pairwise(due))
    # Slow steps (10 ms or more): every step again.
    assert all(stride.due(step, 2.0 + (step - 200) * 0.011) for step in range(200, 220))


def test_pulse_thins_its_gradient_check_on_fast_steps_and_still_finds_a_lasting_nan(tmp_path: Path) -> None:
    from tpudiag.longrun.stride import EVERY_S

    # A NaN that lasts (as one that reached the weights does); steps of a quarter of the interval: a check about
    # every 4th step after the first steps.
    fired_at = _pulse_loop(tmp_path, 60, lambda step: step >= 40, step_s=EVERY_S / 4)
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "spool" / "pulse")
    rows = dict(zip(table["step"].to_pylist(), table["nonfinite"].to_pylist(), strict=True))
    assert sorted(rows) == list(range(60))  # every step has its record
    assert all(rows[s] is False for s in range(schedule.FIRST_STEPS))  # the first steps: every one checked
    thinned = [s for s in range(schedule.FIRST_STEPS, 40) if rows[s] is None]
    assert len(thinned) >= 8, rows  # later fast steps: most read None (unknown), none a copied value
    assert 40 < fired_at["nonfinite"] <= 40 + 8  # found within the interval (read a step after its check)


def test_the_pulse_check_is_unseen_by_dispatch_modes(tmp_path: Path) -> None:
    """The check's ops never reach a dispatch mode on the stack (the numerics collector's counted, checked and
    learned them as the script's; a script's own mode would see tpudiag's ops)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from tpudiag.collectors.pulse import FULL_EVERY, PulseRecorder
    from tpudiag.plugins import CaptureContext
    from tpudiag.spool import Spool

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pulse = PulseRecorder(CaptureContext(run_id="r", run_dir=tmp_path, spool=Spool(tmp_path / "spool")))
    pulse._check_every_ns = 0  # a check at every step
    model(torch.randn(3, 4)).sum().backward()
    with Seen() as seen:
        for _ in range(FULL_EVERY + 1):  # the small check and the full one
            pulse.step_end(opt)
    pulse.stop()
    assert pulse._checks > FULL_EVERY
    assert seen.ops == []


def test_a_far_slower_step_opens_its_window_through_the_interval_a_jitter_window_started() -> None:
    limit = triggers.RateLimit(min_interval_s=30.0)
    assert limit.allow("slow_step", 100.0, severity=5.0)  # a 5x jitter outlier's window
    assert not limit.allow("slow_step", 105.0, severity=8.0)  # like it: held back by the interval
    assert limit.allow("recompile", 105.0)  # another reason has its own interval
    assert limit.allow("slow_step", 108.0, severity=60.0)  # the real slowdown, 12x as severe: opens
    assert not limit.allow("slow_step", 110.0, severity=90.0)  # not 3x the last one any more: held
    assert not limit.allow("slow_step", 111.0)  # no severity known: the interval holds
    assert limit.held["slow_step"] == 3
    capped = triggers.RateLimit(min_interval_s=30.0, max_per_reason=1)
    assert capped.allow("slow_step", 0.0, severity=5.0)
    assert not capped.allow("slow_step", 1.0, severity=500.0)  # the count cap holds whatever the severity


def test_the_pulse_never_counts_more_own_time_than_the_step_took(tmp_path: Path) -> None:
    """A checker clock that jumps (as a budget correction about earlier steps did) is not a stall of this step."""
    import torch

    from tpudiag.collectors.pulse import PulseRecorder
    from tpudiag.plugins import CaptureContext
    from tpudiag.spool import Spool

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    from tpudiag.collectors.numerics.sampling import Budget

    clock = Budget(pct=None)
    control.set_checker_budget(clock)
    try:
        pulse = PulseRecorder(CaptureContext(run_id="r", run_dir=tmp_path, spool=Spool(tmp_path / "spool")))
        for step in range(4):
            pulse.step_begin((torch.ones(1),), {})
            model(torch.randn(3, 4)).sum().backward()
            if step == 2:
                clock.extra_s += 0.5  # half a second "spent" by the checker, all at once
            pulse.step_end(opt)
        pulse.stop()
    finally:
        control.set_checker_budget(None)
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "spool" / "pulse")
    for own, dur, gap in zip(table["own_ns"].to_pylist(), table["dur_ns"].to_pylist(), table["gap_ns"].to_pylist(),
                             strict=True):  # fmt: skip
        assert own <= dur + (gap or 0)
    assert max(table["own_ns"].to_pylist()) < 0.4e9


def test_a_step_the_checker_watched_is_never_judged_slow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A watched step is slower by the dispatch of every op through the mode, more than the checker's clock holds:
    judged, it read as an outlier of the script's and let the next jitter step fire a slow_step window.

    The pulse reads a virtual clock here (steps of exactly 1 ms, watched ones 31 ms): on a loaded machine a real
    ~0.1 ms step jitters past 25x its median now and then, which is the pulse doing its job, not this test's point."""
    import torch

    from tpudiag.collectors import pulse as pulse_module
    from tpudiag.collectors.pulse import PulseRecorder
    from tpudiag.plugins import CaptureContext
    from tpudiag.spool import Spool

    class VirtualTime:
        ns = time.perf_counter_ns()

        def perf_counter_ns(self) -> int:
            return self.ns

        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

    virtual = VirtualTime()
    monkeypatch.setattr(pulse_module, "time", virtual)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    from tpudiag.collectors.numerics.sampling import Budget

    clock = Budget(pct=None)
    control.set_checker_budget(clock)
    fired: list[int] = []
    try:
        pulse = PulseRecorder(CaptureContext(run_id="r", run_dir=tmp_path, spool=Spool(tmp_path / "spool")))
        pulse.slow.factor = 4.0
        for step in range(triggers.WARMUP_STEPS + 40):
            virtual.ns += 200_000  # the gap before the step
            pulse.step_begin((torch.ones(1),), {})
            model(torch.randn(3, 4)).sum().backward()
            virtual.ns += 1_000_000
            if step >= triggers.WARMUP_STEPS and step % 5 == 0:
                virtual.ns += 30_000_000  # a watched step: far slower than its median...
                clock.extra_s += 0.001  # ... of which the checker's clock holds only a little
            pulse.step_end(opt)
            if pulse.slow_ratio is not None:
                fired.append(step)
        pulse.stop()
    finally:
        control.set_checker_budget(None)
    assert fired == []
    assert pulse.slow._last_slow is None  # not even counted as an outlier


def test_a_step_stalled_by_tpudiags_background_threads_is_judged_without_the_stall(tmp_path: Path) -> None:
    """The collectors' flusher and the pulse writer hold the GIL for milliseconds: the script's steps that waited
    on them are not its slowness.  The same stall with no background work fires slow_step."""
    import threading
    import time

    import torch

    from tpudiag.collectors.pulse import PulseRecorder
    from tpudiag.plugins import CaptureContext
    from tpudiag.spool import Spool

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def stalled(step: int) -> bool:
        return step >= triggers.WARMUP_STEPS and step % 10 in (0, 1)  # two 100 ms stalls in a row: a repeat

    go, done = threading.Event(), threading.Event()

    def flusher() -> None:
        while go.wait():
            go.clear()
            with control.background_work():
                time.sleep(0.1)  # a flush holding the GIL, as the script's thread sees it
            done.set()

    threading.Thread(target=flusher, daemon=True).start()

    def run(background: bool) -> list[int]:
        fired: list[int] = []  # the stalled steps that fired (a loaded host's jitter elsewhere is not this test's)
        pulse = PulseRecorder(CaptureContext(run_id="r", run_dir=tmp_path, spool=Spool(tmp_path / f"s{background}")))
        pulse.slow.min_extra_s = 0.05  # a loaded host wakes the script's thread some ms late after the flush
        for step in range(triggers.WARMUP_STEPS + 40):
            pulse.step_begin((torch.ones(1),), {})
            model(torch.randn(3, 4)).sum().backward()
            if stalled(step):
                if background:
                    go.set()
                    done.wait()
                    done.clear()
                else:
                    time.sleep(0.1)
            pulse.step_end(opt)
            if pulse.slow_ratio is not None and stalled(step):
                fired.append(step)
        pulse.stop()
        return fired

    assert run(background=True) == []
    assert run(background=False) != []  # the same stall, the script's own: found


def test_the_root_probes_inline_signature_finds_what_input_signature_recorded() -> None:
    # ``ModuleBoundaries.enter`` tests ``model(x)``'s inputs against the recorded signatures without calling
    # ``input_signature`` (every step's root call): the two forms must hash and compare equal, or every step would
    # probe again.
    import torch

    from tpudiag.collectors.numerics.steps import input_signature

    for x in (torch.ones(32, 128), torch.ones(3, dtype=torch.int64), torch.tensor(1.0)):
        assert ((x.shape, x.dtype),) in {input_signature((x,), {})}
    assert ((torch.ones(4).shape, torch.float32),) not in {input_signature((torch.ones(5),), {})}


@pytest.mark.skipif(not Path("/proc/thread-self/schedstat").exists(), reason="Linux run-queue counts")
def test_a_step_held_off_its_cpu_by_another_task_opens_no_window_the_scripts_own_slowness_does(
    tmp_path: Path,
) -> None:
    """Other processes spinning on the step thread's core keep it waiting in the run queue: its steps are slow
    (repeats, so a window would open) but not the script's, and ``StallClock`` finds the wait.  The same steps slow
    for the script's own reason (blocked in a sleep, as on I/O) still open a window.  Real scheduling, no mock: the
    thread and the spinners share one core."""
    import os
    import subprocess
    import sys

    import torch

    from tpudiag.collectors.pulse import PulseRecorder
    from tpudiag.plugins import CaptureContext
    from tpudiag.spool import Spool

    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    core = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    spin = "import sys, time\nwhile time.time() < float(sys.argv[1]): time.sleep(0.005)\nwhile True: pass"

    def run(held: bool) -> tuple[list[int], int]:
        fired: list[int] = []
        pulse = PulseRecorder(CaptureContext(run_id="r", run_dir=tmp_path, spool=Spool(tmp_path / f"s{held}")))
        # Four spinners (each step waits several of their slices), started now and spinning from ``t_end`` on: no
        # process start inside a step.  Marks every 0.5 s teach the ordinary rate before.
        t_end = time.perf_counter() + 1.5
        spin_at = repr(time.time() + 1.5)
        spinners = [
            subprocess.Popen([sys.executable, "-c", spin, spin_at], preexec_fn=lambda: os.sched_setaffinity(0, {core}))
            for _ in range(4 if held else 0)
        ]
        step = 0
        while True:
            slow_block = step >= triggers.WARMUP_STEPS and time.perf_counter() >= t_end
            pulse.step_begin((torch.ones(1),), {})
            for _ in range(20):
                model(torch.randn(32, 64)).sum().backward()
            if slow_block and not held:
                time.sleep(0.05)
            pulse.step_end(opt)
            if slow_block and pulse.slow_ratio is not None:
                fired.append(step)
            step += 1
            if slow_block and time.perf_counter() >= t_end + 1.5:
                break
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
        pulse.stop()
        return fired, pulse.stall_clock.stalls

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (intra-op threads spinning on the one core would hold the step thread themselves)
    os.sched_setaffinity(0, {core})
    try:
        held_fired, held_stalls = run(held=True)
        own_fired, own_stalls = run(held=False)
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)
    assert held_stalls > 0 and held_fired == [], (held_stalls, held_fired)
    assert own_fired != [] and own_stalls == 0, (own_fired, own_stalls)
