"""Start and stop the compiled-region checker from the numerics collector (the collector's only entry points)."""

from __future__ import annotations

import contextlib
import time
from typing import Any


def start(ctx: Any, options: Any, mode: Any, recorder: Any, device_kind: str) -> Any:
    """A started ``CompiledChecker`` (None when numerics are off or the checker could not start)."""
    if not options.enabled:
        return None
    try:
        from tpudiag.collectors.numerics.compiled.checker import CheckerContext, CompiledChecker

        def next_seq() -> int:
            # One sequence shared with the eager ops, so graph rows sit in execution order among them.
            mode.seq += 1
            return int(mode.seq)

        checker = CompiledChecker(
            CheckerContext(
                run_id=ctx.run_id,
                recorder=recorder,
                options=options,
                budget=mode.budget,
                started=getattr(mode, "started", time.perf_counter()),
                next_seq=next_seq,
                device_kind=device_kind,
                run_dir=ctx.run_dir,
                note=ctx.note,
                emulations=tuple(getattr(getattr(mode, "ctx", None), "emulations", ()) or ()),
                schedule=getattr(mode, "sampler", None),
            )
        )
        checker.start()
        return checker
    except Exception as e:
        with contextlib.suppress(Exception):
            ctx.note(f"numerics: compiled-region checker did not start ({type(e).__name__}: {e})")
        return None


def stop(checker: Any) -> dict[str, Any] | None:
    if checker is None:
        return None
    try:
        summary: dict[str, Any] = checker.stop()
        return summary
    except Exception as e:
        return {"errors": [f"stop: {type(e).__name__}: {e}"]}
