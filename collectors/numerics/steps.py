"""Step boundaries of the numerics collector: optimizer steps, else root-module forwards, attach and detach the
dispatch mode and its module hooks as ``sampling.StepSchedule`` and ``--budget`` decide; an unwatched step's calls
are replayed as skipped from the last watched step; a root module's new input shapes ask for the next step to be
watched.

A mixin of ``NumericsCollector`` (``StepBoundaries``), its ``module_calls`` listener (``ModuleBoundaries``) and the
schedule's state (``StepState``)."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from tpudiag import internal_errors
from tpudiag.collectors import module_calls, steady_steps
from tpudiag.collectors.numerics.sampling import CHECK_STEP_S
from tpudiag.longrun import control, heap
from tpudiag.longrun.schedule import FIRST_STEPS

if TYPE_CHECKING:
    from tpudiag.collectors.numerics.backward_modules import BackwardModules
    from tpudiag.collectors.numerics.collector import NumericsCollector

_is_compiling = torch.compiler.is_compiling
_Tensor = torch.Tensor
_current_autograd_node = torch._C._current_autograd_node  # not None inside a backward
_main_ident = threading.main_thread().ident

# The heap is trimmed after a checked stretch at most this often (a trim is ~50 us when nothing is free, a few ms
# after a large stretch).
HEAP_RELEASE_S = 2.0


class StepBoundaries:
    _mode: Any
    _recorder: Any
    _tracker: Any
    _backward: BackwardModules | None
    _entered: bool
    _module_hook_on: bool
    _hooks_on: bool
    _root: Any
    _opt_steps: int
    _steps: StepState
    _probes: set[int]
    _root_inputs: set[tuple[Any, ...]]

    def _attach(self) -> None:
        """Module hooks on, mode pushed (only at a step boundary: no forward is running)."""
        assert self._tracker is not None and self._backward is not None
        if not self._module_hook_on:
            self._module_hook_on = True
            module_calls.refresh()
        if not self._hooks_on:
            self._tracker.install()
            self._backward.install()
            self._hooks_on = True
        if not self._entered:
            self._mode.detach_requested = False
            self._mode.__enter__()
            self._entered = True

    def _leave_mode(self) -> bool:
        if self._entered and on_top(self._mode):
            self._mode.__exit__(None, None, None)
            self._entered = False
        return not self._entered

    def _detach(self) -> None:
        """Mode popped and module hooks off: the script runs as without tpudiag until the next attach.  The float64
        copies go too: by the next watched step the script has written most of those tensors (an optimizer step
        later every parameter has changed), and kept between checked stretches they held up to their cap (1 GiB)
        for the whole run."""
        if self._leave_mode() and len(self._mode.copies):
            self._mode.copies.clear()
            heap.release(min_interval_s=HEAP_RELEASE_S, caller="detach")
        if not self._entered and self._hooks_on:
            assert self._tracker is not None and self._backward is not None
            self._tracker.remove()
            self._backward.remove()
            self._hooks_on = False
            if self._opt_steps:
                # Optimizer steps are the boundaries: unwatched steps need nothing from module calls.
                self._module_hook_on = False
                module_calls.refresh()

    def _on_module(self, module: Any, args: Any) -> None:
        """Root forwards are step boundaries for scripts without an optimizer; budget detach mid-step."""
        tracker = self._tracker
        if self._entered and tracker is not None and id(module) not in self._probes and tracker.current() is None:
            self._add_probe(module)
        if self._opt_steps == 0 and self._tracker is not None and threading.get_ident() == _main_ident:
            # (Steps are the main thread's, as the trace collector's are: a server's thread pool made a step
            # boundary at every request, each from its own thread, and the run's memory grew by ~5 MB a second.)
            if self._root is None:
                if self._entered and self._tracker.current() is None:
                    self._root = module
                    return
            elif module is self._root and _current_autograd_node() is None:
                # (A root call inside a backward is a checkpointed module's forward, recomputed: no step's end.)
                self._step_end()
                return
        mode: Any = self._mode
        # The first step is watched to its end (checks stop, the mode only counts) so that the calls of the steps
        # not watched later can be counted from it: a one-step pass-through cost, charged to the budget.
        if self._steps.profile is None:
            return
        if self._entered and mode is not None and mode.detach_requested and self._leave_mode():
            self._steps.partial = True
            self._steps.budget_detaches += 1

    def _add_probe(self, root: Any) -> None:
        """This root module's inputs are probed on every step, watched or not: new shapes or dtypes ask for the
        next step to be watched."""
        self._probes.add(id(root))

    def _probe(self, module: Any, args: Any, kwargs: Any) -> None:
        signature = input_signature(args, kwargs)
        if signature in self._root_inputs:
            return
        self._root_inputs.add(signature)
        st = self._steps
        if not st.watching and len(self._root_inputs) > 1:
            st.rewatch = True
            st.rewatches += 1
            steady_steps.gate.shut()  # (another thread's call: the main thread's next step end is a full one)

    def _step_end(self, optimizer: Any = None) -> None:
        """A step's end: ``step_points``' callback at an optimizer step's (never while Dynamo traces a compiled
        one), and at a root forward's in a script without an optimizer (``optimizer`` None).

        The boundary between two steps neither of which is watched (most steps of a long run) is made here in a few
        lines, without a call (the full ``_boundary`` cost ~4x as much, and each call on a step whose caches the
        script has just filled is a cold frame): the step that ended was not watched and left nothing to settle,
        and the next one wants no watching for any reason (schedule, re-check, new inputs, a trigger window's
        boost).  Any other boundary is ``_boundary``'s."""
        # A plain try (``internal_errors.guard``, a generator context manager, cost ~5 us a step).
        try:
            if optimizer is not None:
                self._opt_steps += 1
            mode = self._mode
            if mode is None or not mode.active:
                return
            st = self._steps
            now = time.perf_counter()
            step = st.step + 1
            sch = st.schedule  # ``StepSchedule.wants``, inlined
            if (
                st.watching or st.rewatch or st.unmeasured or st.plain_s is None or self._entered or mode.spent_calls
                or sch.watch_all or step < sch.warmup or not sch.steady or step % sch.every == 0
                or control.STATE.numerics_wanted
            ):  # fmt: skip
                self._boundary()
                return
            self._quiet_steps(st, mode, now - st.t0, 1, now)
            st.t0 = time.perf_counter()
        except Exception as err:
            where = "optimizer step hook" if optimizer is not None else "step boundary"
            internal_errors.current().record("numerics", where, err)

    def _quiet_steps(self, st: StepState, mode: Any, fastest: float, n: int, now: float) -> None:
        """``n`` steps ended on the quiet path (``_step_end``'s, or steady steps' in a batch: ``SteadyNumerics``),
        the fastest of them in ``fastest`` seconds, the last at ``now``.

        ``_unwatched_step_done`` and ``_replay`` for the case here (no watched step waits to be charged).  A step not
        watched for ``steady_state`` is counted in ``quiet_steps``, which ``_settle_quiet`` adds to the per-reason
        counts before anything reads them; the first step after one the budget refused is replayed for its reason."""
        if st.plain_s is None or fastest < st.plain_s:
            st.plain_s = fastest
        quiet = n
        if st.reason != "steady_state":
            self._replay(st.reason)
            st.unwatched[st.reason] = st.unwatched.get(st.reason, 0) + 1
            st.reason = "steady_state"
            quiet -= 1
        # Re-check steps (``step % every``) begun among these steps or as the step now in progress, while the
        # background allowance could not afford one (``SteadyNumerics.horizon`` lets steady steps run past them):
        # ``budget`` steps, as ``_boundary`` would have counted them.  (On the quiet path, and when steady steps stop
        # before a re-check step, there is none.)
        every, last = st.schedule.every, st.step + n
        refused = (last - 1) // every - st.step // every
        if refused:
            st.unwatched["budget"] = st.unwatched.get("budget", 0) + refused
            if st.profile and self._recorder is not None:
                st.pend("budget", refused, mode.seq)
            quiet -= refused
        if last % every == 0:
            st.reason = "budget"
        if quiet:
            if not st.quiet_steps:
                st.quiet_seq = mode.seq
            st.quiet_steps += quiet
        if mode.step_calls:
            mode.step_calls = {}
        st.step += n
        # ``Sampler.begin_step(False, False, capped, now)``, inlined: ``boost`` and ``recheck`` are off already (an
        # unwatched step was begun with them off), as are the step's ``background_step``, ``boost_step`` and
        # ``partial``.  ``_step_started``'s figures (signatures, spent and check seconds at the start) are read only
        # at the end of a watched step, and only ``_boundary`` begins one.
        sampler = mode.sampler
        capped = st.schedule.settled and st.step >= FIRST_STEPS and sampler.options.mode != "all"
        sampler.check_until = now + CHECK_STEP_S if capped else None
        sampler.memory_cap = sampler.check_allowance() if capped else None

    def _boundary(self) -> None:
        """End of a step (``_step_end``, when it is not the quiet kind): learn from it, replay its ops if it was not
        watched, decide whether to watch the next."""
        mode: Any = self._mode
        if mode is None or not mode.active or _is_compiling():
            return
        st = self._steps
        now = time.perf_counter()
        self._settle_quiet(st)
        took = now - st.t0
        budget = mode.budget
        spent_in_step = budget.spent() - st.spent0
        if st.watching:
            signatures = len(mode.sampler.counts)
            if not st.partial:
                st.schedule.step_done(signatures - st.signatures0)
                self._replay_pending()
                st.profile = mode.step_calls
            elif st.profile is None:
                st.profile = mode.step_calls
            checks_in_step = budget.check_s - st.check0
            if st.plain_s is not None and budget.pct is not None:
                measured = max(took - st.plain_s, 0.0)
                budget.correction_s += max(measured - spent_in_step, 0.0)
                cost = max(measured, spent_in_step)
            else:
                cost = spent_in_step
                if st.step > 0:
                    # The first step's wall time holds the script's own warm-up (lazy initialisation, optimizer
                    # state, allocator growth): compared with a warm plain step it would be charged to the checker.
                    # Its cost is what the mode measured, plus the calibrated entry cost per op.
                    st.unmeasured.append((took, spent_in_step))
            # What watching costs by itself (dispatch, hooks), plus one typical check: checks are then admitted one
            # by one inside the step as the allowance permits.
            st.watch_cost_s = max(cost - checks_in_step, 0.0) + budget.typical_check_s()
            if st.partial:
                self._replay("budget", seen=mode.step_calls)
            st.watched += 1
        else:
            self._unwatched_step_done(st, budget, took)
        for (op, phase), n in mode.spent_calls.items():
            flops = st.profile.get((op, phase), [1, 0.0]) if st.profile else [1, 0.0]
            self._recorder.aggregate(mode.seq, op, phase, None, "budget", flops[1] * n / max(flops[0], 1), None, n)
        mode.spent_calls = {}
        mode.step_calls = {}
        ended_background, ended_boost = st.background_step, st.boost_step
        if st.watching and st.plain_s is not None:
            if st.background_step:
                st.background.charge(took - st.plain_s)
            elif st.boost_step:
                st.boost_budget.charge(took - st.plain_s)
        st.step += 1
        boost = control.numerics_wanted()  # a trigger window covers the next step: every op checked
        want = st.schedule.wants(st.step) or st.rewatch or boost
        periodic = not boost and not st.rewatch and st.schedule.periodic(st.step)
        if st.rewatch:
            st.schedule.steady = False  # new inputs: keep watching until a watched step meets nothing new
            st.rewatch = False
        affordable = budget.affords(st.watch_cost_s, now - mode.started)
        if periodic and budget.pct is None:
            affordable = st.background.affords(st.watch_cost_s, now)
        elif boost and budget.pct is None:
            affordable = st.boost_budget.affords(st.watch_cost_s, now - mode.started)
        st.background_step = periodic
        st.boost_step = boost and not periodic
        # Held to CHECK_STEP_S a step only past the first trace window's steps: a short script is checked as before.
        # Boost and re-check only for a step that is watched: the compiled-region checker reads the same flags, and
        # would otherwise replay every compiled graph in a step its allowance refused.
        mode.sampler.begin_step(
            boost and affordable, periodic and affordable, capped=st.schedule.settled and st.step >= FIRST_STEPS
        )
        mode.counting_only = False  # (a step whose check time ran out: the next begins afresh)
        st.watching = want and affordable
        st.reason = "steady_state" if not want else "budget"
        st.partial = False
        if st.watching:
            self._attach()
        else:
            self._detach()
            st.watching = self._entered  # a mode of the script's own above ours: keep watching
        self._step_started(mode, st)
        # This boundary's own cost (the mode and the module hooks attached or detached, the heap trimmed, the calls
        # replayed) belongs to the re-check or the boost it begins or ends, as their steps' time does: charged to
        # their allowance (it had come on top of it: 1.3% of the long-run bench for an allowance of 1%).
        if ended_background or st.background_step:
            st.background.charge(time.perf_counter() - now)
        elif ended_boost or st.boost_step:
            st.boost_budget.charge(time.perf_counter() - now)

    def _unwatched_step_done(self, st: StepState, budget: Any, took: float) -> None:
        """A step that was not watched has ended (``took`` seconds): its plain time and its calls, counted."""
        st.plain_s = took if st.plain_s is None else min(st.plain_s, took)
        # Watched steps (after the first) from before any plain step was timed: charge what they really cost.
        for took_w, spent_w in st.unmeasured:
            budget.correction_s += max(took_w - st.plain_s - spent_w, 0.0)
        st.unmeasured.clear()
        self._replay(st.reason)
        st.unwatched[st.reason] = st.unwatched.get(st.reason, 0) + 1

    @staticmethod
    def _step_started(mode: Any, st: StepState) -> None:
        """Where the next step starts from: signatures met, time, the budget's spent and check seconds."""
        st.signatures0 = len(mode.sampler.counts)
        st.t0 = time.perf_counter()
        st.spent0 = mode.budget.spent()
        st.check0 = mode.budget.check_s

    def _replay(self, reason: str, seen: dict[tuple[str, str], list[Any]] | None = None) -> None:
        """Record the calls of an unwatched step (or the unwatched rest of a step) as skipped for ``reason``.

        A whole unwatched step is only counted here (a few hundred ns on the step's path); its calls are recorded
        in bulk, once per run of such steps, by ``_replay_pending`` (before the profile they repeat changes, and at
        the end)."""
        st = self._steps
        profile = st.profile
        if not profile or self._recorder is None:
            return
        if seen is None:
            st.pend(reason, 1, self._mode.seq)
            return
        seq = self._mode.seq
        for (op, phase), (calls, flops) in profile.items():
            done = seen.get((op, phase), [0, 0.0])[0]
            rest = calls - done
            if rest > 0:
                self._recorder.aggregate(seq, op, phase, None, reason, flops * rest / calls, None, calls=rest)

    def _settle_quiet(self, st: StepState) -> None:
        """The ``steady_state`` steps ``_step_end`` counted in ``quiet_steps``: into the per-reason counts (and the
        replays pending, as ``_replay`` would have put them, at the sequence number of the first of them)."""
        n = st.quiet_steps
        if not n:
            return
        st.quiet_steps = 0
        st.unwatched["steady_state"] = st.unwatched.get("steady_state", 0) + n
        if st.profile and self._recorder is not None:
            st.pend("steady_state", n, st.quiet_seq)

    def _replay_pending(self) -> None:
        """Record the counted unwatched steps' calls (``_replay``) from the profile they repeated."""
        st = self._steps
        self._settle_quiet(st)
        pending, st.pending_replays = st.pending_replays, {}
        if not pending or not st.profile or self._recorder is None:
            return
        seq = st.pending_seq
        for reason, steps in pending.items():
            for (op, phase), (calls, flops) in st.profile.items():
                if calls > 0:
                    self._recorder.aggregate(seq, op, phase, None, reason, flops * steps, None, calls * steps)


class ModuleBoundaries:
    """The numerics collector's ``module_calls`` listener: root forwards (step boundaries in scripts without an
    optimizer, the root input probe) and budget detaches at module boundaries."""

    known_roots = True  # roots of classes seen as roots are enough (``module_calls``' class mode)

    def __init__(self, collector: NumericsCollector) -> None:
        self._collector = collector

    @property
    def roots_only(self) -> bool:
        """Root calls are enough (the input probe; a script without an optimizer's step boundaries, at its root
        module's calls) unless a watched step's budget may detach at module boundaries.  (While a step is watched the
        collector's own tracker takes every call anyway; ``module_calls`` reads this when a listener comes or goes,
        and the tracker leaves after the mode has.)"""
        c = self._collector
        return not (c._module_hook_on and c._entered)

    def enter(self, module: Any, args: Any, kwargs: Any) -> Any:
        c = self._collector
        if id(module) in c._probes:
            # ``input_signature``'s value for ``model(x)`` without its calls (every step's root call): a torch.Size
            # equals and hashes as the tuple of its sizes.
            if not kwargs and len(args) == 1 and type(args[0]) is _Tensor:
                if ((args[0].shape, args[0].dtype),) not in c._root_inputs:
                    c._probe(module, args, kwargs)
            else:
                c._probe(module, args, kwargs)
        if c._module_hook_on:
            c._on_module(module, args)
        return module_calls.NO_EXIT  # nothing to do on exit: not called

    def exit(self, module: Any, token: Any, output: Any, failed: bool) -> None:
        return None


class SteadyNumerics:
    """The numerics collector's part in steady steps (``collectors/steady_steps.py``): the steps its
    ``_step_end`` would end on the quiet path (not watched, nothing to settle, the next re-check step not reached),
    and those steps taken in one pass."""

    def __init__(self, collector: NumericsCollector) -> None:
        self._collector = collector

    def horizon(self, gate: Any) -> None:
        c = self._collector
        mode: Any = c._mode
        st = c._steps
        sch = st.schedule
        # Steps ended by root calls (``steady_steps.Gate.byroot``) are the collector's steps only in a script
        # without an optimizer step, where its module hook makes them at its root module's calls (``_on_module``).
        root_steps = gate.byroot and c._opt_steps == 0
        if root_steps and (c._root is None or id(c._root) != gate.module_id):
            gate.shut()
            return
        if (
            mode is None or not mode.active or (c._module_hook_on and not root_steps) or c._entered or st.watching
            or st.rewatch
            or st.unmeasured or st.plain_s is None or mode.spent_calls or sch.watch_all or not sch.steady
            or control.STATE.numerics_wanted or st.step + 1 < sch.warmup
        ):  # fmt: skip
            gate.shut()
            return
        steps, until = (-(st.step + 1)) % sch.every, float("inf")  # up to the next re-check step (``step % every``)
        if mode.budget.pct is None:
            # Without --budget a re-check step waits for the background allowance (``_boundary``): until it affords
            # one, each ``step % every`` step would end on the full path only to be refused (every 50 steps, where
            # the allowance affords one every few seconds).  Steady until then; the refused ones are counted as
            # they were (``_quiet_steps``).
            now = time.perf_counter()
            wait = st.background.wait_s(st.watch_cost_s, now)
            if wait > 0:
                steps, until = 1 << 30, (now + wait) * 1e9
        gate.limit(steps, until)

    def absorb(self, starts: list[int], ends: list[int]) -> None:
        """``_step_end``'s quiet path for each step: counted, its plain time learnt, the schedule moved on."""
        c = self._collector
        n = len(ends)
        if steady_steps.gate.byroot:
            if c._opt_steps:
                return  # an evaluation's root calls between training steps: not this collector's steps
        else:
            c._opt_steps += n
        mode: Any = c._mode
        if mode is None:
            return
        st = c._steps
        prev = st.t0
        fastest = float("inf")
        for end in ends:
            fastest = min(fastest, end * 1e-9 - prev)
            prev = end * 1e-9
        c._quiet_steps(st, mode, fastest, n, prev)
        st.t0 = prev

    def resume(self, start: int) -> None:
        return None


class StepState:
    """Where the step schedule stands (see ``sampling.StepSchedule``)."""

    def __init__(self) -> None:
        from tpudiag.collectors.numerics.sampling import BOOST_HORIZON_S, BOOST_PCT, Background, StepSchedule

        self.schedule = StepSchedule()
        self.step = 0
        self.watching = True
        self.partial = False  # the budget detached the mode inside the current step
        self.reason = "steady_state"  # why the current step is not watched
        self.t0 = 0.0
        self.spent0 = 0.0
        self.check0 = 0.0
        self.signatures0 = 0
        self.plain_s: float | None = None  # fastest unwatched step
        self.watch_cost_s = 0.0  # extra seconds the last watched step cost
        self.unmeasured: list[tuple[float, float]] = []  # (wall, charged) of watched steps before a plain one
        self.profile: dict[tuple[str, str], list[Any]] | None = None  # (op, phase) -> [calls, flops]
        self.watched = 0
        self.unwatched: dict[str, int] = {}
        self.budget_detaches = 0
        self.rewatch = False  # the root module saw new input shapes/dtypes while unwatched: watch the next step
        self.rewatches = 0
        self.background = Background()  # periodic re-check steps without --budget (issue 21)
        self.background_step = False  # the current step is one
        # Trigger windows' steps without --budget (their clock: seconds since the mode started).
        self.boost_budget = Background(pct=BOOST_PCT, since_s=0.0, horizon_s=BOOST_HORIZON_S)
        self.boost_step = False
        self.pending_replays: dict[str, int] = {}  # reason -> whole unwatched steps not yet recorded (``_replay``)
        self.pending_seq = 0
        self.quiet_steps = 0  # ``steady_state`` steps ``_step_end`` counted, not yet in ``unwatched``
        self.quiet_seq = 0  # the sequence number at the first of them

    def pend(self, reason: str, n: int, seq: int) -> None:
        """``n`` more whole unwatched steps skipped for ``reason``, to be recorded by ``_replay_pending`` (at ``seq``,
        the sequence number of the first step pending, when none was)."""
        if not self.pending_replays:
            self.pending_seq = seq
        self.pending_replays[reason] = self.pending_replays.get(reason, 0) + n


def input_signature(args: Any, kwargs: Any) -> tuple[Any, ...]:
    """(shape, dtype) of every tensor among a module's inputs (top level and inside lists, tuples, dicts)."""
    if not kwargs and len(args) <= 8:
        # The usual root call (a few tensors, nothing nested): the same signature without the walk (every step).
        fast = tuple((tuple(a.shape), a.dtype) for a in args if isinstance(a, torch.Tensor))
        if len(fast) == len(args):
            return fast
    out: list[Any] = []
    todo: list[Any] = [args, kwargs]
    while todo and len(out) < 64:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            out.append((tuple(x.shape), x.dtype))
        elif isinstance(x, (list, tuple)):
            todo.extend(reversed(x))
        elif isinstance(x, dict):
            todo.extend(reversed(list(x.values())))
    return tuple(out)


def on_top(mode: Any) -> bool:
    """Whether ``mode`` is the innermost dispatch mode (the only one that may be exited)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    current: Any = _get_current_dispatch_mode()
    return current is mode
