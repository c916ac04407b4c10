"""See every Dynamo graph before its backend compiles it, and hand back a wrapped compiled callable.

Every graph of every backend passes through ``OutputGraph.call_user_compiler(gm, example_inputs)`` (functions
compiled before the capture started included, both sides of a graph break, recompiles).  It is a private API, so
the patch is applied only when the method exists with that signature (torch >= 2.6, checked on 2.13); otherwise
compiled regions are reported as not checked (skip reason ``no_interception``) and the script runs as without
tpudiag.  The graph is deep-copied *before* the backend runs (backends rewrite it in place); the backend then
compiles the very graph Dynamo made, with the same arguments, so counters and generated code do not change.
torch.export and compiled autograd go through the same method and are left alone.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MIN_TORCH = (2, 6)


@dataclass
class GraphInfo:
    """One intercepted Dynamo graph."""

    compile_id: str
    ref: Any  # deep copy of the fx.GraphModule as Dynamo produced it
    compiler_fn: Any  # the backend as Dynamo calls it (for localisation by sub-graph compiles)
    backend: str
    sources: list[str | None] = field(default_factory=list)  # placeholder -> Dynamo source (L['x'], params)
    frame: str | None = None  # file:line of the compiled function
    function: str | None = None


def unsupported_reason() -> str | None:
    """Why this torch cannot be intercepted (None when it can)."""
    try:
        import torch
        from torch._dynamo.output_graph import OutputGraph
    except Exception as e:  # pragma: no cover - torch without Dynamo
        return f"torch._dynamo not importable ({type(e).__name__})"
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2] if p.isdigit())
    if version < MIN_TORCH:
        return f"torch {torch.__version__} is older than {'.'.join(map(str, MIN_TORCH))}"
    method = getattr(OutputGraph, "call_user_compiler", None)
    if method is None:
        return "OutputGraph.call_user_compiler is missing in this torch"
    params = list(inspect.signature(method).parameters)
    if params[:3] != ["self", "gm", "example_inputs"]:
        return f"OutputGraph.call_user_compiler has an unexpected signature {params}"
    return None


def _backend_name(fn: Any) -> str:
    for attr in ("compiler_name", "__name__"):
        name = getattr(fn, attr, None)
        if isinstance(name, str):
            return name
    inner = getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "compiler_fn", None)
    if inner is not None and inner is not fn:
        return _backend_name(inner)
    return type(fn).__name__


def _frame_of(og: Any) -> tuple[str | None, str | None]:
    with contextlib.suppress(Exception):
        code = og.root_tx.f_code
        return f"{code.co_filename}:{code.co_firstlineno}", code.co_name
    return None, None


class Interceptor:
    """Patches ``OutputGraph.call_user_compiler`` while installed.

    ``on_graph(info, compiled_fn)`` returns the callable Dynamo installs (the wrapper) or ``compiled_fn`` itself;
    it is called with ``compiled_fn=None`` when the backend raised (the exception then goes on to Dynamo as usual).
    ``on_error(where, exc)`` is told about any failure of tpudiag's own code; the compile goes on regardless.
    """

    def __init__(
        self, on_graph: Callable[[GraphInfo, Any], Any], on_error: Callable[[str, BaseException], None]
    ) -> None:
        self.on_graph = on_graph
        self.on_error = on_error
        self._orig: Any = None
        self._patched: Any = None
        self.graphs = 0

    def install(self) -> str | None:
        reason = unsupported_reason()
        if reason is not None:
            return reason
        from torch._dynamo.output_graph import OutputGraph

        orig = OutputGraph.call_user_compiler
        interceptor = self

        def call_user_compiler(og: Any, gm: Any, example_inputs: Any) -> Any:
            info = interceptor._capture(og, gm)
            try:
                compiled = orig(og, gm, example_inputs)
            except BaseException:
                if info is not None:
                    with contextlib.suppress(Exception):
                        interceptor.on_graph(info, None)  # seen, but the backend failed: counted, then re-raised
                raise
            if info is None:
                return compiled
            try:
                return interceptor.on_graph(info, compiled)
            except Exception as e:
                interceptor.on_error("wrap", e)
                return compiled

        call_user_compiler.__wrapped__ = orig  # type: ignore[attr-defined]
        OutputGraph.call_user_compiler = call_user_compiler  # type: ignore[method-assign,assignment]
        self._orig, self._patched = orig, call_user_compiler
        return None

    def remove(self) -> None:
        if self._orig is None:
            return
        from torch._dynamo.output_graph import OutputGraph

        if OutputGraph.call_user_compiler is self._patched:
            OutputGraph.call_user_compiler = self._orig  # type: ignore[method-assign]
        self._orig = self._patched = None

    def _capture(self, og: Any, gm: Any) -> GraphInfo | None:
        try:
            import torch

            if getattr(og, "export", False) or torch.compiler.is_exporting():
                return None
            from torch._dynamo import compiled_autograd

            if getattr(compiled_autograd, "in_compiled_autograd_region", False):
                return None
            sources: list[str | None] = []
            for node in gm.graph.nodes:
                if node.op == "placeholder":
                    arg = node.meta.get("grapharg")
                    src = getattr(arg, "source", None)
                    sources.append(src.name if src is not None and hasattr(src, "name") else None)
            ref = copy.deepcopy(gm)
            frame, function = _frame_of(og)
            self.graphs += 1
            return GraphInfo(
                compile_id=str(getattr(og, "dynamo_compile_id", None) or f"g{self.graphs}"),
                ref=ref,
                compiler_fn=og.compiler_fn,
                backend=_backend_name(og.compiler_fn),
                sources=sources,
                frame=frame,
                function=function,
            )
        except Exception as e:
            self.on_error("capture", e)
            return None
