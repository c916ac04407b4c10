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

Long runs (issue 21).  Once the run has settled (a watched step met nothing new) and is past the first trace
window's steps (``schedule.FIRST_STEPS``: a short script is checked as before), no step outside a trace window is
stalled by the checker for long: a step's checks stop ``CHECK_STEP_S`` after it began (an op never measured is
expected to cost ``UNMEASURED_FACTOR`` times its prior), a new signature's check that would end later waits for a
later call (reason ``budget``), the step's calls after that clock are only counted (``NumericsMode._time_up``), and a
periodic re-check step's signatures left over come first in the next one (``Sampler.ran_out``).
Trace windows' steps (``boost``) check every call, as ``--numerics all`` does.
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tpudiag.numerics_options import DEFAULT_FIRST_K, budget_percent, numerics_mode

WARMUP_STEPS = 3
EVERY_STEPS = 50
# Once a run has settled, the checks of one step stop after this many seconds (issue 21: no step of a long run
# stalled by tpudiag for more than 50 ms outside trace windows); what is left waits for a later step.
CHECK_STEP_S = 0.03
# A settled step's check of an op never measured before is expected to cost this many times its prior.
UNMEASURED_FACTOR = 10.0


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
    mode, first_k = numerics_mode(options.get("numerics") or "sample")
    budget = options.get("budget")
    budget_pct = None if budget is None else budget_percent(budget)
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


# Cost model of one check before any is measured: a fixed part (copies, metrics, rows) plus a part per input
# element; matmul-like kinds do far more work per element.  Measured checks replace these per op and per kind.
PRIOR_FIXED_S = 150e-6
PRIOR_PER_ELEMENT_S = {"matmul": 200e-9, "normalization": 30e-9, "reduction": 15e-9}
PRIOR_DEFAULT_PER_ELEMENT_S = 10e-9
# A signature already checked is checked again only while it leaves this share of the allowance unspent: new
# signatures (new ops, shapes, dtypes) are worth more than repeats.
REPEAT_RESERVE = 0.5


@dataclass
class Budget:
    """Extra time spent vs the script's own time (``--budget PCT``), and what one more check would cost.

    The allowance grows with the script: PCT% of the time the script itself has run so far.  A check is made only
    when its estimated cost fits in what is left; the estimate comes from the checks already made (seconds per
    input element, per op, else per kind, else a prior), so cheap checks go first and an expensive one waits
    until the allowance has grown enough, or is never made.
    """

    pct: float | None
    extra_s: float = 0.0
    per_op_overhead_s: float = 0.0  # the dispatch mode's own cost per op (calibrated at start)
    ops_seen: int = 0
    check_s: float = 0.0  # seconds spent in checks (part of extra_s)
    checks: int = 0
    _avg_check_s: float = 0.0
    _rate_by_op: dict[str, float] = field(default_factory=dict)  # seconds per input element
    _rate_by_kind: dict[str, float] = field(default_factory=dict)
    _fixed_s: float = PRIOR_FIXED_S

    correction_s: float = 0.0  # measured step cost the running estimate missed (hooks, dispatch)

    def spent(self) -> float:
        """Extra seconds so far: the mode's own time, the hidden per-op entry cost, and measured corrections."""
        return self.extra_s + self.per_op_overhead_s * self.ops_seen + self.correction_s

    def own_s(self) -> float:
        """The mode's own seconds as they were spent (``spent`` without ``correction_s``: a correction is learnt at
        a watched stretch's end about the steps before, and would land on the step that happens to be running)."""
        return self.extra_s + self.per_op_overhead_s * self.ops_seen

    def allowance(self, elapsed_s: float) -> float:
        """Extra seconds allowed after ``elapsed_s`` seconds of wall time (PCT% of the script's own part)."""
        if self.pct is None:
            return float("inf")
        return self.pct / 100.0 * max(elapsed_s - self.spent(), 0.0)

    def allows(self, elapsed_s: float) -> bool:
        if self.pct is None:
            return True
        return self.spent() + self._avg_check_s <= self.allowance(elapsed_s)

    def estimate(self, op: str, kind: str, numel: int) -> float:
        """Seconds one check of ``op`` on ``numel`` input elements is expected to cost."""
        rate = self._rate_by_op.get(op)
        if rate is None:
            rate = self._rate_by_kind.get(kind, PRIOR_PER_ELEMENT_S.get(kind, PRIOR_DEFAULT_PER_ELEMENT_S))
        return self._fixed_s + rate * numel

    def cautious_estimate(self, op: str, kind: str, numel: int) -> float:
        """``estimate``, ``UNMEASURED_FACTOR`` times over for an op never checked yet: the priors per kind can be far
        off (a first check of a 2M-element sort took 25x its prior)."""
        cost = self.estimate(op, kind, numel)
        return cost if op in self._rate_by_op else cost * UNMEASURED_FACTOR

    def allows_check(self, op: str, kind: str, numel: int, elapsed_s: float, times_checked: int) -> bool:
        """Whether a check of this cost fits in the allowance left (half of it for a signature already checked)."""
        if self.pct is None:
            return True
        allowance = self.allowance(elapsed_s)
        if times_checked:
            allowance *= REPEAT_RESERVE
        return self.spent() + self.estimate(op, kind, numel) <= allowance

    def typical_check_s(self) -> float:
        """The cheapest check cost measured so far per kind (what one more useful check needs at least)."""
        if not self._rate_by_kind:
            return self._fixed_s
        return self._fixed_s + min(self._rate_by_kind.values()) * 1024

    def exhausted(self, elapsed_s: float) -> bool:
        """True when the extra time already spent is over the budget (the mode should leave the stack)."""
        if self.pct is None:
            return False
        return self.spent() > self.allowance(elapsed_s)

    def affords(self, cost_s: float, elapsed_s: float) -> bool:
        """Whether one more watched step of ``cost_s`` extra seconds stays within the budget."""
        if self.pct is None:
            return True
        return self.spent() + cost_s <= self.allowance(elapsed_s)

    def charge(self, seconds: float, op: str = "", kind: str = "", numel: int = 0, setup_s: float = 0.0) -> None:
        """A check took ``seconds``: spend them and learn the cost per element of this op and kind.  ``setup_s`` of
        them were one-time work (a compiled graph's float64 copy is made at its first check): spent, not learnt."""
        self.extra_s += seconds
        self.check_s += seconds
        self.checks += 1
        self._avg_check_s += (seconds - self._avg_check_s) / self.checks
        if numel > 0 and op:
            rate = max(seconds - setup_s - self._fixed_s, 0.0) / numel
            old = self._rate_by_op.get(op)
            self._rate_by_op[op] = rate if old is None else 0.5 * (old + rate)
            old_kind = self._rate_by_kind.get(kind)
            self._rate_by_kind[kind] = rate if old_kind is None else 0.8 * old_kind + 0.2 * rate
        if numel <= 64:
            # Tiny checks measure the fixed part.
            self._fixed_s = 0.8 * self._fixed_s + 0.2 * seconds


@dataclass
class Sampler:
    options: SamplingOptions
    counts: dict[tuple[Any, ...], int] = field(default_factory=dict)
    checked: dict[tuple[Any, ...], int] = field(default_factory=dict)  # signature -> calls really checked

    refusals: dict[tuple[Any, ...], int] = field(default_factory=dict)
    # Long runs (issue 21): ``boost`` checks every call (a trigger window wants numerics fully on); ``recheck``
    # checks the first call of each signature once more in a periodic watched step, so a fault that starts late in
    # the run is still found (both within the budget, which still refuses what it cannot afford).
    boost: bool = False
    recheck: bool = False
    rechecked: set[tuple[Any, ...]] = field(default_factory=set)
    # Once the run has settled, a step's checks stop at this clock reading (``CHECK_STEP_S`` after the step
    # began; trace windows excepted): a check that would end later is left for a later call of its signature, and
    # a periodic step's re-checks it had no time for are made first in the next periodic step (a round ends once
    # every signature was re-checked).
    check_until: float | None = None
    round_done: bool = True
    # Past the run's first steps, the most one check may hold (``check_memory``; None: no bound but the size cap),
    # set with ``check_until`` by ``begin_step``: the allowance is measured once, when the run settles.
    memory_cap: int | None = None
    _memory_allowance: int | None = None
    _round_size: int = 0  # signatures re-checked in this round when the step began
    _admitted: str = ""  # why the last call ``wants`` admitted was sampled: "first", "recheck" or "all"

    def wants(self, signature: tuple[Any, ...]) -> bool:
        """Whether this call is sampled (counts it either way)."""
        n = self.counts.get(signature, 0)
        self.counts[signature] = n + 1
        if self.options.mode == "all" or self.boost:
            self._admitted = "all"
            return True
        if n - self.refusals.get(signature, 0) < self.options.first_k:
            self._admitted = "first"
            return True
        if self.recheck and signature not in self.rechecked:
            self.rechecked.add(signature)
            self._admitted = "recheck"
            return True
        return False

    @property
    def admitted(self) -> str:
        """Why the last call ``wants`` admitted was sampled: "first", "recheck" or "all"."""
        return self._admitted

    def in_time(self, signature: tuple[Any, ...], cost_s: Callable[[], float]) -> bool:
        """Whether the call ``wants`` just admitted can be checked before the step's check time runs out."""
        until = self.check_until
        if until is None or self._admitted == "all":
            return True
        cost = cost_s()
        if time.perf_counter() + cost <= until:
            return True
        if self._admitted == "recheck":
            self.rechecked.discard(signature)
            # Left for the next periodic step, unless no step could afford it (then only trace windows, which
            # check every call, look at it again): it never holds the round open.
            if cost <= CHECK_STEP_S:
                self.round_done = False
        else:
            self.refused(signature)
        return False

    def too_late(self, signature: tuple[Any, ...], op_s: float) -> bool:
        """After the op ran: whether its admitted check would end past the step's check time, its float64 oracle
        taking at least as long as the op itself took (a lower bound that holds where the estimate was far off:
        a never-measured 2M-element sort had been admitted at a tenth of its 0.4 s check).  ``in_time`` asked again
        with the op's own time as the cost (a refusal is handled the same way)."""
        return not self.in_time(signature, lambda: op_s)

    def begin_step(self, boost: bool, recheck: bool, capped: bool = False, now: float | None = None) -> None:
        """The step about to start: ``boost`` checks every call, ``recheck`` re-checks signatures (this round's
        remaining ones); ``capped``: its checks stop ``CHECK_STEP_S`` after ``now``."""
        self.boost, self.recheck = boost, recheck
        if recheck:
            if self.round_done:
                self.rechecked = set()
            self.round_done = True
            self._round_size = len(self.rechecked)
        if capped and not boost and self.options.mode != "all":
            self.check_until = (time.perf_counter() if now is None else now) + CHECK_STEP_S
        else:
            self.check_until = None
        self.memory_cap = self.check_allowance() if capped and self.options.mode != "all" else None

    def check_allowance(self) -> int:
        """The most one check may hold past the run's first steps (``check_memory.allowance``, measured once)."""
        if self._memory_allowance is None:
            from tpudiag.collectors.numerics import check_memory

            self._memory_allowance = check_memory.allowance()
        return self._memory_allowance

    def ran_out(self) -> None:
        """The step's check time ran out before its end (its later calls were not looked at): a re-check step's round
        goes on in the next periodic step, past the signatures re-checked already, if this step re-checked any (a
        step that re-checked none ends the round: the next starts again from the step's first signatures)."""
        if self.recheck and len(self.rechecked) > self._round_size:
            self.round_done = False

    def refused(self, signature: tuple[Any, ...]) -> None:
        """The sampled call was not checked (over budget): a later call of the signature may take its place."""
        self.refusals[signature] = self.refusals.get(signature, 0) + 1


@dataclass
class StepSchedule:
    """Which steps the mode watches (see the module docstring): warm-up, until steady, then every Nth step."""

    watch_all: bool = False
    warmup: int = WARMUP_STEPS
    every: int = EVERY_STEPS
    steady: bool = False

    settled: bool = False  # steady once: the run's first steps are over (checks are held to CHECK_STEP_S a step)

    def step_done(self, new_signatures: int) -> None:
        """After a fully watched step: steady once it met no op signature it had not met before."""
        self.steady = new_signatures == 0
        self.settled = self.settled or self.steady

    def wants(self, step: int) -> bool:
        """Whether step ``step`` (0-based, about to start) should be watched."""
        return self.watch_all or step < self.warmup or not self.steady or step % self.every == 0

    def periodic(self, step: int) -> bool:
        """Watched only because of the period (steady, past warm-up): a re-check step under the background
        allowance (``Background``) when no ``--budget`` is given."""
        return not self.watch_all and step >= self.warmup and self.steady and step % self.every == 0


# Without --budget, periodic re-check steps in steady state spend at most this share of the time since the run
# became steady (a watched step costs several plain ones: every 50th step unthrottled would cost ~10% for ever).
# Their boundaries (the mode and the module hooks attached and detached) are charged to it too.  0.25% (0.5% until
# session 40): on the long-run bench's ~4.7 ms step a re-check (~25 ms of its period) every ~10 s, so a fault that
# begins late is found within seconds of it.  At 0.5% the re-checks were the largest single part of the capture's
# cost over a 10-minute run (~0.45% of it: the 0.97x throughput target's whole margin was ~2%); 1% had cost ~1.3%
# of that run with the boundaries uncharged.
BACKGROUND_PCT = 0.25
# Without --budget, the steps of trigger windows (numerics fully on) spend at most this share of the run's time ...
BOOST_PCT = 5.0
# ... and what they have not spent is kept for at most this many seconds of the run: a window spends at most
# BOOST_PCT of that at once (1 s), or one watched step's cost where a step costs more.  Without it the allowance
# grew with the run: at hour three one window could have checked every op for nine minutes.  20 s (was 120 s, 6 s at
# once, session 28): the first step a window checks covers every op of the step; the next ones check the same ops
# on new data.  On the long-run bench a slow-step window's checks (a 2M-element sort in float64 each step) spent
# ~2-3.5 s (0.5%) of a 10-minute run.
BOOST_HORIZON_S = 20.0


@dataclass
class Background:
    """The allowance of periodic re-check steps when no ``--budget`` is given (see ``BACKGROUND_PCT``).

    ``horizon_s``: what was not spent is kept for that many seconds only (a bucket that holds ``pct`` of it, or
    one step's ``cost_s`` where that is more): the most it lets through at once does not grow with the run."""

    pct: float = BACKGROUND_PCT
    since_s: float | None = None
    spent_s: float = 0.0
    horizon_s: float | None = None

    def affords(self, cost_s: float, now_s: float) -> bool:
        if self.since_s is None:
            self.since_s = now_s
        left = self._left(now_s)
        if self.horizon_s is not None:
            most = max(self.pct / 100.0 * self.horizon_s, cost_s)
            if left > most:  # the bucket is full: what would overflow it is forfeited
                self.spent_s += left - most
                left = most
        return cost_s <= left

    def _left(self, now_s: float) -> float:
        """The allowance earned since it began counting (none before), less what was spent."""
        since = now_s if self.since_s is None else self.since_s
        return self.pct / 100.0 * (now_s - since) - self.spent_s

    def wait_s(self, cost_s: float, now_s: float) -> float:
        """Seconds from ``now_s`` before ``affords(cost_s, ...)`` can be true, nothing more being charged (0: now,
        or the allowance has not begun counting)."""
        if self.since_s is None or self.pct <= 0:
            return 0.0
        need = cost_s - self._left(now_s)
        return need / (self.pct / 100.0) if need > 0 else 0.0

    def charge(self, cost_s: float) -> None:
        self.spent_s += max(cost_s, 0.0)
