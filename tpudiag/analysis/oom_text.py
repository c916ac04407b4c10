"""Out-of-memory errors read from their text: which kind, the bytes asked for, used and available, and XLA's table
of the largest program allocations, parsed into rows.

The formats (examples with their sources in tests/test_memory_oom_text.py):

- torch on CUDA (``torch.OutOfMemoryError``): "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total
  capacity of 79.15 GiB of which 1.23 GiB is free. ... Of the allocated memory 75.00 GiB is allocated by PyTorch";
- torch on CPU: "DefaultCPUAllocator: can't allocate memory: you tried to allocate 4000000000 bytes" (also "not
  enough memory");
- XLA/TPU (RESOURCE_EXHAUSTED), compile time: "XLA:TPU compile permanent error. Ran out of memory in memory space
  hbm. Used 49.34G of 32.00G hbm. Exceeded hbm capacity by 17.34G." followed, when XLA prints it, by "Largest
  program allocations in hbm:" and numbered entries (Size, Operator, Shape, Unpadded size, Extra memory due to
  padding, XLA label, Allocation type);
- XLA/TPU at run time: "Attempting to reserve 3.95G at the bottom of memory. That was not possible. There are 1.92G
  free, ..." / "Attempting to allocate 1.20G. That was not possible." with "HBM capacity 8.00G".

XLA's sizes are binary (``HumanReadableNumBytes``: K = 1024).  Pure functions, no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_XLA_SIZE = r"(-?\d+(?:\.\d+)?)\s?([KMGTP]?)(?:i?B)?"
_GLOG_PREFIX = re.compile(r"^\s*\d{4}-\d\d-\d\d [\d:.]+: [EWIF]\s+\d+ \S+:\d+\] ?", re.MULTILINE)


def xla_bytes(number: str, unit: str) -> int:
    return round(float(number) * _UNITS[unit.upper()[:1] if unit else ""])


def size_bytes(text: str) -> int | None:
    """ "19.46G", "530.00M", "276.0K", "0B", "2.00 GiB", "512 MiB" -> bytes."""
    m = re.fullmatch(r"\s*" + _XLA_SIZE + r"\s*", text)
    return xla_bytes(m.group(1), m.group(2)) if m else None


@dataclass
class Allocation:
    index: int
    size_bytes: int | None = None
    shape: str | None = None
    operator: str | None = None
    unpadded_bytes: int | None = None
    padding_bytes: int | None = None
    expansion: float | None = None
    xla_label: str | None = None
    allocation_type: str | None = None


@dataclass
class OomText:
    kind: str  # "torch_oom" | "cpu_alloc" | "xla_hbm" | "xla_resource"
    phase: str | None = None  # "compile" | "runtime" | None
    memory_space: str | None = None
    requested_bytes: int | None = None
    live_bytes: int | None = None
    limit_bytes: int | None = None
    allocations: list[Allocation] = field(default_factory=list)


_CPU = re.compile(r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory)(?:: you tried to allocate (\d+))?")
_CUDA_TRIED = re.compile(r"Tried to allocate " + _XLA_SIZE)
_CUDA_TOTAL = re.compile(r"total capacity of " + _XLA_SIZE)
_CUDA_BY_TORCH = re.compile(r"(?:Of the allocated memory )?" + _XLA_SIZE + r" is allocated by PyTorch")
_XLA_RAN_OUT = re.compile(
    r"Ran out of memory in memory space (\w+)\.?\s*(?:\*\*)?\s*Used " + _XLA_SIZE + r" of " + _XLA_SIZE
)
_XLA_EXCEEDED = re.compile(r"Exceeded \w+ capacity by " + _XLA_SIZE)
_XLA_ATTEMPT = re.compile(r"Attempting to (?:reserve|allocate) " + _XLA_SIZE)
_XLA_CAPACITY = re.compile(r"HBM capacity " + _XLA_SIZE)
_XLA_CURRENT = re.compile(r"Currently allocated:\s*" + _XLA_SIZE)
_XLA_TC_SC = re.compile(
    r"TensorCore Hbm usage: "
    + _XLA_SIZE
    + r", SparseCore Hbm usage "
    + _XLA_SIZE
    + r", exceeding available bytes: "
    + _XLA_SIZE
)
_RESOURCE = re.compile(r"RESOURCE_EXHAUSTED|Resource exhausted", re.IGNORECASE)
_TORCH_OOM = re.compile(r"out of memory", re.IGNORECASE)


def parse(message: str, exception: str | None = None) -> OomText | None:
    """The out-of-memory error in ``message`` (``exception``: the exception's type name), or None if it is not one."""
    text = _GLOG_PREFIX.sub("", message)
    cpu = _CPU.search(text)
    if cpu:
        return OomText("cpu_alloc", "runtime", "host", requested_bytes=int(cpu.group(1)) if cpu.group(1) else None)
    ran_out = _XLA_RAN_OUT.search(text)
    if ran_out:
        space = ran_out.group(1).lower()
        used = xla_bytes(ran_out.group(2), ran_out.group(3))
        limit = xla_bytes(ran_out.group(4), ran_out.group(5))
        phase = "compile" if re.search(r"compil", text, re.IGNORECASE) else None
        exceeded = _XLA_EXCEEDED.search(text)
        return OomText(
            "xla_hbm",
            phase,
            space,
            requested_bytes=xla_bytes(exceeded.group(1), exceeded.group(2)) if exceeded else None,
            live_bytes=used,
            limit_bytes=limit,
            allocations=allocations(text),
        )
    tc_sc = _XLA_TC_SC.search(text)
    if tc_sc:
        used = xla_bytes(tc_sc.group(1), tc_sc.group(2)) + xla_bytes(tc_sc.group(3), tc_sc.group(4))
        return OomText(
            "xla_hbm", "compile", "hbm", live_bytes=used, limit_bytes=xla_bytes(tc_sc.group(5), tc_sc.group(6))
        )
    attempt = _XLA_ATTEMPT.search(text)
    if attempt and _RESOURCE.search(text):
        capacity = _XLA_CAPACITY.search(text)
        current = _XLA_CURRENT.search(text)
        return OomText(
            "xla_resource",
            "runtime",
            "hbm" if capacity else None,
            requested_bytes=xla_bytes(attempt.group(1), attempt.group(2)),
            live_bytes=xla_bytes(current.group(1), current.group(2)) if current else None,
            limit_bytes=xla_bytes(capacity.group(1), capacity.group(2)) if capacity else None,
            allocations=allocations(text),
        )
    if exception == "OutOfMemoryError" or (_TORCH_OOM.search(text) and "CUDA" in text):
        tried = _CUDA_TRIED.search(text)
        total = _CUDA_TOTAL.search(text)
        by_torch = _CUDA_BY_TORCH.search(text)
        return OomText(
            "torch_oom",
            "runtime",
            "device",
            requested_bytes=xla_bytes(tried.group(1), tried.group(2)) if tried else None,
            live_bytes=xla_bytes(by_torch.group(1), by_torch.group(2)) if by_torch else None,
            limit_bytes=xla_bytes(total.group(1), total.group(2)) if total else None,
        )
    if _RESOURCE.search(text) and re.search(r"memory", text, re.IGNORECASE):
        return OomText("xla_resource", None, None, allocations=allocations(text))
    return None


_TABLE_START = re.compile(r"Largest program allocations in \w+:?", re.IGNORECASE)
_ENTRY = re.compile(r"(?:^|\s)(\d+)\\?\.\s+Size:\s*")
_FIELDS = ("Operator", "Shape", "Unpadded size", "Extra memory due to padding", "XLA label", "Allocation type")
_FIELD = re.compile(r"\s*(" + "|".join(re.escape(f) for f in _FIELDS) + r"):\s*")


def allocations(text: str) -> list[Allocation]:
    """XLA's "Largest program allocations" entries as rows (empty when the message has no such table)."""
    text = _GLOG_PREFIX.sub("", text)
    start = _TABLE_START.search(text)
    if not start:
        return []
    body = text[start.end() :].replace("**", "")
    marks = list(_ENTRY.finditer(body))
    rows: list[Allocation] = []
    for i, m in enumerate(marks):
        chunk = body[m.end() : marks[i + 1].start() if i + 1 < len(marks) else len(body)]
        chunk = chunk.split("=====")[0]
        parts = _FIELD.split(chunk)
        row = Allocation(index=int(m.group(1)))
        size = re.match(_XLA_SIZE, parts[0].strip())
        row.size_bytes = xla_bytes(size.group(1), size.group(2)) if size else None
        for name, value in zip(parts[1::2], parts[2::2], strict=False):
            value = " ".join(value.split())
            if name == "Operator":
                row.operator = value
            elif name == "Shape":
                row.shape = value
            elif name == "Unpadded size":
                row.unpadded_bytes = size_bytes(value)
            elif name == "Extra memory due to padding":
                pad = re.match(_XLA_SIZE + r"(?:\s*\((\d+(?:\.\d+)?)x expansion\))?", value)
                if pad:
                    row.padding_bytes = xla_bytes(pad.group(1), pad.group(2))
                    row.expansion = float(pad.group(3)) if pad.group(3) else None
            elif name == "XLA label":
                row.xla_label = value
            elif name == "Allocation type":
                row.allocation_type = value
        rows.append(row)
    return rows
