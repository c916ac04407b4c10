"""Module paths for backward ops: forward hooks tag the autograd nodes a module created, so a backward op knows the
module whose forward made its node (read by the numerics collector's ``module_of``)."""

from __future__ import annotations

import contextlib
from typing import Any

_NODE_KEY = "tpudiag_module"


class BackwardModules:
    """Module path per autograd node: after each module forward, untagged nodes behind its outputs get its path.

    A ``module_calls`` listener: exits run innermost first, so a node gets the innermost module whose forward
    created it.
    """

    def __init__(self, tracker: Any) -> None:
        self._tracker = tracker

    def install(self) -> None:
        from tpudiag.collectors import module_calls

        module_calls.add(self)

    def remove(self) -> None:
        from tpudiag.collectors import module_calls

        module_calls.remove(self)

    def enter(self, module: Any, args: Any, kwargs: Any) -> None:
        return None

    def exit(self, module: Any, token: Any, output: Any, failed: bool) -> None:
        import torch
        from torch.utils._pytree import tree_flatten

        if failed or not torch.is_grad_enabled():
            return
        path = self._tracker.path_of(module)
        leaves, _ = tree_flatten(output)
        todo = [t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while todo:
            node: Any = todo.pop()
            if node is None or _NODE_KEY in node.metadata:
                continue
            node.metadata[_NODE_KEY] = path
            todo.extend(n for n, _ in node.next_functions if n is not None)

    @staticmethod
    def current() -> str | None:
        import torch

        node = torch._C._current_autograd_node()
        if node is None:
            return None
        with contextlib.suppress(Exception):
            value = node.metadata.get(_NODE_KEY)  # type: ignore[attr-defined]
            return str(value) if value is not None else None
        return None
