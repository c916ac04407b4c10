"""Sampled checks of compiled graphs: compiled output vs a float64 replay of the same graph on the same inputs.

At a sampled call (first K calls per graph and input signature, then once more in each of the eager schedule's
periodic re-check steps and at every call of a trigger window's steps, within ``--budget``, the same options as
eager checking) the wrapper clones the graph inputs *before* the compiled call (compiled code
may update buffers in place), runs the compiled function as usual, then replays the graph copy twice with the
user's dispatch modes suspended and the RNG state restored afterwards: on the CPU in float64 (the oracle) and
eagerly at the device dtype (the reference error).  Each output gets the ``same()``-style verdict
(``analysis.verdict.decide_graph``) next to the scaled-eps metrics.  A failing graph keeps its inputs for
localisation when the capture stops (``localise``), so training is not slowed by it.

Everything here is inside an error boundary: any failure of the checker is recorded as a skip with reason
``tpudiag_error`` and the compiled function's result is returned untouched.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tpudiag import console
from tpudiag.analysis.numerics_metrics import dtype_name
from tpudiag.analysis.verdict import Verdict, is_divergent
from tpudiag.collectors.numerics import check_memory
from tpudiag.collectors.numerics.compiled.intercept import GraphInfo, Interceptor
from tpudiag.collectors.numerics.sampling import CHECK_STEP_S, Budget, Sampler, SamplingOptions
from tpudiag.model import OpDiff, OpRecord
from tpudiag.oracle import graph as graph_oracle
from tpudiag.oracle.outputs import OutputCheck, check_output, floor_check, within_floor
from tpudiag.tool_range import tool_range

SIZE_CAP = 1 << 26  # input elements of one graph call; larger calls are skipped as "size_cap"
MAX_LOCALISED = 4  # failing graphs whose inputs are kept for localisation


@dataclass
class CheckerContext:
    run_id: str
    recorder: Any  # collectors.numerics.records.Recorder
    options: SamplingOptions
    budget: Budget
    started: float  # perf_counter() when checking started (budget elapsed time)
    next_seq: Callable[[], int]  # one sequence number shared with the eager ops (execution order)
    device_kind: str = "cpu"
    run_dir: Any = None  # Path of the run's artifacts
    note: Callable[[str], None] | None = None
    emulations: tuple[str, ...] = ()  # reduced-precision matmul units the run may use ("bf16", "tf32")
    schedule: Sampler | None = None  # the eager mode's sampler: its step's flags (window boost, re-check, time)


@dataclass
class Graph:
    info: GraphInfo
    fp64: Any = None  # the float64/CPU rewrite of info.ref (made at the first check)
    unverifiable: str | None = None  # a reason every call of this graph is skipped for
    calls: int = 0
    checks: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    failing: dict[str, Any] | None = None  # kept inputs and rows of the first failing call
    failing_bw: dict[str, Any] | None = None  # kept inputs and output gradients of the first failing backward
    divergent_calls: int = 0
    first_seq: int | None = None
    skipped_bw: dict[str, int] = field(default_factory=dict)  # backward checks not made, by reason
    backward_checks: int = 0
    backward_divergent: int = 0
    sampled_out: bool = False  # its one signature is past its first K calls (``compiled_region``'s fast path)
    # Its values in elements (``check_memory.graph_elements``: the most alive at once, all), (-1, -1) when unknown
    replay_elements: tuple[int, int] | None = None


class CompiledChecker:
    def __init__(self, ctx: CheckerContext) -> None:
        self.ctx = ctx
        self.sampler = Sampler(ctx.options)
        self.graphs: list[Graph] = []
        self.active = False
        self.errors: list[str] = []
        self.interceptor = Interceptor(self._on_graph, self._on_error)
        self.unsupported: str | None = None

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> None:
        try:
            self.unsupported = self.interceptor.install()
        except Exception as e:
            self.unsupported = f"interception failed ({type(e).__name__}: {e})"
        self.active = self.unsupported is None
        if self.unsupported and self.ctx.note is not None:
            self.ctx.note(f"numerics: compiled regions are not checked: {self.unsupported}")

    def stop(self) -> dict[str, Any]:
        """Stop checking, localise failing graphs, write the aggregated rows; returns the settings summary."""
        self.active = False
        with contextlib.suppress(Exception):
            self.interceptor.remove()
        localised = 0
        for g in self.graphs:
            if g.failing is not None:
                try:
                    from tpudiag.collectors.numerics.compiled.localise import localise_graph

                    if localise_graph(self, g):
                        localised += 1
                except Exception as e:
                    self._on_error("localise", e)
            if g.failing_bw is not None:
                try:
                    from tpudiag.collectors.numerics.compiled.localise_backward import localise_backward

                    if localise_backward(self, g):
                        localised += 1
                except Exception as e:
                    self._on_error("localise_backward", e)
                try:
                    from tpudiag.collectors.numerics.compiled.repro_backward import write_backward_repro

                    write_backward_repro(self, g)
                except Exception as e:
                    self._on_error("repro_backward", e)
            if g.failing is not None:
                try:
                    from tpudiag.collectors.numerics.compiled.repro import write_repro

                    write_repro(self, g)
                except Exception as e:
                    self._on_error("repro", e)
        for g in self.graphs:
            for reason, n in g.skipped.items():
                self._row_only(g, reason, calls=n)
            for reason, n in g.skipped_bw.items():
                self._row_only(g, reason, calls=n, phase="backward")
        return {
            "graphs": len(self.graphs),
            "graphs_checked": sum(1 for g in self.graphs if g.checks),
            "graph_calls": sum(g.calls for g in self.graphs),
            "graph_checks": sum(g.checks for g in self.graphs),
            "divergent_graphs": sum(1 for g in self.graphs if g.divergent_calls),
            "backward_checks": sum(g.backward_checks for g in self.graphs),
            "divergent_backward_graphs": sum(1 for g in self.graphs if g.backward_divergent),
            "localised": localised,
            "unsupported": self.unsupported,
            "errors": self.errors[:20],
            "repros": [
                f["repro"] for g in self.graphs for f in (g.failing, g.failing_bw) if f is not None and f.get("repro")
            ],
            "localisations": self._localisations(),
        }

    def _localisations(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for g in self.graphs:
            for phase, failing in (("forward", g.failing), ("backward", g.failing_bw)):
                if not failing:
                    continue
                found = failing.get("localised")
                head = {"graph": g.info.compile_id, "phase": phase}
                out.append({**head, **found} if isinstance(found, dict) else {**head, "not_localised": found})
        return out

    # -- interception -----------------------------------------------------------------------------------------
    def _on_error(self, where: str, exc: BaseException) -> None:
        from tpudiag import internal_errors

        self.errors.append(f"{where}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        internal_errors.current().record("numerics (compiled)", where, exc)

    def _on_graph(self, info: GraphInfo, compiled: Any) -> Any:
        g = Graph(info)
        cols = graph_oracle.collectives(info.ref)
        if cols:
            g.unverifiable = "collective"
        elif graph_oracle.mutated_attributes(info.ref):
            # A compiled optimizer step: it updates parameters and state it does not take as inputs.  Its replay
            # would start from stale copies, and the eager reference would update the script's own tensors again.
            g.unverifiable = "mutates_state"
        self.graphs.append(g)
        if compiled is None:
            g.unverifiable = "backend_failed"
            g.skipped["backend_failed"] = 1
            return None
        from torch.fx._lazy_graph_module import _LazyGraphModule

        # Dynamo turns a lazy GraphModule (or its lazy forward) into its real forward right after this call; it
        # cannot see through the wrapper, so do the same here first.
        if isinstance(compiled, _LazyGraphModule):
            _LazyGraphModule.force_recompile(compiled)
        elif isinstance(getattr(compiled, "__self__", None), _LazyGraphModule):
            lazy = compiled.__self__
            _LazyGraphModule.force_recompile(lazy)
            compiled = lazy.forward
        checker = self

        def compiled_region(*args: Any) -> Any:
            if not checker.active:
                return compiled(*args)
            if g.sampled_out and g.unverifiable is None:
                # What ``_plan`` would decide, without its calls (every call of a long run's steady state): a graph
                # with no integer inputs has one signature, past its first K calls for good (``Sampler.wants``),
                # so only a step that re-checks or checks every call can want it.
                schedule = checker.ctx.schedule
                if schedule is None or not (schedule.boost or schedule.recheck):
                    g.calls += 1
                    g.skipped["sampled"] += 1
                    return compiled(*args)
            try:
                plan = checker._plan(g, args)
            except Exception as e:
                checker._on_error("plan", e)
                plan = None
            if plan is None:
                return compiled(*args)
            return checker._checked_call(g, compiled, args, plan)

        # Attributes backends put on their callable (TorchTPU's ``serialize``, AOT's ``_boxed_call``) stay visible.
        with contextlib.suppress(Exception):
            compiled_region.__dict__.update(getattr(compiled, "__dict__", {}))
        compiled_region.__wrapped__ = compiled  # type: ignore[attr-defined]
        return compiled_region

    # -- sampling ---------------------------------------------------------------------------------------------
    def _plan(self, g: Graph, args: tuple[Any, ...]) -> dict[str, Any] | None:
        """None: run as usual (counted); a dict: check this call."""
        g.calls += 1
        if g.unverifiable is not None:
            g.skipped[g.unverifiable] = g.skipped.get(g.unverifiable, 0) + 1
            return None
        # A static graph's shapes are fixed by its guards; a dynamic one's by its integer (SymInt) inputs.
        ints = tuple(a for a in args if isinstance(a, int))
        signature = ("compiled_graph", g.info.compile_id, ints)
        sampler = self.sampler
        schedule = self.ctx.schedule
        if schedule is not None:
            # The eager schedule's step decides for the graphs too: a trigger window's step checks every call, a
            # periodic re-check step (only when its allowance afforded it) each signature once more, and a settled
            # step's checks stop at its check time.  One allowance for both: the watched step's measured cost.
            sampler.boost, sampler.recheck = schedule.boost, schedule.recheck
            sampler.check_until, sampler.rechecked = schedule.check_until, schedule.rechecked
        if not sampler.wants(signature):
            g.skipped["sampled"] = g.skipped.get("sampled", 0) + 1
            g.sampled_out = not ints  # refused for the first-K count: for good (refusals only follow an admission)
            return None
        numel = sum(a.numel() for a in args if isinstance(a, torch.Tensor))
        if numel > SIZE_CAP or self._over_memory(g, args, numel, schedule):
            g.skipped["size_cap"] = g.skipped.get("size_cap", 0) + 1
            return None
        budget = self.ctx.budget
        elapsed = time.perf_counter() - self.ctx.started
        op = f"compiled_graph {g.info.compile_id}"
        if not budget.allows_check(op, "graph", numel, elapsed, sampler.checked.get(signature, 0)):
            sampler.refused(signature)
            g.skipped["budget"] = g.skipped.get("budget", 0) + 1
            return None
        # A replay of the whole graph in float64 is one check: in a settled step it must fit the step's check time
        # (no stall outside windows), else a later step or a window takes it.  A graph's first calls only need the
        # replay to fit that time by itself: the step that compiled the graph has usually spent its check time on
        # the compile, and a graph called once (a recompile's) would never be checked.
        if sampler.admitted == "first" and sampler.check_until is not None:
            fits = budget.estimate(op, "graph", numel) <= CHECK_STEP_S
        else:
            fits = sampler.in_time(signature, lambda: budget.estimate(op, "graph", numel))
        if not fits:
            g.skipped["budget"] = g.skipped.get("budget", 0) + 1
            return None
        sampler.checked[signature] = sampler.checked.get(signature, 0) + 1
        return {"numel": numel, "op": op}

    def _over_memory(self, g: Graph, args: tuple[Any, ...], numel: int, schedule: Any) -> bool:
        """Past the run's first steps: whether this call's check would hold more than a check's memory allowance
        (``check_memory``; a graph whose sizes are not known is not bounded)."""
        cap = getattr(schedule, "memory_cap", None)
        if cap is None:
            return False
        if g.replay_elements is None:
            g.replay_elements = check_memory.graph_elements(g.info.ref) or (-1, -1)
        if g.replay_elements[0] < 0:
            return False
        grad = torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        return check_memory.graph_estimate(numel, g.replay_elements, grad) > cap

    # -- one checked call -------------------------------------------------------------------------------------
    def _checked_call(self, g: Graph, compiled: Any, args: tuple[Any, ...], plan: dict[str, Any]) -> Any:
        t0 = time.perf_counter()
        snapshot: list[Any] | None = None
        try:
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes(), torch.no_grad():
                snapshot = graph_oracle.clone_inputs(args)
        except Exception as e:
            self._on_error("snapshot", e)
        t_call = time.perf_counter()
        out = compiled(*args)  # the user's call: its exceptions are the user's
        call_s = time.perf_counter() - t_call
        if snapshot is None:
            g.skipped["tpudiag_error"] = g.skipped.get("tpudiag_error", 0) + 1
            return out
        backward: Any = None
        try:
            from tpudiag.collectors.numerics.compiled import grads

            backward = grads.plan(args, out)
            if isinstance(backward, str):
                g.skipped_bw[backward] = g.skipped_bw.get(backward, 0) + 1
                backward = None
        except Exception as e:
            self._on_error("backward", e)
            g.skipped_bw["tpudiag_error"] = g.skipped_bw.get("tpudiag_error", 0) + 1
        try:
            # Labelled, so a profiler trace shows the checker's replays as tpudiag's work (one range, not its ops).
            from torch.utils._python_dispatch import _disable_current_modes

            # Its copies, replays and comparisons are the checker's work, not the script's: no dispatch mode sees
            # them (the numerics mode had recorded, and in a watched step checked, its copies as the script's ops).
            with tool_range("tpudiag::compiled_check"), _disable_current_modes():
                self._check(g, snapshot, out, plan, backward)
        except Exception as e:
            self._on_error("check", e)
            g.skipped["tpudiag_error"] = g.skipped.get("tpudiag_error", 0) + 1
        spent = time.perf_counter() - t0 - call_s
        with contextlib.suppress(Exception):
            self.ctx.budget.charge(spent, plan["op"], "graph", plan["numel"], plan.get("setup_s", 0.0))
        return out

    def _check(self, g: Graph, snapshot: list[Any], out: Any, plan: dict[str, Any], backward: Any = None) -> None:
        """Forward verdicts now; with ``backward`` = (node, wanted), the reference forwards keep their autograd
        graphs (one replay each serves the forward and the backward check) and the backward is hooked."""
        from tpudiag.collectors.numerics.compiled import grads

        t0 = time.perf_counter()
        if g.fp64 is None:
            g.fp64 = graph_oracle.to_float64_graph(g.info.ref)
            plan["setup_s"] = time.perf_counter() - t0
        wanted = backward[1] if backward is not None else None
        fp64_in = graph_oracle.float64_inputs(snapshot)
        eager_in = graph_oracle.clone_inputs(snapshot)
        if wanted is not None:
            fp64_in, eager_in = grads.leaves(fp64_in, wanted), grads.leaves(eager_in, wanted)
        try:
            fp64 = graph_oracle.replay(g.fp64, fp64_in, grad=wanted is not None)
        except NotImplementedError:
            g.unverifiable = "no_cpu_kernel"
            g.skipped["no_cpu_kernel"] = g.skipped.get("no_cpu_kernel", 0) + 1
            return
        if fp64.random_ops:
            g.unverifiable = "random_ops"
            g.skipped["random_ops"] = g.skipped.get("random_ops", 0) + 1
            return
        compiled_out = graph_oracle.flat_outputs(out)
        # The eager reference only when some output is not already within same()'s floor of float64.
        floors = [within_floor(c, r) for c, r in zip(compiled_out, fp64.outputs, strict=False)]
        need_eager = any(
            f is not True for c, f in zip(compiled_out, floors, strict=False) if isinstance(c, torch.Tensor)
        )
        eager_outs: list[Any] | None = None
        if need_eager:
            eager_outs = graph_oracle.replay(g.info.ref, eager_in, grad=wanted is not None).outputs
        armed: dict[str, bool] | None = None
        if backward is not None and wanted is not None:
            armed = grads.arm(self, g, backward[0], wanted, out, fp64_in, fp64.outputs, eager_in, eager_outs, snapshot)
        diffs: list[tuple[OutputCheck, OpDiff]] = []
        node_seq = self.ctx.next_seq()  # reserved for the originating node found by localisation
        seq = self.ctx.next_seq()
        for i, (c, r) in enumerate(zip(compiled_out, fp64.outputs, strict=False)):
            if floors[i] is True:
                checked: OutputCheck | None = floor_check(c, r)
            else:
                checked = check_output(c, eager_outs[i] if eager_outs is not None else None, r)
            if checked is None:
                continue
            diffs.append((checked, checked.diff(self.ctx.run_id, seq, i)))
        if self.ctx.emulations and any(ck.verdict.verdict == "fail" for ck, _ in diffs):
            diffs = self._attribute_precision(g, fp64_in, compiled_out, eager_outs, fp64.outputs, diffs, seq)
        g.checks += 1
        divergent = any(is_divergent(ck.verdict.verdict) for ck, _ in diffs)
        if armed is not None:
            armed["forward_divergent"] = divergent
        tensors = [a for a in snapshot if isinstance(a, torch.Tensor)]
        record = OpRecord(
            run_id=self.ctx.run_id,
            seq=seq,
            op=f"compiled_graph {g.info.compile_id}",
            overload=g.info.backend,
            module=None,
            phase="forward",
            source_loc=_short(g.info.frame),
            dtypes=_json([dtype_name(t.dtype) for t in tensors[:64]]),
            shapes=_json([list(t.shape) for t in tensors[:64]]),
            device=str(tensors[0].device) if tensors else None,
            checked=True,
            kind="graph",
            check_ns=int((time.perf_counter() - t0) * 1e9),
            region="compiled_graph",
            graph_id=g.info.compile_id,
        )
        rec = self.ctx.recorder
        rec.op(record)
        rec.diffs([d for _, d in diffs])
        f = rec.findings
        f.seen += 1
        f.checked += 1
        if g.first_seq is None:
            g.first_seq = seq
        if divergent:
            f.divergent += 1
            g.divergent_calls += 1
            if g.failing is None and sum(1 for x in self.graphs if x.failing is not None) < MAX_LOCALISED:
                g.failing = {
                    "inputs": snapshot,
                    "seq": seq,
                    "node_seq": node_seq,
                    "record": record,
                    "outputs": [(ck, d) for ck, d in diffs],
                }
            if f.first is None:
                f.first = f"{record.op} ({g.info.backend}) seq {seq}"
            sys.stderr.write(
                f"{console.prefix()}: numerics: compiled graph {g.info.compile_id} ({g.info.backend}, "
                f"{_short(g.info.frame) or '?'}) diverges from its float64 replay; localising at the end\n"
            )
            sys.stderr.flush()

    def _attribute_precision(
        self,
        g: Graph,
        fp64_in: list[Any],
        compiled_out: list[Any],
        eager_outs: list[Any] | None,
        ref: list[Any],
        diffs: list[tuple[OutputCheck, OpDiff]],
        seq: int,
    ) -> list[tuple[OutputCheck, OpDiff]]:
        """Failing fp32 outputs re-judged against a replay with reduced-precision matmul inputs (TPU's default
        one-pass bf16, TF32): matching it is ``expected_precision``, not a miscompile."""
        from tpudiag.oracle.ops import emulation_casts

        inputs = [x.detach() if isinstance(x, torch.Tensor) else x for x in fp64_in]
        out = list(diffs)
        for name, cast in emulation_casts(list(self.ctx.emulations)):
            emulated = graph_oracle.emulated_replay(g.fp64, inputs, cast)
            for k, (ck, d) in enumerate(out):
                i = d.output_index
                if ck.verdict.verdict != "fail" or ck.dtype != "float32" or eager_outs is None:
                    continue
                again = check_output(compiled_out[i], eager_outs[i], ref[i], emulated=emulated[i])
                if again is not None and again.verdict.verdict == "expected_precision":
                    again.verdict = Verdict(
                        "expected_precision", again.verdict.threshold, f"{again.verdict.note} ({name})"
                    )
                    out[k] = (again, again.diff(self.ctx.run_id, seq, i))
        return out

    def _row_only(self, g: Graph, reason: str, calls: int, phase: str = "forward") -> None:
        self.ctx.recorder.op(
            OpRecord(
                run_id=self.ctx.run_id,
                seq=g.first_seq if g.first_seq is not None else 0,
                op=f"compiled_graph {g.info.compile_id}",
                overload=g.info.backend,
                phase=phase,
                source_loc=_short(g.info.frame),
                checked=False,
                skip_reason=reason,
                kind="graph",
                calls=calls,
                region="compiled_graph",
                graph_id=g.info.compile_id,
            )
        )


def _short(loc: str | None) -> str | None:
    if not loc:
        return loc
    import os

    path, _, line = loc.rpartition(":")
    with contextlib.suppress(ValueError):
        rel = os.path.relpath(path)
        if not rel.startswith(".."):
            return f"{rel}:{line}"
    return loc


def _json(x: Any) -> str:
    import json

    return json.dumps(x, separators=(",", ":"))
