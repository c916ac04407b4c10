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
  metadata gets int stats ``program_id`` and a non-zero ``symbol_id`` (the converters drop ops without);
- the memory collector's live bytes as ``MemoryAllocation`` / ``MemoryDeallocation`` events on a ``Memory`` line
  of the host plane, with the stats XProf's ``memory_profile`` reads (``allocator_name`` = the device,
  ``bytes_allocated``, ``peak_bytes_in_use``, ``allocation_bytes``, ``group_id`` = the step).  Each point of the
  stored (downsampled) timeline is one event whose size is the change since the previous point: the timeline and
  peak are exact at the points kept; the per-op breakdown at the peak stays in tpudiag's own report.

When the run folder holds original ``.xplane.pb`` files (a TPU capture or an imported XSpace), they are copied
unchanged to ``<out>/plugins/profile/<run>_original/``: on a TPU they carry what we do not store (HLO protos,
memory, device capabilities), so the plugin shows more for them.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tpudiag.atomic_file import atomic_file
from tpudiag.exporters import ExportOptions, safe_name
from tpudiag.exporters.xline_encoding import StatColumn, encode_line_events
from tpudiag.progress import Progress
from tpudiag.store import Store
from tpudiag.store import export_queries as q
from tpudiag.store.queries import HOST_OP_CATEGORIES
from tpudiag.traces import xplane_proto as xp

HOST_PLANE = "/host:CPU"
HOST_PLANE_ID = 0
XLA_OPS_LINE = "XLA Ops"
STEPS_LINE = "Steps"
DEVICE_SPAN_STATS = ("device_offset_ps", "device_duration_ps")
_KEY_COLUMNS = ("name", "module", "category", "on_device", "hlo_category", "framework_op", "args")
_NAME_BAD = re.compile(r"[^A-Za-z0-9_.\-/]")
_TYPE_BAD = re.compile(r"[^A-Za-z0-9_]")


def framework_op_name(op: str, module: str | None) -> tuple[str, str]:
    """(XPlane metadata name ``<module>/<ns>.<op>:<Type>``, op type) for a PyTorch op such as ``aten::addmm``.

    The namespace separator ``::`` becomes ``.``; characters XProf's op-name grammar rejects become ``_``.
    XProf accepts an op type that is all lower case (``addmm``) or starts with a capital or ``_``
    (``TBackward0``) and silently drops the op otherwise (``myOp``, ``evaluate_function_TBackward0``), so
    autograd nodes (``autograd::engine::evaluate_function: TBackward0``) are typed by their node name.
    """
    ns, _, short = op.rpartition("::")
    head, sep, node = short.partition(": ")
    op_type = _TYPE_BAD.sub("_", node if sep else short) or "op"
    if not op_type.islower() and op_type[0].islower():
        op_type = op_type[0].upper() + op_type[1:]
    if not (op_type[0].isalpha() or op_type[0] == "_"):
        op_type = "Op_" + op_type
    leaf = _NAME_BAD.sub("_", f"{head}.{node}" if sep else short) or "op"
    name = f"{_NAME_BAD.sub('_', ns.replace('::', '.'))}.{leaf}" if ns else leaf
    if module:
        path = _NAME_BAD.sub("_", module)
        if not path[0].isalnum():
            path = "m" + path
        name = f"{path}/{name}"
    return f"{name}:{op_type}", op_type


def device_plane_name(process: str, index: int, device_kind: str | None) -> str:
    if process.startswith("/device:"):
        return process
    kind = "TPU" if device_kind == "tpu" else "GPU"
    return f"/device:{kind}:{index}"


class _SpaceWriter:
    """Builds one rank's XSpace from its event stream."""

    def __init__(self, host: str, origin_ns: int, run: dict[str, Any], verdicts: dict[tuple[str, str | None], str]):
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

    def line(self, on_device: bool, process: str, thread: str, multi_process: bool) -> tuple[xp.PlaneBuilder, Any]:
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
            value = _positive_int(args.get(k))  # imported XSpaces keep stats as text ("12190760917235803885")
            if value is not None:
                stats[k] = value
        stats.setdefault("symbol_id", len(self._symbols) + 1)
        if row.get("hlo_category"):
            stats["hlo_category"] = row["hlo_category"]
        framework_op = row.get("framework_op")
        if framework_op:
            # A profiler spelling ("aten::addmm") becomes the op name the host plane uses for it.
            stats["tf_op"] = framework_op_name(framework_op, None)[0] if "::" in framework_op else framework_op
        mid = plane.event_metadata(name, "", stats)
        self._symbols[key] = mid
        return mid

    def _metadata_id(self, plane: xp.PlaneBuilder, line_name: str, row: dict[str, Any]) -> int:
        """Event metadata of one (name, module, category, on_device) key on ``plane``."""
        name, module = row["name"], row["module"]
        if not row["on_device"] and row["category"] in HOST_OP_CATEGORIES:
            mkey = (name, module)
            mid = self._op_meta.get(mkey)
            if mid is None:
                mid = plane.event_metadata(framework_op_name(name, module)[0], name)
                self._op_meta[mkey] = mid
            return mid
        if row["on_device"] and (line_name == XLA_OPS_LINE or row["category"] == "xla_op"):
            return self._xla_op_metadata(plane, name, row)
        return plane.event_metadata(name)

    def add_batch(self, batch: pa.RecordBatch, multi_process: bool, progress: Progress) -> None:
        """Append a batch of events (ordered by track, then time) to their lines, encoded with numpy."""
        n = batch.num_rows
        col = {name: batch.column(name) for name in batch.schema.names}
        track = pc.binary_join_element_wise(
            pc.cast(col["on_device"], pa.string()), col["process"], col["thread"], "\x1f"
        )
        same = pc.equal(track.slice(1), track.slice(0, n - 1)).to_numpy(zero_copy_only=False)
        cuts = np.flatnonzero(~same) + 1
        bounds = [0, *cuts.tolist(), n]
        module = pc.fill_null(col["module"], "\x00")
        device = pc.cast(col["on_device"], pa.string())
        key = pc.binary_join_element_wise(col["name"], module, col["category"], device, "\x1f").dictionary_encode()
        key_idx = key.indices.to_numpy()
        offset_ps = (col["start_ns"].to_numpy() - self.origin_ns) * 1000
        duration_ps = np.maximum(col["dur_ns"].to_numpy(), 0) * 1000
        shapes = col["shapes"].dictionary_encode()
        shape_idx = pc.fill_null(shapes.indices, -1).to_numpy()
        corr_valid = col["correlation"].is_valid().to_numpy(zero_copy_only=False)
        corr = pc.fill_null(col["correlation"], 0).to_numpy()
        flops_valid = col["flops"].is_valid().to_numpy(zero_copy_only=False)
        flops = pc.fill_null(col["flops"], 0.0).to_numpy()
        device_spans = [_arg_int(col["args"], stat) for stat in DEVICE_SPAN_STATS]
        for a, b in itertools.pairwise(bounds):
            first = {name: col[name][a].as_py() for name in ("on_device", "process", "thread")}
            plane, line = self.line(bool(first["on_device"]), first["process"], first["thread"], multi_process)
            seg = key_idx[a:b]
            uniq, first_rows = np.unique(seg, return_index=True)
            mids = np.zeros(len(key.dictionary), dtype=np.int64)
            is_op = np.zeros(len(key.dictionary), dtype=bool)
            verdict_ref = np.zeros(len(key.dictionary), dtype=np.int64)
            for u, r in zip(uniq.tolist(), first_rows.tolist(), strict=True):
                row = {k: col[k][a + r].as_py() for k in _KEY_COLUMNS}
                mids[u] = self._metadata_id(plane, line.name, row)
                is_op[u] = not row["on_device"] and row["category"] in HOST_OP_CATEGORIES
                verdict = self.verdicts.get((row["name"], row["module"])) if is_op[u] else None
                if verdict is not None:
                    verdict_ref[u] = plane.stat_id(verdict)
            stats = []
            op_mask = is_op[seg]
            if op_mask.any():
                stats.append(StatColumn(plane.stat_id("is_eager"), "int", np.ones(b - a, np.int64), op_mask))
                self.ops += int(op_mask.sum())
            seg_verdict = verdict_ref[seg]
            if seg_verdict.any():
                stats.append(StatColumn(plane.stat_id("numerics_verdict"), "ref", seg_verdict, seg_verdict > 0))
            seg_shape = shape_idx[a:b]
            if (seg_shape >= 0).any():
                refs = np.zeros(len(shapes.dictionary) + 1, dtype=np.int64)
                for u in np.unique(seg_shape[seg_shape >= 0]).tolist():
                    refs[u] = plane.stat_id(shapes.dictionary[u].as_py())
                stats.append(StatColumn(plane.stat_id("shapes"), "ref", refs[seg_shape], seg_shape >= 0))
            if corr_valid[a:b].any():
                stats.append(StatColumn(plane.stat_id("correlation_id"), "int", corr[a:b], corr_valid[a:b]))
            if flops_valid[a:b].any():
                stats.append(StatColumn(plane.stat_id("flops"), "double", flops[a:b], flops_valid[a:b]))
            for stat, (values, present) in zip(DEVICE_SPAN_STATS, device_spans, strict=True):
                if present[a:b].any():  # the chip's own span: XProf's op statistics count it, not the host span
                    stats.append(StatColumn(plane.stat_id(stat), "int", values[a:b], present[a:b]))
            line.MergeFromString(encode_line_events(mids[seg], offset_ps[a:b], duration_ps[a:b], stats))
        progress.advance(n)

    def add_memory(self, points: list[tuple[str, int, int, int | None]]) -> None:
        """The live-bytes timeline as allocator events (see the module docstring)."""
        if not points:
            return
        line = self.host.line(len(self.host.plane.lines) + 1, "Memory", self.origin_ns)
        previous: dict[str, int] = {}
        peak: dict[str, int] = {}
        for n, (device, ts, allocated, step) in enumerate(points):
            delta = allocated - previous.get(device, 0)
            previous[device] = allocated
            peak[device] = max(peak.get(device, 0), allocated)
            stats: dict[str, xp.StatValue] = {
                "allocator_name": device,
                "bytes_allocated": allocated,
                "bytes_reserved": 0,  # TensorFlow's stack reservation: none in PyTorch
                "bytes_available": 0,
                "peak_bytes_in_use": peak[device],
                "allocation_bytes": abs(delta),
                "requested_bytes": abs(delta),
                "addr": n + 1,
                "tf_op": "live bytes",
                "region_type": "output",
                "tensor_shape": "unknown",
            }
            if step is not None:
                stats["group_id"] = step
            name = "MemoryAllocation" if delta >= 0 else "MemoryDeallocation"
            self.host.add_event(line, name, (ts - self.origin_ns) * 1000, 0, stats)

    def add_steps(self, steps: list[tuple[int, int, int, int, str]]) -> None:
        """A ``Steps`` line on the host plane, and on each device plane that has none of its own."""
        if not steps:
            return
        targets = [self.host]
        targets += [p for p in self.devices.values() if all(line.name != STEPS_LINE for line in p.plane.lines)]
        for plane in targets:
            line = plane.line(len(plane.plane.lines) + 1, STEPS_LINE, self.origin_ns)
            for _rank, step, start, dur, kind in steps:
                event = line.events.add(
                    metadata_id=plane.event_metadata(str(step)),
                    offset_ps=(start - self.origin_ns) * 1000,
                    duration_ps=dur * 1000,
                )
                plane.add_stats(event.stats, {"step_num": step, "step_kind": kind})


def _arg_int(args: pa.ChunkedArray | pa.Array, key: str) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(values, present) of an integer kept as text in the args JSON (``"device_offset_ps":"123"``)."""
    found = pc.extract_regex(pc.fill_null(args, ""), f'"{key}":"(?P<v>[0-9]{{1,18}})"')
    text = pc.struct_field(found, [0])
    present = text.is_valid().to_numpy(zero_copy_only=False)
    values = pc.cast(pc.fill_null(text, "0"), pa.int64()).to_numpy(zero_copy_only=False)
    return values, present


def _positive_int(value: Any) -> int | None:
    """A positive id below 2**64 from an int or its decimal text, else None."""
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**64 else None


def trace_host(tracks: list[q.Track], rank: int) -> str | None:
    """The host an imported XSpace named (``<host>:<device>`` processes), when all of a rank's tracks agree."""
    hosts = {t.process.split(":", 1)[0] for t in tracks if t.rank == rank and ":" in t.process}
    return hosts.pop() if len(hosts) == 1 and all(":" in t.process for t in tracks if t.rank == rank) else None


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
        base = out_dir / "plugins" / "profile"
        default_host = safe_name(run.get("host") or "localhost")
        written: list[Path] = []
        with store.reader() as con:
            origin = q.time_origin_ns(con, run["id"])
            tracks = q.tracks(con, run["id"])
            ranks = q.ranks(con, run["id"]) or [0]
            all_steps = q.steps(con, run["id"])
            verdicts = q.op_verdicts(con, run["id"])
            progress = Progress(f"export tensorboard {run['id']}", sum(t.events for t in tracks))
            # A long run's trace windows (issue 21) are one XProf session each: <run>_wNNN_<reason>/.  A run with one
            # window (a short script) or none keeps the single <run>/ session.
            windows = q.trace_windows(con, run["id"])
            sessions: list[tuple[Path, tuple[int, int] | None, tuple[int, int] | None]] = [
                (base / safe_name(run["id"]), None, None)
            ]
            if len({w[0] for w in windows}) > 1:
                sessions = [
                    (base / f"{safe_name(run['id'])}_w{wid:03d}_{reason}", (first, first + n), (lo, hi))
                    for wid, reason, first, n, lo, hi, _ in windows
                ]
            for run_dir, ids, step_range in sessions:
                steps = [s for s in all_steps if step_range is None or step_range[0] <= s[1] <= step_range[1]]
                written += self._sessions(con, run, run_dir, ids, ranks, tracks, steps, origin, verdicts, progress,
                                          default_host)  # fmt: skip
        progress.finish()
        if options.include_original:
            for original in original_xplanes(run):
                target = out_dir / "plugins" / "profile" / f"{safe_name(run['id'])}_original" / original.name
                with atomic_file(target) as fh, open(original, "rb") as src:
                    shutil.copyfileobj(src, fh)
                written.append(target)
        return written

    @staticmethod
    def _sessions(
        con: Any,
        run: dict[str, Any],
        run_dir: Path,
        ids: tuple[int, int] | None,
        ranks: list[int],
        tracks: list[q.Track],
        steps: list[Any],
        origin: int | None,
        verdicts: dict[tuple[str, str | None], str],
        progress: Progress,
        default_host: str,
    ) -> list[Path]:
        written: list[Path] = []
        for rank in ranks:
            # An imported trace keeps its own host's name (XProf lists hosts by file name).
            named = trace_host(tracks, rank) if run.get("source") == "import" else None
            host = safe_name(named) if named else default_host
            writer = _SpaceWriter(host, origin if origin is not None else 0, run, verdicts)
            multi = len({t.process for t in tracks if t.rank == rank and not t.on_device}) > 1
            for batch in q.iter_rows(q.xplane_event_batches(con, run["id"], rank, ids)):
                writer.add_batch(batch, multi, progress)
            writer.add_steps([s for s in steps if s[0] == rank])
            if ids is None or ids[0] == 0:  # the memory timeline goes with the run's (or its first window's) session
                writer.add_memory(q.memory_points(con, run["id"], rank))
            fname = f"{host}.xplane.pb" if ranks == [0] or named else f"{host}_{rank}.xplane.pb"
            path = run_dir / fname
            with atomic_file(path) as fh:
                fh.write(writer.space.SerializeToString())
            written.append(path)
        return written
