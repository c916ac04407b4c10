"""Run-time XPlane message classes: real XSpace files round-trip through them; builders make valid planes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from google.protobuf.unknown_fields import UnknownFieldSet

from tpudiag.traces import xplane_proto as xp

FIXTURES = (
    "xla/jax_cpu_matmul_tanh.xplane.pb",
    "xla/jax_cpu_train_step.xplane.pb",
    "torch_tpu/host_only_cpu_activity.xplane.pb",
)


def _unknown_fields(msg: Any) -> int:
    """Unknown fields anywhere in the tree: > 0 means our descriptor misses a field the writer used."""
    count = len(UnknownFieldSet(msg))
    for fd, value in msg.ListFields():
        if fd.type != fd.TYPE_MESSAGE:
            continue
        if fd.message_type.GetOptions().map_entry:
            children = list(value.values())
        elif fd.is_repeated:
            children = list(value)
        else:
            children = [value]
        count += sum(_unknown_fields(c) for c in children)
    return count


@pytest.mark.parametrize("name", FIXTURES)
def test_real_xspace_round_trips_field_identically(shared_fixtures: Path, name: str) -> None:
    raw = (shared_fixtures / name).read_bytes()
    space = xp.parse_xspace(raw)
    assert _unknown_fields(space) == 0
    again = space.SerializeToString()
    # Same fields and values; map entries may come out in another order, so compare messages, and sizes.
    assert len(again) == len(raw)
    assert xp.parse_xspace(again) == space
    host = [p for p in space.planes if p.name == "/host:CPU"]
    assert host and sum(len(line.events) for line in host[0].lines) > 0
    for plane in space.planes:
        for line in plane.lines:
            for event in line.events:
                assert event.metadata_id in plane.event_metadata


def test_known_fixture_contents(shared_fixtures: Path) -> None:
    space = xp.parse_xspace((shared_fixtures / "xla/jax_cpu_matmul_tanh.xplane.pb").read_bytes())
    host = next(p for p in space.planes if p.name == "/host:CPU")
    # 469 events: the count xprof's own Events DB reports for this file (DESIGN §4.1).
    assert sum(len(line.events) for line in host.lines) == 469
    assert "python" in {line.name for line in host.lines}
    assert list(space.hostnames) == ["vm"]
    env = next(p for p in space.planes if p.name == "Task Environment")
    names = {env.stat_metadata[s.metadata_id].name: xp.stat_value(s, env) for s in env.stats}
    assert isinstance(names.get("profile_start_time"), int)


def test_builder_interns_metadata_and_stats() -> None:
    space = xp.XSpace(hostnames=["h"])
    plane = xp.PlaneBuilder.new(space, "/device:TPU:0", plane_id=1)
    ops = plane.line(3, "XLA Ops", timestamp_ns=1_000)
    plane.add_event(
        ops,
        "fusion.1",
        0,
        500,
        stats={"flops": 1.5e6},
        metadata_stats={"program_id": 7, "symbol_id": 2, "hlo_category": "convolution"},
    )
    plane.add_event(ops, "fusion.1", 600, 400, stats={"flops": 2.0})
    plane.add_event(ops, "copy.2", 1_000, 10, stats={"is_eager": True, "big": 2**63 + 5, "raw": b"\x01"})
    parsed = xp.parse_xspace(space.SerializeToString())
    p = parsed.planes[0]
    assert [e.metadata_id for e in p.lines[0].events] == [1, 1, 2]
    assert 0 not in p.event_metadata and 0 not in p.stat_metadata
    meta = p.event_metadata[1]
    assert meta.name == "fusion.1"
    assert {p.stat_metadata[s.metadata_id].name: xp.stat_value(s, p) for s in meta.stats} == {
        "program_id": 7,
        "symbol_id": 2,
        "hlo_category": "convolution",
    }
    ev = p.lines[0].events[2]
    assert {p.stat_metadata[s.metadata_id].name: xp.stat_value(s, p) for s in ev.stats} == {
        "is_eager": 1,
        "big": 2**63 + 5,
        "raw": b"\x01",
    }
    assert p.lines[0].events[0].stats[0].WhichOneof("value") == "double_value"
    # A second builder on the same plane reuses the existing ids.
    again = xp.PlaneBuilder(p)
    assert again.event_metadata("fusion.1") == 1
    assert again.stat_id("flops") == plane.stat_id("flops")


def test_ref_value_resolves_to_stat_metadata_name() -> None:
    plane = xp.XPlane(name="p")
    b = xp.PlaneBuilder(plane)
    ref = b.stat_id("interned string")
    stat = xp.XStat(metadata_id=b.stat_id("kind"), ref_value=ref)
    assert xp.stat_value(stat, plane) == "interned string"
    assert xp.stat_value(xp.XStat(metadata_id=1)) is None
    with pytest.raises(TypeError):
        xp.set_stat_value(xp.XStat(), [1, 2])  # type: ignore[arg-type]
