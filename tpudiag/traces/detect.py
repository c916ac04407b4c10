"""What kind of trace a file holds, decided from its content (the extension is only a hint).

- Kineto / Chrome trace JSON, plain or gzip: the (decompressed) text starts with ``{`` or ``[``;
- XPlane (``XSpace`` protobuf): the first byte is the tag of one of XSpace's fields (planes, errors, warnings,
  hostnames: all length-delimited) and the length that follows fits in the file;
- ``TORCH_TRACE`` logs: glog-prefixed lines (``V0101 12:00:00.000000 123 file.py:45] {json}``).
"""

from __future__ import annotations

import importlib.util
import re
import zlib
from pathlib import Path

from tpudiag.errors import ImportFormatError
from tpudiag.traces.protowire import varint_at

KINETO, XPLANE, TORCH_TRACE = "kineto", "xplane", "torch_trace"
TRACE_SUFFIXES = (".json", ".json.gz", ".xplane.pb", ".xspace.pb", ".log")
_SNIFF = 1 << 16
_XSPACE_TAGS = {0x0A, 0x12, 0x1A, 0x22}  # fields 1-4, wire type 2
_GLOG_LINE = re.compile(rb"^[VIWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ [^\]]*\] ")


def _head(path: Path) -> bytes:
    with path.open("rb") as f:
        data = f.read(_SNIFF)
    if data[:2] == b"\x1f\x8b":
        try:
            return zlib.decompressobj(wbits=31).decompress(data, _SNIFF)
        except zlib.error as err:
            raise ImportFormatError(f"{path}: corrupt gzip data ({err})") from None
    return data


def looks_like_xspace(head: bytes, size: int) -> bool:
    if not head or head[0] not in _XSPACE_TAGS:
        return False
    parsed = varint_at(head, 1)
    return parsed is not None and parsed[1] + parsed[0] <= size


def torch_trace_module_available() -> bool:
    return importlib.util.find_spec("tpudiag.traces.torch_trace") is not None


def detect(path: Path) -> str:
    """``kineto``, ``xplane`` or ``torch_trace``; ImportFormatError naming the file otherwise."""
    try:
        size = path.stat().st_size
        if size == 0:
            raise ImportFormatError(f"{path}: empty file")
        head = _head(path)
    except OSError as err:
        raise ImportFormatError(f"{path}: cannot read ({err.strerror or err})") from None
    text = head.lstrip(b" \t\r\n\xef\xbb\xbf")
    if text[:1] in (b"{", b"["):
        return KINETO
    if _GLOG_LINE.match(head):
        return TORCH_TRACE
    # Before the TORCH_TRACE reader is imported (msgspec and the compile-event analysis: ~40 ms): an XSpace starts
    # with a field tag byte, which no glog line (first byte V, I, W, E or F) does.
    if head[:2] != b"\x1f\x8b" and looks_like_xspace(head, size):
        return XPLANE
    if torch_trace_module_available():
        from tpudiag.traces import torch_trace

        if torch_trace.is_torch_trace(path):
            return TORCH_TRACE
    if not text:
        raise ImportFormatError(f"{path}: empty file")
    raise ImportFormatError(
        f"{path}: unrecognised format (expected Kineto/Chrome trace JSON, an XPlane .xplane.pb or a TORCH_TRACE log)"
    )


def expand(paths: list[Path]) -> list[Path]:
    """Files to import: files as given, folders searched recursively for trace files (sorted)."""
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(TRACE_SUFFIXES))
            if not found:
                raise ImportFormatError(f"{p}: no trace files in this folder ({', '.join(TRACE_SUFFIXES)})")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise ImportFormatError(f"{p}: no such file or folder")
    return out
