"""``tpudiag compare A B``: what changed between two runs — comparability, steps, ops, numerics, compilation.

A and B are run ids, unique names, id prefixes, or snapshot files (``tpudiag check --update-baseline`` writes
them).  The exit status is 0 unless ``--fail-on`` names sections whose regressions should fail (then 1); bad
input is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

from tpudiag.errors import TpudiagError, UsageError

FORMATS = ("table", "md", "github", "junit")
FAIL_ON = ("steps", "ops", "numerics", "compile", "any")


@contextlib.contextmanager
def usage_errors() -> Iterator[None]:
    """Every domain error of these commands exits 2 (1 and 3 mean 'regression' and 'inconclusive')."""
    try:
        yield
    except UsageError:
        raise
    except TpudiagError as err:
        raise UsageError(str(err)) from None


def _fail_on(text: str) -> set[str]:
    chosen = {s.strip() for s in text.split(",") if s.strip()}
    unknown = chosen - set(FAIL_ON)
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of {', '.join(FAIL_ON)}")
    return {"steps", "ops", "numerics", "compile"} if "any" in chosen else chosen


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", help="store path (default: $TPUDIAG_DB or ./tpudiag.duckdb)")
    p.add_argument("--warmup", type=int, default=1, metavar="N", help="steps left out as warm-up (default 1)")
    p.add_argument("--alpha", type=float, default=0.01, help="significance level of the rank tests (default 0.01)")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "compare",
        help="what changed between two runs: steps, ops, numerics, compilation (with statistics)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("a", metavar="A", help="baseline: run id, unique name, or snapshot file")
    p.add_argument("b", metavar="B", help="candidate: run id, unique name, or snapshot file")
    add_common(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--format", "-f", choices=FORMATS, default="table", help="output format (default table)")
    p.add_argument(
        "--fail-on",
        type=_fail_on,
        metavar="SECTIONS",
        help=f"exit 1 when these sections have regressions (comma-separated: {', '.join(FAIL_ON)})",
    )
    p.set_defaults(func=cmd_compare)


def check_numbers(args: argparse.Namespace) -> None:
    if args.warmup < 0:
        raise UsageError("--warmup must be 0 or more")
    if not 0 < args.alpha < 1:
        raise UsageError("--alpha must be between 0 and 1")


def cmd_compare(args: argparse.Namespace, rest: list[str]) -> int:
    from tpudiag.comparison import ci_output, render
    from tpudiag.comparison.compare import compare, findings, regressions
    from tpudiag.comparison.source import snapshot_of
    from tpudiag.store_access import open_store

    check_numbers(args)
    with usage_errors():
        store = open_store(args.db)
        a = snapshot_of(store, args.a)
        b = snapshot_of(store, args.b)
    result = compare(a, b, warmup=args.warmup, alpha=args.alpha)
    found = findings(result)
    if args.json:
        result["findings"] = [f.to_dict() for f in found]
        print(json.dumps(result, indent=2, default=str))
    elif args.format == "md":
        sys.stdout.write(render.render_markdown(result))
    elif args.format == "github":
        for line in ci_output.github_annotations(found):
            print(line)
        ci_output.write_step_summary(render.render_markdown(result))
    elif args.format == "junit":
        cases = [
            {
                "name": section,
                "classname": "tpudiag.compare",
                "status": "fail" if bad else "pass",
                "message": "; ".join(f.title for f in bad),
                "detail": "\n".join(f.message for f in bad),
            }
            for section in ("steps", "ops", "numerics", "compile")
            for bad in [[f for f in found if f.section == section and f.severity == "error"]]
        ]
        sys.stdout.write(ci_output.junit_xml("tpudiag compare", cases))
    else:
        sys.stdout.write(render.render_text(result))
    if args.fail_on:
        bad = regressions(result, args.fail_on)
        for f in bad:
            sys.stderr.write(f"tpudiag: regression: {f.message}\n")
        return 1 if bad else 0
    return 0
