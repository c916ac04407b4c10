"""Which steps the trace windows cover when nothing goes wrong (pure: steps and seconds are passed in).

- The first window: the script's start up to ``first_steps`` steps or ``first_s`` seconds, whichever comes first
  (time to the first result, compiles and warm-up).  A script that ends inside it gets one trace of everything, as a
  whole-run trace would.
- Then one window at a regular interval, in the form ``torch.profiler.schedule`` users know:
  ``wait=W,warmup=U,active=A,repeat=R[,skip_first=S]`` (steps; each cycle waits W steps, then traces U + A steps;
  ``repeat=0`` cycles until the run ends), or by time: ``every=120s,active=5`` (a window of A steps every 120 s,
  the default, so a window's cost does not depend on how fast the steps are).
- In the time form a window also ends once it has lasted ``max=30s`` (after at least one step; ``max=0``: no
  limit), and the wait after a window is at least 9 times its length, so windows trace at most ~10% of the run
  whatever the step time: with 10 s steps, five-step windows every 120 s would trace 30% of the run (50 s of 170),
  and each window's trace would be 50 s long.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpudiag.errors import UsageError

FIRST_STEPS = 20
FIRST_S = 60.0
DEFAULT_SPEC = "every=120s,active=5"
_KEYS = ("wait", "warmup", "active", "repeat", "skip_first", "every", "max")
MAX_S = 30.0  # the time form's longest window (``max=``)
TRACED_SHARE = 0.1  # the time form's windows trace at most this share of the run: the wait is >= 9x a window


@dataclass(frozen=True)
class WindowSchedule:
    active: int = 5
    warmup: int = 0
    wait: int | None = None  # step form
    repeat: int = 0
    skip_first: int = 0
    every_s: float | None = 120.0  # time form
    max_s: float | None = MAX_S  # time form: a window ends after this long (at a step's end); None: no limit
    first_steps: int = FIRST_STEPS
    first_s: float = FIRST_S

    @property
    def steps(self) -> int:
        """Steps one scheduled window covers."""
        return self.warmup + self.active

    def wait_s(self, last_len_s: float) -> float:
        """Time form: the wait after a scheduled window that lasted ``last_len_s`` (0 after the first window)."""
        assert self.every_s is not None
        return max(self.every_s, last_len_s * (1.0 / TRACED_SHARE - 1.0))

    def due(
        self, step: int, window_steps_after: int, now_s: float, last_end_s: float, cycles: int, last_len_s: float = 0.0
    ) -> bool:
        """Whether a scheduled window opens at ``step`` (about to start).

        ``window_steps_after``: the step the last window of any kind ended at; ``last_end_s``: when the last
        scheduled (or the first) window ended, ``last_len_s`` how long it lasted; ``cycles``: scheduled windows
        opened so far.
        """
        if self.repeat and cycles >= self.repeat:
            return False
        if self.wait is not None:
            start = max(self.first_steps, self.skip_first)
            if step < start:
                return False
            cycle = self.wait + self.steps
            return (step - start) % cycle == self.wait
        return now_s - last_end_s >= self.wait_s(last_len_s) and step >= window_steps_after

    def not_before(
        self, step: int, window_steps_after: int, last_end_s: float, cycles: int, last_len_s: float = 0.0
    ) -> tuple[float, float]:
        """(first step, first time) before either of which ``due`` is false for every step from ``step`` on, the
        other arguments as they stand (a step's end may then skip asking): ``due`` needs both reached."""
        never = (float("inf"), float("inf"))
        if self.repeat and cycles >= self.repeat:
            return never
        if self.wait is not None:
            start = max(self.first_steps, self.skip_first)
            cycle = self.wait + self.steps
            if step <= start:
                return (start + self.wait, float("-inf"))
            return (step + (self.wait - (step - start)) % cycle, float("-inf"))
        return (window_steps_after, last_end_s + self.wait_s(last_len_s))


def parse(spec: str | None, first_steps: int = FIRST_STEPS, first_s: float = FIRST_S) -> WindowSchedule:
    """``wait=..,warmup=..,active=..,repeat=..`` or ``every=120s,active=5`` -> a schedule; UsageError if bad."""
    text = (spec or DEFAULT_SPEC).strip()
    values: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in _KEYS:
            raise UsageError(
                f"--trace-schedule {spec!r}: expected wait=W,warmup=U,active=A,repeat=R (steps) or every=120s,active=A"
            )
        values[key] = value.strip()
    try:
        ints = {k: int(v) for k, v in values.items() if k not in ("every", "max")}
        every = float(values["every"].rstrip("s")) if "every" in values else None
        longest = float(values["max"].rstrip("s")) if "max" in values else MAX_S
    except ValueError:
        raise UsageError(f"--trace-schedule {spec!r}: values must be whole numbers (every: seconds)") from None
    if (
        any(v < 0 for v in ints.values())
        or ints.get("active", 1) < 1
        or (every is not None and every <= 0)
        or not longest >= 0
    ):
        raise UsageError(f"--trace-schedule {spec!r}: active must be at least 1, the others not negative")
    if "wait" in ints and every is not None:
        raise UsageError(f"--trace-schedule {spec!r}: give wait=.. (steps) or every=.. (seconds), not both")
    if "wait" in ints and "max" in values:
        raise UsageError(f"--trace-schedule {spec!r}: max=.. (seconds) goes with every=.., not wait=..")
    if "wait" not in ints and every is None:
        every = 120.0
    return WindowSchedule(
        active=ints.get("active", 5),
        warmup=ints.get("warmup", 0),
        wait=ints.get("wait"),
        repeat=ints.get("repeat", 0),
        skip_first=ints.get("skip_first", 0),
        every_s=every if "wait" not in ints else None,
        max_s=(longest or None) if "wait" not in ints else None,
        first_steps=first_steps,
        first_s=first_s,
    )
