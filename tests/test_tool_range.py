"""tpudiag's own work under a profiler: one labelled range and none of its ops (tpudiag.tool_range)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tpudiag.tool_range import tool_range


def _names_under(prof: profile, parent: str) -> list[str]:
    return [e.name for e in prof.events() if e.cpu_parent is not None and e.cpu_parent.name == parent]


def test_a_tool_range_records_itself_and_none_of_its_ops_and_recording_resumes_after_it() -> None:
    x = torch.randn(16, 16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with tool_range("tpudiag::numerics"):
            with tool_range("tpudiag::inner"):  # nested: the outer range's end switches recording back on
                (x.double() @ x.double()).sum()
            x.double().sum()  # still inside the outer range: not recorded
        torch.mm(x, x)
    names = [e.name for e in prof.events()]
    assert names.count("tpudiag::numerics") == 1
    assert "tpudiag::inner" not in names  # opened while recording was off
    assert _names_under(prof, "tpudiag::numerics") == []
    assert "aten::_to_copy" not in names and "aten::sum" not in names
    assert "aten::mm" in names  # the script's op after the range


def test_a_tool_range_left_by_an_exception_switches_recording_back_on() -> None:
    x = torch.randn(4, 4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with pytest.raises(RuntimeError), tool_range("tpudiag::numerics"):
            raise RuntimeError("the oracle failed")
        torch.mm(x, x)
    assert "aten::mm" in [e.name for e in prof.events()]


def test_no_profiler_no_range() -> None:
    with tool_range("tpudiag::numerics"):
        torch.ones(2).sum()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(2).sum()
    assert "aten::sum" in [e.name for e in prof.events()]
