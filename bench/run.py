"""Run every benchmark (bench/bench_*.py, each with a ``main() -> dict``) or the ones named on the command line.

python -m bench.run            # all
python -m bench.run capture    # bench/bench_capture.py only
"""

from __future__ import annotations

import importlib
import sys

from bench.common import BENCH_DIR, write_result


def main(argv: list[str]) -> int:
    names = argv or sorted(p.stem[len("bench_") :] for p in BENCH_DIR.glob("bench_*.py"))
    failed = 0
    for name in names:
        module = importlib.import_module(f"bench.bench_{name}")
        try:
            result = module.main()
        except Exception as err:  # keep going: one broken benchmark must not hide the others
            print(f"{name}: FAILED: {err}", file=sys.stderr)
            failed += 1
            continue
        write_result(name, result)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
