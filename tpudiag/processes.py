"""Whether another process still runs (no torch, no store: the store, the analysis and feeder children and the
uploader all ask)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while a process with this id exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
