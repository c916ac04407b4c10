"""The report's ``hlo_ops`` section: XLA runs (TPU, or XLA's CPU/GPU backends) per HLO op, per chip, per kind.

What a TPU user reads first in XProf, from the stored events: each chip's busy time split into compute, copy and
collective ops, the ``Async XLA Ops`` line apart (async copies and collectives overlap compute, so they are not
busy time), and the top HLO ops with their FLOP rate and memory bandwidth against the chip's peaks (read from the
device planes of the XSpace files kept beside the run).  Self times are summed over chips, as XProf's
``hlo_stats`` sums them; ``per_chip_us`` is that sum divided by the chips that ran the op.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tpudiag.store import Store, hlo_queries
from tpudiag.traces.xplane_device_info import DevicePeak, peaks_of_files

KINDS = ("compute", "copy", "collective")


def _kept_xspaces(run: dict[str, Any]) -> list[Path]:
    folder = run.get("artifacts_dir")
    if not folder or not Path(folder).is_dir():
        return []
    return sorted(p for p in Path(folder).rglob("*.xplane.pb") if p.is_file())


def build_section(store: Store, run: dict[str, Any], top: int = 20) -> dict[str, Any] | None:
    if not hlo_queries.has_hlo_ops(store, run["id"]):
        return None
    peaks = peaks_of_files(_kept_xspaces(run))
    ops = hlo_queries.hlo_ops(store, run["id"], limit=top)
    for op in ops:
        op.update(_utilisation(op, peaks))
    return {"devices": _devices(hlo_queries.device_totals(store, run["id"]), peaks), "ops": ops}


def _utilisation(op: dict[str, Any], peaks: dict[str, DevicePeak]) -> dict[str, Any]:
    """FLOP rate and bytes per second of the op's device self time, and their share of the chips' peaks."""
    seconds = op["self_us"] / 1e6
    flop_rate = op["flops"] / seconds if op["flops"] and seconds > 0 else None
    byte_rate = op["bytes_accessed"] / seconds if op["bytes_accessed"] and seconds > 0 else None
    chips = [peaks[d] for d in op["per_device"] if d in peaks]
    peak_flops = sum(p.peak_tflops for p in chips if p.peak_tflops) / len(chips) * 1e12 if chips else 0.0
    peak_bytes = sum(p.peak_hbm_gbps for p in chips if p.peak_hbm_gbps) / len(chips) * 1e9 if chips else 0.0
    n = max(len(op["per_device"]), 1)
    return {
        "per_chip_us": round(op["self_us"] / n, 3),
        "gflops_per_s": round(flop_rate / 1e9, 3) if flop_rate is not None else None,
        "gbytes_per_s": round(byte_rate / 1e9, 3) if byte_rate is not None else None,
        # Summed work over summed time is the per-chip rate; the peak is one chip's.
        "flops_util": round(flop_rate / peak_flops, 6) if flop_rate is not None and peak_flops else None,
        "hbm_bw_util": round(byte_rate / peak_bytes, 6) if byte_rate is not None and peak_bytes else None,
    }


def _devices(rows: list[dict[str, Any]], peaks: dict[str, DevicePeak]) -> list[dict[str, Any]]:
    by_device: dict[str, dict[str, Any]] = {}
    for r in rows:
        d = by_device.setdefault(
            r["device"],
            {"device": r["device"], "busy_us": 0.0, "async_us": 0.0, **{f"{k}_us": 0.0 for k in KINDS}, "span": []},
        )
        if r["category"] == hlo_queries.ASYNC_OP_CATEGORY:
            d["async_us"] += float(r["total_us"])
        else:
            d["busy_us"] += float(r["self_us"])
            d[f"{hlo_queries.op_kind(r['hlo_category'], r['name'])}_us"] += float(r["self_us"])
            d["span"] += [int(r["first_ns"]), int(r["last_ns"])]
    out = []
    for name in sorted(by_device):
        d = by_device[name]
        span = d.pop("span")
        d["span_us"] = round((max(span) - min(span)) / 1e3, 3) if span else 0.0
        for key in ("busy_us", "async_us", *(f"{k}_us" for k in KINDS)):
            d[key] = round(d[key], 3)
        peak = peaks.get(name)
        d["device_type"] = peak.device_type if peak else None
        d["peak_tflops"] = peak.peak_tflops if peak else None
        d["peak_hbm_gbps"] = peak.peak_hbm_gbps if peak else None
        out.append(d)
    return out


def _us(v: float) -> str:
    from tpudiag.report import human_us

    return human_us(v)


def _pct(v: float | None) -> str:
    """A share of peak; above 100% the op's time is too short for its bytes to mean a rate (an async start)."""
    return "-" if v is None else ">100%" if v > 1 else f"{100 * v:.1f}%"


def render_section(section: dict[str, Any]) -> list[str]:
    from tpudiag.report import table

    lines = ["XLA time per device (HLO ops; async copies/collectives overlap and are listed apart):"]
    rows = [
        [
            d["device"] + (f" ({d['device_type']})" if d["device_type"] else ""),
            _us(d["busy_us"]),
            _us(d["span_us"]),
            *(_us(d[f"{k}_us"]) for k in KINDS),
            _us(d["async_us"]),
        ]
        for d in section["devices"]
    ]
    # A CPU backend's ops run on host threads: "device" is the host CPU, with no peak rates in the trace.
    lines += [
        "  " + line for line in table(["chip", "busy", "span", *KINDS, "async line"], rows, right=set(range(1, 7)))
    ]
    lines += ["", "slowest HLO ops by device self time (summed over chips; per chip = sum / chips):"]
    op_rows = [
        [
            o["name"],
            o["module"] or "-",
            o["kind"],
            str(o["occurrences"]),
            _us(o["self_us"]),
            _us(o["per_chip_us"]),
            _pct(o["flops_util"]),
            _pct(o["hbm_bw_util"]),
        ]
        for o in section["ops"]
    ]
    headers = ["hlo op", "module", "kind", "calls", "self", "per chip", "FLOPs util", "HBM BW util"]
    lines += ["  " + line for line in table(headers, op_rows, right={3, 4, 5, 6, 7})]
    return lines
