"""What each device plane of an XSpace says about its chip: type and peak rates (XProf's ``perf_env``).

TPU runtimes write plane-level stats on ``/device:TPU:N``: ``device_type_string`` ("TPU v6 Lite"),
``peak_teraflops_per_second`` and ``peak_hbm_bw_gigabytes_per_second``.  They are not events, so the events
table does not hold them; the report reads them from the XSpace files kept beside a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from google.protobuf.message import DecodeError

from tpudiag.traces import xplane_proto


@dataclass(frozen=True)
class DevicePeak:
    device: str  # "TPU:0"
    device_type: str | None
    peak_tflops: float | None  # per second
    peak_hbm_gbps: float | None  # GB (1e9 bytes) per second


def device_peaks(data: bytes) -> list[DevicePeak]:
    """The device planes' chip type and peaks (planes without any of them are left out); [] when unreadable."""
    try:
        space = xplane_proto.parse_raw_xspace(data)
    except DecodeError:
        return []
    out = []
    for plane in space.planes:
        if not plane.name.startswith("/device:"):
            continue
        names = {k: m.name for k, m in plane.stat_metadata.items()}
        stats = {names.get(s.metadata_id, ""): xplane_proto.stat_value(s, plane) for s in plane.stats}
        kind, tflops, hbm = (
            stats.get("device_type_string"),
            stats.get("peak_teraflops_per_second"),
            stats.get("peak_hbm_bw_gigabytes_per_second"),
        )
        if kind is None and tflops is None and hbm is None:
            continue
        out.append(
            DevicePeak(
                device=plane.name.removeprefix("/device:"),
                device_type=str(kind) if kind is not None else None,
                peak_tflops=float(tflops) if isinstance(tflops, int | float) and tflops > 0 else None,
                peak_hbm_gbps=float(hbm) if isinstance(hbm, int | float) and hbm > 0 else None,
            )
        )
    return out


def peaks_of_files(paths: list[Path]) -> dict[str, DevicePeak]:
    """Device -> its peaks, over the XSpace files (the first file that names a device wins)."""
    out: dict[str, DevicePeak] = {}
    for path in paths:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        for peak in device_peaks(data):
            out.setdefault(peak.device, peak)
    return out
