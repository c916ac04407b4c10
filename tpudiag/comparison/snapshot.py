"""A run reduced to what a comparison needs; the same object is the baseline file kept in git.

A snapshot holds the run's fingerprint, its per-step times, per-step self time of its top ops, numerics per op
and the compile summary: a few hundred kilobytes at most, whatever the size of the store.  ``tpudiag compare``
and ``check`` accept a snapshot file wherever they accept a run.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tpudiag.errors import UsageError

FORMAT = "tpudiag-snapshot"
VERSION = 1
MAX_OPS = 300
MAX_STEP_SAMPLES = 500
RUN_FIELDS = (
    "id",
    "name",
    "status",
    "exit_code",
    "started_at",
    "script",
    "argv",
    "host",
    "python_version",
    "torch_version",
    "tpudiag_version",
    "device_kind",
    "device_name",
    "precision",
    "env",
    "git_commit",
    "collectors",
)


@dataclass
class Snapshot:
    run: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)  # {step, dur_ns, kind, input_shapes}, time order
    checker_steps: list[int] = field(default_factory=list)  # steps timed while the numerics checker worked
    time_source: str | None = None  # "host" | "device" | None (no op events)
    op_events: int = 0
    op_self_ns: int = 0
    ops: list[dict[str, Any]] = field(default_factory=list)  # {name, module, calls, self_ns, shapes, per_step}
    numerics: list[dict[str, Any]] | None = None  # per (op, module); None: numerics not captured
    compile: dict[str, Any] | None = None  # compile_report.summarize + after-warm-up counts; None: not captured
    memory: dict[str, Any] | None = None  # memory_diff.memory_summary; None: no memory recorded (older snapshots)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, **asdict(self)}

    @property
    def label(self) -> str:
        return str(self.run.get("name") or self.run.get("id"))


def from_json(data: Any, origin: str) -> Snapshot:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UsageError(f"{origin} is not a tpudiag snapshot (write one with tpudiag check RUN --update-baseline)")
    if data.get("version") != VERSION:
        raise UsageError(f"{origin} is snapshot version {data.get('version')}; this tpudiag reads version {VERSION}")
    try:
        return Snapshot(**{k: v for k, v in data.items() if k not in ("format", "version")})
    except TypeError as err:
        raise UsageError(f"{origin} is a damaged snapshot: {err}") from None


def load(path: Path) -> Snapshot:
    try:
        text = path.read_text()
    except OSError as err:
        raise UsageError(f"cannot read {path}: {err.strerror or err}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise UsageError(f"{path} is not JSON ({err.msg} at line {err.lineno})") from None
    return from_json(data, str(path))


def save(snap: Snapshot, path: Path) -> None:
    """Write atomically: a crash never leaves half a baseline in git."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(snap.to_json(), indent=1, sort_keys=True, default=str) + "\n")
        tmp.replace(path)
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror or err}") from None


def build(
    run: dict[str, Any],
    material: dict[str, Any],
    compile_section: dict[str, Any] | None,
    memory: dict[str, Any] | None = None,
) -> Snapshot:
    """A snapshot from a run row, its ``compare_queries.run_material`` and its compile summary."""
    steps = [
        {"step": int(s["step"]), "dur_ns": int(s["dur_ns"]), "kind": s["kind"], "input_shapes": s["input_shapes"]}
        for s in material["steps"]
    ]
    keep = {s["step"] for s in steps[-MAX_STEP_SAMPLES:]}
    ops = []
    for o in material["ops"]:
        per_step = [[int(st), int(ns)] for st, ns in (o["per_step"] or []) if int(st) in keep]
        ops.append(
            {
                "name": o["name"],
                "module": o["module"],
                "calls": int(o["calls"]),
                "self_ns": int(o["self_ns"]),
                "shapes": list(o["shapes"] or []),
                "per_step": per_step,
            }
        )
    numerics = None
    if material["has_numerics"]:
        numerics = [
            {
                "op": n["op"],
                "module": n["module"],
                "checked": int(n["checked"]),
                "divergent": int(n["divergent"]),
                "expected_precision": int(n["expected_precision"]),
                "max_scaled_error": float(n["max_scaled_error"]) if n["max_scaled_error"] is not None else None,
                "first_seq": n["first_seq"],
                "first_source": n["first_source"],
                "first_phase": n["first_phase"],
                "seq": int(n["seq"]),
            }
            for n in material["numerics"]
        ]
    return Snapshot(
        run={k: run.get(k) for k in RUN_FIELDS},
        steps=steps,
        checker_steps=list(material["checker_steps"]),
        time_source=material["time_source"],
        op_events=material["op_events"],
        op_self_ns=material["op_self_ns"],
        ops=ops,
        numerics=numerics,
        compile=compile_section,
        memory=memory,
    )
