"""TorchTPU's rank -> chip assignment in the rank records and the report.

What is verified here: the record format (``device_ids``: JSON list of global device ids indexed by rank, as
TorchTPU's ``get_device_assignment`` returns it), the report's ``chip`` per rank, and that the real torch-tpu
function is reached and fails soft on a gloo group (it returns ``[]`` without a TPU process group).  Not verified:
the ids on a real TPU slice (no TPU here).
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO, TPU_PYTHON
from tpudiag.distributed import report_section
from tpudiag.distributed.identity import chip_of, tpu_device_ids


def _info(rank: int, device_ids: str | None) -> dict[str, object]:
    return {"rank": rank, "restart": 0, "world_size": 4, "status": "ok", "host": "h", "device_ids": device_ids}


def test_chip_of_reads_the_record_format() -> None:
    ids = json.dumps([5, 4, 7, 6])  # arbitrary rank -> chip order, as launchers give it
    assert [chip_of(ids, r) for r in range(4)] == [5, 4, 7, 6]
    assert chip_of(ids, 4) is None and chip_of(None, 0) is None and chip_of("not json", 0) is None
    assert chip_of('{"0": 1}', 0) is None


def test_report_rows_carry_the_chip() -> None:
    ids = json.dumps([5, 4, 7, 6])
    section = report_section.assemble([_info(r, ids) for r in range(4)], {}, None, [], None, {}, [])
    assert [r["chip"] for r in section["ranks"]] == [5, 4, 7, 6]
    text = "\n".join(report_section.render_section(section))
    assert "chip 7" in text
    plain = report_section.assemble([_info(r, None) for r in range(2)], {}, None, [], None, {}, [])
    assert [r["chip"] for r in plain["ranks"]] == [None, None]
    assert "chip" not in "\n".join(report_section.render_section(plain))
    from app.ranks import rank_rows  # the dashboard's Ranks table: a chip column only where chips are known

    assert [r["chip"] for r in rank_rows(section)] == [5, 4, 7, 6]
    assert "chip" not in rank_rows(plain)[0]


def test_without_torch_tpu_nothing_is_imported() -> None:
    import sys

    assert "torch_tpu" not in sys.modules
    assert tpu_device_ids() is None
    assert "torch_tpu" not in sys.modules


PROBE = r"""
import os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
import torch, torch_tpu, torch.distributed as dist
from tpudiag.distributed.identity import RankIdentity
dist.init_process_group("gloo")
ident = RankIdentity.from_env()
assert ident.update_from_process_group()
print("IDS", ident.device_ids, "REACHED", "torch_tpu._internal.distributed.device_mesh" in sys.modules)
dist.barrier()  # torch 2.13's gloo aborts ~6% of exits without it (plain runs too)
dist.destroy_process_group()
"""


@pytest.mark.skipif(not TPU_PYTHON.exists(), reason="no Python with torch-tpu (set TPUDIAG_TPU_PYTHON)")
def test_real_torch_tpu_api_reached_and_soft_on_gloo(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    res = subprocess.run(
        [str(TPU_PYTHON), "-c", textwrap.dedent(PROBE), str(port)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert "IDS None REACHED True" in res.stdout
