"""The gate: rules evaluated on a comparison, each giving pass, fail, inconclusive or skipped.

Rules live in ``[tool.tpudiag.check]`` of pyproject.toml::

    [tool.tpudiag.check]
    warmup_steps = 1
    alpha = 0.01
    [[tool.tpudiag.check.rules]]
    metric = "steps.steady"     # see METRICS
    direction = "lower"         # lower is better (the default); "higher" for throughput-like metrics
    max_ratio = 1.10            # allowed B/A
    floor = 0.00005             # absolute change (seconds) below which nothing fails

A rule of the file replaces the default rule of the same metric; ``enabled = false`` turns one off.  Exact
metrics (counts) take ``max`` (allowed count in B) or ``max_increase`` (allowed B − A).  A statistical rule fails
only when the change is significant *and* beyond both the ratio and the floor; beyond them but not significant
(too few samples, too noisy, a machine-wide shift) it is inconclusive — never a failure.

Timing rules (``TIMING``: step, op and compile times) measure work, so they are inconclusive when the runs did
different work — other input shapes, host against device times, steps found another way (the comparison's
``timing_problems``) — unless ``allow_mismatch``.  Count rules stay exact whatever the shapes: a recompile after
warm-up caused by a new sequence length is exactly what they are for.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpudiag.comparison import compile_diff, stats
from tpudiag.comparison.compare import location, where
from tpudiag.errors import UsageError

STATISTICAL = ("steps.steady", "steps.first", "ops.time")
COUNTS = (
    "numerics.new_divergent_ops",
    "numerics.divergent_ops",
    "numerics.error_growth",
    "compile.recompiles_after_warmup",
    "compile.recompiles",
    "compile.new_graph_breaks",
    "compile.graph_breaks",
    "compile.cache_misses",
    "compile.compiles",
)
RATIOS = ("compile.compile_time", "memory.peak")
METRICS = STATISTICAL + COUNTS + RATIOS
TIMING = STATISTICAL + RATIOS  # measure time, so need the same work on both sides; COUNTS do not
RULE_KEYS = {"metric", "direction", "max_ratio", "floor", "max", "max_increase", "enabled"}

DEFAULT_RULES: tuple[dict[str, Any], ...] = (
    {"metric": "numerics.new_divergent_ops", "max": 0},
    {"metric": "compile.recompiles_after_warmup", "max_increase": 0},
    {"metric": "compile.new_graph_breaks", "max": 0},
    {"metric": "steps.steady", "direction": "lower", "max_ratio": 1.10, "floor": 5e-5},
    {"metric": "memory.peak", "max_ratio": 1.10, "floor": 1 << 20},  # +10% peak (and 1 MiB), same shapes
)


@dataclass(frozen=True)
class Rule:
    metric: str
    direction: str = "lower"
    max_ratio: float | None = None
    floor: float = 0.0
    max: int | None = None
    max_increase: int | None = None

    def allowed(self) -> str:
        if self.max is not None:
            return f"at most {self.max}"
        if self.max_increase is not None:
            return f"at most {self.max_increase} more than the baseline"
        word = "slower" if self.direction == "lower" else "lower"
        return f"at most {((self.max_ratio or 1.0) - 1) * 100:.0f}% {word} (and {self.floor:g} absolute)"


@dataclass
class Config:
    rules: list[Rule]
    warmup_steps: int = 1
    alpha: float = 0.01
    source: str = "defaults"


@dataclass(frozen=True)
class Outcome:
    rule: Rule
    status: str  # "pass" | "fail" | "inconclusive" | "skipped"
    seen: str
    where: str | None = None
    file: str | None = None
    line: int | None = None
    details: list[str] = field(default_factory=list)

    @property
    def severity(self) -> str:
        return {"fail": "error", "inconclusive": "warning"}.get(self.status, "notice")

    @property
    def title(self) -> str:
        return f"{self.rule.metric} {self.status}"

    @property
    def reason(self) -> str | None:
        """Why an inconclusive rule could not decide (its first detail)."""
        return self.details[0] if self.status == "inconclusive" and self.details else None

    @property
    def message(self) -> str:
        text = f"{self.rule.metric}: allowed {self.rule.allowed()}, seen {self.seen}"
        if self.reason:
            return text + f" — inconclusive: {self.reason}"
        return text + (f" — {self.where}" if self.where else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.rule.metric,
            "status": self.status,
            "allowed": self.rule.allowed(),
            "seen": self.seen,
            "where": self.where,
            "file": self.file,
            "line": self.line,
            "reason": self.reason,
            "details": self.details,
        }


def _rule(raw: dict[str, Any], origin: str) -> Rule | None:
    unknown = set(raw) - RULE_KEYS
    if unknown:
        raise UsageError(
            f"{origin}: unknown rule key(s) {', '.join(sorted(unknown))} (known: {', '.join(sorted(RULE_KEYS))})"
        )
    metric = raw.get("metric")
    if metric not in METRICS:
        raise UsageError(f"{origin}: unknown metric {metric!r} (known: {', '.join(METRICS)})")
    if raw.get("direction", "lower") not in ("lower", "higher"):
        raise UsageError(f"{origin}: direction must be 'lower' or 'higher' (which way is better)")
    if raw.get("enabled", True) is False:
        return None
    try:
        rule = Rule(
            metric=metric,
            direction=raw.get("direction", "lower"),
            max_ratio=float(raw["max_ratio"]) if "max_ratio" in raw else None,
            floor=float(raw.get("floor", 0.0)),
            max=int(raw["max"]) if "max" in raw else None,
            max_increase=int(raw["max_increase"]) if "max_increase" in raw else None,
        )
    except (TypeError, ValueError) as err:
        raise UsageError(f"{origin}: rule for {metric}: {err}") from None
    if metric in COUNTS and rule.max is None and rule.max_increase is None:
        raise UsageError(f"{origin}: {metric} is a count: give max or max_increase")
    if metric not in COUNTS and rule.max_ratio is None:
        raise UsageError(f"{origin}: {metric} needs max_ratio")
    return rule


def load_config(path: Path | None) -> Config:
    """Defaults, overridden by ``[tool.tpudiag.check]`` of ``path`` (or ./pyproject.toml when it has one)."""
    explicit = path is not None
    path = path or Path("pyproject.toml")
    table: dict[str, Any] = {}
    if path.is_file():
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise UsageError(f"cannot read rules from {path}: {err}") from None
        table = data.get("tool", {}).get("tpudiag", {}).get("check", {})
    elif explicit:
        raise UsageError(f"--rules {path}: no such file")
    if explicit and not table:
        raise UsageError(f"{path} has no [tool.tpudiag.check] table")
    raw_rules = {r["metric"]: dict(r) for r in DEFAULT_RULES}
    for i, raw in enumerate(table.get("rules", [])):
        if not isinstance(raw, dict) or "metric" not in raw:
            raise UsageError(f"{path}: rule {i + 1} needs a metric")
        raw_rules[raw["metric"]] = dict(raw)
    rules = [r for m, raw in raw_rules.items() if (r := _rule(raw, str(path))) is not None and m]
    try:
        warmup = int(table.get("warmup_steps", 1))
        alpha = float(table.get("alpha", 0.01))
    except (TypeError, ValueError) as err:
        raise UsageError(f"{path}: {err}") from None
    return Config(rules, warmup, alpha, str(path) if table else "defaults")


# -- evaluation -------------------------------------------------------------------------------------------------
def evaluate(config: Config, result: dict[str, Any], has_baseline: bool, allow_mismatch: bool = False) -> list[Outcome]:
    """Every rule's outcomes.  When the runs did different work (``timing_problems`` of the comparison) timing
    rules are inconclusive with that reason, unless ``allow_mismatch``; count rules decide either way."""
    mismatch = ((result.get("comparable") or {}).get("timing_problems") or []) if has_baseline else []
    out: list[Outcome] = []
    for rule in config.rules:
        outcomes = _evaluate(rule, result, has_baseline)
        if rule.metric in TIMING and mismatch and not allow_mismatch:
            outcomes = _not_timed(rule, outcomes, mismatch)
        out.extend(outcomes)
    return out


def _not_timed(rule: Rule, outcomes: list[Outcome], mismatch: list[str]) -> list[Outcome]:
    """A timing rule on runs that did different work: what was measured, but inconclusive with the reason."""
    if all(o.status == "skipped" for o in outcomes):
        return outcomes
    if len(outcomes) == 1:
        seen = outcomes[0].seen
    else:  # ops.time: one outcome per op beyond the ratio
        seen = f"{len(outcomes)} ops beyond ×{rule.max_ratio}: " + "; ".join(o.where or "" for o in outcomes[:3])
    hint = "count rules still decide; --allow-mismatch times them anyway"
    return [Outcome(rule, "inconclusive", seen, details=[f"{mismatch[0]} ({hint})", *mismatch[1:]])]


def _evaluate(rule: Rule, result: dict[str, Any], has_baseline: bool) -> list[Outcome]:
    m = rule.metric
    if m.startswith("steps."):
        if not has_baseline:
            return [Outcome(rule, "skipped", "no baseline to time against")]
        return [_statistical(rule, (result["steps"] or {}).get(m.split(".")[1]), result)]
    if m == "ops.time":
        return _ops_time(rule, result, has_baseline)
    if m.startswith("numerics."):
        return [_numerics(rule, result)]
    if m.startswith("memory."):
        return [_memory(rule, result)]
    return [_compile(rule, result)]


def _bad_ratio(rule: Rule, a: float, b: float) -> tuple[bool, float | None]:
    ratio = b / a if a else None
    limit = rule.max_ratio or 1.0
    if rule.direction == "lower":
        return ratio is not None and ratio > limit and (b - a) > rule.floor, ratio
    return ratio is not None and ratio < 1 / limit and (a - b) > rule.floor, ratio


def _statistical(rule: Rule, d: dict[str, Any] | None, result: dict[str, Any]) -> Outcome:
    if not d or d["median_a"] is None or d["median_b"] is None:
        return Outcome(rule, "skipped", "no step times on one side")
    bad, ratio = _bad_ratio(rule, d["median_a"], d["median_b"])
    seen = (
        f"{d['median_a']:.6g} s -> {d['median_b']:.6g} s (×{ratio:.3f}, p={d['p_value']:.2g}, "
        f"n={stats.sample_count(d)}, {d['verdict']})"
        if ratio is not None
        else f"median A is 0 ({d['verdict']})"
    )
    if not bad:
        return Outcome(rule, "pass", seen)
    wanted = "slower" if rule.direction == "lower" else "faster"
    shift = (result["ops"] or {}).get("uniform_shift")
    if d["verdict"] == wanted and shift:
        return Outcome(rule, "inconclusive", seen, details=[shift["notice"]])
    if d["verdict"] == wanted:
        return Outcome(rule, "fail", seen)
    if d["verdict"] == "too few samples" and d.get("blocks_a") is not None:
        why = (
            f"too few samples: steps are tested in blocks of at least {stats.BLOCK_S:g} s (the machine's speed "
            "drifts on that scale), and these runs fill too few; run more steady steps for a verdict"
        )
        return Outcome(rule, "inconclusive", seen, details=[why])
    return Outcome(rule, "inconclusive", seen, details=[f"the change is not significant ({d['verdict']})"])


def _ops_time(rule: Rule, result: dict[str, Any], has_baseline: bool) -> list[Outcome]:
    if not has_baseline:
        return [Outcome(rule, "skipped", "no baseline to time against")]
    ops = result["ops"] or {}
    bad = []
    for e in ops.get("entries", []):
        if e["category"] != ("slower" if rule.direction == "lower" else "faster"):
            continue
        hit, ratio = _bad_ratio(
            rule,
            e["per_step_s_a"] or 0.0,
            (e["per_step_s_b"] or 0.0) / (ops["uniform_shift"]["factor"] if ops.get("uniform_shift") else 1.0),
        )
        if hit:
            bad.append(
                Outcome(
                    rule,
                    "fail",
                    f"{e['per_step_s_a']:.6g} s -> {e['per_step_s_b']:.6g} s per step "
                    f"(×{ratio:.3f}, q={e['q_value']:.2g})",
                    where(e["op"], e["module"]),
                )
            )
    return bad or [Outcome(rule, "pass", f"no op beyond ×{rule.max_ratio}")]


def _count(rule: Rule, a: int, b: int) -> bool:
    if rule.max is not None and b > rule.max:
        return False
    return not (rule.max_increase is not None and b - a > rule.max_increase)


def _numerics(rule: Rule, result: dict[str, Any]) -> Outcome:
    num = result["numerics"]
    if num is None or (not num.get("comparable", False) and rule.metric != "numerics.divergent_ops"):
        return Outcome(rule, "skipped", "numerics not captured on both sides")
    changes = num["changes"]
    if rule.metric == "numerics.new_divergent_ops":
        items = [c for c in changes if c["change"] == "regression"]
        a, b = 0, len(items)
    elif rule.metric == "numerics.error_growth":
        items = [c for c in changes if c["change"] == "error growth"]
        a, b = 0, len(items)
    else:
        items = [c for c in changes if c["status_b"] == "fail"]
        a, b = int(num.get("divergent_ops_a", 0)), int(num.get("divergent_ops_b", 0))
    seen = f"{b}" + (f" (baseline {a})" if rule.max_increase is not None else "")
    if _count(rule, a, b):
        return Outcome(rule, "pass", seen)
    first = items[0] if items else {}
    file, line = location(first.get("source"))
    return Outcome(
        rule,
        "fail",
        seen,
        where(first["op"], first["module"], first["source"]) if first else None,
        file,
        line,
        [where(c["op"], c["module"], c["source"]) for c in items],
    )


def _memory(rule: Rule, result: dict[str, Any]) -> Outcome:
    mem = result.get("memory")
    if mem is None:
        return Outcome(rule, "skipped", "memory not recorded on both sides")
    seen = f"{mem['peak_a']} B -> {mem['peak_b']} B peak" + (f" (×{mem['ratio']:.3f})" if mem["ratio"] else "")
    if not mem["same_shapes"]:
        return Outcome(rule, "skipped", seen + "; the runs' input shapes differ")
    if not mem["comparable"]:
        return Outcome(
            rule, "skipped", seen + f"; peaks from different sources ({mem['source_a']} / {mem['source_b']})"
        )
    bad, _ratio = _bad_ratio(rule, mem["peak_a"], mem["peak_b"])
    return Outcome(rule, "fail" if bad else "pass", seen)


def _compile(rule: Rule, result: dict[str, Any]) -> Outcome:
    comp = result["compile"]
    if comp is None:
        return Outcome(rule, "skipped", "compilation not captured")
    key = rule.metric.split(".", 1)[1]
    if key == "compile_time":
        ct = comp["compile_time_s"]
        if not ct["a"] or ct["b"] is None:
            return Outcome(rule, "skipped", "no compile time on one side")
        bad, ratio = _bad_ratio(rule, ct["a"], ct["b"])
        return Outcome(rule, "fail" if bad else "pass", f"{ct['a']:.3g} s -> {ct['b']:.3g} s (×{ratio:.3f})")
    if key == "new_graph_breaks":
        sites = comp["new_graph_breaks"]
        if _count(rule, 0, len(sites)):
            return Outcome(rule, "pass", str(len(sites)))
        file, line = location(sites[0])
        return Outcome(rule, "fail", str(len(sites)), sites[0], file, line, list(sites))
    counts = comp[key]
    a, b = int(counts["a"] or 0), int(counts["b"] or 0)
    seen = f"{b} (baseline {a})"
    if _count(rule, a, b):
        return Outcome(rule, "pass", seen)
    if key == "recompiles_after_warmup":
        events = compile_diff.after_warmup({"recompile_events": comp["recompiles_after_warmup_b"]}, 0)
        first = events[0] if events else {}
        site = f"{first.get('function')} at {first.get('file')}:{first.get('line')}: {first.get('reason')}"
        details = [f"{e.get('function')} at {e.get('file')}:{e.get('line')}: {e.get('reason')}" for e in events]
        return Outcome(rule, "fail", seen, site if first else None, first.get("file"), first.get("line"), details)
    return Outcome(rule, "fail", seen)
