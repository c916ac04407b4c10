"""Perfetto / Chrome trace export: ``<out>/<run>.trace.json`` (or ``.json.gz``), Chrome trace-event format.

ui.perfetto.dev and chrome://tracing open it.  Contents:
- ``M`` events name every process (``rank N: <process>``) and thread, so tracks read like the source trace;
- one ``X`` (complete) event per stored trace event, ``ts``/``dur`` in microseconds from the run's first
  event with nanosecond decimals, ``args`` holding module, phase, input shapes/dtypes, step, self time, ids
  and, when the run has numerics results, the op's worst verdict for its (op, module);
- flow events (``s`` on the host op, ``f`` with ``bp: e`` on the device event) link host ops to the device
  work they launched (``launch_id`` or a shared correlation id);
- a long run's trace windows (issue 21): one slice per window, named by its reason, on a "tpudiag windows" track.
- counter tracks (``C`` events) of the memory collector: live bytes in the trace windows and the per-step figures,
  on a process of their own named "memory".

The event JSON is produced by DuckDB (one text per row, streamed in Arrow batches), so a million events never
become Python dicts.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import IO, Any, cast

from tpudiag.atomic_file import atomic_file
from tpudiag.exporters import ExportOptions, safe_name
from tpudiag.progress import Progress
from tpudiag.store import Store
from tpudiag.store import export_queries as q


def _metadata_events(tracks: list[tuple[int, int, int, str, str, bool]]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    seen: set[int] = set()
    for pid, tid, rank, process, thread, on_device in tracks:
        if pid not in seen:
            seen.add(pid)
            label = f"rank {rank}: {process}" + (" (device)" if on_device else "")
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return events


def _flow_events(
    flows: list[tuple[int, str, str, int, int, str, str, int]],
    ids: dict[tuple[int, str, str], tuple[int, int]],
    origin_ns: int,
) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for fid, hproc, hthread, hstart, rank, dproc, dthread, dstart in flows:
        hpid, htid = ids[(rank, hproc, hthread)]
        dpid, dtid = ids[(rank, dproc, dthread)]
        common = {"name": "launch", "cat": "flow", "id": fid}
        events.append({**common, "ph": "s", "pid": hpid, "tid": htid, "ts": _us(hstart - origin_ns)})
        events.append({**common, "ph": "f", "bp": "e", "pid": dpid, "tid": dtid, "ts": _us(dstart - origin_ns)})
    return events


def _window_events(
    spans: list[tuple[int, str, int, int, str | None]], pid: int, origin_ns: int
) -> list[dict[str, Any]]:
    """A long run's trace windows (issue 21) as one slice each on a "tpudiag windows" track, so each profiler
    session is found and zoomed to at once; nothing for a run with a single window (a short script)."""
    if len(spans) < 2:
        return []
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "tpudiag windows"}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "windows"}},
    ]
    for wid, reason, start, end, detail in spans:
        events.append(
            {"ph": "X", "name": f"window {wid}: {reason}", "cat": "tpudiag_window", "pid": pid, "tid": 1,
             "ts": _us(start - origin_ns), "dur": _us(max(end - start, 0)), "args": {"detail": detail or ""}}
        )  # fmt: skip
    return events


def _memory_events(counters: list[tuple[str, int, str, int]], pid: int, origin_ns: int) -> list[dict[str, Any]]:
    if not counters:
        return []
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "memory"}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
    ]
    for name, ts, series, value in counters:
        events.append({"ph": "C", "name": name, "pid": pid, "ts": _us(ts - origin_ns), "args": {series: value}})
    return events


def _us(ns: int) -> float:
    return round(ns / 1000, 3)


class PerfettoExporter:
    name = "perfetto"
    description = "Chrome trace-event JSON for ui.perfetto.dev and chrome://tracing (--gzip for .json.gz)"

    def export(self, store: Store, run: dict[str, Any], out_dir: Path, options: ExportOptions) -> list[Path]:
        suffix = ".trace.json.gz" if options.gzip else ".trace.json"
        path = out_dir / f"{safe_name(run['id'])}{suffix}"
        with store.reader() as con:
            origin = q.time_origin_ns(con, run["id"]) or 0
            tracks = q.chrome_track_names(con, run["id"])
            ids = {(rank, proc, thread): (pid, tid) for pid, tid, rank, proc, thread, _ in tracks}
            flows = _flow_events(q.chrome_flows(con, run["id"]), ids, origin)
            memory_pid = max((t[0] for t in tracks), default=0) + 1
            flows += _memory_events(q.memory_counters(con, run["id"]), memory_pid, origin)
            flows += _window_events(q.window_spans(con, run["id"]), memory_pid + 1, origin)
            total = q.count_rows(con, "trace_events", run["id"])
            progress = Progress(f"export perfetto {run['id']}", total)
            header = {
                "displayTimeUnit": "ns",
                "otherData": {
                    "tpudiag_run": run["id"],
                    "run_name": run.get("name"),
                    "host": run.get("host"),
                    "device": run.get("device_kind"),
                    "origin_epoch_ns": origin,
                },
            }
            with atomic_file(path) as raw:
                fh = cast(IO[bytes], gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=3) if options.gzip else raw)
                try:
                    self._write(fh, header, _metadata_events(tracks), flows, con, run["id"], origin, progress)
                finally:
                    if options.gzip:
                        fh.close()
        progress.finish()
        return [path]

    @staticmethod
    def _write(
        fh: IO[bytes],
        header: dict[str, Any],
        meta: list[dict[str, Any]],
        flows: list[dict[str, Any]],
        con: Any,
        run_id: str,
        origin: int,
        progress: Progress,
    ) -> None:
        head = json.dumps(header)[:-1]  # reopen the object to append traceEvents
        fh.write(f'{head}, "traceEvents": [\n'.encode())
        first = True
        for small in (meta, flows):
            for ev in small:
                fh.write((("" if first else ",\n") + json.dumps(ev, separators=(",", ":"))).encode())
                first = False
        for batch in q.iter_rows(q.chrome_event_json(con, run_id, origin)):
            texts = batch.column(0).to_pylist()
            chunk = ",\n".join(texts)
            fh.write((chunk if first else ",\n" + chunk).encode())
            first = False
            progress.advance(len(texts))
        fh.write(b"\n]}\n")
