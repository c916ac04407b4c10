"""The values of ``--numerics`` and ``--budget``, parsed in one place (the CLI and the numerics collector both call
these, so a value the command line accepts is one the collector accepts, with the same message when it is not)."""

from __future__ import annotations

from tpudiag.errors import UsageError

DEFAULT_FIRST_K = 3
NUMERICS_CHOICES = "expected sample, all, off, or a number of calls per signature (e.g. 5)"


def numerics_mode(text: object) -> tuple[str, int]:
    """``sample`` / ``all`` / ``off`` / ``N`` (or ``first:N``) -> (mode, calls checked per signature)."""
    raw = str(text).strip().lower()
    if raw in ("all", "off", "sample"):
        return raw, DEFAULT_FIRST_K
    digits = raw.removeprefix("first:")
    if digits.isdigit() and int(digits) >= 1:
        return "sample", int(digits)
    raise UsageError(f"--numerics {text!r}: {NUMERICS_CHOICES}")


def budget_percent(text: object) -> float:
    """``20`` or ``20%`` -> 20.0; more than 0."""
    try:
        value = float(str(text).strip().rstrip("%"))
    except ValueError:
        raise UsageError(f"--budget {text!r}: expected a percentage such as 20") from None
    if not value > 0:  # also refuses nan
        raise UsageError(f"--budget {text!r}: must be more than 0 percent")
    return value
