"""TensorBoard export end to end: a real capture, a real TensorBoard server, its profile plugin's HTTP API."""

from __future__ import annotations

import collections
import gzip
import json
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_tpudiag
from tpudiag.exporters.xplane_export import framework_op_name
from tpudiag.traces import xplane_proto as xp

SCRIPT = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(4):
    x = torch.randn(8, 16)
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("done")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _get(base: str, path: str, **params: str) -> Any:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}" if params else f"{base}{path}"
    req = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        body = resp.read()
        if resp.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
    return json.loads(body)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("tb")
    (work / "tiny_train.py").write_text(SCRIPT)
    db = str(work / "store.duckdb")
    cap = run_tpudiag("capture", "--db", db, "--collect", "trace", "tiny_train.py", cwd=work)
    assert cap.returncode == 0, cap.stderr
    rep = run_tpudiag("report", "--db", db, "--json", "--top", "100000", cwd=work)
    assert rep.returncode == 0, rep.stderr
    report = json.loads(rep.stdout)
    out = work / "logdir"
    exp = run_tpudiag("export", "--db", db, "--format", "tensorboard", "--out", str(out), cwd=work)
    assert exp.returncode == 0, exp.stderr
    return {"report": report, "out": out, "files": [Path(p) for p in exp.stdout.split()]}


@pytest.fixture(scope="module")
def server(exported: dict[str, Any]) -> Iterator[str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(exported["out"]), "--host", "127.0.0.1",
           "--port", str(port)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"tensorboard exited: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
            try:
                _get(base, "/data/plugin/profile/runs")
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("tensorboard did not answer within 120 s")
                time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def _rows(table: dict[str, Any]) -> list[dict[str, Any]]:
    cols = [c["id"] for c in table["cols"]]
    return [dict(zip(cols, [c.get("v") for c in row["c"]], strict=True)) for row in table["rows"]]


@pytest.mark.slow
def test_tensorboard_serves_framework_op_stats_equal_to_report(exported: dict[str, Any], server: str) -> None:
    run_id = exported["report"]["run"]["id"]
    [xplane] = exported["files"]
    assert xplane.parent.name == run_id and xplane.name.endswith(".xplane.pb")
    host = xplane.name[: -len(".xplane.pb")]

    assert run_id in _get(server, "/data/plugin/profile/runs")
    tools = {t.rstrip("@^") for t in _get(server, "/data/plugin/profile/run_tools", run=run_id)}
    assert {"framework_op_stats", "trace_viewer"} <= tools

    data = _get(server, "/data/plugin/profile/data", run=run_id, tag="framework_op_stats", host=host)
    table = data[0] if isinstance(data, list) else data
    got = {r["operation"]: r for r in _rows(table) if r["host_or_device"] == "Host" and r["type"] != "IDLE"}
    want = exported["report"]["slow_ops"]
    assert len(want) > 10
    assert len(got) == len(want)
    for op in want:
        name = framework_op_name(op["name"], op["module"])[0].split(":")[0]
        row = got[name]
        assert row["occurrences"] == op["calls"], name
        assert row["total_self_time"] == pytest.approx(op["self_us"], rel=0.01, abs=0.01), name
        assert row["total_time"] == pytest.approx(op["total_us"], rel=0.01, abs=0.01), name

    trace = _get(server, "/data/plugin/profile/data", run=run_id, tag="trace_viewer@", host=host)
    # Trace Viewer: every op event of the report, under its own name, as many times as the report counts it.
    shown = collections.Counter(e["name"] for e in trace["traceEvents"] if e.get("ph") == "X")
    calls: collections.Counter[str] = collections.Counter()
    for op in want:
        calls[op["name"]] += op["calls"]
    assert {"aten::addmm", "aten::relu"} <= set(calls)
    assert {name: shown[name] for name in calls} == dict(calls)


def test_xplane_file_structure(exported: dict[str, Any]) -> None:
    [xplane] = exported["files"]
    space = xp.parse_xspace(xplane.read_bytes())
    host = next(p for p in space.planes if p.name == "/host:CPU")
    lines = {line.name: line for line in host.lines}
    assert "Steps" in lines
    assert len(lines["Steps"].events) == exported["report"]["steps"]["count"] == 4
    is_eager = next(k for k, m in host.stat_metadata.items() if m.name == "is_eager")
    ops = [
        (host.event_metadata[e.metadata_id], e)
        for line in host.lines
        for e in line.events
        if any(s.metadata_id == is_eager and s.int64_value == 1 for s in e.stats)
    ]
    report_ops = {(op["name"], op["module"]) for op in exported["report"]["slow_ops"]}
    for meta, _event in ops:
        module = meta.name.split("/")[0] if "/" in meta.name else None
        assert (meta.display_name, module) in report_ops
        assert ":" in meta.name
    assert sum(op["calls"] for op in exported["report"]["slow_ops"]) == len(ops)


@pytest.mark.parametrize(
    ("op", "module", "expected"),
    [
        ("aten::addmm", "blocks.0.fc", ("blocks.0.fc/aten.addmm:addmm", "addmm")),
        ("aten::_log_softmax", None, ("aten._log_softmax:_log_softmax", "_log_softmax")),
        ("detach", "Model", ("Model/detach:detach", "detach")),
        ("my ns::op(x)", "_orig_mod.h[0]", ("m_orig_mod.h_0_/my_ns.op_x_:op_x_", "op_x_")),
        (
            "autograd::engine::evaluate_function: TBackward0",
            "0",
            ("0/autograd.engine.evaluate_function.TBackward0:TBackward0", "TBackward0"),
        ),
        ("mylib::fusedOp", None, ("mylib.fusedOp:FusedOp", "FusedOp")),
        ("ProfilerStep#3", None, ("ProfilerStep_3:ProfilerStep_3", "ProfilerStep_3")),
    ],
)
def test_framework_op_name(op: str, module: str | None, expected: tuple[str, str]) -> None:
    assert framework_op_name(op, module) == expected


# Names that need sanitising, with their (XProf operation, type): XProf silently drops op types that are not
# CamelCase-or-lowercase identifiers, so each must reach framework_op_stats with its call count.
AWKWARD = [
    ("aten::addmm", "blocks.0.fc", 3),
    ("my ns::op(x)", "_orig_mod.h[0]", 2),
    ("autograd::engine::evaluate_function: TBackward0", "0", 4),
    ("mylib::fusedOp", None, 1),
    ("aten::_log_softmax", None, 5),
    ("detach", "Model", 2),
]
XPROF_TOOLS = """
import json, sys
from xprof.convert import raw_to_tool_data as r
data, _ = r.xspace_to_tool_data([sys.argv[1]], "framework_op_stats", {})
table = json.loads(data)
table = table[0] if isinstance(table, list) else table
cols = [c["id"] for c in table["cols"]]
trace, _ = r.xspace_to_tool_data([sys.argv[1]], "trace_viewer@", {})
trace = json.loads(trace)
print(json.dumps({"ops": [dict(zip(cols, [c.get("v") for c in row["c"]])) for row in table["rows"]],
                  "events": [e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"]}))
"""


def test_sanitised_op_names_reach_xprof_framework_op_stats_with_their_counts(tmp_path: Path) -> None:
    from tests.factories import make_event, make_run, store_with
    from tpudiag.model import TraceEvent
    from tpudiag.store import Store

    db = tmp_path / "s.duckdb"
    run = make_run()
    events, t, k = [], 1_700_000_000_000_000_000, 0
    for name, module, calls in AWKWARD:
        for _ in range(calls):
            events.append(make_event(run.id, k, name, t, 1000 + k, module=module, process="python", thread="main"))
            t += 5000
            k += 1
    store_with(Store(db), run, {TraceEvent: events})
    exp = run_tpudiag("export", "--db", str(db), run.id, "--format", "tensorboard", "--out", str(tmp_path / "logs"))
    assert exp.returncode == 0, exp.stderr
    [xplane] = [Path(p) for p in exp.stdout.split()]
    child = subprocess.run([sys.executable, "-c", XPROF_TOOLS, str(xplane)], capture_output=True, text=True,
                           timeout=300)  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    seen = json.loads(child.stdout)
    rows = {r["operation"]: r for r in seen["ops"] if r["host_or_device"] == "Host" and r["type"] != "IDLE"}
    expected = {}
    for name, module, calls in AWKWARD:
        full, op_type = framework_op_name(name, module)
        expected[full.split(":")[0]] = (op_type, calls)
    assert {op: (r["type"], r["occurrences"]) for op, r in rows.items()} == expected
    # The trace viewer shows each op event once, under the op's own name.
    names = collections.Counter(seen["events"])
    assert {n: names[n] for n, _, _ in AWKWARD} == {n: c for n, _, c in AWKWARD}
