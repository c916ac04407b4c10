"""The numerics collector's summary once checking stopped: ``settings.json`` (sampling, precision, compiled graphs,
steps, budget), the run's notes on what went unchecked and why, and the one closing line on stderr.

A mixin of ``NumericsCollector`` (it reads the collector's mode, recorder, step state and settings)."""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Any

from tpudiag import console
from tpudiag.collectors.numerics.sampling import CHECK_STEP_S

if TYPE_CHECKING:
    from tpudiag.collectors.numerics.steps import StepState
    from tpudiag.plugins import CaptureContext


class RunSummary:
    _ctx: CaptureContext | None
    _mode: Any
    _recorder: Any
    _settings: dict[str, Any]
    _compiles: int
    _opt_steps: int
    _root: Any
    _steps: StepState

    def _summarize(self) -> None:
        """Settings, notes and the closing line, after the final write (``stop`` calls it last)."""
        assert self._ctx is not None
        f = self._recorder.findings
        self._settings.update(
            {
                "compiled_frames": self._compiles,
                "seconds_checking": round(self._mode.budget.extra_s, 3),
                "shadow_dropped": self._mode.shadow.dropped,
                # Kept float64 copies found changed without a version bump (fused/foreach/compiled writes): each
                # would have fed the oracle an old value; they were refused and copied afresh.
                "copies_stale": self._mode.copies.stale,
            }
        )
        self._settings["precision"]["autocast_seen"] = sorted(self._mode.autocast_seen)
        st = self._steps
        self._settings["steps"] = {
            "boundaries": "optimizer" if self._opt_steps else ("root_forward" if self._root is not None else None),
            "total": st.step,
            "watched": st.watched,
            "unwatched": dict(st.unwatched),
            "budget_detaches": st.budget_detaches,
            # Steps past the first window whose check time (``sampling.CHECK_STEP_S``) ran out before their end.
            "check_time_ran_out": self._mode.time_ups,
            "rewatched_for_new_inputs": st.rewatches,
        }
        budget: Any = self._mode.budget
        if budget.pct is not None:
            self._settings["budget"] = {
                "pct": budget.pct,
                "spent_s": round(budget.spent(), 4),
                "entry_cost_per_op_us": round(budget.per_op_overhead_s * 1e6, 2),
                "measured_correction_s": round(budget.correction_s, 4),
                "elapsed_s": round(time.perf_counter() - self._mode.started, 4),
            }
        path = self._ctx.run_dir / "numerics" / "settings.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self._settings, indent=1))
        if st.unwatched:
            parts_s = ", ".join(f"{n} for {reason}" for reason, n in sorted(st.unwatched.items()))
            self._ctx.note(
                f"numerics: {sum(st.unwatched.values())} of {st.step} steps ran without the checker ({parts_s}); "
                "their op calls are counted as skipped from the last watched step, not seen one by one"
            )
        if st.budget_detaches:
            self._ctx.note(
                f"numerics: --budget {self._mode.budget.pct:g}% ran out {st.budget_detaches} time(s) inside a step; "
                "the checker left at the next module boundary (ops after that in the step are counted as 'budget')"
            )
        if self._mode.time_ups:
            self._ctx.note(
                f"numerics: in {self._mode.time_ups} watched step(s) the check time of a step "
                f"({CHECK_STEP_S * 1e3:g} ms) ran out before its end; their later op calls are counted as 'budget'"
            )
        compiled = self._settings.get("compiled") or {}
        if self._compiles and compiled.get("graphs"):
            self._ctx.note(
                f"numerics: {self._compiles} torch.compile frame(s); {compiled.get('graphs_checked', 0)} of "
                f"{compiled['graphs']} compiled graph(s) checked as whole regions against a float64 replay"
            )
        elif self._compiles:
            self._ctx.note(
                f"numerics: {self._compiles} torch.compile frame(s) compiled normally; their fused kernels are "
                "not checked (aten ops they call are)"
            )
        if f.scaled_overflows:
            self._ctx.note(
                f"numerics: {f.scaled_overflows} checked op call(s) of backward passes scaled by a GradScaler "
                "overflowed their dtype (verdict scaled_overflow, not a divergence: the scaler skips those optimizer "
                "steps and lowers its scale)"
            )
        if f.seen == 0:
            self._ctx.note("numerics: no aten ops were seen (did the script run any torch ops?)")
        elif f.checked == 0:
            self._ctx.note(f"numerics: WARNING: {f.seen} ops seen but none checked (see the report's coverage)")
        # The one closing line (the live status line, same words, was erased when checking stopped).
        closing = counts_line(f) + (f", first divergence {f.first}" if f.first else "")
        sys.stderr.write(f"{console.prefix()}: {closing}\n")
        sys.stderr.flush()


def counts_line(f: Any) -> str:
    """The numerics counts, as the live status line and the closing line both say them."""
    return f"numerics: {f.seen:,} ops seen, {f.checked:,} checked, {f.originators} originator(s)"
