"""Reader of TORCH_TRACE logs (``dedicated_log_torch_trace_*.log``, the files tlparse reads) -> CompileEvents.

Format: one record per glog line ``V1130 05:13:45.711000 13044 torch/_dynamo/utils.py:2350] {json metadata}``
followed by its payload, one line per payload line, each prefixed with a TAB.  A job writes one file per rank
(``dedicated_log_torch_trace_rank_3_<random>.log`` under torch.distributed).  Records are interpreted by
``tpudiag.analysis.compile_events.CompileEventBuilder``, the same code the live compile collector uses.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from tpudiag.analysis.compile_events import CompileEventBuilder
from tpudiag.errors import ImportFormatError
from tpudiag.model import CompileEvent
from tpudiag.progress import StatusLine

FILE_PREFIX = "dedicated_log_torch_trace_"
_GLOG = re.compile(rb"^[VIWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) +\d+ [^\]]*\] ")
_RANK = re.compile(r"rank_(\d+)_")
_decoder = msgspec.json.Decoder()

Progress = Callable[[str], None]


def _looks_like_trace(path: Path) -> bool:
    try:
        with path.open("rb") as fh:
            first = fh.readline(1 << 20)
    except OSError:
        return False
    m = _GLOG.match(first)
    return m is not None and first[m.end() :].lstrip().startswith(b"{")


def trace_files(path: Path) -> list[Path]:
    """The TORCH_TRACE log files at ``path`` (a file, or a folder searched recursively), in a stable order."""
    if path.is_file():
        return [path] if path.name.startswith(FILE_PREFIX) or _looks_like_trace(path) else []
    if path.is_dir():
        return sorted(p for p in path.rglob(f"{FILE_PREFIX}*.log") if p.is_file())
    return []


def is_torch_trace(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a TORCH_TRACE log or a folder holding some (cheap: names and one line)."""
    files = trace_files(Path(path))
    return bool(files) and _looks_like_trace(files[0])


def rank_of(path: Path) -> int | None:
    m = _RANK.search(path.name)
    return int(m.group(1)) if m else None


def _timestamp_ns(m: re.Match[bytes], year: int) -> int:
    """glog prints local month/day/time without a year: the file's modification year fills it in."""
    month, day, hh, mm, ss, us = (int(g) for g in m.groups())
    try:
        epoch = time.mktime((year, month, day, hh, mm, ss, 0, 0, -1))
    except (OverflowError, ValueError):
        return 0
    return int(epoch) * 1_000_000_000 + us * 1000


def records(
    path: Path,
    wants_payload: Callable[[dict[str, Any]], bool] | None = None,
    progress: Progress | None = None,
) -> Iterator[tuple[dict[str, Any], str | None, int]]:
    """(metadata, payload, ts_ns) for each record of one file; payloads only where ``wants_payload`` says."""
    year = time.localtime(path.stat().st_mtime).tm_year
    size = max(path.stat().st_size, 1)
    meta: dict[str, Any] | None = None
    ts = 0
    keep = False
    lines: list[bytes] = []
    last_report = time.monotonic()
    done = 0
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            done += len(raw)
            if raw.startswith(b"\t"):
                if meta is None:
                    raise ImportFormatError(f"{path}:{lineno}: payload line before any record (not a TORCH_TRACE log?)")
                if keep:
                    lines.append(raw[1:].rstrip(b"\n"))
                continue
            if meta is not None:
                yield meta, (b"\n".join(lines).decode("utf-8", "replace") if keep else None), ts
                meta, lines = None, []
            if not raw.strip():
                continue
            m = _GLOG.match(raw)
            if not m:
                raise ImportFormatError(f"{path}:{lineno}: not a TORCH_TRACE record (expected a glog prefix)")
            try:
                decoded = _decoder.decode(raw[m.end() :])
            except msgspec.DecodeError as err:
                raise ImportFormatError(f"{path}:{lineno}: bad record metadata JSON ({err})") from None
            if not isinstance(decoded, dict):
                raise ImportFormatError(f"{path}:{lineno}: record metadata is not a JSON object")
            meta, ts = decoded, _timestamp_ns(m, year)
            keep = bool(decoded.get("has_payload")) and (wants_payload is None or wants_payload(decoded))
            if progress is not None and time.monotonic() - last_report > 0.5:
                last_report = time.monotonic()
                progress(f"{path.name}: {done / 1e6:.0f}/{size / 1e6:.0f} MB")
    if meta is not None:
        yield meta, (b"\n".join(lines).decode("utf-8", "replace") if keep else None), ts


def read_torch_trace(
    path: str | os.PathLike[str],
    run_id: str,
    progress: Progress | None = None,
) -> list[CompileEvent]:
    """All CompileEvents of a TORCH_TRACE file or folder (one builder per file: each is one process)."""
    root = Path(path)
    if not root.exists():
        raise ImportFormatError(f"no such file or folder: {root}")
    files = trace_files(root)
    if not files:
        raise ImportFormatError(f"{root}: no TORCH_TRACE logs ({FILE_PREFIX}*.log) found")
    line: StatusLine | None = None
    if progress is None and sys.stderr.isatty() and sum(f.stat().st_size for f in files) > 50_000_000:
        line = StatusLine(interval_s=0)
        progress = functools.partial(_reading, line)
    events: list[CompileEvent] = []
    for index, file in enumerate(files):
        rank = rank_of(file)
        builder = CompileEventBuilder(run_id, rank=rank if rank is not None else index, first_seq=len(events))
        try:
            for meta, payload, ts in records(file, builder.wants_payload, progress):
                events += builder.feed(meta, payload, ts)
        except OSError as err:
            raise ImportFormatError(f"cannot read {file}: {err.strerror or err}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ImportFormatError(f"{file}: unexpected record shape ({type(err).__name__}: {err})") from None
        events += builder.finish()
    if line is not None:
        line.done()
    return events


def _reading(line: StatusLine, text: str) -> None:
    line(f"reading torch trace {text}")
