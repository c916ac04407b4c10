"""The name tpudiag's own live lines on stderr start with: ``tpudiag``, or ``tpudiag[rank 2]`` in a rank.

In a distributed job every rank writes to the same terminal; a rank's capture session sets its rank here
(``set_rank``) as soon as it is known, so each of its lines says which rank it comes from.
"""

from __future__ import annotations

_rank: list[int | None] = [None]


def set_rank(rank: int | None) -> None:
    _rank[0] = rank


def prefix() -> str:
    """``tpudiag`` or ``tpudiag[rank N]``: what each of tpudiag's stderr lines starts with, before the colon."""
    rank = _rank[0]
    return "tpudiag" if rank is None else f"tpudiag[rank {rank}]"
