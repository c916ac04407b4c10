"""Regenerate the small traces under sample_traces/ (used by the tests and the demo).

    python sample_traces/generate.py            # all
    python sample_traces/generate.py tpu        # only the synthetic TPU device-plane XSpace

- ``tpu_device.xplane.pb``: an XSpace built from the schema (tpudiag.traces.xplane_proto) with the conventions of a
  TorchTPU/XProf TPU profile: a ``/host:CPU`` plane and a ``/device:TPU:0`` plane with lines ``Steps``,
  ``XLA Modules`` and ``XLA Ops`` (each op with program_id, symbol_id, hlo_category, flops, bytes_accessed and the
  framework op it came from).  No real TPU profile is available to this project; this one is synthetic, and its
  expected numbers are in ``tpu_device.expected.json`` (computed here from what was written).
- ``cpu_mlp.trace.json.gz``: a Kineto trace of a tiny MLP training loop on CPU (torch.profiler).
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# (hlo op, hlo category, framework op, duration ps, flops, bytes)
TPU_OPS = [
    ("fusion.1", "convolution fusion", "aten::convolution", 420_000_000, 2_000_000_000, 3_000_000),
    ("dot.2", "matmul", "aten::addmm", 310_000_000, 1_500_000_000, 2_000_000),
    ("fusion.3", "loop fusion", "aten::relu", 45_000_000, 1_000_000, 4_000_000),
    ("reduce.4", "reduce", "aten::sum", 30_000_000, 500_000, 1_000_000),
    ("copy.5", "data formatting", "aten::copy_", 12_000_000, 0, 8_000_000),
]
TPU_STEPS = 4


def tpu_device_xspace() -> tuple[Any, dict[str, Any]]:
    """The synthetic TPU XSpace and its expected per-framework-op totals."""
    from tpudiag.traces import xplane_proto as xp

    space = xp.XSpace()
    space.hostnames.append("tpu-host")
    host = xp.PlaneBuilder.new(space, "/host:CPU", 1)
    hline = host.line(1, "python", timestamp_ns=1_700_000_000_000_000_000)
    tpu = xp.PlaneBuilder.new(space, "/device:TPU:0", 2)
    t0 = 1_700_000_000_000_000_000
    steps = tpu.line(1, "Steps", t0)
    modules = tpu.line(2, "XLA Modules", t0)
    ops = tpu.line(3, "XLA Ops", t0)
    expected: dict[str, dict[str, float]] = defaultdict(lambda: {"ps": 0, "calls": 0, "flops": 0.0, "bytes": 0.0})
    offset = 0
    for step in range(TPU_STEPS):
        step_len = sum(op[3] for op in TPU_OPS) + 10_000_000
        tpu.add_event(steps, str(step), offset, step_len, stats={"group_id": step, "step_num": step})
        host.add_event(hline, f"ProfilerStep#{step}", offset, step_len)
        tpu.add_event(modules, "jit_train_step(7)", offset, step_len - 5_000_000, metadata_stats={"program_id": 7})
        t = offset + 1_000_000
        for k, (hlo, cat, fw, dur, flops, nbytes) in enumerate(TPU_OPS):
            tpu.add_event(
                ops,
                hlo,
                t,
                dur,
                stats={"group_id": step},
                metadata_stats={
                    "program_id": 7,
                    "symbol_id": k + 1,
                    "hlo_category": cat,
                    "tf_op": f"{fw}:{fw.split('::')[-1]}",
                    "flops": flops,
                    "bytes_accessed": nbytes,
                    "long_name": f"%{hlo} = ...",
                },
            )
            e = expected[fw]
            e["ps"] += dur
            e["calls"] += 1
            e["flops"] += flops
            e["bytes"] += nbytes
            t += dur
        offset += step_len
    return space, {"ops": dict(expected), "steps": TPU_STEPS, "xla_ops": TPU_STEPS * len(TPU_OPS)}


def tpu_large_xspace(events: int, cores: int = 4, ops_per_step: int = 500) -> Any:
    """A large synthetic TPU XSpace (benchmarks): ``cores`` TPU planes of ``Steps``, ``XLA Modules`` and ``XLA Ops``.

    About ``events`` events in all, built with the same builder as ``tpu_device_xspace``: each core runs the same
    jitted step, ``ops_per_step`` HLO ops cycling over 64 metadata entries (shared metadata with program_id,
    symbol_id, hlo_category, tf_op, flops, bytes_accessed), every op event with its own ``group_id`` stat.
    """
    from tpudiag.traces import xplane_proto as xp

    space = xp.XSpace()
    space.hostnames.append("tpu-host")
    host = xp.PlaneBuilder.new(space, "/host:CPU", 1)
    hline = host.line(1, "python", timestamp_ns=1_700_000_000_000_000_000)
    steps = max(1, events // (cores * (ops_per_step + 2)))
    kinds = [(f"{hlo}.{k}", cat, fw) for k in range(64) for hlo, cat, fw, *_ in [TPU_OPS[k % len(TPU_OPS)]]]
    for core in range(cores):
        tpu = xp.PlaneBuilder.new(space, f"/device:TPU:{core}", 2 + core)
        t0 = 1_700_000_000_000_000_000
        step_line, module_line, op_line = (
            tpu.line(i + 1, n, t0) for i, n in enumerate(("Steps", "XLA Modules", "XLA Ops"))
        )
        offset = 0
        for step in range(steps):
            step_len = ops_per_step * 1_000_000 + 2_000_000
            tpu.add_event(step_line, str(step), offset, step_len, stats={"group_id": step, "step_num": step})
            if core == 0:
                host.add_event(hline, f"ProfilerStep#{step}", offset, step_len)
            tpu.add_event(
                module_line, "jit_train_step(7)", offset, step_len - 1_000_000, metadata_stats={"program_id": 7}
            )
            for k in range(ops_per_step):
                hlo, cat, fw = kinds[k % len(kinds)]
                tpu.add_event(
                    op_line,
                    hlo,
                    offset + 500_000 + k * 1_000_000,
                    900_000 - (k % 7) * 1_000,
                    stats={"group_id": step},
                    metadata_stats={
                        "program_id": 7,
                        "symbol_id": k % len(kinds) + 1,
                        "hlo_category": cat,
                        "tf_op": f"{fw}:{fw.split('::')[-1]}",
                        "flops": 1_000 * (k % 64 + 1),
                        "bytes_accessed": 4_096 * (k % 16 + 1),
                    },
                )
            offset += step_len
    return space


def write_tpu() -> None:
    space, expected = tpu_device_xspace()
    (HERE / "tpu_device.xplane.pb").write_bytes(space.SerializeToString())
    (HERE / "tpu_device.expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")


def write_cpu_mlp() -> None:
    import tempfile

    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    with torch.profiler.profile(record_shapes=True) as prof:
        for step in range(3):
            with torch.profiler.record_function(f"ProfilerStep#{step}"):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "t.json"
        prof.export_chrome_trace(str(out))
        (HERE / "cpu_mlp.trace.json.gz").write_bytes(gzip.compress(out.read_bytes(), mtime=0))


if __name__ == "__main__":
    which = set(sys.argv[1:]) or {"tpu", "cpu"}
    if "tpu" in which:
        write_tpu()
    if "cpu" in which:
        write_cpu_mlp()
