"""How often a running capture's periodic store work runs, as the run gets older (issue 21).

While the script runs, the flusher thread writes the collectors' rows to the spool, and the feeder child loads the
spool into the store, every ``TPUDIAG_FLUSH_S`` seconds (10 by default): a job seen in the dashboard a few seconds
after it starts.  Each round has a fixed cost whatever it carries: the feeder opens the store, loads and commits
(about 0.1 s of CPU on the long-run bench loop's 10 s of parts, 1% of a core), and on a machine whose cores are all
busy that CPU is the training loop's.  Minutes into a job nobody needs the store to be 10 s behind it, so the wait
grows with the run's age, one twentieth of it, up to 30 s: every 10 s for the first 200 s, every 30 s from the
tenth minute on (the feeder's steady share falls to about 0.3%).  A longer ``TPUDIAG_FLUSH_S`` is kept as it is.

The feeder's own clock (``unwatched_interval``) slows faster, to half the run's age, up to every two minutes
(from the fourth minute on): its loads are for the store's readers, and a reader asks for one when it reads
(``store/live_loads.py``), so a load nobody asked for only keeps the store near the job for whoever reads the file
with a client of their own.  On the long-run bench loop (its capture pinned to one core) the feeder's CPU over the
first five minutes fell from 3.1 s to 1.8 s (of which ~0.5 s is its start: Python, DuckDB's import).
"""

from __future__ import annotations

AGE_SHARE = 0.05  # the wait grows to this share of the run's age ...
LATEST_S = 30.0  # ... up to this (never under the configured interval)
UNWATCHED_AGE_SHARE = 0.5  # the feeder's own loads: every 10 s for the first 20 s ...
UNWATCHED_LATEST_S = 120.0  # ... then slower, up to every two minutes


def settling_interval(base_s: float, age_s: float) -> float:
    """The wait before the next round, ``age_s`` seconds into the run, for a configured interval of ``base_s``."""
    return max(base_s, min(age_s * AGE_SHARE, LATEST_S))


def unwatched_interval(base_s: float, age_s: float) -> float:
    """The feeder's wait before a load nobody asked for (``store/live_loads.py``), ``age_s`` seconds into the run."""
    return max(base_s, min(age_s * UNWATCHED_AGE_SHARE, UNWATCHED_LATEST_S))
