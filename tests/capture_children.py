"""Imported by scripts that tests run under ``tpudiag capture``: the capture's background children (the window
analyst, the store feeder) as the script's own process sees them."""

from __future__ import annotations

import os


def children() -> dict[str, tuple[int, list[str]]]:
    """``{"analyst" | "feeder": (pid, argv)}`` for each such child of this process running now."""
    found = {}
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as fh:
            for pid in fh.read().split():
                with open(f"/proc/{pid}/cmdline") as cmd:
                    argv = cmd.read().split("\0")
                for name in ("analyst", "feeder"):
                    if any(a.endswith("." + name) for a in argv):
                        found[name] = (int(pid), argv)
    return found
