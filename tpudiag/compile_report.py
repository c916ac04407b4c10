"""The report's ``compile`` section: what compiled, what hit the cache, what recompiled, why, at what cost.

``summarize`` is pure (CompileEvents in, the section dict out); ``build_section`` reads the store;
``render_section`` writes the text lines.  Section keys: compiles, recompiles, graph_breaks, cache_hits,
cache_misses, compile_time_s, recompile_reasons, by_frame, tpu_cache.  ``cache_hits``/``cache_misses`` count
the torch.compile caches (Inductor FX graph, AOTAutograd); the TorchTPU executable cache is in ``tpu_cache``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from tpudiag.model import CompileEvent
from tpudiag.store import Store, compile_queries
from tpudiag.store.compile_queries import TpuEagerSummary

COMPILE_KINDS = ("compile", "recompile")
TIMED_KINDS = ("compile", "recompile", "backward_compile")
MAX_REASONS = 50
MAX_FRAMES = 50
MAX_SHAPES = 20


def _unique(values: Iterable[str | None], limit: int = MAX_REASONS) -> list[str]:
    out: list[str] = []
    for v in values:
        if v and v not in out:
            out.append(v)
            if len(out) >= limit:
                break
    return out


def _tpu_cache(events: list[CompileEvent], eager: TpuEagerSummary | None) -> dict[str, Any] | None:
    stats = {e.reason: json.loads(e.payload) for e in events if e.kind == "tpu_stats" and e.payload}
    graphs = sum(1 for e in events if e.kind == "tpu_graph")
    if not stats and eager is None and not graphs:
        return None
    out: dict[str, Any] = {
        "requests": None,
        "hits": None,
        "misses": None,
        "compilations": None,
        "hit_rate": None,
    }
    end, start = stats.get("end"), stats.get("start") or {}
    if end is not None:

        def delta(name: str) -> int | None:
            if name not in end:
                return None
            return int(end[name]) - int(start.get(name, 0))

        out.update(
            source="torch.tpu._get_cache_stats",
            requests=delta("num_cache_reqs"),
            hits=delta("num_cache_hits"),
            compilations=delta("num_compilations"),
            entries=end.get("num_entries"),
            peak_compilation_host_memory_bytes=end.get("peak_compilation_host_memory_bytes"),
        )
        if out["requests"] is not None and out["hits"] is not None:
            out["misses"] = out["requests"] - out["hits"]
    elif eager is not None:
        out.update(
            source="eager events",
            requests=eager.events,
            hits=eager.hits,
            misses=eager.misses,
            compilations=eager.misses,
        )
    if out["requests"]:
        out["hit_rate"] = round(out["hits"] / out["requests"], 4) if out["hits"] is not None else None
    out["graphs"] = graphs
    if eager is not None:
        out["eager"] = {
            "events": eager.events,
            "hits": eager.hits,
            "misses": eager.misses,
            "compile_failed": eager.failed,
            "time_s": round(eager.duration_s, 6),
            "reasons": eager.reasons,
            "top_ops": eager.top_ops,
        }
    return out


def summarize(events: list[CompileEvent], tpu_eager: TpuEagerSummary | None = None) -> dict[str, Any]:
    """The compile section from a run's events (``tpu_eager`` events aggregated separately, see the store)."""
    compiles = [e for e in events if e.kind in COMPILE_KINDS]
    recompiles = [e for e in events if e.kind == "recompile"]
    cache = [e for e in events if e.kind == "cache"]
    frame_of: dict[tuple[int, str | None], tuple[Any, ...]] = {}
    frames: dict[tuple[Any, ...], dict[str, Any]] = {}
    for e in events:
        if e.kind not in TIMED_KINDS:
            continue
        key = (e.function, e.file, e.line)
        if e.kind in COMPILE_KINDS:
            frame_of[(e.rank, e.compile_id)] = key
        f = frames.setdefault(
            key,
            {
                "function": e.function,
                "file": e.file,
                "line": e.line,
                "compiles": 0,
                "recompiles": 0,
                "compile_time_s": 0.0,
                "reasons": [],
                "shapes": [],
                "graph_breaks": [],
            },
        )
        f["compiles"] += e.kind in COMPILE_KINDS
        f["recompiles"] += e.kind == "recompile"
        f["compile_time_s"] += e.duration_s or 0.0
        reason = e.reason if e.kind == "recompile" and not e.failed else (f"failed: {e.reason}" if e.failed else None)
        if reason and reason not in f["reasons"] and len(f["reasons"]) < MAX_REASONS:
            f["reasons"].append(reason)
        if e.shapes and e.kind in COMPILE_KINDS:
            shapes = json.loads(e.shapes)
            if shapes not in f["shapes"] and len(f["shapes"]) < MAX_SHAPES:
                f["shapes"].append(shapes)
    for e in events:
        if e.kind == "graph_break":
            owner = frame_of.get((e.rank, e.compile_id))
            site = f"{e.file}:{e.line}: {e.reason}"
            if owner in frames and site not in frames[owner]["graph_breaks"]:
                frames[owner]["graph_breaks"].append(site)
    by_frame = sorted(frames.values(), key=lambda f: (-f["recompiles"], -f["compile_time_s"], str(f["function"])))
    for f in by_frame:
        f["compile_time_s"] = round(f["compile_time_s"], 6)
    return {
        "compiles": len(compiles),
        "recompiles": len(recompiles),
        "graph_breaks": sum(1 for e in events if e.kind == "graph_break"),
        "cache_hits": sum(1 for e in cache if e.cache_hit is True),
        "cache_misses": sum(1 for e in cache if e.cache_hit is False),
        "compile_time_s": round(sum(e.duration_s or 0.0 for e in events if e.kind in TIMED_KINDS), 6),
        "recompile_reasons": _unique(e.reason for e in recompiles if not e.failed),
        "by_frame": by_frame[:MAX_FRAMES],
        "tpu_cache": _tpu_cache(events, tpu_eager),
    }


def build_section(store: Store, run: dict[str, Any]) -> dict[str, Any] | None:
    """None when the run has no compile data at all (no compile collector, nothing imported)."""
    counts = compile_queries.count_by_kind(store, run["id"])
    if not counts and "compile" not in (run.get("collectors") or []):
        return None
    events = compile_queries.compile_events(store, run["id"])
    eager = compile_queries.tpu_eager_summary(store, run["id"]) if counts.get("tpu_eager") else None
    return summarize(events, eager)


# -- text ----------------------------------------------------------------------------------------------------
def _where(f: dict[str, Any]) -> str:
    return f"{f['function']} ({f['file']}:{f['line']})" if f.get("file") else str(f.get("function"))


def _changing_shapes(shapes: list[dict[str, Any]]) -> list[str]:
    """``x: [4] -> [8] -> [s0]`` for each input whose shape differs between compilations."""
    names: list[str] = []
    for s in shapes:
        names += [n for n in s if n not in names]
    out = []
    for name in names:
        seen = _unique((json.dumps(s[name]) for s in shapes if name in s), limit=8)
        if len(seen) > 1:
            out.append(f"{name}: {' -> '.join(seen)}")
    return out


def render_section(section: dict[str, Any]) -> list[str]:
    s = section
    if (
        not s["compiles"]
        and not s["graph_breaks"]
        and not s["cache_hits"]
        and not s["cache_misses"]
        and not s.get("tpu_cache")
    ):
        return ["compile: nothing was compiled in this run (no torch.compile frame, no TorchTPU compilation)"]
    lines = [
        f"compile: {s['compiles']} compilation(s), {s['recompiles']} recompile(s), "
        f"{s['compile_time_s']:.2f} s compiling; {s['graph_breaks']} graph break(s); "
        f"torch.compile caches {s['cache_hits']} hit(s) / {s['cache_misses']} miss(es)"
    ]
    recompiling = [f for f in s["by_frame"] if f["recompiles"]]
    if recompiling:
        lines.append("  frames that recompile most:")
        for f in recompiling[:10]:
            lines.append(
                f"    {_where(f)}: {f['compiles']} compilations ({f['recompiles']} recompiles), "
                f"{f['compile_time_s']:.2f} s"
            )
            lines += [f"      reason: {r}" for r in f["reasons"][:5]]
            lines += [f"      shapes: {c}" for c in _changing_shapes(f.get("shapes") or [])]
    elif s["by_frame"]:
        top = s["by_frame"][0]
        lines.append(f"  no recompiles; longest compile: {_where(top)} {top['compile_time_s']:.2f} s")
    breaks = [(f, site) for f in s["by_frame"] for site in f.get("graph_breaks") or []]
    if breaks:
        lines.append("  graph breaks:")
        lines += [f"    {site.splitlines()[0][:200]}" for _, site in breaks[:10]]
    failed = [(f, r) for f in s["by_frame"] for r in f["reasons"] if r.startswith("failed: ")]
    for f, reason in failed[:5]:
        lines.append(f"  compile failed in {_where(f)}: {reason.removeprefix('failed: ')[:200]}")
    tpu = s.get("tpu_cache")
    if tpu:
        lines.append(
            f"  TorchTPU executable cache: {tpu['requests']} request(s), {tpu['hits']} hit(s), "
            f"{tpu['compilations']} compilation(s)"
            + (f", hit rate {tpu['hit_rate']:.1%}" if tpu.get("hit_rate") is not None else "")
        )
        eager = tpu.get("eager")
        if eager:
            reasons = ", ".join(f"{k} x{v}" for k, v in list(eager["reasons"].items())[:5])
            lines.append(
                f"    eager batches: {eager['events']} ({eager['misses']} compiled, "
                f"{eager['compile_failed']} failed); materialised by: {reasons}"
            )
            for op in eager["top_ops"][:5]:
                if op["misses"]:
                    lines.append(f"    {op['op']}: {op['misses']} compilation(s) of {op['events']}")
        if tpu.get("graphs"):
            lines.append(f"    torch.compile(backend='tpu') graphs: {tpu['graphs']}")
    return lines
