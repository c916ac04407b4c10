"""Calls the mode does not check: their aggregate or ``ops`` row, and the shadow values and kept float64 copies
that views of checked tensors carry.  A mixin of ``NumericsMode``."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch

from tpudiag.analysis.numerics_metrics import dtype_name
from tpudiag.collectors.numerics.op_cost import _device, _flops, user_source
from tpudiag.collectors.numerics.oracle_runs import _dense, _tool_range
from tpudiag.collectors.numerics.records import Recorder, describe_inputs
from tpudiag.model import OpRecord
from tpudiag.oracle import ops as oracle
from tpudiag.oracle.ops import OpPlan

if TYPE_CHECKING:
    from tpudiag.collectors.numerics.context import Context
    from tpudiag.collectors.numerics.sampling import Sampler
    from tpudiag.collectors.numerics.shadow import ShadowStream
    from tpudiag.oracle.copies import Float64Copies

_MAX_DESCRIPTIONS = 1 << 16


class UncheckedCalls:
    ctx: Context
    sampler: Sampler
    copies: Float64Copies
    shadow: ShadowStream
    recorder: Recorder
    step_calls: dict[tuple[str, str], list[Any]]
    _descriptions: dict[tuple[Any, ...], tuple[str, str, str]]

    # -- unchecked calls ------------------------------------------------------------------------------------
    def _unchecked(
        self,
        func: Any,
        plan: OpPlan,
        seq: int,
        module: str | None,
        phase: str,
        reason: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        tensors: list[torch.Tensor],
        signature: tuple[Any, ...] | None,
    ) -> None:
        if len(self.shadow) or (plan.is_view and len(self.copies)):
            with _tool_range():
                self._carry_shadow(func, plan, args, kwargs, out, tensors)
        outputs = oracle.targets(plan, args, kwargs, out)
        # Past the run's first steps (a capped step: ``Sampler.check_until``) every unchecked call is counted in its
        # aggregate row, views and factories too: the calls of one step repeat those the first steps recorded one
        # by one, and a long run's periodic steps would each add a row per view, with its source line looked up.
        if reason in ("sampled", "filtered", "budget", "off") or self.sampler.check_until is not None:
            described = self._described(signature, tensors)
            flops = (
                _flops(func, args, kwargs, out, outputs, signature)
                if plan.kind == "matmul"
                else float(sum(t.numel() for t in outputs if isinstance(t, torch.Tensor)))
            )
            self.recorder.aggregate(seq, plan.name, phase, module, reason, flops, described[2])
            self.step_calls[(plan.name, phase)][1] += flops
            return
        flops = _flops(func, args, kwargs, out, outputs, signature)
        self.step_calls[(plan.name, phase)][1] += flops
        dtypes, shapes, _ = self._described(signature, tensors)
        self.recorder.op(
            OpRecord(
                run_id=self.ctx.run_id,
                seq=seq,
                op=plan.name,
                overload=plan.overload,
                module=module,
                phase=phase,
                source_loc=user_source(3),
                dtypes=dtypes,
                shapes=shapes,
                device=_device(tensors),
                checked=False,
                skip_reason=reason,
                flops=flops,
                kind=plan.kind,
            )
        )

    def _described(self, signature: tuple[Any, ...] | None, tensors: list[torch.Tensor]) -> tuple[str, str, str]:
        """(dtypes JSON, shapes JSON, sorted distinct dtypes JSON) of the inputs, cached per signature (a call
        without one, a view or a factory, by its inputs' shapes and dtypes: three JSON dumps a call were most of a
        watched step's time on its views)."""
        key = signature if signature is not None else (None, *[(t.shape, t.dtype) for t in tensors])
        hit = self._descriptions.get(key)
        if hit is None:
            dtypes, shapes = describe_inputs(tensors)
            hit = (dtypes, shapes, json.dumps(sorted({dtype_name(t.dtype) for t in tensors})))
            if len(self._descriptions) < _MAX_DESCRIPTIONS:
                self._descriptions[key] = hit
        return hit

    def _carry_shadow(
        self,
        func: Any,
        plan: OpPlan,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        tensors: list[torch.Tensor],
    ) -> None:
        """Views of a tensor with a shadow get the same view of the shadow; anything else loses its shadow.

        Views also carry a kept float64 copy (the same view of it), when it has the layout a fresh copy would have.
        """
        if plan.is_view and plan.skip == "view" and tensors and isinstance(out, torch.Tensor):
            if len(self.shadow) and self.shadow.get(tensors[0]) is not None:
                try:
                    a64, k64 = oracle.convert(args, kwargs, oracle.float64_of, self.shadow.get)
                    view = func(*a64, **k64)
                    if isinstance(view, torch.Tensor) and view.shape == out.shape:
                        self.shadow.set(out, view)
                except Exception:
                    pass
            if len(self.copies) and out.device.type == "cpu" and out.dtype.is_floating_point:
                self._carry_copy(func, args, kwargs, out, tensors[0])
            return
        if len(self.shadow):
            for w in oracle.targets(plan, args, kwargs, out):
                if isinstance(w, torch.Tensor):
                    self.shadow.forget(w)

    def _carry_copy(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor, base: torch.Tensor
    ) -> None:
        kept = self.copies.get(base)
        if kept is None or kept.stride() != base.stride() or kept.storage_offset() != base.storage_offset():
            return
        # Only where a fresh copy of the view would have the view's own strides (dense, non-overlapping): then the
        # oracle sees exactly the layout it would have seen without the cache.
        if not _dense(out):
            return
        try:
            view = func(kept, *args[1:], **kwargs)
        except Exception:
            return
        if isinstance(view, torch.Tensor) and view.shape == out.shape and view.stride() == out.stride():
            self.copies.put(out, view)
