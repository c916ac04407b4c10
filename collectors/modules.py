"""Module paths (``transformer.h.0.mlp``) for whatever code runs inside an ``nn.Module`` forward.

A ``module_calls`` listener keeps a per-thread stack of the modules being executed (no global module hooks:
torch.compile never sees it).  Names come from the first root
module's ``named_modules()`` (so paths read like the model's own attribute paths); the root itself is labelled
with its class name (a torch.compile'd root by the class it wraps).
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from tpudiag import internal_errors
from tpudiag.collectors import module_calls


def _shape_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return list(value.shape)
    if isinstance(value, (list, tuple)) and value and len(value) <= 8:
        inner = [_shape_of(v) for v in value]
        return inner if any(v is not None for v in inner) else None
    if isinstance(value, dict) and value and len(value) <= 8:
        inner_d = {str(k): _shape_of(v) for k, v in value.items()}
        inner_d = {k: v for k, v in inner_d.items() if v is not None}
        return inner_d or None
    return None


def input_shapes(args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> str | None:
    """JSON of the tensor shapes among a call's arguments (nested one level), or None if none."""
    shapes = [s for s in (_shape_of(a) for a in args) if s is not None]
    if kwargs:
        kw = {k: s for k, s in ((k, _shape_of(v)) for k, v in kwargs.items()) if s is not None}
        if kw:
            shapes.append(kw)
    return json.dumps(shapes, separators=(",", ":")) if shapes else None


def _source_of(cls: type[Any]) -> str | None:
    forward = getattr(cls, "forward", None)
    if forward is None:
        return None
    try:
        path = inspect.getsourcefile(forward)
        _, line = inspect.getsourcelines(forward)
    except (OSError, TypeError):
        return None
    if path is None:
        return None
    try:
        rel = os.path.relpath(path)
        path = rel if not rel.startswith("..") else path
    except ValueError:
        pass
    return f"{path}:{line}"


def _global_name(module: torch.nn.Module) -> str | None:
    """The name ``module`` has among the globals of the code that called it (the first frame outside tpudiag and
    ``nn.Module``'s call machinery), or None."""
    namespace = caller_globals(_outward(sys._getframe(1)))
    return name_in(namespace, module) if namespace is not None else None


def _outward(frame: types.FrameType | None) -> Iterator[types.FrameType]:
    while frame is not None:
        yield frame
        frame = frame.f_back


def caller_globals(frames: Iterable[types.FrameType], limit: int = 16) -> dict[str, Any] | None:
    """The globals of the first of ``frames`` (innermost first) outside tpudiag and the module call machinery."""
    for i, frame in enumerate(frames):
        if i >= limit:
            return None
        if not str(frame.f_globals.get("__name__", "")).startswith(_CALL_MACHINERY):
            return frame.f_globals
    return None


def name_in(namespace: dict[str, Any], module: torch.nn.Module) -> str | None:
    """The name ``module`` has in ``namespace`` (a frame's globals), or None."""
    for key, value in namespace.items():
        if value is module:
            return str(key)
    return None


_CALL_MACHINERY = ("tpudiag", "torch.nn.modules.module", "torch._dynamo")


def foreign_path(module: torch.nn.Module, caller: torch.nn.Module, caller_path: str, name: Callable[[], str]) -> str:
    """The path of ``module``, called by ``caller`` (at ``caller_path``, "" for the root) but outside the model's
    tree: ``name()`` (its global's name) under the caller's path.  A stand-in of its own caller (a hub kernel's
    global function-module hands the call to the model's private copy of it, which compiled code skips) takes the
    caller's path, so eager and compiled rows agree.  The module tracker and the memory collector's traceback reader
    both name such modules so."""
    if type(module) is type(caller):
        return caller_path
    own = name()
    return f"{caller_path}.{own}" if caller_path else own


def _nothing() -> None:
    return None


class ModuleTracker:
    """Tracks the module path of the running forward, per thread.

    ``on_enter(path, module, args, kwargs, is_root)`` and ``on_exit(path)`` let a collector act at module
    boundaries (the trace collector opens a profiler range there).
    """

    def __init__(
        self,
        on_enter: Callable[[str, Any, tuple[Any, ...], dict[str, Any], bool], Any] | None = None,
        on_exit: Callable[[str, Any], None] | None = None,
    ) -> None:
        self._paths: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        self._foreign: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        self._local = threading.local()
        self._on_enter = on_enter
        self._on_exit = on_exit
        self._handles: list[Any] = []
        # Only root calls wanted (``module_calls``): the trace collector between trace windows.  Module paths and
        # sources are then learnt for roots only; the next window's calls learn the rest.
        self.roots_only = False
        self.known_roots = True  # roots of classes seen as roots are enough then (``module_calls``' class mode)
        self.sources: dict[str, str] = {}
        self._class_sources: dict[type[Any], str | None] = {}
        self._root: Callable[[], torch.nn.Module | None] = _nothing  # the last root module called (weakly)
        self._root_path = ""

    # -- lifecycle ------------------------------------------------------------------------------------------
    def install(self) -> None:
        module_calls.add(self)

    def remove(self) -> None:
        module_calls.remove(self)

    # -- queries --------------------------------------------------------------------------------------------
    def _stack(self) -> list[tuple[torch.nn.Module, str, Any]]:
        stack: list[tuple[torch.nn.Module, str, Any]] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = []
            self._local.stack = stack
        return stack

    def current(self) -> str | None:
        stack = self._stack()
        return stack[-1][1] if stack else None

    def path_of(self, module: torch.nn.Module) -> str:
        # The root call of every step is the same module: its path without a weak-dictionary lookup (which builds
        # a weak reference per call).  Kept (``_root``) once its path is known, at its second root call.
        if self._root() is module:
            return self._root_path
        path = self._paths.get(module)
        if path is not None:
            if not self._stack():
                self._root, self._root_path = weakref.ref(module), path
            return path
        stack = self._stack()
        if not stack:
            # A torch.compile'd module (OptimizedModule) is named after the module it wraps, without "_orig_mod".
            orig = getattr(module, "_orig_mod", None)
            root_label = type(orig if isinstance(orig, torch.nn.Module) else module).__name__
            for name, sub in module.named_modules():
                shown = ".".join(part for part in name.split(".") if part != "_orig_mod")
                self._paths.setdefault(sub, shown if shown else root_label)
            return self._paths[module]
        parent_module, parent_path = stack[-1][0], stack[-1][1]
        if parent_module not in self._paths:
            # The parent is itself outside the tree: its children's paths depend on its caller, so none is kept.
            for name, child in parent_module.named_children():
                if child is module:
                    return parent_path if name == "_orig_mod" else f"{parent_path}.{name}"
            return foreign_path(module, parent_module, parent_path, lambda: self._foreign_name(module))
        for name, child in parent_module.named_children():
            if name == "_orig_mod":
                self._paths.setdefault(child, parent_path)
                continue
            self._paths.setdefault(child, f"{parent_path}.{name}" if parent_path else name)
        path = self._paths.get(module)
        if path is not None:
            return path
        # Not in the tree: a module the caller reached through its globals (transformers' hub kernels turn
        # functions such as ``apply_rotary_pos_emb`` into modules) is named by that global under its caller's path,
        # as the compiled graphs' module stacks name it, per caller (every layer calls the same one).  The root's
        # own label is left out, as it is for its children (a stand-in of the root keeps the label).
        caller_path = parent_path if len(stack) > 1 else ""
        return foreign_path(module, parent_module, caller_path, lambda: self._foreign_name(module)) or parent_path

    def _foreign_name(self, module: torch.nn.Module) -> str:
        name = self._foreign.get(module)
        if name is None:
            name = _global_name(module) or type(module).__name__
            self._foreign[module] = name
        return name

    # -- module_calls listener ---------------------------------------------------------------------------
    def enter(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._stack()
        if not stack and self.roots_only and module_calls.current_depth() > 0:
            return module_calls.NO_EXIT  # nested in a root call not kept (below): nothing to track
        is_root = not stack
        if is_root and self._root() is module:
            path = self._root_path  # every step's root call (its source was noted when its path was first found)
        else:
            path = self.path_of(module)
            cls = type(module)
            if cls not in self._class_sources:
                self._class_sources[cls] = _source_of(cls)
            src = self._class_sources[cls]
            if src is not None and path not in self.sources:
                self.sources[path] = src
        token = None
        if self._on_enter is not None:
            try:
                token = self._on_enter(path, module, args, kwargs, is_root)
            except Exception as err:  # a collector's bookkeeping must never break the user's forward
                internal_errors.current().record("module hooks", f"enter {path}", err)
                token = None
        if is_root and token is None and self.roots_only:
            # Between trace windows (``roots_only`` still, after ``on_enter``, which may have opened one): no
            # nested call will ask for the stack, and nothing is to be done at the exit.
            return module_calls.NO_EXIT
        stack.append((module, path, token))
        return module

    def exit(self, module: torch.nn.Module, token: Any, output: Any, failed: bool) -> None:
        stack = self._stack()
        # Pop to this module (a child that raised may not have popped itself if its listener failed).
        while stack:
            mod, path, tok = stack.pop()
            if self._on_exit is not None:
                try:
                    self._on_exit(path, tok)
                except Exception as err:
                    internal_errors.current().record("module hooks", f"exit {path}", err)
            if mod is module:
                break
