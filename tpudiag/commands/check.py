"""``tpudiag check RUN [--baseline RUN|FILE]``: the CI gate.

Exit status: 0 every rule passed, 1 a rule failed (each failure printed with what was allowed, what was seen and
where), 2 usage or environment error, 3 inconclusive (a rule could not decide: too noisy, too few samples, a
machine-wide shift).  Without a baseline the run is held against an ideal one: no divergent op, no recompile
after warm-up, no graph break (timing rules need a baseline and are skipped).  ``--update-baseline`` writes the
run's snapshot (a small JSON file to commit) to the ``--baseline`` path or the path given.

When the runs did different work only in what timing measures (other input shapes — variable sequence lengths —,
host against device times, steps found another way) the timing rules are inconclusive, with that reason, and the
count rules still decide: a new recompile after warm-up fails.  ``--allow-mismatch`` times them anyway.  Another
script or other arguments, or a run that did not end ok, make the runs not comparable at all: exit 2 unless
``--allow-mismatch``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tpudiag.commands.compare import add_common, check_numbers, usage_errors
from tpudiag.errors import UsageError

FORMATS = ("text", "md", "github", "junit")
EXIT = {"fail": 1, "inconclusive": 3}


def register(sub: Any) -> None:
    p = sub.add_parser(
        "check",
        help="gate a run in CI against a baseline run or file (exit 0 pass, 1 fail, 2 error, 3 inconclusive)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run", metavar="RUN", help="run id, unique name, or snapshot file")
    p.add_argument("--baseline", metavar="RUN|FILE", help="baseline run or snapshot file (default: none)")
    p.add_argument("--rules", metavar="TOML", help="file with [tool.tpudiag.check] (default: ./pyproject.toml)")
    p.add_argument(
        "--update-baseline",
        nargs="?",
        const="",
        metavar="FILE",
        help="write RUN's snapshot as the new baseline file (default: the --baseline file)",
    )
    p.add_argument(
        "--allow-mismatch",
        action="store_true",
        help="gate even when the runs are not comparable (and apply timing rules when their input shapes differ)",
    )
    add_common(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--format", "-f", choices=FORMATS, default="text", help="output format (default text)")
    p.add_argument("--junit", metavar="FILE", help="also write JUnit XML to FILE")
    p.set_defaults(func=cmd_check, warmup=None, alpha=None)


def _line(o: Any) -> str:
    text = f"{o.status.upper():<12} {o.message}"
    for d in o.details[1:] if o.status in ("fail", "inconclusive") else o.details:
        text += f"\n             {d}"
    return text


def cmd_check(args: argparse.Namespace, rest: list[str]) -> int:
    from tpudiag.comparison import ci_output, render, rules, snapshot
    from tpudiag.comparison.compare import compare
    from tpudiag.comparison.snapshot import Snapshot
    from tpudiag.comparison.source import looks_like_file, snapshot_of
    from tpudiag.store_access import open_store

    config = rules.load_config(Path(args.rules) if args.rules else None)
    if args.warmup is not None:
        config.warmup_steps = args.warmup
    if args.alpha is not None:
        config.alpha = args.alpha
    args.warmup, args.alpha = config.warmup_steps, config.alpha
    check_numbers(args)
    update_to: Path | None = None
    if args.update_baseline is not None:
        target = args.update_baseline or args.baseline
        if not target or (not looks_like_file(target) and not target.endswith(".json")):
            raise UsageError("--update-baseline needs a file: --baseline FILE.json or --update-baseline FILE.json")
        update_to = Path(target)
    with usage_errors():
        store = open_store(args.db)
        run = snapshot_of(store, args.run)
        base: Snapshot | None = None
        if args.baseline and not (
            update_to is not None and Path(args.baseline) == update_to and not update_to.exists()
        ):
            base = snapshot_of(store, args.baseline)
    has_baseline = base is not None
    if base is None:  # the ideal run: nothing diverges, nothing recompiles, no graph break
        base = Snapshot(
            run={"id": None, "name": "(no baseline)"},
            numerics=[] if run.numerics is not None else None,
            compile={} if run.compile is not None else None,
        )
    result = compare(base, run, warmup=config.warmup_steps, alpha=config.alpha)
    comparable = result["comparable"]
    timing_only: list[str] = comparable.get("timing_problems", []) if has_baseline else []
    problems = [p for p in comparable["problems"] if p not in timing_only] if has_baseline else []
    if problems and not args.allow_mismatch:
        raise UsageError(f"runs not comparable: {problems[0]} (pass --allow-mismatch to gate anyway)")
    outcomes = rules.evaluate(config, result, has_baseline, allow_mismatch=args.allow_mismatch)
    statuses = {o.status for o in outcomes}
    code = 1 if "fail" in statuses else 3 if "inconclusive" in statuses else 0
    verdict = {0: "passed", 1: "FAILED", 3: "INCONCLUSIVE"}[code]
    counts = ", ".join(
        f"{sum(o.status == s for o in outcomes)} {s}" for s in ("fail", "inconclusive", "pass", "skipped")
    )
    summary = f"tpudiag check {run.label}: {verdict} ({counts}; rules: {config.source})"
    cases = [
        {
            "name": o.rule.metric + (f" [{o.where}]" if o.where and o.status == "fail" else ""),
            "classname": "tpudiag.check",
            "status": o.status,
            "message": o.message,
            "detail": "\n".join([o.message, *o.details]),
        }
        for o in outcomes
    ]
    markdown = _markdown(summary, outcomes) + ("\n" + render.render_markdown(result) if has_baseline else "")
    if args.json:
        print(
            json.dumps(
                {
                    "exit_code": code,
                    "verdict": verdict.lower(),
                    "outcomes": [o.to_dict() for o in outcomes],
                    "timing_not_comparable": [] if args.allow_mismatch else timing_only,
                    "comparison": result,
                },
                indent=2,
                default=str,
            )
        )
    elif args.format == "md":
        sys.stdout.write(markdown)
    elif args.format == "github":
        order = {"fail": 0, "inconclusive": 1}
        noteworthy = sorted((o for o in outcomes if o.status in order), key=lambda o: order[o.status])
        for line in ci_output.github_annotations(noteworthy):
            print(line)
        print(summary)
        ci_output.write_step_summary(markdown)
    elif args.format == "junit":
        sys.stdout.write(ci_output.junit_xml("tpudiag check", cases))
    else:
        for o in outcomes:
            print(_line(o))
        print(summary)
    if args.junit:
        try:
            Path(args.junit).write_text(ci_output.junit_xml("tpudiag check", cases))
        except OSError as err:
            raise UsageError(f"cannot write --junit {args.junit}: {err.strerror or err}") from None
    if update_to is not None:
        snapshot.save(run, update_to)
        sys.stderr.write(f"tpudiag: wrote baseline {update_to} (commit it)\n")
    return code


def _markdown(summary: str, outcomes: list[Any]) -> str:
    lines = ["## tpudiag check", "", summary, ""]
    undecided = [o for o in outcomes if o.status == "inconclusive"]
    if undecided:
        lines += [f"**Inconclusive**: {o.rule.metric}: {o.reason}" for o in undecided] + [""]
    lines += ["| status | rule | allowed | seen | where / why |", "|---|---|---|---|---|"]
    for o in outcomes:
        cells = [o.status, o.rule.metric, o.rule.allowed(), o.seen, o.where or o.reason or ""]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"
