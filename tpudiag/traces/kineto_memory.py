"""The allocator events of a Kineto Chrome trace written with ``profile_memory=True``.

Each is an instant event ``{"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "ts": µs, "pid", "tid",
"args": {"Addr", "Bytes" (negative: a free), "Total Allocated", "Total Reserved", "Device Type", "Device Id"}}``.
Device Type follows c10's DeviceType (0 CPU, 1 CUDA, ..., 20 PrivateUse1); Total Allocated/Reserved are the
allocator's totals for that device after the event.  ``kineto.load`` keeps complete events only, so these are read
here, in one more pass over the file.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import msgspec
import numpy as np

from tpudiag.analysis.memory_events import MemoryEvents

DEVICE_TYPES = {0: "cpu", 1: "cuda", 8: "ipu", 12: "xpu", 13: "mps", 20: "privateuse1"}


class _MemArgs(msgspec.Struct, gc=False):
    addr: int = msgspec.field(default=0, name="Addr")
    nbytes: int = msgspec.field(default=0, name="Bytes")
    total_allocated: int | None = msgspec.field(default=None, name="Total Allocated")
    total_reserved: int | None = msgspec.field(default=None, name="Total Reserved")
    device_type: int = msgspec.field(default=0, name="Device Type")
    device_id: int = msgspec.field(default=-1, name="Device Id")


class _Event(msgspec.Struct, gc=False):
    ph: str = ""
    name: str = ""
    pid: int | str = ""
    tid: int | str = ""
    ts: float | None = None
    args: msgspec.Raw = msgspec.Raw()


class _Doc(msgspec.Struct, gc=False):
    traceEvents: list[_Event] = []
    baseTimeNanoseconds: int | float | None = None


_DOC = msgspec.json.Decoder(_Doc)
_ARGS = msgspec.json.Decoder(_MemArgs)


def _device_name(dtype: int, index: int) -> str:
    kind = DEVICE_TYPES.get(dtype, f"device{dtype}")
    return kind if kind == "cpu" or index < 0 else f"{kind}:{index}"


def load(path: Path) -> MemoryEvents:
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    doc = _DOC.decode(raw)
    base = doc.baseTimeNanoseconds
    base_ns = int(base) if isinstance(base, int | float) else 0
    rows = [e for e in doc.traceEvents if e.ph == "i" and e.name == "[memory]" and e.ts is not None]
    args = [_ARGS.decode(e.args) for e in rows]
    ts = np.array([e.ts for e in rows], dtype=np.float64)
    whole = np.floor(ts)
    ts_ns = whole.astype(np.int64) * 1000 + np.rint((ts - whole) * 1000).astype(np.int64) + base_ns
    devices: dict[tuple[int, int], int] = {}
    device = np.array([devices.setdefault((a.device_type, a.device_id), len(devices)) for a in args], dtype=np.int32)
    order = np.argsort(ts_ns, kind="stable")
    return MemoryEvents(
        ts_ns=ts_ns[order],
        addr=np.array([a.addr for a in args], dtype=np.int64)[order] if args else np.zeros(0, np.int64),
        nbytes=np.array([a.nbytes for a in args], dtype=np.int64)[order] if args else np.zeros(0, np.int64),
        total_allocated=np.array(
            [-1 if a.total_allocated is None else a.total_allocated for a in args], dtype=np.int64
        )[order]
        if args
        else np.zeros(0, np.int64),
        total_reserved=np.array([-1 if a.total_reserved is None else a.total_reserved for a in args], dtype=np.int64)[
            order
        ]
        if args
        else np.zeros(0, np.int64),
        device=device[order] if args else np.zeros(0, np.int32),
        devices=[_device_name(t, i) for (t, i) in devices],
        threads=[(str(rows[i].pid), str(rows[i].tid)) for i in order.tolist()],
    )
