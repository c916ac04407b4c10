"""The distributed probe inside each rank: who the rank is, and fingerprints of what it computed.

- ``init_process_group`` is wrapped (same signature, same result) so a rank started without ``RANK`` in its
  environment (``torch.multiprocessing.spawn``) learns its number, world size and backend the moment the group
  exists, and its shards move to their ``rank=`` folder.
- Global optimizer hooks fingerprint the gradients before each optimizer step (after DDP's all-reduce) and the
  parameters after it: per-tensor sums and absolute sums, one small device-to-host copy per fingerprint.  Ranks
  that hold the same numbers get the same fingerprint, so the first step where one rank's fingerprint differs
  names the rank whose numbers diverged.

Every rank must run the same program under capture (TorchTPU ranks exchange a fingerprint of each compiled
program before running it; a rank that materialises a tensor where the others do not can hang the job).  So which
steps are fingerprinted is decided from the step number alone (``fingerprint_due``), identically on every rank,
never from timings.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import struct
import threading
from collections.abc import Callable, Iterable
from typing import Any

from tpudiag.distributed.identity import RankIdentity
from tpudiag.distributed.records import Fingerprint
from tpudiag.distributed.shards import ShardSpool
from tpudiag.tool_range import tool_range

WARMUP_STEPS = 10
EVERY_STEPS = 10


def fingerprint_due(step: int) -> bool:
    """Steps 0..9, then every 10th: the same answer on every rank for the same step number."""
    return step < WARMUP_STEPS or step % EVERY_STEPS == 0


def fingerprint_tensors(tensors: Iterable[Any]) -> tuple[str, float, int] | None:
    """(digest, sum of |x|, tensor count) of a list of tensors; None when there is nothing to fingerprint."""
    import torch

    items = [t.detach() for t in tensors if t is not None]
    if not items:
        return None
    # A ``tpudiag::`` range: the trace marks this work as tpudiag's own, never as the script's ops.
    with torch.no_grad(), tool_range("tpudiag::fingerprint"):
        try:
            sums = torch.stack([t.float().sum() for t in items] + [t.float().abs().sum() for t in items]).cpu()
            values = [float(v) for v in sums.tolist()]
        except RuntimeError:  # tensors on several devices: one scalar at a time
            values = [float(t.float().sum()) for t in items] + [float(t.float().abs().sum()) for t in items]
    digest = hashlib.blake2b(struct.pack(f"<{len(values)}d", *values), digest_size=8).hexdigest()
    return digest, sum(values[len(items) :]), len(items)


class DistributedProbe:
    def __init__(self, identity: RankIdentity, spool: ShardSpool, on_rank: Callable[[RankIdentity], None]) -> None:
        self.identity, self._spool, self._on_rank = identity, spool, on_rank
        self._records: list[Fingerprint] = []
        self._lock = threading.Lock()
        self._step = 0
        self._hooks: list[Any] = []
        self._patched: list[tuple[Any, str, Any]] = []
        self.errors: list[str] = []

    def start(self) -> None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        if dist.is_available():
            original = distributed_c10d.init_process_group
            probe = self

            @functools.wraps(original)
            def init_process_group(*args: Any, **kwargs: Any) -> Any:
                result = original(*args, **kwargs)
                probe._group_ready()
                return result

            for owner in (dist, distributed_c10d):
                if getattr(owner, "init_process_group", None) is original:
                    self._patched.append((owner, "init_process_group", original))
                    setattr(owner, "init_process_group", init_process_group)  # noqa: B010
        self._hooks.append(register_optimizer_step_pre_hook(self._before_step))
        self._hooks.append(register_optimizer_step_post_hook(self._after_step))

    def _group_ready(self) -> None:
        try:
            if self.identity.update_from_process_group():
                self._on_rank(self.identity)
        except Exception as err:  # never the user's problem
            self.errors.append(f"rank discovery failed: {err}")

    def _params(self, optimizer: Any) -> list[Any]:
        return [p for group in optimizer.param_groups for p in group["params"]]

    def _record(self, kind: str, tensors: list[Any]) -> None:
        try:
            got = fingerprint_tensors(tensors)
        except Exception as err:
            self.errors.append(f"fingerprint failed: {err}")
            return
        if got is None:
            return
        digest, abs_sum, count = got
        with self._lock:
            self._records.append(
                Fingerprint(
                    run_id=self._spool.run_id,
                    rank=self.identity.rank or 0,
                    step=self._step,
                    kind=kind,
                    fingerprint=digest,
                    restart=self.identity.attempt,
                    tensors=count,
                    abs_sum=abs_sum,
                )
            )

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if fingerprint_due(self._step):
            self._record("grad", [p.grad for p in self._params(optimizer)])

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if fingerprint_due(self._step):
            self._record("param", self._params(optimizer))
        self._step += 1

    def flush(self) -> None:
        with self._lock:
            records, self._records = self._records, []
        self._spool.write_records(Fingerprint, records)

    def stop(self) -> None:
        for h in self._hooks:
            with contextlib.suppress(Exception):
                h.remove()
        self._hooks.clear()
        for owner, attr, original in self._patched:
            setattr(owner, attr, original)
        self._patched.clear()
        if self.identity.backend is None:
            self._group_ready()  # a group made through a path we did not see
        self.flush()
