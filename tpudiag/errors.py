"""Domain errors: each carries an exit code and prints as one clear line, never a traceback."""

from __future__ import annotations


class TpudiagError(Exception):
    """An error the user can act on. ``str(err)`` is the one line printed on stderr."""

    exit_code = 2


class UsageError(TpudiagError):
    exit_code = 2


class StoreError(TpudiagError):
    exit_code = 3


class StoreLockedError(StoreError):
    exit_code = 4


class UnknownRunError(TpudiagError):
    exit_code = 5


class ImportFormatError(TpudiagError):
    exit_code = 6
