"""Object names of a run in the bucket, and the key of the node that wrote them.

Under the ``--remote`` prefix::

    shards/<table>/run_id=<run>/node=<node>/rank=<rank>/<part>.parquet   per-rank Parquet (hive layout)
    raw/run_id=<run>/node=<node>/<path in the node's run folder>          raw traces, repro bundles, worker files
    plugins/profile/session_<run>/<host>_<rank>.xplane.pb                 TPU XPlanes in XProf's own layout
    manifests/run_id=<run>/node=<node>/manifest-<seq>.json               what each upload batch wrote
    manifests/run_id=<run>/node=<node>/complete.json                     the node finished (its outcome)

The node key is ``<hostname>-<launcher pid>``: several nodes can share a hostname (containers, two launchers on one
machine), and torchrun's c10d rendezvous hands out ranks by arrival, so neither the hostname nor ``--node-rank`` is
unique alone.  The partition is called ``node=``, not ``host=``: the rank records already carry a ``host`` column,
and a partition column with the same name as a file column is an error in Spark and ambiguous in DuckDB.
The job's run id comes from ``tpudiag.distributed.run_id.derive_run_id``.  Every name is written once (a new
manifest per batch, never an update), so nothing relies on rename, append or
``makedirs`` in the bucket.
"""

from __future__ import annotations

import os
import re
import socket

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def safe(value: str) -> str:
    return _SAFE.sub("-", value).strip("-.")[:120] or "x"


def node_key(host: str | None = None, pid: int | None = None) -> str:
    return safe(f"{host or socket.gethostname()}-{pid if pid is not None else os.getpid()}")


def shard_object(table: str, run_id: str, node: str, rank: int, part: str) -> tuple[str, ...]:
    return ("shards", table, f"run_id={run_id}", f"node={node}", f"rank={rank}", part)


def raw_object(run_id: str, node: str, relative: str) -> tuple[str, ...]:
    return ("raw", f"run_id={run_id}", f"node={node}", *relative.split("/"))


def xplane_object(run_id: str, host: str, rank: int) -> tuple[str, ...]:
    return ("plugins", "profile", f"session_{run_id}", f"{safe(host)}_{rank}.xplane.pb")


def manifest_dir(run_id: str, node: str | None = None) -> tuple[str, ...]:
    return ("manifests", f"run_id={run_id}") + ((f"node={node}",) if node else ())


def manifest_object(run_id: str, node: str, seq: int) -> tuple[str, ...]:
    return (*manifest_dir(run_id, node), f"manifest-{seq:06d}.json")


def complete_object(run_id: str, node: str) -> tuple[str, ...]:
    return (*manifest_dir(run_id, node), "complete.json")


def partition_value(segment: str, key: str) -> str | None:
    prefix = f"{key}="
    return segment[len(prefix) :] if segment.startswith(prefix) else None
