"""``tpudiag repro RUN SEQ --rank R``: one rank's divergent op of a distributed run, and its saved inputs.

Each rank saved the inputs of its divergent ops in its own folder (``<run>/workers/<attempt>-<pid>/numerics/
repro``); ``dist_op_diffs`` (``tpudiag.store.rank_numerics_queries``) holds the op and the rank's folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tpudiag.errors import UnknownRunError
from tpudiag.store import Store
from tpudiag.store import rank_numerics_queries as q


def rank_op(store: Store, run_id: str, rank: int, seq: int) -> tuple[dict[str, Any] | None, Path]:
    """(the op's record, the path its saved inputs would have); raises when the run has no such rank data."""
    with store.reader() as con:
        row = q.rank_op(con, run_id, rank, seq)
    if row is None:
        raise UnknownRunError(f"run {run_id} lists no divergent op with seq {seq} on rank {rank} (see tpudiag report)")
    folder = Path(row.get("artifacts_dir") or ".")
    saved = Path(row["repro_path"]) if row.get("repro_path") else folder / "numerics" / "repro" / f"op-{seq}.pt"
    if not saved.is_absolute():
        saved = folder / saved
    if not saved.is_file():  # a run gathered from a bucket: the node's files, if `gather --raw` brought them
        saved = gathered_copy(store.run_dir(run_id) / "raw", saved, row.get("host")) or saved
    return row, saved


def gathered_copy(raw: Path, saved: Path, host: str | None) -> Path | None:
    """Where ``tpudiag gather --raw`` put a node's file ``saved`` (``<raw>/<node>/<path in the node's run
    folder>``): the path from its ``workers`` folder on (a rank of a launcher) or its ``numerics`` folder (a
    one-process run) is looked for under every node's folder; a node of the rank's host first."""
    parts = saved.parts
    start = parts.index("workers") if "workers" in parts else (parts.index("numerics") if "numerics" in parts else -1)
    if start < 0 or not raw.is_dir():
        return None
    found = sorted(p for p in raw.glob("*/" + "/".join(parts[start:])) if p.is_file())
    mine = [p for p in found if host and p.relative_to(raw).parts[0].startswith(f"{host}-")]
    best = mine or found
    return best[0] if best else None
