"""The memory sampler on each backend.

- CPU (here): RSS from /proc (checked against the kernel's own VmRSS), RLIMIT_AS as the limit when one is set, every
  device figure None (unknown), never 0.
- CUDA (marked ``device``; skipped without a GPU): the sampler's figures are torch.cuda's own, read in the same
  state (``torch.cuda.max_memory_allocated`` itself), and the collector never resets the script's peak counter.
- TorchTPU without a TPU (the second interpreter with the real torch-tpu package, TPUDIAG_TPU_PYTHON): how far the
  path goes with no device: torch_tpu is loaded, the sampler takes the TPU path, and what neither the allocator nor
  libtpu answers stays None.  Real HBM figures need a TPU and are not checked here.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from tests.conftest import REPO, TPU_PYTHON
from tpudiag.collectors.memory_sampler import MemorySampler


def _vm_rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_cpu_figures_are_rss_and_unknowns() -> None:
    fig = MemorySampler().sample()
    assert fig["device"] == "cpu"
    assert abs(fig["rss_bytes"] - _vm_rss()) < 64 << 20
    assert fig["sources"]["rss_bytes"] == "/proc/self/statm"
    for key in ("allocated_bytes", "reserved_bytes", "peak_bytes", "device_used_bytes"):
        assert fig[key] is None and key not in fig["sources"]
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    expected = None if soft == resource.RLIM_INFINITY else soft
    assert fig["limit_bytes"] == expected


def test_rss_follows_a_real_allocation() -> None:
    sampler = MemorySampler()
    before = sampler.sample()["rss_bytes"]
    block = bytearray(64 << 20)  # touched: resident
    after = sampler.sample()["rss_bytes"]
    assert after - before >= 48 << 20
    del block


@pytest.mark.device
def test_cuda_figures_are_torch_cuda_own() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA or TPU device")
    x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del x
    y = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
    peak_before = torch.cuda.max_memory_allocated()
    fig = MemorySampler().sample()
    assert fig["device"].startswith("cuda:")
    assert fig["peak_bytes"] == torch.cuda.max_memory_allocated() == peak_before  # read, never reset
    assert fig["allocated_bytes"] == torch.cuda.memory_allocated() >= 16 << 20
    assert fig["reserved_bytes"] == torch.cuda.memory_reserved()
    assert fig["limit_bytes"] == torch.cuda.get_device_properties(0).total_memory
    assert fig["sources"]["peak_bytes"] == "torch.cuda.max_memory_allocated"
    del y


TPU_PROBE = """
import json, sys
import torch
from tpudiag.collectors.memory_sampler import MemorySampler
s = MemorySampler()
fig = s.sample()
print("PROBE " + json.dumps({"torch_tpu": "torch_tpu" in sys.modules, "backend": s.backend,
                              "libtpu": s._libtpu is not None, "fig": fig}))
"""


@pytest.mark.skipif(not TPU_PYTHON.exists(), reason="no Python with torch-tpu (set TPUDIAG_TPU_PYTHON)")
def test_torchtpu_path_without_a_tpu() -> None:
    env = {**os.environ, "TPU_SKIP_MDS_QUERY": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run([str(TPU_PYTHON), "-c", TPU_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    probe = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("PROBE "))[6:])
    assert probe["torch_tpu"] and probe["backend"] == "tpu"
    fig = probe["fig"]
    assert fig["rss_bytes"] > 0
    # Without a TPU nothing answers for the device: unknown, never 0.
    for key in ("allocated_bytes", "reserved_bytes", "peak_bytes", "device_used_bytes", "limit_bytes"):
        assert fig[key] is None or fig[key] > 0, (key, fig)
        assert (fig[key] is None) == (key not in fig["sources"])


def test_sampler_module_is_importable_without_torch_loaded() -> None:
    code = "import sys; from tpudiag.collectors.memory_sampler import MemorySampler; " \
           "f = MemorySampler().sample(); print('torch' in sys.modules, f['device'])"  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "cpu"]
