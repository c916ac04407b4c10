"""TensorBoard / XProf export: ``<out>/plugins/profile/<run>/<host>.xplane.pb``, one XSpace per host (rank).

What the profile plugin (xprof 2.24) needs, checked against its converters (DESIGN §5):
- a host plane ``/host:CPU`` with one XLine per thread (``timestamp_ns`` epoch, events ``offset_ps``/
  ``duration_ps``);
- for *Framework Op Stats* to count a PyTorch op, its event metadata name must parse as a TensorFlow op
  ``name:Type`` (only ``[A-Za-z0-9_.-/]`` in the name, an identifier as the type) and the event itself must
  carry ``is_eager=1`` (on the metadata it is ignored).  We name ops ``<module path>/aten.addmm:addmm``
  (display name ``aten::addmm``), so the tool lists them per module like tpudiag's own report; self time is
  the op's duration minus the ops nested in it, as in the report;
- device planes ``/device:TPU:N`` (``/device:GPU:N`` for CUDA runs) with the run's device lines; XLA op
  metadata gets int stats ``program_id`` and a non-zero ``symbol_id`` (the converters drop ops without).

When the run folder holds original ``.xplane.pb`` files (a TPU capture or an imported XSpace), they are copied
unchanged to ``<out>/plugins/profile/<run>_original/``: on a TPU they carry what we do not store (HLO protos,
memory, device capabilities), so the plugin shows more for them.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from tpudiag.exporters import ExportOptions, Progress, atomic_file, safe_name
from tpudiag.store import Store
from tpudiag.store import export_queries as q
from tpudiag.store.queries import HOST_OP_CATEGORIES
from tpudiag.traces import xplane_proto as xp

HOST_PLANE = "/host:CPU"
HOST_PLANE_ID = 0
XLA_OPS_LINE = "XLA Ops"
STEPS_LINE = "Steps"
_NAME_BAD = re.compile(r"[^A-Za-z0-9_.\-/]")
_TYPE_BAD = re.compile(r"[^A-Za-z0-9_]")


def framework_op_name(op: str, module: str | None) -> tuple[str, str]:
    """(XPlane metadata name ``<module>/<ns>.<op>:<op>``, op type) for a PyTorch op such as ``aten::addmm``.

    The namespace separator ``::`` becomes ``.``; characters XProf's op-name grammar rejects become ``_``.
    """
    ns, _, short = op.rpartition("::")
    short = _TYPE_BAD.sub("_", short) or "op"
    if not short[0].isalpha() and short[0] != "_":
        short = "op_" + short
    name = f"{_NAME_BAD.sub('_', ns.replace('::', '.'))}.{short}" if ns else short
    if module:
        path = _NAME_BAD.sub("_", module.replace(" ", "_"))
        if not path[0].isalnum():
            path = "m" + path
        name = f"{path}/{name}"
    return f"{name}:{short}", short


def device_plane_name(process: str, index: int, device_kind: str | None) -> str:
    if process.startswith("/device:"):
        return process
    kind = "TPU" if device_kind == "tpu" else "GPU"
    return f"/device:{kind}:{index}"


class _SpaceWriter:
    """Builds one rank's XSpace from its event stream."""

    def __init__(
        self, host: str, origin_ns: int, run: dict[str, Any], verdicts: dict[tuple[str, str | None], str]
    ):
        self.space = xp.XSpace(hostnames=[host])
        self.origin_ns = origin_ns
        self.run = run
        self.verdicts = verdicts
        self.host = xp.PlaneBuilder.new(self.space, HOST_PLANE, HOST_PLANE_ID)
        self.devices: dict[str, xp.PlaneBuilder] = {}
        self.lines: dict[tuple[bool, str, str], tuple[xp.PlaneBuilder, Any]] = {}
        self.host_processes: set[str] = set()
        self._symbols: dict[tuple[str, str], int] = {}
        self._op_meta: dict[tuple[str, str | None], int] = {}
        self.ops = 0

    def _plane(self, on_device: bool, process: str) -> xp.PlaneBuilder:
        if not on_device:
            return self.host
        plane = self.devices.get(process)
        if plane is None:
            name = device_plane_name(process, len(self.devices), self.run.get("device_kind"))
            plane = xp.PlaneBuilder.new(self.space, name, len(self.devices) + 1)
            self.devices[process] = plane
        return plane

    def line(
        self, on_device: bool, process: str, thread: str, multi_process: bool
    ) -> tuple[xp.PlaneBuilder, Any]:
        key = (on_device, process, thread)
        found = self.lines.get(key)
        if found is None:
            plane = self._plane(on_device, process)
            name = f"{process} {thread}" if (multi_process and not on_device) else thread
            found = (plane, plane.line(len(plane.plane.lines) + 1, name, self.origin_ns))
            self.lines[key] = found
        return found

    def _xla_op_metadata(self, plane: xp.PlaneBuilder, name: str, row: dict[str, Any]) -> int:
        key = (plane.plane.name, name)
        symbol = self._symbols.get(key)
        if symbol is not None:
            return symbol
        stats: dict[str, xp.StatValue] = {"program_id": 1}
        args = _json_object(row.get("args"))
        for k in ("program_id", "symbol_id"):
            if isinstance(args.get(k), int) and args[k] > 0:
                stats[k] = args[k]
        stats.setdefault("symbol_id", len(self._symbols) + 1)
        if row.get("hlo_category"):
            stats["hlo_category"] = row["hlo_category"]
        framework_op = row.get("framework_op")
        if framework_op:
            # A profiler spelling ("aten::addmm") becomes the op name the host plane uses for it.
            stats["tf_op"] = (
                framework_op_name(framework_op, None)[0] if "::" in framework_op else framework_op
            )
        mid = plane.event_metadata(name, "", stats)
        self._symbols[key] = mid
        return mid

    def add_batch(self, cols: dict[str, list[Any]], multi_process: bool, progress: Progress) -> None:
        n = len(cols["event_id"])
        origin = self.origin_ns
        current: tuple[bool, str, str] | None = None
        plane = line = None
        for i in range(n):
            on_device, process, thread = bool(cols["on_device"][i]), cols["process"][i], cols["thread"][i]
            if (on_device, process, thread) != current:
                current = (on_device, process, thread)
                plane, line = self.line(on_device, process, thread, multi_process)
            assert plane is not None and line is not None
            name = cols["name"][i]
            offset_ps = (cols["start_ns"][i] - origin) * 1000
            duration_ps = cols["dur_ns"][i] * 1000
            stats: dict[str, xp.StatValue] = {}
            if not on_device and cols["category"][i] in HOST_OP_CATEGORIES:
                module = cols["module"][i]
                mkey = (name, module)
                mid = self._op_meta.get(mkey)
                if mid is None:
                    meta_name, _ = framework_op_name(name, module)
                    mid = plane.event_metadata(meta_name, name)
                    self._op_meta[mkey] = mid
                stats["is_eager"] = 1
                verdict = self.verdicts.get(mkey)
                if verdict is not None:
                    stats["numerics_verdict"] = verdict
                self.ops += 1
            elif on_device and (line.name == XLA_OPS_LINE or cols["category"][i] == "xla_op"):
                mid = self._xla_op_metadata(
                    plane, name, {k: cols[k][i] for k in ("hlo_category", "framework_op", "args")}
                )
            else:
                mid = plane.event_metadata(name)
            event = line.events.add(metadata_id=mid, offset_ps=offset_ps, duration_ps=duration_ps)
            for key, col in (("shapes", "shapes"), ("correlation_id", "correlation"), ("flops", "flops")):
                value = cols[col][i]
                if value is not None:
                    stats[key] = value
            if stats:
                plane.add_stats(event.stats, stats)
        progress.advance(n)

    def add_steps(self, steps: list[tuple[int, int, int, int, str]]) -> None:
        """A ``Steps`` line on the host plane, and on each device plane that has none of its own."""
        if not steps:
            return
        targets = [self.host]
        targets += [
            p for p in self.devices.values() if all(line.name != STEPS_LINE for line in p.plane.lines)
        ]
        for plane in targets:
            line = plane.line(len(plane.plane.lines) + 1, STEPS_LINE, self.origin_ns)
            for _rank, step, start, dur, kind in steps:
                event = line.events.add(
                    metadata_id=plane.event_metadata(str(step)),
                    offset_ps=(start - self.origin_ns) * 1000,
                    duration_ps=dur * 1000,
                )
                plane.add_stats(event.stats, {"step_num": step, "step_kind": kind})


def _json_object(text: Any) -> dict[str, Any]:
    if not isinstance(text, str):
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def original_xplanes(run: dict[str, Any]) -> list[Path]:
    """``.xplane.pb`` files kept in the run's artifact folder (a TPU capture or an imported XSpace)."""
    folder = run.get("artifacts_dir")
    if not folder or not Path(folder).is_dir():
        return []
    return sorted(p for p in Path(folder).rglob("*.xplane.pb") if p.is_file())


class TensorBoardExporter:
    name = "tensorboard"
    description = "XPlane files for the TensorBoard profile plugin / XProf (tensorboard --logdir OUT)"

    def export(self, store: Store, run: dict[str, Any], out_dir: Path, options: ExportOptions) -> list[Path]:
        run_dir = out_dir / "plugins" / "profile" / safe_name(run["id"])
        host = safe_name(run.get("host") or "localhost")
        written: list[Path] = []
        with store.reader() as con:
            origin = q.time_origin_ns(con, run["id"])
            tracks = q.tracks(con, run["id"])
            ranks = q.ranks(con, run["id"]) or [0]
            steps = q.steps(con, run["id"])
            verdicts = q.op_verdicts(con, run["id"])
            progress = Progress(f"export tensorboard {run['id']}", sum(t.events for t in tracks))
            for rank in ranks:
                writer = _SpaceWriter(host, origin if origin is not None else 0, run, verdicts)
                multi = len({t.process for t in tracks if t.rank == rank and not t.on_device}) > 1
                for batch in q.iter_rows(q.xplane_event_batches(con, run["id"], rank)):
                    writer.add_batch(batch.to_pydict(), multi, progress)
                writer.add_steps([s for s in steps if s[0] == rank])
                fname = f"{host}.xplane.pb" if ranks == [0] else f"{host}_{rank}.xplane.pb"
                path = run_dir / fname
                with atomic_file(path) as fh:
                    fh.write(writer.space.SerializeToString())
                written.append(path)
        progress.finish()
        if options.include_original:
            for original in original_xplanes(run):
                target = out_dir / "plugins" / "profile" / f"{safe_name(run['id'])}_original" / original.name
                with atomic_file(target) as fh, open(original, "rb") as src:
                    shutil.copyfileobj(src, fh)
                written.append(target)
        return written
