"""Which ranks of a big job record traces (``--trace-ranks``) and check numerics (``--numerics-ranks``).

Every rank decides alone from what its launcher set before it started (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``)
with the same rule, so no rank waits on another and the choice is the same whichever rank computes it.
Terms: an integer rank, ``a-b`` (inclusive), ``last`` (world size - 1), ``first-per-host`` (local rank 0),
``all``.  A rank whose number is not known before ``init_process_group`` (``torch.multiprocessing.spawn``)
counts as its spawn index.

What a deselected rank skips is recording, not work the program depends on: a trace collector that does not
start changes nothing the rank executes on CPU/CUDA.  On TorchTPU, checking numerics copies tensors to the host,
which cuts the rank's graphs: keep ``--numerics-ranks`` at ``all`` there, or accept that only the chosen ranks'
programs change (TorchTPU's "never diverge" rule is about collectives, which numerics does not add).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tpudiag.errors import UsageError

# Collector name -> the option that selects its ranks.
SELECTED_BY = {"trace": "trace_ranks", "numerics": "numerics_ranks"}


@dataclass(frozen=True)
class RankSet:
    ranks: frozenset[int]
    last: bool = False
    first_per_host: bool = False
    everyone: bool = False

    def __contains__(self, where: tuple[int, int | None, int | None]) -> bool:
        rank, local_rank, world = where
        return (
            self.everyone
            or rank in self.ranks
            or (self.last and world is not None and rank == world - 1)
            or (self.first_per_host and local_rank == 0)
        )


def parse(spec: str, option: str = "--trace-ranks") -> RankSet:
    ranks: set[int] = set()
    last = first = everyone = False
    for term in (t.strip().lower() for t in spec.split(",")):
        if not term:
            continue
        if term == "last":
            last = True
        elif term == "first-per-host":
            first = True
        elif term == "all":
            everyone = True
        elif term.isdigit():
            ranks.add(int(term))
        elif "-" in term and all(p.isdigit() for p in term.split("-", 1)):
            a, b = (int(p) for p in term.split("-", 1))
            ranks.update(range(min(a, b), max(a, b) + 1))
        else:
            raise UsageError(f"{option} {spec!r}: expected ranks like 0,last,first-per-host,4-7")
    if not (ranks or last or first or everyone):
        raise UsageError(f"{option} needs at least one rank")
    return RankSet(frozenset(ranks), last, first, everyone)


def deselected(options: Mapping[str, object], rank: int, local_rank: int | None, world: int | None) -> set[str]:
    """The collectors this rank leaves out under ``options`` (a capture's collector options)."""
    out = set()
    for collector, key in SELECTED_BY.items():
        spec = options.get(key)
        if isinstance(spec, str) and (rank, local_rank, world) not in parse(spec, "--" + key.replace("_", "-")):
            out.add(collector)
    return out
