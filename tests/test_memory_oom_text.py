# ruff: noqa: E501, W291  (the messages are quoted as published: long lines, trailing spaces)
"""Out-of-memory messages, real ones, read into kind, bytes and XLA's allocation table (tpudiag.analysis.oom_text).

Sources of the texts (quoted as published; only the glog prefixes of one are kept to test that they are stripped):
- FLOWPM: https://github.com/DifferentiableUniverseInitiative/flowpm/issues/27 (TPU, TF 1.x, compile-time
  "Compilation failure: Ran out of memory in memory space hbm", with "Largest program allocations in hbm").
- MEDIUM_TPU: Chaim Rejwan's "TPU training" blog post as republished (Chinese translation) in a public repository:
  the TF "Resource exhausted ... Ran out of memory in memory space hbm" with two allocation entries flattened onto
  few lines and markdown bold around some phrases.
- XLA_ERROR_1000: openxla/xla docs/errors/error_1000.md ("Compile Time: HBM OOM" sample messages).
- XLA_RUNTIME: https://github.com/pytorch/xla/issues/1735 (PyTorch/XLA on TPU, run time: "Attempting to reserve
  3.95G at the bottom of memory. That was not possible.").
- PTXLA_GLOG: https://github.com/pytorch/xla/issues/1965 (allocation entries as PyTorch/XLA logs them, one glog line
  each).
- TORCH_TPU_RUNTIME: https://github.com/pytorch/xla/issues/3532 ("RESOURCE_EXHAUSTED: Ran out of memory in memory
  space hbm. Used 29.80G of 7.98G hbm.").
- VMEM: https://github.com/pytorch/xla/issues/9524 (a Pallas kernel out of vmem, "Allocation type: scoped").
- CUDA: the message torch's CUDACachingAllocator builds (c10/cuda/CUDACachingAllocator.cpp, torch 2.x format).
- CPU: printed by torch 2.13 on this machine for ``torch.empty(10**14, dtype=torch.uint8)``.
"""

from __future__ import annotations

from tpudiag.analysis.oom_text import allocations, parse, size_bytes

G, M, K = 1 << 30, 1 << 20, 1 << 10

FLOWPM = """E1111 07:35:00.272763 140408571025152 error_handling.py:81] Closing session due to error From /job:worker/replica:0/task:0:
Compilation failure: Ran out of memory in memory space hbm. Used 41.74G of 16.00G hbm. Exceeded hbm capacity by 25.74G.

Total hbm usage >= 41.74G:
    reserved        528.00M
    program          41.22G
    arguments       unknown size

Output size unknown.

Program hbm requirement 41.22G:
    reserved           4.0K
    global           29.82M
    HLO temp         41.19G (24.2% utilization, 0.7% fragmentation (293.84M))

  Largest program allocations in hbm:

  1. Size: 32.00G
     Operator: op_type="FloorMod" op_name="slicewise_79/cic_update/FloorMod"
     Shape: s32[8388608,8,4]{2,1,0:T(8,128)}
     Unpadded size: 1.00G
     Extra memory due to padding: 31.00G (32.0x expansion)
     XLA label: %copy.40488 = s32[8388608,8,4]{2,1,0:T(8,128)} copy(s32[8388608,8,4]{0,2,1:T(4,128)} %get-tuple-element.32429), metadata={op_type="FloorMod" op_name="slicewise_79/cic_update/FloorMod"}
"""

MEDIUM_TPU = """(0) Resource exhausted: {{function_node __inference_train_function_80576}} Ran out of memory in memory space hbm. **Used 19.46G of 15.48G hbm. Exceeded hbm capacity by 3.98G**.
Total hbm usage >= 19.98G: 
    reserved 530.00M 
    program 19.46G
    arguments 0BOutput size 0B; shares 0B with arguments.Program hbm requirement 19.46G:
    global 276.0K
    scoped 173.0K
    HLO temp 19.46G (33.1% utilization: **Unpadded (6.40G) Padded (19.32G)**, 0.7% fragmentation (147.91M)) **Largest program allocations in hbm**:

  1\\. Size: 14.00G 
     Operator: op_type="OneHot" op_name="model/loss/one_hot"
     Shape: s32[29360128,10]{1,0:T(8,128)}
     Unpadded size: 1.09G
     Extra memory due to padding: 12.91G (12.8x expansion)
     XLA label: %iota.2 = s32[29360128,10]{1,0:T(8,128)} iota(), iota_dimension=1, metadata={op_type="OneHot" op_name="model/loss/one_hot"}
     Allocation type: HLO temp
     ========================== 2\\. Size: 2.62G
     Operator: op_name="model/layer_1/Conv2D"
     Shape: f32[128,256,896,18]{0,3,2,1:T(8,128)}
     Unpadded size: 1.97G
     Extra memory due to padding: 672.00M (1.3x expansion)
     XLA label: %fusion.9.remat.1.remat = f32[128,256,896,18]{0,3,2,1:T(8,128)} fusion(f32[1,1,8,18]{3,2,1,0:T(8,128)} %get-tuple-element.4316, f32[18]{0:T(256)} %get-tuple-element.4085, f32[128,256,896,8]{0,3,2,1:T(8,128)} %get-tuple-element.3899, f32[8]{0:T(256)} %rsqrt...
     Allocation type: HLO temp
     ==========================
"""

XLA_ERROR_1000 = (
    "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 49.34G of "
    "32.00G hbm. Exceeded hbm capacity by 17.34G."
)
XLA_ERROR_1000_TC_SC = (
    "RESOURCE_EXHAUSTED: TPU TensorCore Hbm usage: 34.82G, SparseCore Hbm usage 174.10G, exceeding available "
    "bytes: 95.74G"
)

XLA_RUNTIME = """RuntimeError: Resource exhausted: From /job:tpu_worker/replica:0/task:0:
Attempting to reserve 3.95G at the bottom of memory. That was not possible. There are 1.92G free, 0B reserved, and 1.92G reservable.; 
HBM capacity 8.00G:
       Top-of-Memory reserved:  529.00M (     554,696,704 bytes)
          Currently allocated:    6.08G (   6,532,939,776 bytes)
          Program requirement:    3.95G (   4,237,689,856 bytes)
                               ------------
      Available after request:   -2.55G (  -2,735,391,744 bytes)
; attempting reservation for program memory
"""

PTXLA_GLOG = """2020-05-04 09:05:40.721100: E    1578 tensorflow/compiler/xla/xla_client/xla_util.cc:76]   Largest program allocations in hbm:
2020-05-04 09:05:40.721110: E    1578 tensorflow/compiler/xla/xla_client/xla_util.cc:76]   1. Size: 48.00M
2020-05-04 09:05:40.721128: E    1578 tensorflow/compiler/xla/xla_client/xla_util.cc:76]      Shape: bf16[512,16,3072]{2,1,0:T(8,128)(2,1)}
2020-05-04 09:05:40.721136: E    1578 tensorflow/compiler/xla/xla_client/xla_util.cc:76]      Unpadded size: 48.00M
2020-05-04 09:05:40.721147: E    1578 tensorflow/compiler/xla/xla_client/xla_util.cc:76]      XLA label: %reshape.152469 = bf16[512,16,3072]{2,1,0:T(8,128)(2,1)} reshape(bf16[6291456,4]{1,0:T(8,128)(2,1)} %fusion.41543)
2020-05-04 09:05:40.721156: E    1578 tensorflow/compiler/xla/xla_client/xla_util.cc:76]      Allocation type: HLO temp
2020-05-04 09:05:40.721167: E    1578 tensorflow/compiler/xla/xla_client/xla_util.cc:76]      ==========================
"""

TORCH_TPU_RUNTIME = (
    "(0) RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 29.80G of 7.98G hbm. Exceeded hbm capacity "
    "by 21.82G."
)

VMEM = """RuntimeError: Bad StatusOr access: RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space vmem. Used 16.30M of 16.00M vmem. Exceeded vmem capacity by 304.0K.

  Largest program allocations in vmem:

  4. Size: 64.0K
     Shape: f32[128,6]{1,0}
     Unpadded size: 3.0K
     Extra memory due to padding: 61.0K (21.3x expansion)
     XLA label: reduce-window.4 = reduce-window(pad_bitcast_fusion.1, pad_bitcast_fusion, constant.58, constant.58), window={size=1x128 pad=0_0x127_0}, to_apply=AddComputation.10.clone
     Allocation type: scoped
     ==========================
"""

CUDA = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.23 GiB is "
    "free. Including non-PyTorch memory, this process has 77.90 GiB memory in use. Of the allocated memory 75.00 GiB "
    "is allocated by PyTorch, and 1.50 GiB is reserved by PyTorch but unallocated."
)

CPU = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate "
    "100000000000000 bytes. Error code 12 (Cannot allocate memory)"
)


def test_sizes_are_binary_as_xla_prints_them() -> None:
    assert size_bytes("19.46G") == round(19.46 * G)
    assert size_bytes("276.0K") == 276 * K
    assert size_bytes("0B") == 0
    assert size_bytes("2.00 GiB") == 2 * G
    assert size_bytes("not a size") is None


def test_compile_time_hbm_oom_with_its_allocation_table() -> None:
    oom = parse(FLOWPM)
    assert oom is not None and oom.kind == "xla_hbm" and oom.phase == "compile" and oom.memory_space == "hbm"
    assert (oom.live_bytes, oom.limit_bytes) == (round(41.74 * G), 16 * G)
    assert oom.requested_bytes == round(25.74 * G)  # what it would have needed beyond the capacity
    [row] = oom.allocations
    assert row.index == 1
    assert row.size_bytes == 32 * G and row.unpadded_bytes == 1 * G
    assert row.padding_bytes == 31 * G and row.expansion == 32.0
    assert row.shape == "s32[8388608,8,4]{2,1,0:T(8,128)}"
    assert row.operator == 'op_type="FloorMod" op_name="slicewise_79/cic_update/FloorMod"'
    assert row.xla_label is not None and row.xla_label.startswith("%copy.40488 = s32[8388608,8,4]")
    assert row.allocation_type is None  # this older format has no allocation type line


def test_flattened_table_with_markdown_still_splits_into_rows() -> None:
    oom = parse(MEDIUM_TPU)
    assert oom is not None and oom.kind == "xla_hbm" and oom.phase is None  # run time: nothing says "compile"
    assert (oom.live_bytes, oom.limit_bytes) == (round(19.46 * G), round(15.48 * G))
    first, second = oom.allocations
    assert (first.index, first.size_bytes, first.expansion) == (1, 14 * G, 12.8)
    assert first.operator == 'op_type="OneHot" op_name="model/loss/one_hot"' and first.allocation_type == "HLO temp"
    assert (second.index, second.size_bytes, second.padding_bytes) == (2, round(2.62 * G), 672 * M)
    assert second.shape == "f32[128,256,896,18]{0,3,2,1:T(8,128)}"
    assert second.xla_label is not None and second.xla_label.endswith("%rsqrt...")


def test_xla_error_code_1000_samples() -> None:
    oom = parse(XLA_ERROR_1000)
    assert oom is not None and (oom.kind, oom.phase) == ("xla_hbm", "compile")
    assert (oom.live_bytes, oom.limit_bytes, oom.allocations) == (round(49.34 * G), 32 * G, [])
    split = parse(XLA_ERROR_1000_TC_SC)
    assert split is not None and split.kind == "xla_hbm"
    assert split.live_bytes == round(34.82 * G) + round(174.10 * G) and split.limit_bytes == round(95.74 * G)


def test_runtime_reservation_failure() -> None:
    oom = parse(XLA_RUNTIME)
    assert oom is not None and (oom.kind, oom.phase) == ("xla_resource", "runtime")
    assert oom.requested_bytes == round(3.95 * G)
    assert oom.live_bytes == round(6.08 * G) and oom.limit_bytes == 8 * G


def test_glog_prefixed_entries_and_vmem() -> None:
    [row] = allocations(PTXLA_GLOG)
    assert (row.index, row.size_bytes, row.allocation_type) == (1, 48 * M, "HLO temp")
    assert row.shape == "bf16[512,16,3072]{2,1,0:T(8,128)(2,1)}" and row.operator is None
    runtime = parse(TORCH_TPU_RUNTIME)
    assert runtime is not None and runtime.live_bytes == round(29.80 * G) and runtime.limit_bytes == round(7.98 * G)
    vmem = parse(VMEM)
    assert vmem is not None and vmem.memory_space == "vmem" and vmem.phase == "compile"
    assert [(a.index, a.size_bytes, a.allocation_type) for a in vmem.allocations] == [(4, 64 * K, "scoped")]


def test_torch_messages() -> None:
    cuda = parse(CUDA, "OutOfMemoryError")
    assert cuda is not None and cuda.kind == "torch_oom"
    assert (cuda.requested_bytes, cuda.live_bytes) == (2 * G, 75 * G)
    assert cuda.limit_bytes == round(79.15 * G)
    cpu = parse(CPU, "RuntimeError")
    assert cpu is not None and cpu.kind == "cpu_alloc" and cpu.requested_bytes == 10**14


def test_other_errors_are_not_out_of_memory() -> None:
    assert parse("RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x3 and 4x5)", "RuntimeError") is None
    assert parse("ValueError: out of range", "ValueError") is None
