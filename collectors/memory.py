"""The memory collector: per-step memory figures, and the diagnosis of an out-of-memory error that ends the script.

- **Per step** (at every optimizer step's end, through the capture's one optimizer post-hook,
  ``collectors/step_points.py``, first of its callbacks): ``MemorySampler``
  figures (device allocator, libtpu, process RSS) with their sources, kept in a small buffer and spooled at each
  flush (``memory_steps``, origin "sampler").  The pulse of long runs can call ``MemorySampler.sample`` itself.
- **Per module and op**: the trace collector's ``profile_memory`` option records the allocator's events;
  ``collectors/memory_window.py`` reads them from each trace window (method "profiler").  Where the profiler has
  no device memory events (TorchTPU), ``memory_dispatch`` counts live tensor bytes at dispatch instead
  (``collectors/memory_dispatch.py``, method "dispatch"; opt-in: a dispatch mode makes torch.compile run eagerly).
- **Out of memory**: ``runner`` tells this collector the exception that ends the script, before its traceback is
  printed (the traceback and exit status are untouched).  The message is classified and parsed
  (``tpudiag.analysis.oom_text``); the step, the module (from the traceback's innermost ``forward`` frame: no
  per-call hook is needed), the bytes asked for, live and limit bytes and XLA's allocation table are stored as
  ``memory_oom`` / ``memory_oom_allocs``.  The op that asked, and what was live by module, come from the last trace
  window (``memory_window``) when the trace collector ran.

Nothing here runs per op or per module call: the cost is one sample per step.

- **Into the pulse** (long runs, ``tpudiag.longrun.probes``): each sample's figures are published to the pulse record
  of the step that took it (``memory.allocated_bytes`` ...; a step without a sample, or unknown figures, stay null),
  and growth of the live bytes past their post-warm-up floor, held over a run of steps
  (``tpudiag.longrun.growth``), asks for a ``memory`` trace window.  The step hook runs before the pulse's
  (``collectors/step_points.py``): no second reading.
"""

from __future__ import annotations

import collections
import functools
import json
import math
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from tpudiag import internal_errors, runner
from tpudiag.longrun import control, probes, triggers
from tpudiag.longrun.growth import GrowthWatch
from tpudiag.longrun.stride import Stride
from tpudiag.plugins import CaptureContext

LIVE_FIGURES = ("allocated_bytes", "device_used_bytes", "rss_bytes")  # the live bytes: the first one known
PROBE_FIGURES = ("allocated_bytes", "reserved_bytes", "peak_bytes", "rss_bytes", "device_used_bytes")

OOM_FILE = "oom.json"  # run_dir/memory/oom.json: the OOM record, for the trace window analysis to complete


def oom_path(run_dir: Path) -> Path:
    return run_dir / "memory" / OOM_FILE


def _module_of_traceback(tb: TracebackType | None) -> str | None:
    """The module path of the innermost ``nn.Module.forward`` frame in the traceback, named as the module tracker
    names it (the outermost module in the traceback is the root: its class name; the others by attribute path)."""
    import torch

    from tpudiag.collectors.modules import foreign_path

    frames: list[Any] = []
    modules: list[tuple[torch.nn.Module, int]] = []  # (module, index of its forward's frame), outermost first
    while tb is not None:
        frame = tb.tb_frame
        me = frame.f_locals.get("self") if frame.f_code.co_name == "forward" else None
        if isinstance(me, torch.nn.Module):
            modules.append((me, len(frames)))
        frames.append(frame)
        tb = tb.tb_next
    if not modules:
        return None
    root = modules[0][0]
    orig = getattr(root, "_orig_mod", None)
    label = type(orig if isinstance(orig, torch.nn.Module) else root).__name__
    tree = {id(sub): ".".join(p for p in name.split(".") if p != "_orig_mod") for name, sub in root.named_modules()}
    path = ""
    for i, (module, at) in enumerate(modules[1:], start=1):
        if id(module) in tree:
            path = tree[id(module)]
            continue
        caller = modules[i - 1][0]
        path = foreign_path(module, caller, path, functools.partial(_global_name_before, module, frames[:at]))
    return path or label


def _global_name_before(module: Any, frames: list[Any]) -> str:
    """``module``'s name among the globals of the code that called it (the last of ``frames`` outside tpudiag and
    the module call machinery), as the module tracker names it; else its class name."""
    from tpudiag.collectors.modules import caller_globals, name_in

    namespace = caller_globals(reversed(frames))
    return (name_in(namespace, module) if namespace is not None else None) or type(module).__name__


def _oom_in(exc: BaseException) -> tuple[BaseException, Any] | None:
    """The out-of-memory error in ``exc`` or its causes, with its parsed text."""
    from tpudiag.analysis import oom_text

    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        parsed = oom_text.parse(str(cur), type(cur).__name__)
        if parsed is not None:
            return cur, parsed
        cur = cur.__cause__ or cur.__context__
    return None


class MemoryCollector:
    name = "memory"
    description = (
        "memory per step (device allocator, libtpu HBM, process RSS, each figure with its source), what was live at "
        "the peak by module and op, the largest allocations, and the diagnosis of an out-of-memory error"
    )
    start_order = 25  # after the trace (it stops first, before the trace's last window is analysed), before numerics

    def __init__(self) -> None:
        self._ctx: CaptureContext | None = None
        self._sampler: Any = None
        # deque: append (the step's thread) and popleft (the flusher) are atomic, so the step takes no lock
        self._rows: collections.deque[tuple[int, int, dict[str, Any]]] = collections.deque()
        self._steps = 0
        self._hooks: list[Any] = []
        self._remove_listener: Any = None
        self._oom: dict[str, Any] | None = None
        self._oom_allocs: list[Any] = []
        self._last_flushed: dict[str, Any] | None = None  # the last step's figures once its row is spooled
        self._dispatch: Any = None  # memory_dispatch.LiveBytes when counting at dispatch
        self._tracker: Any = None
        self._windows = 0
        self._window_lock = threading.Lock()
        self._oom_holders: list[dict[str, Any]] = []
        self._growth = GrowthWatch()  # growth of the live bytes past their post-warm-up floor
        self._span_from = 0  # the step of the growth span's first reading
        self._live: int | None = None  # live bytes of the last sample (the growth watch's figure)
        self._stride = Stride()  # one sample a step, thinned on fast steps (tpudiag.longrun.stride)
        self._read_at = -math.inf  # the clock from which the stride's next reading is due

    # -- plugin protocol --------------------------------------------------------------------------------------
    def is_available(self) -> bool:
        import importlib.util

        return importlib.util.find_spec("torch") is not None

    def prepare(self, ctx: CaptureContext) -> None:
        pass

    def start(self, ctx: CaptureContext) -> None:
        from tpudiag.collectors import step_points
        from tpudiag.collectors.memory_sampler import MemorySampler

        self._ctx = ctx
        self._sampler = MemorySampler()
        self._hooks.append(step_points.add(self._after_step, step_points.READ, "memory", by_root=True, steady=self))
        self._remove_listener = runner.add_failure_listener(self._on_failure)
        if ctx.options.get("memory_dispatch"):
            from tpudiag.collectors.memory_dispatch import LiveBytes
            from tpudiag.collectors.modules import ModuleTracker

            self._tracker = ModuleTracker()
            self._tracker.install()
            self._dispatch = LiveBytes(self._tracker.current, lambda: self._steps)
            self._dispatch.__enter__()
            ctx.metadata.setdefault("memory", {})["method"] = "dispatch"

    def flush(self) -> None:
        if self._ctx is None:
            return
        from tpudiag.model import MemoryStep

        pending = []
        while True:
            try:
                pending.append(self._rows.popleft())
            except IndexError:
                break
        if pending:
            self._last_flushed = pending[-1][2]
        sources_json: dict[tuple[tuple[str, str], ...], str] = {}  # a run's steps share a few source sets
        rows = []
        for step, ts_ns, fig in pending:
            key = tuple(sorted(fig["sources"].items()))
            if key not in sources_json:
                sources_json[key] = json.dumps(dict(key), sort_keys=True)
            rows.append(
                MemoryStep(
                    run_id=self._ctx.run_id, step=step, origin="sampler", ts_ns=ts_ns, device=fig["device"],
                    allocated_bytes=fig["allocated_bytes"], reserved_bytes=fig["reserved_bytes"],
                    peak_bytes=fig["peak_bytes"], rss_bytes=fig["rss_bytes"],
                    device_used_bytes=fig["device_used_bytes"], limit_bytes=fig["limit_bytes"],
                    sources=sources_json[key],
                )
            )  # fmt: skip
        self._ctx.spool.write_records(MemoryStep, rows)
        if self._dispatch is not None:
            self._spool_dispatch_window()

    def _spool_dispatch_window(self) -> None:
        """The dispatch counts since the last window, analysed like a trace window (method "dispatch")."""
        from tpudiag.analysis import memory_events
        from tpudiag.model import MemoryBlock, MemoryPoint, MemoryStep, records_to_arrow

        assert self._ctx is not None
        with self._window_lock:
            taken = self._dispatch.take_window()
            if taken is None:
                return
            window = self._windows
            self._windows += 1
        mem, sites = taken
        out = memory_events.analyse(mem, sites, self._ctx.run_id, window, method="dispatch")
        for cls, rows in ((MemoryPoint, out.points), (MemoryBlock, out.blocks), (MemoryStep, out.steps)):
            if rows:
                self._ctx.spool.write_table(cls.TABLE, records_to_arrow(cls, rows))

    def stop(self) -> None:
        if self._ctx is None:
            return
        if self._dispatch is not None:
            from torch.utils._python_dispatch import _get_current_dispatch_mode

            mode: Any = _get_current_dispatch_mode()
            if mode is self._dispatch:
                mode.__exit__(None, None, None)
            else:
                self._ctx.note("memory: the script left a dispatch mode of its own active above tpudiag's")
            self._tracker.remove()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        probes.withdraw("memory")
        if self._remove_listener is not None:
            self._remove_listener()
        self.flush()
        self._sampler.close()
        self._ctx.metadata["memory"] = {"backend": self._sampler.backend, "device": self._sampler.device}
        if self._oom is not None:
            write_oom(self._ctx, self._oom, self._oom_allocs)
            if self._oom_holders:
                from tpudiag.model import MemoryBlock, records_to_arrow

                held = [
                    MemoryBlock(self._ctx.run_id, self._windows, "at_oom", h["bytes"], "dispatch", 0,
                                module=h["module"], step=self._oom["step"])
                    for h in self._oom_holders
                ]  # fmt: skip
                self._ctx.spool.write_table("memory_blocks", records_to_arrow(MemoryBlock, held), part="oom-held")

    # -- per step ---------------------------------------------------------------------------------------------
    def _after_step(self, optimizer: Any) -> None:
        """``step_points``' callback (``READ``: before the pulse's, so the step's reading is in its own pulse
        record): the step's reading if the stride says it is due, and the growth watch."""
        # Every step, cold (see ``collectors/step_points.py``): a clock and a few attributes, no call, unless the
        # stride's reading is due or the growth watch has something to decide.
        try:
            step = self._steps
            now = time.monotonic()
            if now >= self._read_at or step < self._stride.first_steps:
                self._read(step, now)
            live = self._live
            if live is not None and step >= triggers.WARMUP_STEPS:  # as every trigger: after warm-up
                self._watch_growth(step, live, control.STATE.window_open)
            if self._dispatch is not None:
                self._dispatch.failed_op = None  # an error the script caught and went past
                if self._dispatch.full():
                    self._spool_dispatch_window()
        except Exception as err:  # never into the user's optimizer step
            internal_errors.current().record("memory", "sample a step", err)
        self._steps += 1

    # -- steady steps (collectors/steady_steps.py) ------------------------------------------------------------
    def horizon(self, gate: Any) -> None:
        """The steps ``_after_step`` would take no reading on: until the stride's next reading, past its first
        steps, without dispatch counting.  The growth watch's steps are taken in ``absorb``, unless the held
        reading is already past the growth threshold: then the step where the span closes (and may ask for a
        window) is a full one, so the window opens on the next step as it would without steady steps (asked from
        ``absorb``, it came up to 50 ms later, and a leak near a script's end could end before its window)."""
        if self._dispatch is not None or self._steps < self._stride.first_steps:
            gate.shut()
            return
        from tpudiag.collectors import steady_steps  # (torch's: this module loads without it)

        steps = 1 << 30  # (the gate holds its own cap)
        growth, live = self._growth, self._live
        if live is not None and growth.past_threshold(live):
            steps = growth.quiet if live == growth.held and not control.STATE.window_open else 0
        gate.limit(steps, steady_steps.perf_ns(self._read_at))

    def absorb(self, starts: list[int], ends: list[int]) -> None:
        """Steady steps: ``_after_step`` without a reading, step by step (the growth watch sees the held reading;
        a span it closes asks for its window now, on the steady steps' last step at the latest)."""
        window_open = control.STATE.window_open
        live = self._live
        for _ in ends:
            step = self._steps
            if live is not None and step >= triggers.WARMUP_STEPS:
                self._watch_growth(step, live, window_open)
            self._steps = step + 1

    def _watch_growth(self, step: int, live: int, window_open: bool) -> None:
        """The growth watch on one step past warm-up (``_after_step``, and ``absorb`` for steady steps): a held
        reading that decides nothing is only counted (``GrowthWatch``'s docstring); a span that closes grown past
        the floor asks for a ``memory`` window."""
        growth = self._growth
        if growth.quiet and live == growth.held and not window_open:
            growth.quiet -= 1
            growth.pending += 1
            return
        if growth.seen + growth.pending == 0:
            self._span_from = step
        low = growth.see(live, in_window=window_open)
        if low is not None and growth.floor:
            self._ask_for_window(low, step)

    def resume(self, start: int) -> None:
        return None

    def _read(self, step: int, now: float) -> None:
        """The step's reading, if the stride says it is due (``tpudiag.longrun.stride``)."""
        stride = self._stride
        if stride.due(step, now):
            fig = self.sample_step(step)
            self._live = next((fig[k] for k in LIVE_FIGURES if fig.get(k)), None)
            probes.published["memory"] = {k: fig.get(k) for k in PROBE_FIGURES}  # ``probes.publish``
        self._read_at = stride.next_s()

    def _ask_for_window(self, low: int, step: int) -> None:
        """A ``memory`` window: the live bytes grew well past their post-warm-up floor (judged every step on the
        latest reading, held between thinned readings, so a span is still 16 steps)."""
        floor = self._growth.floor or low
        detail = f"live memory at least {low / 2**20:.0f} MiB over steps {self._span_from}-{step}"
        detail += f", {low / floor:.2f}x its floor of {floor / 2**20:.0f} MiB after warm-up"
        if control.request("memory", numerics=False, detail=detail):
            self._growth.granted(low)

    def sample_step(self, step: int) -> dict[str, Any]:
        """One step's figures (the sampler's dict), kept for the next flush (records are built there, off the
        step).  On the main thread only (``step_points``)."""
        fig: dict[str, Any] = self._sampler.sample()
        self._rows.append((step, time.time_ns(), fig))
        return fig

    # -- out of memory ------------------------------------------------------------------------------------------
    def _on_failure(self, exc: BaseException) -> None:
        with internal_errors.current().guard("memory", "read an out-of-memory error"):
            found = _oom_in(exc)
            if found is None or self._ctx is None:
                return
            err, parsed = found
            fig = self._sampler.sample() if self._sampler is not None else {}
            live = parsed.live_bytes
            live_source = "message" if live is not None else None
            if live is None:
                for key in ("allocated_bytes", "device_used_bytes", "rss_bytes"):
                    if fig.get(key) is not None:
                        live, live_source = fig[key], fig["sources"].get(key)
                        break
            limit = parsed.limit_bytes if parsed.limit_bytes is not None else fig.get("limit_bytes")
            last: dict[str, Any] | None
            try:
                last = self._rows[-1][2]
            except IndexError:
                last = self._last_flushed
            self._oom = {
                "kind": parsed.kind,
                "message": str(err)[:20000],
                "phase": parsed.phase,
                "step": self._steps,
                "module": _module_of_traceback(err.__traceback__),
                "op": None,
                "requested_bytes": parsed.requested_bytes,
                "live_bytes": live,
                "limit_bytes": limit,
                "last_good_peak_bytes": last["peak_bytes"] if last is not None else None,
                "memory_space": parsed.memory_space,
                "exception": type(err).__name__,
                "op_source": None,
                "ts_ns": time.time_ns(),
                "live_source": live_source,
            }
            self._oom_allocs = parsed.allocations
            failed = self._dispatch.failed_op if self._dispatch is not None else None
            if failed is not None:
                self._oom.update(op=failed["op"], op_source="dispatch")
                if self._oom["module"] is None:
                    self._oom["module"] = failed["module"]
                self._oom_holders = failed["holders"]


def _oom_record(ctx: CaptureContext, oom: dict[str, Any]) -> Any:
    from tpudiag.model import MemoryOom, column_names

    fields = set(column_names(MemoryOom)) - {"run_id"}
    return MemoryOom(run_id=ctx.run_id, **{k: v for k, v in oom.items() if k in fields})


def write_oom(ctx: CaptureContext, oom: dict[str, Any], allocs: list[Any]) -> None:
    """Spool the OOM record (part "oom": a later write with the op filled in replaces it) and leave it in the run
    folder for the analysis of the last trace window."""
    from tpudiag.atomic_file import atomic_file
    from tpudiag.model import MemoryOomAlloc

    ctx.spool.write_table("memory_oom", _to_arrow(_oom_record(ctx, oom)), part="oom")
    rows = [
        MemoryOomAlloc(ctx.run_id, a.index, a.size_bytes, a.shape, a.operator, a.unpadded_bytes, a.padding_bytes,
                       a.expansion, a.xla_label, a.allocation_type)
        for a in allocs
    ]  # fmt: skip
    if rows:
        from tpudiag.model import records_to_arrow

        ctx.spool.write_table("memory_oom_allocs", records_to_arrow(MemoryOomAlloc, rows), part="oom")
    path = oom_path(ctx.run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, "w") as fh:
        json.dump(oom, fh)


def _to_arrow(record: Any) -> Any:
    from tpudiag.model import records_to_arrow

    return records_to_arrow(type(record), [record])
