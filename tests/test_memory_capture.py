"""The memory collector end to end on CPU, with real allocations: ``tpudiag capture`` runs small training scripts,
``tpudiag report --json`` is read back.

- a model whose third block allocates a large activation: that block is what is live at the peak, and the largest
  allocation is its op with its shapes;
- per-step peaks grow with the batch;
- a real CPU out-of-memory error under a lowered address-space limit (RLIMIT_AS, set by the script itself, so the
  child process alone is limited): the report names the step, the module, the op and the bytes asked for; the
  script's stdout, stderr and exit status are what they are with the memory collector left out;
- the same two scripts without the trace, live tensor bytes counted at dispatch (``--memory-dispatch``, the method
  for backends whose profiler records no device memory events): the largest allocation, growing step peaks, and the
  op and module of the out-of-memory error found by the dispatch mode itself.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_tpudiag

MODEL = """
import sys, torch
torch.manual_seed(0)

class Block(torch.nn.Module):
    def __init__(self, big=False):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.big = big

    def forward(self, x):
        y = torch.relu(self.lin(x))
        if self.big:  # a large activation: [batch, 64 * WIDE] floats
            y = y.repeat(1, WIDE).view(y.shape[0], WIDE, 64).mean(1)
        return y

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(Block(), Block(), Block(True), Block())

    def forward(self, x):
        return self.blocks(x)

model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
"""

TRAIN = (
    MODEL.replace("WIDE", "512")
    + """
for batch in [int(b) for b in sys.argv[1:]]:
    loss = model(torch.randn(batch, 64)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print("trained")
"""
)

OOM = (
    MODEL.replace("WIDE", "(1 << 14)")
    + """
import resource

def vm_size():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024

model(torch.randn(8, 64)).sum().backward(); opt.zero_grad()  # warm up: threads and allocator exist
# 2 GiB of address space above what the process maps now; the third step's activation asks for 16 GiB.
resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (2 << 30), resource.RLIM_INFINITY))
for batch in (8, 16, 4096):
    loss = model(torch.randn(batch, 64)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print("step", batch, flush=True)
"""
)


def _capture(
    tmp_path: Path, db: Path, script: str, *args: str, collect: str = "trace,memory", flag: str = "--profile-memory"
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "script.py").write_text(script)
    return run_tpudiag(
        "capture", "--db", str(db), "--wait", flag, "--collect", collect, "script.py", *args, cwd=tmp_path
    )  # fmt: skip


def _memory(db: Path, tmp_path: Path) -> dict:
    rep = run_tpudiag("report", "--db", str(db), "--json", cwd=tmp_path)
    assert rep.returncode == 0, rep.stderr[-2000:]
    return json.loads(rep.stdout)["memory"]


@pytest.mark.slow
def test_large_activation_is_named_at_the_peak_and_step_peaks_grow_with_the_batch(tmp_path: Path, db: Path) -> None:
    out = _capture(tmp_path, db, TRAIN, "16", "32", "64", "128")
    assert out.returncode == 0, out.stderr[-2000:]
    mem = _memory(db, tmp_path)
    assert mem["method"] == "profiler"
    # Blocks 0, 1 and 3 hold [batch, 64] floats at most; block 2's activation is 512 times that.
    top_module = mem["by_module_at_peak"][0]
    assert top_module["module"] == "blocks.2", mem["by_module_at_peak"][:4]
    assert top_module["bytes"] >= 128 * 64 * 512 * 4  # the last step's [128, 32768] float32 block
    biggest = mem["top_allocations"][0]
    assert biggest["module"] == "blocks.2" and biggest["bytes"] == 128 * 64 * 512 * 4
    assert {a["op"] for a in mem["top_allocations"][:2]} >= {"aten::repeat"}
    assert json.loads(next(a["shapes"] for a in mem["top_allocations"] if a["op"] == "aten::repeat"))[0] == [128, 64]
    # One row per optimizer step, each peak from the profiler's events of that step, growing with the batch.
    steps = mem["per_step"]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    peaks = [s["peak_bytes"] for s in steps]
    assert all(b > a * 1.5 for a, b in itertools.pairwise(peaks)), peaks
    assert all(s["sources"]["peak_bytes"].startswith("profiler memory events") for s in steps)
    # CPU: no device allocator to ask; RSS is read, the device figures are unknown (None), never 0.
    assert all(s["rss_bytes"] and s["sources"]["rss_bytes"] == "/proc/self/statm" for s in steps)
    assert all(s["reserved_bytes"] is None for s in steps)
    assert mem["peak_bytes"] == max(peaks) and mem["peak_step"] == 3 and mem["oom"] is None
    text = run_tpudiag("report", "--db", str(db), cwd=tmp_path).stdout
    assert "memory: peak" in text and "blocks.2" in text


@pytest.mark.slow
def test_cpu_out_of_memory_is_diagnosed_and_the_script_ends_as_it_would(tmp_path: Path, db: Path) -> None:
    (tmp_path / "script.py").write_text(OOM)
    plain = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 1 and "DefaultCPUAllocator: can't allocate memory" in plain.stderr
    without = _capture(tmp_path, tmp_path / "without.duckdb", OOM, collect="trace")
    out = _capture(tmp_path, db, OOM)
    # The script's own output and exit status: as under python, and unchanged by the memory collector.
    assert out.returncode == without.returncode == plain.returncode == 1
    assert out.stdout == without.stdout == plain.stdout == "step 8\nstep 16\n"
    script_err = out.stderr.split("tpudiag: run ")[0]
    assert script_err == without.stderr.split("tpudiag: run ")[0]
    assert script_err.strip().splitlines()[-1] == plain.stderr.strip().splitlines()[-1]
    oom = _memory(db, tmp_path)["oom"]
    assert oom is not None, out.stderr[-2000:]
    assert (oom["kind"], oom["step"], oom["module"], oom["op"]) == ("cpu_alloc", 2, "blocks.2", "aten::repeat")
    assert oom["requested_bytes"] == 4096 * 64 * (1 << 14) * 4  # 16 GiB
    assert oom["exception"] == "RuntimeError" and "DefaultCPUAllocator" in oom["message"]
    assert oom["limit_bytes"] is not None and oom["limit_bytes"] < oom["requested_bytes"]  # the RLIMIT_AS it set
    assert oom["live_bytes"] is not None and oom["last_good_peak_bytes"] is not None
    assert oom["holders"] and all(h["bytes"] > 0 for h in oom["holders"])
    text = run_tpudiag("report", "--db", str(db), cwd=tmp_path).stdout
    assert "OUT OF MEMORY (cpu_alloc, runtime) at step 2 in blocks.2, op aten::repeat: asked for 16.00 GiB" in text


@pytest.mark.slow
def test_dispatch_method_without_the_trace(tmp_path: Path) -> None:
    db = tmp_path / "train.duckdb"
    out = _capture(tmp_path, db, TRAIN, "16", "32", "64", collect="memory", flag="--memory-dispatch")
    assert out.returncode == 0, out.stderr[-2000:]
    mem = _memory(db, tmp_path)
    assert mem["method"] == "dispatch"
    biggest = mem["top_allocations"][0]
    assert biggest["bytes"] == 64 * 64 * 512 * 4 and biggest["module"] == "blocks.2"
    forward = next(a for a in mem["top_allocations"] if a["op"] == "aten::repeat")
    assert json.loads(forward["shapes"]) == [[64, 64]] and forward["module"] == "blocks.2"
    peaks = [s["peak_bytes"] for s in mem["per_step"]]
    assert len(peaks) == 3 and all(b > a * 1.5 for a, b in itertools.pairwise(peaks)), peaks
    assert mem["per_step"][0]["sources"]["peak_bytes"].startswith("live tensor bytes counted at dispatch")

    db = tmp_path / "oom.duckdb"
    out = _capture(tmp_path, db, OOM, collect="memory", flag="--memory-dispatch")
    assert out.returncode == 1 and out.stdout == "step 8\nstep 16\n"
    oom = _memory(db, tmp_path)["oom"]
    assert (oom["step"], oom["module"], oom["op"], oom["op_source"]) == (2, "blocks.2", "aten::repeat", "dispatch")
    assert oom["requested_bytes"] == 1 << 34
    assert oom["holders"] and sum(h["bytes"] for h in oom["holders"]) > 0


BLOCK = """
import json, sys, torch
import tpudiag

class Wide(torch.nn.Module):
    def forward(self, x):
        return torch.empty(10**14, dtype=torch.uint8)  # a real allocation the CPU allocator refuses

model = torch.nn.Sequential(torch.nn.Linear(8, 8), Wide())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
try:
    with tpudiag.capture(name="block_oom", db=sys.argv[1], collect="trace,memory") as run:
        for _ in range(2):
            model[0](torch.ones(4, 8)).sum().backward()
            opt.step()
        model(torch.ones(4, 8))
except RuntimeError as err:
    print(json.dumps({"id": run.id, "status": run.status, "error": str(err)[:80]}))
"""


@pytest.mark.slow
def test_out_of_memory_in_a_captured_block(tmp_path: Path, db: Path) -> None:
    (tmp_path / "block.py").write_text(BLOCK)
    out = subprocess.run(
        [sys.executable, "block.py", str(db)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts["status"] == "failed" and "DefaultCPUAllocator" in facts["error"]  # the block's error goes on
    rep = run_tpudiag("report", "--db", str(db), "--json", facts["id"], cwd=tmp_path)
    oom = json.loads(rep.stdout)["memory"]["oom"]
    assert (oom["kind"], oom["step"], oom["module"], oom["op"]) == ("cpu_alloc", 2, "1", "aten::empty")
    assert oom["requested_bytes"] == 10**14
