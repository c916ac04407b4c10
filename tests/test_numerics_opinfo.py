"""OpInfo sweep: PyTorch's own float32 samples of every op in op_db, checked by the numerics mode.

A correct CPU kernel must (almost) never be flagged: at most 0.1% of compared outputs, and every op call or output
left out carries a reason.  All ops, the first few samples of each (principled subset: same ops every run).
"""

from __future__ import annotations

import collections
import os
import warnings
from typing import Any

import pytest
import torch

SAMPLES_PER_OP = int(os.environ.get("TPUDIAG_OPINFO_SAMPLES", "3"))


def sweep(samples_per_op: int = SAMPLES_PER_OP) -> dict[str, Any]:
    from torch.testing._internal.common_methods_invocations import op_db

    from tpudiag.collectors.numerics.mode import Context, NumericsMode
    from tpudiag.collectors.numerics.records import Recorder
    from tpudiag.collectors.numerics.sampling import SamplingOptions

    recorder = Recorder("opinfo", None)
    mode = NumericsMode(Context(run_id="opinfo"), SamplingOptions(mode="all"), recorder)
    sample_errors = 0
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
                try:
                    with mode:
                        info.op(sample.input, *sample.args, **sample.kwargs)
                except Exception:
                    sample_errors += 1
            for seq in range(first, mode.seq + 1):
                owner[seq] = info.name
    ops, diffs = recorder.drain(final=True)
    return {"ops": ops, "diffs": diffs, "owner": owner, "sample_errors": sample_errors}


@pytest.mark.slow
def test_opinfo_float32_sweep_rarely_flags_and_reasons_every_skip() -> None:
    result = sweep()
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


if __name__ == "__main__":
    import time

    t0 = time.time()
    res = sweep()
    ops, diffs = res["ops"], res["diffs"]
    by_seq = {o.seq: o for o in ops}
    compared = [d for d in diffs if d.verdict != "skip"]
    flagged = [d for d in compared if d.verdict not in ("pass",)]
    print(
        f"{time.time() - t0:.1f}s ops {len(ops)} checked {sum(o.checked for o in ops)} compared {len(compared)} "
        f"flagged {len(flagged)} sample errors {res['sample_errors']}"
    )
    print(collections.Counter(o.skip_reason for o in ops if not o.checked))
    for d in flagged:
        o = by_seq[d.seq]
        print(o.op, res["owner"].get(d.seq), d.output_index, d.verdict, d.scaled_error, d.threshold, d.note, o.shapes)
