"""OpInfo sweep: PyTorch's own float32 samples of every op in op_db, checked by the numerics mode.

Three things must hold.  The mode never changes what an op does: each sample run with and without it gives the
same values (bitwise, NaN where NaN) or raises the same exception type.  A correct CPU kernel is (almost) never
flagged: at most 0.1% of compared outputs, and every op call or output left out carries a reason.  And a wrong
kernel is caught: a float32 fault of 1e-3 injected through ``torch.library`` into a few dozen ops is flagged
``fail``, as the originator, in every one of them (a checker that never flags fails here).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_map

REPO = Path(__file__).resolve().parents[1]
SAMPLES_PER_OP = int(os.environ.get("TPUDIAG_OPINFO_SAMPLES", "3"))


def _outcome(fn: Any, sample: Any) -> tuple[str, Any]:
    """("value", result) or ("raises", exception type), on a private copy of the sample (ops may mutate it)."""
    inp, args, kwargs = tree_map(
        lambda x: x.clone() if isinstance(x, torch.Tensor) else x, (sample.input, sample.args, sample.kwargs)
    )
    torch.manual_seed(0)
    try:
        return "value", fn(inp, *args, **kwargs)
    except Exception as err:
        return "raises", type(err)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if (a.shape, a.dtype, a.layout) != (b.shape, b.dtype, b.layout):
        return False
    if a.layout != torch.strided:
        a, b = a.to_dense(), b.to_dense()
    a, b = a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg()
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.dtype in (torch.float16, torch.bfloat16) or not (a.is_floating_point() or a.dtype == torch.bool):
        a, b = a.double() if a.is_floating_point() else a, b.double() if b.is_floating_point() else b
    if torch.equal(a, b):
        return True
    # Bitwise the same but NaN != NaN: equal where both are NaN, equal elsewhere.
    return a.is_floating_point() and bool(
        torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        try:
            return _same_tensor(a, b)
        except (RuntimeError, NotImplementedError):  # a dtype/layout without equal(): compare the values as text
            return (a.shape, a.dtype) == (b.shape, b.dtype) and repr(a.tolist()) == repr(b.tolist())
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return bool(a == b)


# Samples whose outcome the mode does change today (found by this test; see notes/issue-16.md): each is a bug to fix
# in collectors/numerics, then to remove from here.
KNOWN_CHANGES = {
    "to_sparse": "the mode's compare step raises on sparse outputs (aminmax has no SparseCPU kernel)",
    "linalg.cond": "last-bit differences of the result under the mode (LAPACK-backed)",
    "linalg.eigvalsh": "last-bit differences of the result under the mode (LAPACK-backed)",
    "linalg.svdvals": "last-bit differences of the result under the mode (LAPACK-backed)",
    "norm": "last-bit differences of the result under the mode",
}


# Ops whose result is not a function of the inputs: uninitialized memory (empty*), so only metadata is compared.
UNINITIALIZED = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}


def sweep(samples_per_op: int = SAMPLES_PER_OP) -> dict[str, Any]:
    from torch.testing._internal.common_methods_invocations import op_db

    from tpudiag.collectors.numerics.mode import Context, NumericsMode
    from tpudiag.collectors.numerics.records import Recorder
    from tpudiag.collectors.numerics.sampling import SamplingOptions

    recorder = Recorder("opinfo", None)
    mode = NumericsMode(Context(run_id="opinfo"), SamplingOptions(mode="all"), recorder)
    sample_errors = 0
    samples_run = 0
    changed: list[str] = []
    owner: dict[int, str] = {}
    for info in op_db:
        if torch.float32 not in info.supported_dtypes("cpu"):
            continue
        try:
            samples = list(info.sample_inputs("cpu", torch.float32, requires_grad=False))[:samples_per_op]
        except Exception:
            sample_errors += 1
            continue
        for sample in samples:
            first = mode.seq + 1
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plain = _outcome(info.op, sample)
                with mode:
                    watched = _outcome(info.op, sample)
            samples_run += 1
            sample_errors += plain[0] == "raises"
            if plain[0] != watched[0] or (plain[0] == "raises" and plain[1] is not watched[1]):
                changed.append(f"{info.name}: {plain[0]} {plain[1]!s:.80} vs {watched[0]} {watched[1]!s:.80}")
            elif plain[0] == "value" and not _same(plain[1], watched[1]):
                if info.name in UNINITIALIZED:
                    if not _same(torch.empty_like(plain[1]).zero_(), torch.empty_like(watched[1]).zero_()):
                        changed.append(f"{info.name}: metadata differs")
                else:
                    changed.append(f"{info.name}: values differ")
            for seq in range(first, mode.seq + 1):
                owner[seq] = info.name
    ops, diffs = recorder.drain(final=True)
    return {
        "ops": ops,
        "diffs": diffs,
        "owner": owner,
        "sample_errors": sample_errors,
        "samples": samples_run,
        "changed": changed,
    }


@pytest.mark.slow
def test_opinfo_float32_sweep_changes_nothing_rarely_flags_and_reasons_every_skip() -> None:
    result = sweep()
    assert result["samples"] > 1500
    # The mode changes no op's outcome: same values, or the same exception type (but for the known cases below).
    unexplained = [c for c in result["changed"] if c.split(":")[0] not in KNOWN_CHANGES]
    assert not unexplained, unexplained[:20]
    ops, diffs = result["ops"], result["diffs"]
    compared = [d for d in diffs if d.verdict != "skip"]
    flagged = [d for d in compared if d.verdict in ("fail", "overflow")]
    checked_ops = [o for o in ops if o.checked]
    assert len(checked_ops) > 1000, "the sweep must really check ops"
    assert len(compared) > 1500
    by_seq = {o.seq: o for o in ops}
    detail = collections.Counter(f"{by_seq[d.seq].op} ({result['owner'].get(d.seq)})" for d in flagged)
    assert len(flagged) <= 0.001 * len(compared), f"{len(flagged)} of {len(compared)} flagged: {detail}"
    # Every op call not checked and every output not compared says why.
    assert all(o.skip_reason for o in ops if not o.checked)
    assert all(d.skip_reason for d in diffs if d.verdict == "skip")


# A CPU kernel override per op (torch.library, dispatch key CPU): numpy computes the op, float32 results are off by
# a relative 1e-3 (a few thousand float32 eps), float64 ones (the oracle's) are exact.  Run in a child process so
# the overrides never reach another test.
FAULTS = textwrap.dedent(
    """
    import json, sys, warnings
    import numpy as np
    import torch

    from tpudiag.collectors.numerics.mode import Context, NumericsMode
    from tpudiag.collectors.numerics.records import Recorder
    from tpudiag.collectors.numerics.sampling import SamplingOptions

    UNARY = {
        "sin": np.sin, "cos": np.cos, "tan": np.tan, "tanh": np.tanh, "sinh": np.sinh, "cosh": np.cosh,
        "asin": np.arcsin, "acos": np.arccos, "atan": np.arctan, "asinh": np.arcsinh, "exp": np.exp,
        "exp2": np.exp2, "expm1": np.expm1, "log": np.log, "log2": np.log2, "log10": np.log10, "log1p": np.log1p,
        "sqrt": np.sqrt, "rsqrt": lambda a: 1 / np.sqrt(a), "reciprocal": np.reciprocal,
        "sigmoid": lambda a: 1 / (1 + np.exp(-a)),
    }
    BINARY = {
        "add.Tensor": np.add, "sub.Tensor": np.subtract, "mul.Tensor": np.multiply, "div.Tensor": np.divide,
        "atan2": np.arctan2, "hypot": np.hypot, "pow.Tensor_Tensor": np.power, "mm": np.matmul, "bmm": np.matmul,
    }
    FAULT = 1e-3

    def faulty(fn, arity):
        def kernel(*args, **kwargs):
            arrays = [a.detach().numpy() if isinstance(a, torch.Tensor) else a for a in args[:arity]]
            if kwargs.get("alpha", 1) != 1:
                arrays[1] = arrays[1] * kwargs["alpha"]
            out = np.asarray(fn(*arrays))
            first = args[0]
            if first.dtype == torch.float32:
                out = out * (1 + FAULT)
            return torch.from_numpy(np.ascontiguousarray(out)).to(first.dtype)
        return kernel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": that is the point
        lib = torch.library.Library("aten", "IMPL")
        for name, fn in UNARY.items():
            lib.impl(name, faulty(fn, 1), "CPU")
        for name, fn in BINARY.items():
            lib.impl(name, faulty(fn, 2), "CPU")

    g = torch.Generator().manual_seed(0)
    x = torch.rand(8, 16, generator=g) * 0.7 + 0.2  # in the domain of every op above
    y = torch.rand(8, 16, generator=g) * 0.7 + 1.7
    calls = {name.split(".")[0]: (lambda n=name: getattr(torch, n.split(".")[0])(x)) for name in UNARY}
    calls.update({
        "add": lambda: torch.add(x, y), "sub": lambda: torch.sub(y, x), "mul": lambda: torch.mul(x, y),
        "div": lambda: torch.div(x, y), "atan2": lambda: torch.atan2(x, y), "hypot": lambda: torch.hypot(x, y),
        "pow": lambda: torch.pow(y, x), "mm": lambda: torch.mm(x, y.T), "bmm": lambda: torch.bmm(x[None], y.T[None]),
    })
    assert abs(float(torch.sin(x)[0, 0]) / float(np.sin(x.numpy()[0, 0])) - 1 - FAULT) < 1e-5  # the fault is live
    results = {}
    for name, call in calls.items():
        recorder = Recorder("faults", None)
        mode = NumericsMode(Context(run_id="faults"), SamplingOptions(mode="all"), recorder)
        with mode:
            call()
        ops, diffs = recorder.drain(final=True)
        op_names = {o.seq: o.op for o in ops}
        results[name] = [(op_names.get(d.seq), d.verdict, d.role, d.scaled_error) for d in diffs]
    print(json.dumps(results))
    """
)


@pytest.mark.slow
def test_a_float32_fault_injected_into_each_of_thirty_ops_is_flagged_fail_as_originator() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", FAULTS],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 30
    for name, rows in results.items():
        assert rows, f"{name}: nothing was checked"
        target = [r for r in rows if r[0] == f"aten::{name}"]
        assert target, f"{name}: {rows}"
        assert [(r[1], r[2]) for r in target] == [("fail", "originator")], f"{name}: {rows}"
        assert target[0][3] > 1000  # thousands of eps off, nowhere near the threshold


if __name__ == "__main__":
    import time

    t0 = time.time()
    res = sweep()
    ops, diffs = res["ops"], res["diffs"]
    by_seq = {o.seq: o for o in ops}
    compared = [d for d in diffs if d.verdict != "skip"]
    flagged = [d for d in compared if d.verdict not in ("pass",)]
    print(
        f"{time.time() - t0:.1f}s samples {res['samples']} ops {len(ops)} checked {sum(o.checked for o in ops)} "
        f"compared {len(compared)} flagged {len(flagged)} sample errors {res['sample_errors']} "
        f"changed {len(res['changed'])}"
    )
    print("\n".join(res["changed"]))
    print(collections.Counter(o.skip_reason for o in ops if not o.checked))
    for d in flagged:
        o = by_seq[d.seq]
        print(o.op, res["owner"].get(d.seq), d.output_index, d.verdict, d.scaled_error, d.threshold, d.note, o.shapes)
