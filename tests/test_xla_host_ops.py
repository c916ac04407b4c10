"""XLA's CPU runtime runs the HLO ops on host threads (``tf_XLAEigen/...``, ``tf_XLAPjRtCpuClient/...``), each
event stamped with an ``hlo_op`` stat: a jax CPU trace ranks them as the program's ops, with their module."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from tests.conftest import SHARED_FIXTURES, run_tpudiag
from tpudiag.store import Store, hlo_queries
from tpudiag.traces import xplane_proto

FILES = ["xla/jax_cpu_train_step.xplane.pb", "xla/jax_cpu_matmul_tanh.xplane.pb"]
pytestmark = pytest.mark.skipif(not SHARED_FIXTURES.is_dir(), reason="../shared/fixtures is absent")


def hlo_events(path: Path) -> tuple[Counter[str], dict[str, int], dict[str, str]]:
    """Straight from the XSpace: per HLO op its event count, summed duration (ns) and module."""
    space = xplane_proto.parse_xspace(path.read_bytes())
    calls: Counter[str] = Counter()
    dur: dict[str, int] = defaultdict(int)
    module: dict[str, str] = {}
    for plane in space.planes:
        names = {k: m.name for k, m in plane.stat_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                stats = {names[s.metadata_id]: xplane_proto.stat_value(s, plane) for s in event.stats}
                if "hlo_op" in stats:
                    op = str(stats["hlo_op"])
                    calls[op] += 1
                    dur[op] += (event.offset_ps + event.duration_ps) // 1000 - event.offset_ps // 1000
                    module[op] = str(stats.get("hlo_module"))
    return calls, dur, module


@pytest.mark.parametrize("name", FILES)
def test_jax_cpu_trace_ranks_its_hlo_ops(tmp_path: Path, name: str) -> None:
    path = SHARED_FIXTURES / name
    calls, dur, module = hlo_events(path)
    assert calls, "the fixture has HLO op events"
    db = tmp_path / "store.duckdb"
    assert run_tpudiag("import", "--db", str(db), str(path), cwd=tmp_path).returncode == 0
    proc = run_tpudiag("report", "--db", str(db), "--json", "--top", "1000", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    ranked = {o["name"]: o for o in report["slow_ops"]}
    assert set(calls) <= set(ranked)  # every HLO op is an op of the run ...
    self_times = [o["self_us"] for o in report["slow_ops"]]
    assert self_times == sorted(self_times, reverse=True)
    listed = [o["name"] for o in report["hlo_ops"]["ops"]]
    assert set(listed) <= set(calls) and len(listed) == min(20, len(calls))  # the report's top HLO ops
    hlo = {o["name"]: o for o in hlo_queries.hlo_ops(Store(db), report["run"]["id"], limit=None)}
    assert set(hlo) == set(calls)  # ... and all of them, exactly, in the store's HLO view
    for op, n in calls.items():
        assert ranked[op]["calls"] == n and hlo[op]["occurrences"] == n
        assert hlo[op]["total_us"] == pytest.approx(dur[op] / 1e3, abs=1e-3)
        assert 0 < hlo[op]["self_us"] <= hlo[op]["total_us"]
        assert hlo[op]["module"] == module[op] and hlo[op]["per_device"].keys() == {"cpu:0"}
    text = run_tpudiag("report", "--db", str(db), cwd=tmp_path).stdout
    top = max(calls, key=lambda op: hlo[op]["self_us"])
    assert "slow ops: no op events" not in text and top in text and module[top] in text
