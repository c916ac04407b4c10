"""Which op calls get checked: sampling by signature, op and module filters, and a time budget.

Checking every op of a training run against a CPU float64 oracle can cost 100x the run, so by default only the
first K calls of each (op, input shapes, dtypes) signature are checked; later calls of a signature repeat what was
already seen.  ``--numerics all`` checks everything; ``--ops``/``--modules`` narrow the set; ``--budget PCT`` keeps
the extra time (oracle work plus the mode's own per-op cost) within PCT percent of the script's own time.

Step policy (``StepSchedule``).  A dispatch mode costs Python work on *every* op it sees, checked or not, so once
nothing new is being learned the collector leaves the dispatch stack altogether.  Step boundaries are optimizer
steps (a global ``Optimizer.step`` post-hook) or, in scripts that never step an optimizer, root-module forwards.
The mode watches steps 0..WARMUP-1, keeps watching while a watched step still meets a new op signature, and then
watches only every EVERY-th step; the steps in between run with no mode and no module hooks at all.  Their ops are
recorded as skipped with reason ``steady_state`` (call counts replayed from the last fully watched step).
``--numerics all`` watches every step.  With ``--budget PCT`` a step is watched only while the budget allows it:
the cost of a watched step is measured as its wall time minus a plain (unwatched) step's, so the hidden dispatch
and hook costs are charged too; before any plain step exists a calibrated per-op entry cost stands in.  When the
budget runs out inside a step the mode leaves at the next module boundary; steps the schedule wanted but the
budget refused are recorded as skipped with reason ``budget``.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

from tpudiag.errors import UsageError

DEFAULT_FIRST_K = 3
WARMUP_STEPS = 3
EVERY_STEPS = 50


@dataclass(frozen=True)
class SamplingOptions:
    mode: str = "sample"  # "sample" | "all" | "off"
    first_k: int = DEFAULT_FIRST_K
    ops: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    budget_pct: float | None = None

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


def _patterns(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    return tuple(p.strip() for p in items if str(p).strip())


def parse_options(options: dict[str, Any]) -> SamplingOptions:
    """Options as the CLI passes them (``numerics``, ``budget``, ``ops``, ``modules``); UsageError when invalid."""
    raw = str(options.get("numerics") or "sample").strip().lower()
    mode, first_k = "sample", DEFAULT_FIRST_K
    if raw in ("all", "off", "sample"):
        mode = raw
    elif raw.startswith("first:") or raw.isdigit():
        digits = raw.removeprefix("first:")
        if not digits.isdigit() or int(digits) < 1:
            raise UsageError(f"--numerics {raw!r}: expected sample, all, off, or a number of calls (e.g. 5)")
        first_k = int(digits)
    else:
        raise UsageError(f"--numerics {raw!r}: expected sample, all, off, or a number of calls (e.g. 5)")
    budget = options.get("budget")
    budget_pct: float | None = None
    if budget is not None:
        try:
            budget_pct = float(str(budget).rstrip("%"))
        except ValueError:
            raise UsageError(f"--budget {budget!r}: expected a percentage such as 20") from None
        if not budget_pct > 0:
            raise UsageError(f"--budget {budget!r}: must be more than 0 percent")
    return SamplingOptions(mode, first_k, _patterns(options.get("ops")), _patterns(options.get("modules")), budget_pct)


def op_matches(name: str, patterns: tuple[str, ...]) -> bool:
    """``aten::tanh`` matches ``tanh``, ``aten::tanh``, ``*tanh*``; ``add`` also matches ``add_`` and ``add.out``."""
    if not patterns:
        return True
    short = name.split("::", 1)[-1]
    for p in patterns:
        if fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(short, p) or short.rstrip("_") == p:
            return True
    return False


def module_matches(path: str | None, patterns: tuple[str, ...]) -> bool:
    """A module pattern selects that module and everything inside it."""
    if not patterns:
        return True
    if path is None:
        return False
    for p in patterns:
        if fnmatch.fnmatchcase(path, p) or path.startswith(p + ".") or fnmatch.fnmatchcase(path, p + ".*"):
            return True
    return False


@dataclass
class Budget:
    """Extra time spent vs the script's own time; checks stop while the extra time is over budget."""

    pct: float | None
    extra_s: float = 0.0
    per_op_overhead_s: float = 0.0  # the dispatch mode's own cost per op (calibrated at start)
    ops_seen: int = 0
    _avg_check_s: float = 0.0
    _checks: int = 0

    correction_s: float = 0.0  # measured step cost the running estimate missed (hooks, dispatch)

    def spent(self) -> float:
        """Extra seconds so far: the mode's own time, the hidden per-op entry cost, and measured corrections."""
        return self.extra_s + self.per_op_overhead_s * self.ops_seen + self.correction_s

    def allows(self, elapsed_s: float) -> bool:
        if self.pct is None:
            return True
        spent = self.spent()
        own = max(elapsed_s - spent, 0.0)
        return spent + self._avg_check_s <= self.pct / 100.0 * own

    def exhausted(self, elapsed_s: float) -> bool:
        """True when the extra time already spent is over the budget (the mode should leave the stack)."""
        if self.pct is None:
            return False
        spent = self.spent()
        return spent > self.pct / 100.0 * max(elapsed_s - spent, 0.0)

    def affords(self, cost_s: float, elapsed_s: float) -> bool:
        """Whether one more watched step of ``cost_s`` extra seconds stays within the budget."""
        if self.pct is None:
            return True
        spent = self.spent()
        return spent + cost_s <= self.pct / 100.0 * max(elapsed_s - spent, 0.0)

    def charge(self, seconds: float) -> None:
        self.extra_s += seconds
        self._checks += 1
        self._avg_check_s += (seconds - self._avg_check_s) / self._checks


@dataclass
class Sampler:
    options: SamplingOptions
    counts: dict[tuple[Any, ...], int] = field(default_factory=dict)

    def wants(self, signature: tuple[Any, ...]) -> bool:
        """Whether this call is sampled (counts it either way)."""
        n = self.counts.get(signature, 0)
        self.counts[signature] = n + 1
        if self.options.mode == "all":
            return True
        return n < self.options.first_k


@dataclass
class StepSchedule:
    """Which steps the mode watches (see the module docstring): warm-up, until steady, then every Nth step."""

    watch_all: bool = False
    warmup: int = WARMUP_STEPS
    every: int = EVERY_STEPS
    steady: bool = False

    def step_done(self, new_signatures: int) -> None:
        """After a fully watched step: steady once it met no op signature it had not met before."""
        self.steady = new_signatures == 0

    def wants(self, step: int) -> bool:
        """Whether step ``step`` (0-based, about to start) should be watched."""
        return self.watch_all or step < self.warmup or not self.steady or step % self.every == 0
