"""What the bucket holds for a run, read from the nodes' manifests (listing is the only "directory" a bucket has).

A reader trusts only objects a manifest names: an upload cut short leaves at most an unnamed object, never read.
A node with ``complete.json`` finished; a node with manifests but no completion marker crashed or is still
running (its ranks without a rank record are ``lost`` once merged).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tpudiag.errors import TpudiagError, UsageError
from tpudiag.remote import layout
from tpudiag.remote.location import Remote, redact


@dataclass
class NodeState:
    node: str
    host: str | None = None
    objects: list[str] = field(default_factory=list)  # object paths relative to the prefix
    complete: dict[str, Any] | None = None
    last_written: float = 0.0

    def shard_objects(self) -> list[str]:
        return [o for o in self.objects if o.startswith("shards/") and o.endswith(".parquet")]


def _relative(remote: Remote, path: str) -> str:
    prefix = remote.prefix.strip("/") + "/"
    path = path.lstrip("/") if remote.protocol == "file" else path
    return path[len(prefix) :] if path.startswith(prefix) else path


def _fail(what: str, err: Exception) -> TpudiagError:
    return TpudiagError(redact(f"{what}: {type(err).__name__}: {err}"))


def run_ids(remote: Remote, fs: Any) -> list[tuple[str, float]]:
    """(run id, newest manifest time) of every run with manifests under the prefix, newest first."""
    try:
        entries = fs.ls(remote.path("manifests"), detail=False)
    except FileNotFoundError:
        return []
    except Exception as err:
        raise _fail(f"cannot list {remote.url}/manifests", err) from None
    found = []
    for entry in entries:
        rid = layout.partition_value(str(entry).rstrip("/").rsplit("/", 1)[-1], "run_id")
        if rid:
            found.append((rid, max((n.last_written for n in nodes(remote, fs, rid)), default=0.0)))
    return sorted(found, key=lambda x: -x[1])


def resolve_run(remote: Remote, fs: Any, run_id: str | None) -> str:
    if run_id:
        return run_id
    runs = run_ids(remote, fs)
    if not runs:
        raise UsageError(f"no tpudiag runs under {remote.url} (nothing in manifests/)")
    return runs[0][0]


def nodes(remote: Remote, fs: Any, run_id: str) -> list[NodeState]:
    base = remote.path(*layout.manifest_dir(run_id))
    try:
        files = fs.find(base)
    except FileNotFoundError:
        return []
    except Exception as err:
        raise _fail(f"cannot list {remote.url} run {run_id}", err) from None
    states: dict[str, NodeState] = {}
    for path in sorted(str(f) for f in files):
        parts = _relative(remote, path).split("/")
        if len(parts) != 4 or not parts[3].endswith(".json"):
            continue
        node = layout.partition_value(parts[2], "node")
        if node is None:
            continue
        state = states.setdefault(node, NodeState(node))
        try:
            body = json.loads(fs.cat_file(path))
        except Exception as err:
            raise _fail(f"cannot read {parts[3]} of node {node}", err) from None
        state.host = body.get("host") or state.host
        state.last_written = max(state.last_written, float(body.get("written_at") or 0))
        if parts[3] == "complete.json":
            state.complete = body
        else:
            state.objects += [str(o["object"]) for o in body.get("objects", []) if o.get("object")]
    if not states:
        raise UsageError(f"no run {run_id} under {remote.url}")
    return [states[k] for k in sorted(states)]
