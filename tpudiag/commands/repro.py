"""``tpudiag repro RUN SEQ [--out DIR]``: a small bundle that re-runs one divergent op on the device and the CPU.

The capture kept the CPU copies of each divergent op's inputs (taken before the op ran, so in-place ops repro
too); the bundle is those inputs plus ``repro.py``, which runs the op on the chosen device and on the CPU at the
same dtype, compares both with the CPU float64 oracle and prints the metrics and the verdict.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from tpudiag.distributed import rank_repro
from tpudiag.errors import TpudiagError, UnknownRunError, UsageError
from tpudiag.store import numerics_queries, queries
from tpudiag.store_access import open_store

SCRIPT = '''"""Re-run {op} (seq {seq} of run {run_id}: {module}, {phase}, {source}) and compare with float64.

    python repro.py [--device cpu|cuda|tpu]      (default: {device})
"""

import argparse
import pathlib

import torch

from tpudiag.analysis.numerics_metrics import compare
from tpudiag.analysis.op_kinds import op_kind
from tpudiag.analysis.verdict import Evidence, decide, eps_of, working_dtype
from tpudiag.oracle import ops as oracle

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="{device}")
device = parser.parse_args().device
if device != "cpu" and not torch.accelerator.is_available():
    print(f"no {{device}} runtime here: running on the CPU")
    device = "cpu"
bundle = torch.load(pathlib.Path(__file__).with_name("inputs.pt"), weights_only=False)
namespace, packet, overload = bundle["op"].split(".")
func = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
plan = oracle.plan_for(func)
args, kwargs = bundle["args"], bundle["kwargs"]


def on(dev, dtype_fn):
    a, k = oracle.convert(args, kwargs, dtype_fn)
    if dev != "cpu":
        a, k = torch.utils._pytree.tree_map(lambda x: x.to(dev) if isinstance(x, torch.Tensor) else x, (a, k))
    return oracle.targets(plan, a, k, func(*a, **k))


expected = on("cpu", oracle.float64_of)
actual = on(device, lambda d: d)
cpu_same = on("cpu", lambda d: d)
inputs = oracle.tensors_in(args, kwargs)
for i, (act, exp, ref) in enumerate(zip(actual, expected, cpu_same)):
    m = compare(oracle.as_tensor(act).cpu(), oracle.as_tensor(exp))
    r = compare(oracle.as_tensor(ref), oracle.as_tensor(exp))
    # Judged as the capture judged it: a mixed-precision op at its least precise input's eps.
    at = working_dtype(m.dtype, [str(t.dtype).removeprefix("torch.") for t in inputs])
    f = eps_of(m.dtype) / eps_of(at)
    ev = Evidence(dtype=at, kind=op_kind(plan.name),
                  scaled_error=None if m.scaled_error is None else m.scaled_error * f,
                  ref_scaled_error=r.scaled_error * f if device != "cpu" and r.scaled_error is not None else None,
                  overflow=m.overflow,
                  nonfinite_mismatch=m.nonfinite_mismatch, mismatch_rate=m.mismatch_rate,
                  reduction_len=oracle.reduction_len(plan, inputs, actual))
    v = decide(ev)
    print(f"output {{i}} ({{m.dtype}}, {{m.numel}} elements) on {{device}}: {{v.verdict}}"
          + (f" ({{v.note}})" if v.note else ""))
    for name in ("scaled_error", "max_abs", "max_rel", "rmse", "cosine", "max_ulp", "nan_device", "inf_device"):
        print(f"  {{name:13}} {{getattr(m, name)}}")
    print(f"  cpu {{m.dtype}} scaled_error {{r.scaled_error}}")
'''


def register(sub: Any) -> None:
    p = sub.add_parser(
        "repro",
        help="write a bundle (inputs + script) that re-runs one divergent op on the device and the CPU",
        description="Write a small bundle that re-runs op SEQ of a run on the device and on the CPU and prints "
        "its error against the CPU float64 oracle. SEQ is the 'seq' of a divergent op in tpudiag report.",
    )
    p.add_argument("--db", help="store path (default: $TPUDIAG_DB or ./tpudiag.duckdb)")
    p.add_argument("run", help="run id or unique name")
    p.add_argument("seq", type=int, help="the op's sequence number (from tpudiag report)")
    p.add_argument("--out", "-o", help="output directory (default: ./tpudiag-repro-<run>-<seq>)")
    p.add_argument("--rank", type=int, help="distributed runs: the rank whose op it is (as the report lists it)")
    p.set_defaults(func=cmd_repro)


def cmd_repro(args: Any, rest: list[str]) -> int:
    store = open_store(args.db)
    run = queries.resolve_run(store, args.run)
    if args.rank is not None:  # another rank's op: its record and saved inputs are the rank's (rank_numerics)
        detail, saved = rank_repro.rank_op(store, run["id"], args.rank, args.seq)
    else:
        detail = numerics_queries.op_detail(store, run["id"], args.seq)
        artifacts = Path(run.get("artifacts_dir") or store.run_dir(run["id"]))
        saved = artifacts / "numerics" / "repro" / f"op-{args.seq}.pt"
    if detail is None:
        raise UnknownRunError(f"run {run['id']} has no recorded op with seq {args.seq} (see tpudiag report)")
    if not saved.is_file():
        from tpudiag.remote.gather import GATHERED_NOTE

        gathered = any(n.startswith(GATHERED_NOTE) for n in run.get("notes") or [])
        raise UsageError(
            f"op {args.seq} ({detail['op']}) of run {run['id']} has no saved inputs here: "
            + (
                "this run was gathered from a bucket; its ranks' files come with `tpudiag gather URL --run "
                f"{run['id']} --raw`, then "
                + ("run this again" if args.rank is not None else f"`tpudiag repro {run['id']} {args.seq} --rank R`")
                if gathered
                else "inputs are kept only for divergent ops (originators, up to 20 per run)"
            )
        )
    out = Path(args.out or f"tpudiag-repro-{run['id']}-{args.seq}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} exists and is not an empty directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(saved, out / "inputs.pt")
        (out / "repro.py").write_text(
            SCRIPT.format(
                op=detail["op"],
                seq=args.seq,
                run_id=run["id"],
                module=detail["module"] or "no module",
                phase=detail["phase"],
                source=detail["source_loc"] or "source unknown",
                device=(run.get("device_kind") or "cpu"),
            )
        )
    except OSError as err:
        raise TpudiagError(f"cannot write the bundle to {out}: {err.strerror or err}") from None
    sys.stdout.write(f"wrote {out}/repro.py and {out}/inputs.pt: python {out}/repro.py\n")
    return 0
