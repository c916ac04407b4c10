"""Two snapshots compared, in the order a reader needs: comparability, steps, ops, numerics, compilation.

``compare`` is pure (two snapshots in, one JSON-ready dict out, inputs untouched); ``findings`` turns the result
into the list of things that changed, most severe first, which every output format (text, markdown, GitHub
annotations, JUnit) and ``--fail-on`` read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tpudiag.comparison import stats
from tpudiag.comparison.compile_diff import compare_compile
from tpudiag.comparison.fingerprint import comparability
from tpudiag.comparison.memory_diff import compare_memory
from tpudiag.comparison.numerics_diff import compare_numerics
from tpudiag.comparison.ops_diff import FACTOR, compare_ops
from tpudiag.comparison.snapshot import Snapshot
from tpudiag.comparison.steps_diff import WARMUP_STEPS, compare_steps

SECTIONS = ("steps", "ops", "numerics", "compile", "memory")
_SOURCE = re.compile(r"^(?P<file>.+?):(?P<line>\d+)")


def compare(
    a: Snapshot, b: Snapshot, warmup: int = WARMUP_STEPS, alpha: float = stats.ALPHA, factor: float = FACTOR
) -> dict[str, Any]:
    return {
        "a": {"id": a.run.get("id"), "name": a.run.get("name")},
        "b": {"id": b.run.get("id"), "name": b.run.get("name")},
        "comparable": comparability(a, b),
        "steps": compare_steps(a, b, warmup, alpha),
        "ops": compare_ops(a, b, warmup, alpha, factor),
        "numerics": compare_numerics(a, b),
        "compile": compare_compile(a, b, warmup),
        "memory": compare_memory(a, b),
    }


@dataclass(frozen=True)
class Finding:
    """One thing worth a line in CI: ``severity`` error (regression) | warning | notice (improvement, info)."""

    section: str
    severity: str
    title: str
    message: str
    file: str | None = None
    line: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("section", "severity", "title", "message", "file", "line")}


def location(source: str | None) -> tuple[str | None, int | None]:
    """``path:line`` (as the numerics collector records source lines) -> (path, line)."""
    m = _SOURCE.match(source or "")
    return (m["file"], int(m["line"])) if m else (None, None)


def where(op: str, module: str | None, source: str | None = None) -> str:
    parts = [op, f"in {module}" if module else None, f"at {source}" if source else None]
    return " ".join(p for p in parts if p)


def _pct(ratio: float | None) -> str:
    return f"{(ratio - 1) * 100:+.1f}%" if ratio is not None else "?"


def findings(result: dict[str, Any]) -> list[Finding]:
    out: list[Finding] = []
    comp = result["comparable"]
    timing = set(comp.get("timing_problems", []))
    for p in comp["problems"]:
        out.append(Finding("comparable", "warning", "not comparable" + (" for timing" if p in timing else ""), p))
    steady = (result["steps"] or {}).get("steady")
    if steady and steady["verdict"] in ("slower", "faster"):
        sev = "error" if steady["verdict"] == "slower" else "notice"
        out.append(
            Finding(
                "steps",
                sev,
                f"steady step {steady['verdict']}",
                f"steady step median {steady['median_a']:.6g} s -> {steady['median_b']:.6g} s "
                f"({_pct(steady['ratio'])}, p={steady['p_value']:.2g}, n={stats.sample_count(steady)})",
            )
        )
    ops = result["ops"]
    if ops.get("uniform_shift"):
        out.append(Finding("ops", "warning", "uniform shift", ops["uniform_shift"]["notice"]))
    for e in ops.get("entries", []):
        if e["category"] in ("slower", "faster"):
            out.append(
                Finding(
                    "ops",
                    "error" if e["category"] == "slower" else "notice",
                    f"{e['op']} {e['category']}",
                    f"{where(e['op'], e['module'])}: {e['per_step_s_a'] * 1e3:.4g} -> {e['per_step_s_b'] * 1e3:.4g} "
                    f"ms per step ({_pct(e['ratio'])}, {e['impact'] * 100:+.1f}% of step time, q={e['q_value']:.2g})",
                )
            )
    num = result["numerics"] or {}
    for c in num.get("changes", []):
        file, line = location(c["source"])
        sev = {"regression": "error", "error growth": "warning", "still failing": "warning"}.get(c["change"], "notice")
        out.append(
            Finding(
                "numerics",
                sev,
                f"{c['op']} numerics {c['change']}",
                f"{where(c['op'], c['module'], c['source'])}: {c['status_a'] or 'not checked'} -> "
                f"{c['status_b'] or 'not checked'}, max scaled error {_num(c['max_scaled_error_a'])} -> "
                f"{_num(c['max_scaled_error_b'])}",
                file,
                line,
            )
        )
    comp_s = result["compile"] or {}
    if comp_s.get("recompiles_after_warmup", {}).get("delta", 0) > 0:
        reasons = "; ".join(str(e.get("reason")) for e in comp_s["recompiles_after_warmup_b"][:3])
        first = comp_s["recompiles_after_warmup_b"][0] if comp_s["recompiles_after_warmup_b"] else {}
        out.append(
            Finding(
                "compile",
                "error",
                "recompile after warm-up",
                f"{comp_s['recompiles_after_warmup']['a']} -> {comp_s['recompiles_after_warmup']['b']} recompiles "
                f"after warm-up ({reasons})",
                first.get("file"),
                first.get("line"),
            )
        )
    for site in comp_s.get("new_graph_breaks", []):
        file, line = location(site)
        out.append(Finding("compile", "error", "new graph break", site, file, line))
    mem = result.get("memory")
    if mem and mem["comparable"] and mem["ratio"] and mem["ratio"] > 1.10:
        out.append(
            Finding("memory", "error", "peak memory grew",
                    f"peak {mem['peak_a']} B -> {mem['peak_b']} B ({_pct(mem['ratio'])}) with the same input shapes")
        )  # fmt: skip
    order = {"error": 0, "warning": 1, "notice": 2}
    return sorted(out, key=lambda f: order[f.severity])


def _num(v: float | None) -> str:
    return "–" if v is None else f"{v:.3g}"


def regressions(result: dict[str, Any], sections: set[str]) -> list[Finding]:
    """The error findings of the chosen sections (``--fail-on``)."""
    return [f for f in findings(result) if f.severity == "error" and f.section in sections]
