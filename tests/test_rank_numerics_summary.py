"""Pure parts of the every-rank numerics and of reaching a script's workers: which ranks diverge and which agree,
and which Python commands are an elastic agent's workers (made ranks), tpudiag's own, or missed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tpudiag.distributed import children
from tpudiag.distributed.rank_numerics import rank_summary


def _entry(
    rank: int, seq: int, op: str = "aten::tanh", verdict: str = "fail", role: str = "originator"
) -> dict[str, Any]:
    return {"rank": rank, "seq": seq, "op": op, "module": "m.1", "phase": "forward", "verdict": verdict, "role": role}


def test_one_rank_diverging_is_named_and_the_others_agree() -> None:
    cov = {r: {"checked": 10, "divergent": 3 if r == 2 else 0, "expected_precision": 0} for r in range(3)}
    summary = rank_summary([_entry(2, 7), _entry(2, 9)], cov, [0, 1, 2])
    assert summary is not None
    assert summary["diverging"] == [2] and summary["agreeing"] == [0, 1]
    assert summary["text"] == "rank 2 only: aten::tanh in m.1 (forward), seq 7; ranks 0, 1 agree (no divergent op)"


def test_every_rank_and_distinct_first_ops() -> None:
    same = rank_summary([_entry(0, 5), _entry(1, 5)], {}, [0, 1])
    assert same is not None and same["text"] == "every rank: aten::tanh in m.1 (forward), seq 5"
    two = rank_summary([_entry(0, 5), _entry(1, 8, op="aten::mul")], {}, [0, 1, 2])
    assert two is not None
    assert two["text"] == (
        "rank 0: aten::tanh in m.1 (forward), seq 5; rank 1: aten::mul in m.1 (forward), seq 8; rank 2 agrees "
        "(no divergent op)"
    )
    # A propagator or an expected-precision finding alone does not make a rank diverge.
    quiet = rank_summary([_entry(1, 3, verdict="expected_precision", role="")], {}, [0, 1])
    assert quiet is not None and quiet["diverging"] == [] and quiet["text"] == "every rank agrees"
    assert rank_summary([_entry(0, 1)], {}, [0]) is None  # one rank: nothing to say across ranks


def test_elastic_workers_are_rerouted_and_other_python_commands_counted(tmp_path: Path) -> None:
    wrapper = tmp_path / "python-worker"
    watch = children.ChildWatch(wrapper)
    elastic_env = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0"}
    assert watch._command((sys.executable, "-u", "train.py"), None, elastic_env) == [str(wrapper), "-u", "train.py"]
    assert watch.reached == 1 and watch.missed == []
    assert watch._command(["/bin/echo", "hi"], None, {}) == ["/bin/echo", "hi"]  # not Python: left alone
    assert watch._command([sys.executable, "-m", "tpudiag.deferred_store"], None, {}) is not None
    assert watch.missed == []  # tpudiag's own process
    watch._command([sys.executable, "-m", "torch.distributed.run", "t.py"], None, {})  # its workers: PYTHON_EXEC
    assert watch.missed == []
    watch._command([sys.executable, "work.py", "a", "b"], None, {})
    assert watch.missed == [f"subprocess: {Path(sys.executable).name} work.py a ..."]
    note = watch.note()
    assert note is not None and note.startswith("the script started 1 Python process(es) that tpudiag did not")
    assert children.ChildWatch(None)._command([sys.executable, "t.py"], None, elastic_env) == [sys.executable, "t.py"]


def test_wrappers_are_put_back() -> None:
    import multiprocessing.process
    import subprocess

    before = (subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start)  # type: ignore[attr-defined]
    watch = children.ChildWatch(None)
    watch.install()
    assert subprocess.Popen._execute_child is not before[0]  # type: ignore[attr-defined]
    assert subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True, text=True).stdout == "1\n"
    watch.remove()
    assert (subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start) == before  # type: ignore[attr-defined]
    assert len(watch.missed) == 1


def test_accelerates_single_child_is_a_launched_worker(monkeypatch: Any) -> None:
    import types

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    child_env = {"PATH": "/bin", "ACCELERATE_USE_CPU": "True"}
    monkeypatch.delitem(sys.modules, "accelerate.commands.launch", raising=False)
    assert not children.is_launched_worker(child_env)  # no accelerate launcher in this process
    monkeypatch.setitem(sys.modules, "accelerate.commands.launch", types.ModuleType("accelerate.commands.launch"))
    assert children.is_launched_worker(child_env)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")  # the parent's own setting, passed on: not the launcher's
    assert not children.is_launched_worker(child_env)
    assert children.is_launched_worker({"TORCHELASTIC_RUN_ID": "r"})
