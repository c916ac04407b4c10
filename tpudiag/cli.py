"""The ``tpudiag`` command line: one small function per subcommand, domain errors as one clear line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import tpudiag
from tpudiag.errors import TpudiagError, UsageError

CAPTURE_VALUE_OPTIONS = {
    "--db", "--name", "--collect", "--numerics", "--budget", "--ops", "--modules", "--run-id",
    "--trace", "--trace-schedule", "--max-disk",
    "--remote", "--trace-ranks", "--numerics-ranks",
}  # fmt: skip
CAPTURE_FLAG_OPTIONS = {"--with-stack", "--wait", "-h", "--help"}


def _add_db(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", help="store path (default: $TPUDIAG_DB or ./tpudiag.duckdb)")


def _numerics_mode(text: str) -> str:
    from tpudiag.numerics_options import numerics_mode

    try:
        numerics_mode(text)
    except UsageError as err:  # argparse adds "argument --numerics:"
        raise argparse.ArgumentTypeError(str(err).removeprefix("--numerics ")) from None
    return text.strip().lower()


def _percent(text: str) -> float:
    from tpudiag.numerics_options import budget_percent

    try:
        return budget_percent(text)
    except UsageError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--budget ")) from None


def _trace_schedule(text: str) -> str:
    from tpudiag.longrun.schedule import parse

    try:
        parse(text)
    except UsageError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--trace-schedule ")) from None
    return text


def _size(text: str) -> str:
    from tpudiag.longrun.analyst import parse_size

    try:
        parse_size(text)
    except UsageError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--max-disk ")) from None
    return text


def _split_capture_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split ``capture`` arguments into tpudiag's options and the target (script or -m module) with its args.

    Everything from the script name on belongs to the script, as with ``python [opts] script.py args``.
    """
    own: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return own, list(argv[i:])
        if arg == "--":
            return own, list(argv[i + 1 :])
        name = arg.split("=", 1)[0]
        if name in CAPTURE_VALUE_OPTIONS:
            own.append(arg)
            if "=" not in arg and i + 1 < len(argv):
                own.append(argv[i + 1])
                i += 1
        elif name in CAPTURE_FLAG_OPTIONS or (arg.startswith("-") and arg != "-"):
            own.append(arg)
        else:
            return own, list(argv[i:])
        i += 1
    return own, []


def cmd_capture(args: argparse.Namespace, rest: list[str]) -> int:
    from tpudiag.runner import Target, signals_to_main_thread

    with signals_to_main_thread():  # numpy's and Arrow's worker threads start at import
        from tpudiag.capture_options import CaptureOptions
        from tpudiag.script_capture import run_capture_cli
        from tpudiag.store import resolve_db_path

    if not rest:
        raise UsageError("capture needs a script or -m module (tpudiag capture [options] script.py [args...])")
    if rest[0] == "-m":
        if len(rest) < 2:
            raise UsageError("-m needs a module name")
        target = Target("module", rest[1], tuple(rest[2:]))
    else:
        target = Target("script", rest[0], tuple(rest[1:]))
    collect = None
    if args.collect:
        collect = [c.strip() for c in args.collect.split(",") if c.strip()]
        if not collect:
            raise UsageError("--collect needs at least one collector name (or 'none')")
        if collect == ["none"]:
            collect = []
    collector_options: dict[str, Any] = {"with_stack": args.with_stack}
    if args.profile_memory:
        collector_options["profile_memory"] = True
    if args.memory_dispatch:
        collector_options["memory_dispatch"] = True
    for key in (
        "numerics",
        "budget",
        "ops",
        "modules",
        "trace_ranks",
        "numerics_ranks",
        "trace",
        "trace_schedule",
        "max_disk",
    ):
        value = getattr(args, key, None)
        if value is not None:
            collector_options[key] = value
    for key in ("trace_ranks", "numerics_ranks"):
        if collector_options.get(key) is not None:  # a bad rank list fails here, before any rank starts
            from tpudiag.distributed.selection import parse as parse_ranks

            parse_ranks(collector_options[key], "--" + key.replace("_", "-"))
    options = CaptureOptions(
        db=resolve_db_path(args.db), name=args.name, collect=collect, collector_options=collector_options,
        run_id=args.run_id, remote=args.remote,
    )  # fmt: skip
    if args.wait:
        options.wait = True
    return run_capture_cli(target, options)


def cmd_runs(args: argparse.Namespace, rest: list[str]) -> int:
    from tpudiag.report import run_summary
    from tpudiag.report import table as text_table
    from tpudiag.store import queries
    from tpudiag.store_access import open_store

    store = open_store(args.db)
    store.recover_stale_runs()
    runs = queries.list_runs(store)
    left = _not_uploaded(runs)
    if args.json:
        print(json.dumps([run_summary(r) | left.get(r["id"], {}) for r in runs], indent=2, default=str))
        return 0
    if not runs:
        print(f"no runs in {store.path} yet: tpudiag capture script.py")
        return 0
    rows = [
        [
            r["id"],
            r["name"],
            r["status"],
            str(r["exit_code"]),
            r["device_kind"] or "-",
            f"{r['duration_s']:.2f}" if r["duration_s"] is not None else "-",
            r["script"] or "-",
        ]
        for r in runs
    ]
    print("\n".join(text_table(["id", "name", "status", "exit", "device", "dur (s)", "script"], rows, {3, 5})))
    for rid, info in left.items():
        n = len(info["not_uploaded"]["files"])
        print(f"run {rid}: {n} file(s) not uploaded to {info['not_uploaded']['url']} (retry: tpudiag upload {rid})")
    return 0


def _not_uploaded(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Runs whose ``--remote`` upload gave up, with what is left (only when the run folder has an upload)."""
    from pathlib import Path

    found: dict[str, dict[str, Any]] = {}
    for r in runs:
        folder = Path(r["artifacts_dir"]) / "upload" if r.get("artifacts_dir") else None
        if folder is None or not folder.is_dir():
            continue
        from tpudiag.remote import pending

        left = pending(folder.parent)
        if left:
            found[r["id"]] = {"not_uploaded": left}
    return found


def cmd_report(args: argparse.Namespace, rest: list[str]) -> int:
    if args.remote:  # read in place from the bucket: no store involved
        from tpudiag.remote.location import parse
        from tpudiag.remote.reader import remote_report, render

        data = remote_report(parse(args.remote), args.run)
        if args.json:
            print(json.dumps(data, indent=2, default=str))
        else:
            sys.stdout.write(render(data))
        return 0
    from tpudiag import report
    from tpudiag.store import queries
    from tpudiag.store_access import open_store

    store = open_store(args.db)
    store.recover_stale_runs()
    run = queries.resolve_run(store, args.run)
    data = report.build(store, run, top=args.top)
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        sys.stdout.write(report.render_text(data))
    return 0


Command = Callable[[argparse.Namespace, list[str]], int]


def build_parser(extra_commands: bool = True) -> argparse.ArgumentParser:
    """The command line; ``extra_commands`` false leaves out the subcommands that live in their own modules (a
    capture needs none of them, and importing them costs ~0.15 s before the script starts)."""
    parser = argparse.ArgumentParser(
        prog="tpudiag",
        description="Which ops are slow, which ops give different numbers than a CPU reference, and what "
        "recompiles. Runs land in a DuckDB store.",
    )
    parser.add_argument("--version", action="version", version=f"tpudiag {tpudiag.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "capture",
        help="run a script (or -m module) as python would, with collectors hooked in",
        usage="tpudiag capture [options] (script.py | -m module) [args...]",
    )
    _add_db(p)
    p.add_argument("--name", help="name of the run (default: the script's name)")
    p.add_argument("--collect", help="comma-separated collectors, or none (default: every available one)")
    p.add_argument("--with-stack", action="store_true", help="record Python stacks in the trace (slower)")
    p.add_argument(
        "--profile-memory",
        action="store_true",
        help="record the allocator's events in the trace: live bytes over time, what was live at the peak by "
        "module and op, the largest allocations (slower; the memory collector's per-step figures need no flag)",
    )
    p.add_argument(
        "--memory-dispatch",
        action="store_true",
        help="memory collector: count live tensor bytes at dispatch, by module and op (where the profiler records "
        "no device memory events, e.g. TorchTPU; a dispatch mode makes torch.compile run eagerly)",
    )
    p.add_argument(
        "--wait",
        action="store_true",
        help="store the run before exiting (default: the script's exit status returns at once and the last "
        "trace analysis and store write finish in the background; every tpudiag command waits for them; "
        "also TPUDIAG_WAIT=1)",
    )
    p.add_argument(
        "--run-id",
        metavar="ID",
        help="distributed launchers: the job's run id, the same on every node, so all nodes' ranks join one run "
        "(default for a multi-node torchrun: its --rdzv-id)",
    )
    p.add_argument(
        "--remote",
        metavar="URL",
        help="upload the run's shards, raw traces and XPlanes to gs://, s3:// or file:// from a separate uploader "
        "process (credentials from the environment): a distributed launcher's nodes as files become final, a "
        "single process as a one-rank job once its run is stored; read them back with `tpudiag gather URL`, "
        "`tpudiag report --remote URL` or `tpudiag dashboard --remote URL`",
    )
    p.add_argument(
        "--trace-ranks",
        metavar="RANKS",
        help="distributed: only these ranks record traces, e.g. 0,last,first-per-host,3 (decided from each "
        "rank's own environment, the same rule on every rank)",
    )
    p.add_argument(
        "--numerics-ranks",
        metavar="RANKS",
        help="distributed: only these ranks check numerics (same syntax as --trace-ranks)",
    )
    p.add_argument(
        "--numerics",
        metavar="MODE",
        type=_numerics_mode,
        help="which ops the numerics collector checks against the CPU float64 oracle: sample (default: the "
        "first 3 calls of each op/shape/dtype signature), N (the first N calls), all, or off",
    )
    p.add_argument(
        "--budget",
        metavar="PCT",
        type=_percent,
        help="numerics: spend at most PCT percent extra time on checking (e.g. 20); later ops are skipped",
    )
    p.add_argument(
        "--ops",
        metavar="PATTERNS",
        help="numerics: check only these ops (comma-separated, e.g. mm,tanh,*norm*)",
    )
    p.add_argument(
        "--modules",
        metavar="PATTERNS",
        help="numerics: check only ops inside these modules (comma-separated paths or globs, e.g. transformer.h.0)",
    )
    p.add_argument(
        "--trace",
        choices=["windows", "all"],
        help="windows (default): a pulse of every step, the profiler on for the first steps, now and then, and "
        "when a trigger fires (slow step, recompile, non-finite, manual...); all: one trace of the whole run",
    )
    p.add_argument(
        "--trace-schedule",
        metavar="SPEC",
        type=_trace_schedule,
        help="when scheduled windows open: wait=W,warmup=U,active=A,repeat=R (steps, as torch.profiler.schedule) "
        "or every=120s,active=5,max=30s (the default: a window also ends after 30 s, and the next waits at least 9x "
        "its length)",
    )
    p.add_argument(
        "--max-disk",
        metavar="SIZE",
        type=_size,
        help="cap on the trace windows' files (default 2GB): scheduled windows are pruned first, anomaly windows "
        "kept, the pulse always kept",
    )
    p.set_defaults(func=cmd_capture)

    p = sub.add_parser("runs", help="list the runs in the store, newest first")
    _add_db(p)
    p.add_argument("--json", action="store_true", help="print a JSON list of run objects")
    p.set_defaults(func=cmd_runs)

    p = sub.add_parser("report", help="summary of a run: slow ops, steps, numerics, compilation")
    _add_db(p)
    p.add_argument("run", nargs="?", help="run id, unique name, or omitted for the latest run")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--top", type=int, default=20, help="how many slow ops to list (default 20)")
    p.add_argument(
        "--remote",
        metavar="URL",
        help="read the run's distributed summary straight from a bucket (gs://, s3://, file://) that "
        "`capture --remote` uploaded to; RUN is the run id there (default: the newest)",
    )
    p.set_defaults(func=cmd_report)

    for register in EXTRA_COMMANDS if extra_commands else []:
        _load_register(register)(sub)
    return parser


# "module:function" of functions that add subcommands (import, export, dashboard, repro...).
EXTRA_COMMANDS: list[str] = [
    "tpudiag.commands.import_cmd:register",
    "tpudiag.commands.export:register",
    "tpudiag.commands.dashboard:register",
    "tpudiag.commands.repro:register",
    "tpudiag.commands.compare:register",
    "tpudiag.commands.check:register",
    "tpudiag.commands.trigger:register",
    "tpudiag.commands.remote_cmd:register_gather",
    "tpudiag.commands.remote_cmd:register_upload",
]


def _load_register(spec: str) -> Callable[[Any], None]:
    import importlib

    module_name, _, attr = spec.partition(":")
    fn: Callable[[Any], None] = getattr(importlib.import_module(module_name), attr)
    return fn


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(extra_commands=argv[:1] != ["capture"])
    rest: list[str] = []
    if argv and argv[0] == "capture":
        own, rest = _split_capture_argv(argv[1:])
        argv = ["capture", *own]
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed its one-line usage error
        return int(exc.code or 0)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        func: Command = args.func
        return func(args, rest)
    except TpudiagError as err:
        sys.stderr.write(f"tpudiag: error: {err}\n")
        return err.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("tpudiag: interrupted\n")
        return 130
    except BrokenPipeError:
        return 0


def console_main() -> None:
    code = main()
    from tpudiag import runner

    if runner.ended_by_signal is not None:
        die_of(runner.ended_by_signal)  # (flushes, or not, as python does for that signal)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def die_of(sig: int) -> None:
    """End this process as python ends a script that a signal ended, then kill it by ``sig`` with the default
    action.  SIGINT (an uncaught KeyboardInterrupt): python finalizes first, its non-daemon threads joined and its
    exit handlers run (the interpreter's own order), its output flushed.  SIGTERM: python dies at once, with no
    exit handler run, no thread waited for and the output still in its buffers lost; so does the capture, once the
    run is stored (a preempted job under tpudiag had waited for its threads and run its exit handlers: an upload
    in an exit handler, or a thread that never ends, kept it alive past its grace period).  Returns only if the
    signal cannot be delivered (the caller exits with its code, as before)."""
    import atexit
    import signal
    import threading

    try:
        if sig != signal.SIGTERM:
            threading._shutdown()  # type: ignore[attr-defined]  # what finalization does first (waits for threads)
            atexit._run_exitfuncs()
            sys.stdout.flush()
        from tpudiag import termination

        termination.kill_self(sig)  # (to this thread: delivered before the call returns)
    except Exception:  # (a handler that raises is printed by atexit itself, as python prints it)
        return


if __name__ == "__main__":
    console_main()


__all__ = ["build_parser", "console_main", "main"]
