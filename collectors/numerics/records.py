"""Rows the numerics collector produces: one ``OpRecord`` per recorded op call, one ``OpDiff`` per compared output.

Calls skipped only because sampling already saw their signature are aggregated (one row per op, phase and reason,
with a ``calls`` count and summed FLOPs), so a long training run does not write a row per op call.  Rows are
handed to the spool in batches (``drain``), from the flusher thread as well as at the end.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tpudiag.model import OpDiff, OpRecord

AGGREGATED_REASONS = ("sampled", "filtered", "budget", "off", "steady_state")
MAX_REPRO_BUNDLES = 20
MAX_REPRO_BYTES = 256 << 20


@dataclass
class _Aggregate:
    seq: int
    calls: int = 0
    flops: float = 0.0
    dtypes: str | None = None


@dataclass
class Findings:
    """Counters the progress line and the collector's closing line read."""

    seen: int = 0
    checked: int = 0
    divergent: int = 0
    originators: int = 0
    first: str | None = None
    scaled_overflows: int = 0  # checked calls whose outputs overflowed under a GradScaler (not divergent)


class Recorder:
    def __init__(self, run_id: str, repro_dir: Path | None) -> None:
        self.run_id = run_id
        self._ops: list[OpRecord] = []
        self._diffs: list[OpDiff] = []
        self._aggregates: dict[tuple[str, str | None, str | None, str], _Aggregate] = {}
        self._lock = threading.Lock()
        self.findings = Findings()
        self.repro_dir = repro_dir
        self._repro_count = 0
        self._repro_bytes = 0

    # -- producing ------------------------------------------------------------------------------------------
    def op(self, record: OpRecord) -> None:
        with self._lock:
            self._ops.append(record)

    def diffs(self, rows: list[OpDiff]) -> None:
        with self._lock:
            self._diffs.extend(rows)

    def aggregate(
        self,
        seq: int,
        op: str,
        phase: str | None,
        module: str | None,
        reason: str,
        flops: float,
        dtypes: str | None,
        calls: int = 1,
    ) -> None:
        # Module kept only for filtered ops (the filter is by module); otherwise one row per op and phase.
        key = (op, phase, module if reason == "filtered" else None, reason)
        with self._lock:
            agg = self._aggregates.get(key)
            if agg is None:
                agg = self._aggregates[key] = _Aggregate(seq=seq, dtypes=dtypes)
            agg.calls += calls
            agg.flops += flops

    # -- draining -------------------------------------------------------------------------------------------
    def drain(self, final: bool) -> tuple[list[OpRecord], list[OpDiff]]:
        """Rows collected since the last drain; aggregated rows only at the end (their counts keep growing)."""
        with self._lock:
            ops, diffs = self._ops, self._diffs
            self._ops, self._diffs = [], []
            if final:
                for (op, phase, module, reason), agg in self._aggregates.items():
                    ops.append(
                        OpRecord(
                            run_id=self.run_id,
                            seq=agg.seq,
                            op=op,
                            phase=phase,
                            module=module,
                            checked=False,
                            skip_reason=reason,
                            flops=agg.flops,
                            calls=agg.calls,
                            dtypes=agg.dtypes,
                        )
                    )
                self._aggregates.clear()
        return ops, diffs

    # -- repro inputs ---------------------------------------------------------------------------------------
    def save_repro(
        self, seq: int, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], meta: dict[str, Any]
    ) -> str | None:
        """Keep the CPU copies of a divergent op's inputs so ``tpudiag repro`` can build a bundle later."""
        if self.repro_dir is None or self._repro_count >= MAX_REPRO_BUNDLES:
            return None
        leaves = [x for x in _leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        size = sum(t.numel() * t.element_size() for t in leaves)
        if self._repro_bytes + size > MAX_REPRO_BYTES:
            return None
        self.repro_dir.mkdir(parents=True, exist_ok=True)
        path = self.repro_dir / f"op-{seq}.pt"
        payload = {"op": _qualified(func), "args": args, "kwargs": kwargs, "meta": meta}
        tmp = path.with_suffix(".tmp")
        torch.save(payload, tmp)
        tmp.replace(path)
        self._repro_count += 1
        self._repro_bytes += size
        return str(path)


def _leaves(tree: Any) -> list[Any]:
    from torch.utils._pytree import tree_flatten

    leaves, _ = tree_flatten(tree)
    return leaves


def _qualified(func: Any) -> str:
    """``aten.tanh.default``: resolvable again through ``torch.ops``."""
    namespace = getattr(func, "namespace", "aten")
    return f"{namespace}.{func.overloadpacket.__name__}.{func._overloadname}"


def describe_inputs(tensors: list[torch.Tensor]) -> tuple[str, str]:
    """(dtypes JSON, shapes JSON) of an op's tensor inputs."""
    return (
        json.dumps([str(t.dtype).removeprefix("torch.") for t in tensors], separators=(",", ":")),
        json.dumps([list(t.shape) for t in tensors], separators=(",", ":")),
    )


@dataclass
class Timing:
    """Where the collector's time went (seconds)."""

    oracle_s: float = 0.0
    total_check_s: float = 0.0
    ops_s: float = 0.0
    extras: dict[str, float] = field(default_factory=dict)
