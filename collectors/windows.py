"""Which steps the trace collector traces: the window plan (issue 21).

Decisions are taken at the end of each step (the optimizer's post-hook) and carried out by the trace collector at
the next root-module forward, where no profiler range is open (a range spanning two sessions corrupts Kineto's
heap).  Deciding a step early lets the numerics collector, whose own step hook runs right after, watch the window's
first step already.

- Window 0 (``first_steps``) is open from the capture's start until ``first_steps`` steps or ``first_s`` seconds.
- A trigger (slow step, recompile, graph break, non-finite, memory, numerics, manual) after warm-up asks for a
  window over the next ``trigger_steps`` steps (or ``TRIGGER_MAX_S`` of them, manual requests excepted), with every
  op checked (within ``--budget``); rate-limited (``tpudiag.longrun.triggers.RateLimit``).  A trigger during an
  open window waits for it to close.
- Otherwise the schedule (``tpudiag.longrun.schedule``) opens one now and then, while ``--max-disk`` allows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tpudiag.longrun import control
from tpudiag.longrun.analyst import DiskCap
from tpudiag.longrun.schedule import WindowSchedule
from tpudiag.longrun.triggers import WARMUP_STEPS, RateLimit

TRIGGER_STEPS = 5
TRIGGER_MAX_S = 30.0
MAX_QUEUED = 4


@dataclass
class Window:
    window_id: int
    reason: str
    first_step: int
    end_step: int | None  # exclusive; None: until the run ends
    deadline_s: float | None = None
    numerics: bool = False
    detail: str | None = None
    start_ns: int = 0
    opened_s: float | None = None  # scheduled windows: when chosen (their length spaces the next one)


class WindowPlan:
    def __init__(
        self,
        schedule: WindowSchedule,
        cap: DiskCap,
        limit: RateLimit,
        trigger_steps: int = TRIGGER_STEPS,
        now_s: float | None = None,
    ) -> None:
        self.schedule, self.cap, self.limit, self.trigger_steps = schedule, cap, limit, trigger_steps
        t0 = time.monotonic() if now_s is None else now_s
        self.open: Window | None = Window(0, "first_steps", 0, schedule.first_steps, t0 + schedule.first_s)
        self.next: Window | None = None
        self.close_next = False
        self.count = 1  # window ids handed out
        self.cycles = 0  # scheduled windows opened
        self.last_end_s = t0  # when the last scheduled (or the first) window ended
        self.last_len_s = 0.0  # ... and how long it lasted, if scheduled (``WindowSchedule.wait_s``)
        self.last_end_step = 0
        self.queued: list[control.WindowRequest] = []
        self.refused: dict[str, int] = {}  # windows the disk cap kept closed, by reason
        self.disabled: str | None = None  # why no more windows open (the run folder failed)
        self.warm = False
        self._quiet: tuple[float, float] | None = None  # (step, time) before which an idle plan has nothing to do

    def plan(
        self,
        step: int,
        now_s: float,
        fired: list[tuple[str, str]],
        busy: Any,
        severity: dict[str, float] | None = None,
    ) -> None:
        """At the end of a step: ``step`` is the index of the step about to start; ``fired`` the pulse's triggers
        (``severity``: how severe, by reason, where known); ``busy()`` the ids of windows still being analysed (never
        pruned).

        Most steps of a long run find nothing open, coming or asked for, and the schedule not yet due: they return
        at once (``_quiet``: the step and the time before which the schedule cannot be due)."""
        quiet = self._quiet
        if quiet is not None and not fired and (step < quiet[0] or now_s < quiet[1]) and not control.STATE.pending:
            return
        self._quiet = None
        current = self.open
        if current is not None and not self.close_next:
            over = current.end_step is not None and step >= current.end_step
            if over or (current.deadline_s is not None and now_s >= current.deadline_s):
                self.close_next = True
        if not self.warm and step >= WARMUP_STEPS and (self.open is None or self.open.window_id > 0):
            self.warm = True
        for reason, detail in fired:
            how = severity.get(reason) if severity else None
            if self.warm and len(self.queued) < MAX_QUEUED and self.limit.allow(reason, now_s, how):
                self.queued.append(control.WindowRequest(reason, None, True, detail))
        for req in control.take():
            wanted = req.reason == "manual" or (self.warm and self.limit.allow(req.reason, now_s))
            if wanted and len(self.queued) < MAX_QUEUED:
                self.queued.append(req)
        free = self.open is None or self.close_next
        if free and self.next is None and self.disabled is None:
            self.next = self._choose(step, now_s, busy)
        coming = self.next if self.next is not None else (None if self.close_next else self.open)
        control.set_numerics_wanted(bool(coming and coming.numerics))
        if self.open is None and self.next is None and not self.close_next and not self.queued:
            if self.disabled is not None:
                self._quiet = (float("inf"), float("inf"))
            else:
                self._quiet = self.schedule.not_before(
                    step + 1, self.last_end_step, self.last_end_s, self.cycles, self.last_len_s
                )

    def _choose(self, step: int, now_s: float, busy: Any) -> Window | None:
        while self.queued:
            req = self.queued.pop(0)
            if not self.cap.allows(req.reason, busy()):
                self.refused[req.reason] = self.refused.get(req.reason, 0) + 1
                continue
            steps = req.steps or self.trigger_steps
            # A trigger's window ends after its steps or TRIGGER_MAX_S (one step at least): five 60 s steps would be
            # five minutes of trace.  A manual request gets the steps it asked for.
            deadline = None if req.reason == "manual" else now_s + TRIGGER_MAX_S
            return Window(self.count, req.reason, step, step + steps, deadline, req.numerics, req.detail)
        closing = self.open.reason if self.open is not None else None
        if closing in ("first_steps", "schedule"):
            return None  # the schedule's clock restarts when this window has closed (``closed``), not before
        schedule = self.schedule
        if schedule.due(step, self.last_end_step, now_s, self.last_end_s, self.cycles, self.last_len_s):
            if not self.cap.allows("schedule", busy()):
                self.refused["schedule"] = self.refused.get("schedule", 0) + 1
                return None
            self.cycles += 1
            deadline = now_s + schedule.max_s if schedule.max_s is not None else None
            return Window(self.count, "schedule", step, step + schedule.steps, deadline, opened_s=now_s)
        return None

    # -- carried out by the trace collector ---------------------------------------------------------------------
    def closed(self, step: int, now_s: float) -> Window | None:
        window, self.open, self.close_next = self.open, None, False
        self._quiet = None
        self.last_end_step = step
        if window is not None and window.reason in ("first_steps", "schedule"):
            self.last_end_s = now_s  # the schedule keeps its own rhythm, whatever triggers open in between
            # Spaced by the length of scheduled windows only (the first window is the run's start, paid once).
            self.last_len_s = now_s - window.opened_s if window.opened_s is not None else 0.0
        return window

    def opened(self) -> Window | None:
        window, self.next = self.next, None
        if window is not None:
            self._quiet = None
            self.count += 1
            self.open = window
        return window
