"""A torchrun worker under capture: ``python -u -m tpudiag.distributed.worker [-u] (script | -m module) [args]``.

torchrun starts each worker as ``$PYTHON_EXEC -u [-m] <script> <args>``; the launcher side points ``PYTHON_EXEC`` at
a two-line shell wrapper that runs this module instead, with the same arguments.  The target then runs exactly as
``python -u`` would run it (``tpudiag.runner``), with the rank's capture session around it, and the worker exits
with the target's exit status.  Only the launcher's direct children go through ``PYTHON_EXEC``: DataLoader workers,
compile workers and any other subprocess a rank starts use ``sys.executable`` and are not captured.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from tpudiag import forks, runner
from tpudiag.distributed.identity import RankIdentity
from tpudiag.distributed.session import WorkerSession, take_config_from_env


def parse_target(argv: Sequence[str]) -> runner.Target | None:
    args = list(argv)
    while args and args[0] == "-u":  # the wrapper already runs Python unbuffered
        args.pop(0)
    if not args:
        return None
    if args[0] == "-m":
        return runner.Target("module", args[1], tuple(args[2:])) if len(args) > 1 else None
    return runner.Target("script", args[0], tuple(args[1:]))


def main(argv: Sequence[str] | None = None) -> int:
    target = parse_target(sys.argv[1:] if argv is None else argv)
    if target is None:
        sys.stderr.write("tpudiag worker: expected a script or -m module\n")
        return 2
    config = take_config_from_env()
    if config is None:  # started outside a capture: just run the target
        return runner.run(target).exit_code
    session = WorkerSession(config, RankIdentity.from_env())
    session.start()

    def store(outcome: runner.Outcome) -> None:
        session.finish(outcome.status, outcome.exit_code, outcome.error)

    # At SIGTERM ``store`` runs from the signal handler, the rank's stack left as it was, and the worker then dies of
    # the signal, as python would (torchrun's agent stops the other ranks of a failed job with SIGTERM).
    outcome = runner.run(target, on_sigterm=store)
    if not forks.in_child():  # (a child the script forked, run on to its end, exits as without tpudiag)
        store(outcome)
    return outcome.exit_code


if __name__ == "__main__":
    sys.exit(main())
