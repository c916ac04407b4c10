"""Python's full garbage collections, moved into trace windows (issue 21: no stall outside windows over 50 ms).

CPython runs a full (generation 2) collection when the objects promoted to the oldest generation since the last
one reach a quarter of those it holds.  A capture's start up (tpudiag's imports, its threads', the first window's
profiler and the numerics checker's warm-up records) leaves such a debt behind, and its later records add a trickle
(~90 objects a second on the long-run bench loop) that the plain script does not make.  The debt came due a minute
or two into a steady loop, in whichever thread allocated next: the pulse writer's or a numerics re-check's, holding
the GIL for 0.2 s while the script's thread waited (a 221 ms gap before one step; 196.7 ms of tpudiag's own time in a
re-check step of the 10-minute bench), where the plain script never runs one after its start up.

``Settler.settle`` runs that collection where the script's loop already waits on tpudiag: as a trace window closes (the
step that closes a window is counted as part of it).  The first window's close clears the start up's debt; a later
window's close does it again at most every ``EVERY_S`` seconds, or a thousand times the last one's duration on a
larger heap, so the trickle never comes due outside a window and settling costs at most ~0.1% of the run.  A script
that has turned automatic collection off (``gc.disable()``, or ``gc.set_threshold(0)``) manages its own collections:
never here.  What the collection frees is what the next automatic one would have freed (a finalizer runs earlier
than it would have, as it does whenever other allocations move a collection).
"""

from __future__ import annotations

import gc
import time

EVERY_S = 300.0  # the least time between two settles after the first window's
COST_FACTOR = 1000.0  # ... or this many times the last settle's duration, if longer


class Settler:
    """One capture's settles: when the last one ran and what it cost."""

    def __init__(self) -> None:
        self.last_s: float | None = None  # monotonic clock of the last settle
        self.last_cost_s = 0.0

    def settle(self, first: bool) -> float | None:
        """A full collection now if it is due (``first``: the first window's close, always); its seconds, or None."""
        if not gc.isenabled() or gc.get_threshold()[0] == 0:  # automatic collection off (either of the two ways)
            return None
        if (
            not first
            and self.last_s is not None
            and time.monotonic() - self.last_s < max(EVERY_S, COST_FACTOR * self.last_cost_s)
        ):
            return None
        t0 = time.perf_counter()
        gc.collect()
        self.last_cost_s = time.perf_counter() - t0
        self.last_s = time.monotonic()
        return self.last_cost_s
