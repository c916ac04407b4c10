"""One process-wide instrumentation point for ``nn.Module`` calls that torch.compile never sees.

Why not global module hooks (``register_module_forward_pre_hook``): Dynamo reads the global hook dicts while it
traces.  With any hook registered it traces ``Module._call_impl`` instead of ``forward``, inlines the hooks into
the graph (a hook that touches Python state then fails with "... is already tracked for mutation"), and guards
on the dicts' lengths, so adding or removing a hook between steps recompiles.  Compiled code would differ from a
run without tpudiag.

Instead ``nn.Module.__call__`` is wrapped here, once, for every listener:

- While Dynamo compiles a frame (its compile start/end callbacks) the original ``__call__`` is put back, so Dynamo
  finds exactly the module class it finds without tpudiag (it short-circuits to ``forward`` only when
  ``__call__`` is torch's own) and has nothing of ours to trace or guard.
- At run time, compiled code never calls ``__call__`` for the modules it inlined; the wrapper runs only around
  module calls made by eager Python.
- The wrapper's own frame is skipped by Dynamo's frame evaluation (nested frames keep the default treatment, so
  a compiled ``forward`` inside still compiles), and the listeners run in frames Dynamo skips recursively: a
  graph-break gap in a compiled function never turns tpudiag code into a compiled frame of its own.
- A listener that raises is recorded in ``tpudiag.internal_errors`` and skipped; the module call goes on.

A listener has ``enter(module, args, kwargs) -> token`` and ``exit(module, token, output, failed)``.  Listeners
enter in the order they were added and exit in reverse; a token ``NO_EXIT`` skips the listener's exit.

A listener whose ``roots_only`` attribute is true needs only root calls (the outermost module call on a thread: a
step's start).  While every listener says so, a nested call costs the wrapper a depth check and nothing else (on
the long-run bench loop the listeners' work on every call of every step was ~4% of the step time); a listener that
changes its mind calls ``refresh()``.  Calls are entered and exited in pairs whatever changes in between: a call
entered on the fast path is never exited, and one entered is always exited.

Known roots only (the steady state of a long run).  Even skipped, a nested call paid the wrapper's frame: ~0.6 us,
~10 us a step of the long-run bench's 15-module forward, as much as the pulse's whole budget (issue 21), and a
transformer's forward makes hundreds.  While every listener is ``roots_only`` and also ``known_roots`` (the root
calls of classes already seen as roots are enough: the trace collector between windows, the numerics collector
between watched steps), ``nn.Module.__call__`` is torch's own again and only the classes seen as roots get the
wrapper as their ``__call__``: nested calls of other classes cost nothing.  A root of a class not seen before is
then not entered; the next refresh that needs every call (a trace window, a watched numerics step) puts the
wrapper back on ``nn.Module`` and learns it.  Classes that define a ``__call__`` of their own (``OptimizedModule``)
keep the wrapper on ``nn.Module`` (a compiled root's nested calls are compiled code and reach no ``__call__``).
Dynamo never sees the class wrappers either: a compile's start takes them off with the ``nn.Module`` one, and they
guard nothing (no recompile when they come or go, tested).  In class mode the wrapper hands a call to whatever
``nn.Module.__call__`` is then (torch's, or a tracer's own patch such as ``torch.fx``'s), never past it.

Steady steps (``collectors/steady_steps.py``): the root call that begins a steady step (the same root module as
the last full step's, on the main thread, with inputs of the same shapes and dtypes) only appends its start and
enters no listener; any other root call first hands the steady steps so far to the collectors (``settle``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from tpudiag import forks, internal_errors
from tpudiag.collectors import steady_steps
from tpudiag.longrun import control


class _CompilingFlag:
    """``torch.compiler.is_compiling()`` as an attribute, where torch has no module flag of that name."""

    @property
    def _is_compiling_flag(self) -> bool:
        return bool(torch.compiler.is_compiling())


# ``torch.compiler.is_compiling()`` without its two Python frames (it calls ``torch.jit.is_scripting()``, then
# returns this module flag; ~0.5 us on a cold step): ``compiling._is_compiling_flag``.  Outside TorchScript (which
# never runs this code) the two are the same; Dynamo never traces the frames that read it (see above).
compiling: Any = (
    torch.compiler if isinstance(getattr(torch.compiler, "_is_compiling_flag", None), bool) else _CompilingFlag()
)


class Listener(Protocol):
    def enter(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...

    def exit(self, module: torch.nn.Module, token: Any, output: Any, failed: bool) -> None: ...


# A listener's ``enter`` may return NO_EXIT: its ``exit`` is not called for that call (a listener with nothing to do
# on exit saves the call).  A listener whose ``enter`` raised is treated the same way.
NO_EXIT = _FAILED = object()
_lock = threading.Lock()
_listeners: tuple[Listener, ...] = ()
_original: Callable[..., Any] | None = None
_compiling = 0  # Dynamo compiles in progress (the original __call__ is in place meanwhile)
_callbacks: tuple[Any, Any] | None = None
_roots_only = False  # every listener needs only root calls (``refresh``)
_known_roots = False  # ... and only those of classes already seen as roots (class mode allowed)
_local = threading.local()  # ``depth``: eager module calls in progress on this thread (not the main thread) ...
_main_depth = 0  # ... and on the main thread (a module global: read on every steady root call, see ``_call``)
_Module = torch.nn.Module
MAX_ROOT_CLASSES = 64  # more distinct root classes than this: the wrapper stays on nn.Module
_root_classes: dict[type[Any], bool] = {}  # classes seen as roots -> whether their ``__call__`` is torch's
_patched: list[type[Any]] = []  # classes given the wrapper as their ``__call__`` (class mode)
_class_mode = False  # nn.Module.__call__ is not the wrapper; the classes in ``_patched`` have it
_forget_child: forks.ChildHook | None = None  # ``_let_go_in_child`` registered with ``tpudiag.forks``


def add(listener: Listener) -> None:
    """Start calling ``listener`` around every eager module call (installs the wrapper on first use)."""
    global _listeners
    with _lock:
        if listener in _listeners:
            return
        if not _listeners:
            _install()
        _listeners = (*_listeners, listener)
        _refresh_locked()


def remove(listener: Listener) -> None:
    global _listeners
    with _lock:
        if listener not in _listeners:
            return
        _listeners = tuple(x for x in _listeners if x is not listener)
        if not _listeners:
            _uninstall()
        _refresh_locked()


def refresh() -> None:
    """A listener's ``roots_only`` changed: take it into account from the next module call on."""
    with _lock:
        _refresh_locked()


def _refresh_locked() -> None:
    global _roots_only, _known_roots
    _roots_only = bool(_listeners) and all(getattr(x, "roots_only", False) for x in _listeners)
    _known_roots = _roots_only and all(getattr(x, "known_roots", False) for x in _listeners)
    _apply_mode_locked()


def class_mode() -> bool:
    """Whether only the classes seen as roots have the wrapper now (see the module's docstring)."""
    return _class_mode


def current_depth() -> int:
    """Entered module calls in progress on this thread."""
    return _main_depth if _get_ident() == _main_ident else int(getattr(_local, "depth", 0))


def installed() -> bool:
    return _original is not None


# -- the wrapper ------------------------------------------------------------------------------------------------
def _call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    global _main_depth
    if _class_mode:
        # The wrapper is this class's ``__call__``: on to whatever nn.Module's is now (a tracer may have patched it).
        original = _Module.__call__
        if original is _call:
            original = _original or _torch_call
    else:
        original = _original or _torch_call
    gate = _gate
    if gate.ready and id(self) == gate.module_id and not _main_depth and _get_ident() == _main_ident:
        # A steady step's root call (``collectors/steady_steps.py``), the common root call of a long run, checked
        # before anything else but the call to hand on is read: on a step whose caches the script has just filled
        # each object touched is a cache miss (this order and the main thread's depth in a module global, not a
        # ``threading.local``, took ~4 us off each step of the long-run bench loop, measured in one process against
        # torch's own call).
        try:  # (an input whose shape raises, a nested tensor's: never into the script's call)
            if not kwargs and len(args) == 1 and type(args[0]) is _Tensor:
                key: Any = (args[0].shape, args[0].dtype)
            else:
                key = steady_steps.key(args, kwargs)
        except Exception:
            key = None
        if (
            key == gate.key
            and gate.left
            and not gate.byroot
            and type(self) is gate.cls
            and _roots_only
            and not compiling._is_compiling_flag
        ):
            gate.starts.append(_perf_counter_ns())
            gate.ready = False
            gate.begun = True
            _main_depth = 1
            try:
                return original(self, *args, **kwargs)
            finally:
                _main_depth = 0
    main = _get_ident() == _main_ident
    depth = _main_depth if main else getattr(_local, "depth", 0)
    if _roots_only and depth > 0:
        # Nested in an entered call (most module calls of a step): nothing to enter, and no count either
        # (``depth`` only tells an entered call is in progress on this thread; the entered call restores it).
        # This comes before the compiling check, which cost as much as the rest of this path (~0.5 us a call):
        # a call is entered only when nothing compiles, and calls inside it take torch's own path either way.
        return original(self, *args, **kwargs)
    if compiling._is_compiling_flag:  # ``torch.compiler.is_compiling()``, without its frames
        # Tracing under ``torch.export`` (non-strict) or Dynamo, were it ever to trace this function (it should
        # not: see the module's docstring): torch's own __call__, with nothing entered.
        return (original if _class_mode else _torch_call)(self, *args, **kwargs)
    listeners = _listeners
    if not listeners:
        return original(self, *args, **kwargs)
    if not depth and (gate.ready or gate.starts):  # (a steady step ``begun`` has its start in ``starts``)
        # A steady step's root call that the first test did not take (``gate.ready`` and a steady step begun, or a
        # step ended by root calls), or another call of the same root with the same inputs inside a steady step
        # (gradient accumulation's micro-batches), steady too while the step is younger than the shortest step a
        # root call may end (``root_steps``).
        if gate.left and _roots_only and id(self) == gate.module_id and type(self) is gate.cls and main:
            try:  # (an input whose shape raises, a nested tensor's: never into the script's call)
                key = (
                    (args[0].shape, args[0].dtype)
                    if not kwargs and len(args) == 1 and type(args[0]) is _Tensor
                    else steady_steps.key(args, kwargs)
                )
            except Exception:
                key = None
            now = _perf_counter_ns()
            if gate.byroot:
                # A step ended by root calls (``root_steps``): this call ends the step in progress and begins the
                # next, as ``step_points.end_without_optimizer`` would have (not inside a backward, where a
                # checkpointed module's forward is recomputed: never a step's end).
                if (
                    key == gate.key
                    and now < gate.until_ns
                    and now - gate.last_end <= gate.slow_ns
                    and _STATE.compiles == gate.compiles
                    and not _STATE.pending
                    and _current_autograd_node() is None
                ):
                    gate.ends.append(now)
                    gate.starts.append(now)
                    gate.last_end = now
                    gate.left -= 1
                    gate.steady += 1
                    _main_depth = 1
                    try:
                        return original(self, *args, **kwargs)
                    finally:
                        _main_depth = 0
            elif key == gate.key and (gate.ready or (gate.begun and now - gate.starts[-1] < gate.long_ns)):
                if gate.ready:
                    gate.starts.append(now)
                    gate.ready = False
                    gate.begun = True
                _main_depth = 1
                try:
                    return original(self, *args, **kwargs)
                finally:
                    _main_depth = 0
        if main:
            # A root call the listeners take: the next steady step waits for a step's end, and the listeners find
            # the collectors as the steady steps left them.
            gate.ready = False
            steady_steps.settle()
    if not depth and type(self) not in _root_classes:
        _note_root(type(self))
    # Listeners are entered in ``_enter_all`` only, never from this frame: Dynamo skips that function and all it
    # calls (``_mark_for_dynamo``), not what this frame calls (the module's own forward must compile as usual).
    tokens = _enter_all(listeners, self, args, kwargs)
    if gate.root_ended and not depth and main:
        # The listeners ended a step at this root call and began the next: the next root calls may be steady.
        steady_steps.reopen_by_root()
    if main:
        _main_depth = depth + 1
    else:
        _local.depth = depth + 1
    output: Any = None
    failed = True
    try:
        output = original(self, *args, **kwargs)
        failed = False
        return output
    finally:
        # The depth first, then the listeners' exits (none when no listener wants this call's exit: ``tokens``).
        if main:
            _main_depth = depth
        else:
            _local.depth = depth
        if tokens is not None:
            _exit_all(listeners, tokens, self, output, failed)


def _enter_all(
    listeners: tuple[Listener, ...], module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[Any] | None:
    """The listeners' tokens, or None when none wants this call's exit."""
    tokens: list[Any] = []
    exits = False
    for listener in listeners:
        try:
            token = listener.enter(module, args, kwargs)
        except Exception as err:
            _enter_failed(listener, err)
            token = _FAILED
        tokens.append(token)
        exits = exits or token is not _FAILED
    return tokens if exits else None


def _enter_failed(listener: Listener, err: Exception) -> None:
    internal_errors.current().record("module hooks", f"{type(listener).__name__}.enter", err)


def _exit_all(
    listeners: tuple[Listener, ...], tokens: list[Any], module: torch.nn.Module, output: Any, failed: bool
) -> None:
    for listener, token in zip(reversed(listeners), reversed(tokens), strict=True):
        if token is _FAILED:
            continue
        try:
            listener.exit(module, token, output, failed)
        except Exception as err:
            internal_errors.current().record("module hooks", f"{type(listener).__name__}.exit", err)


_torch_call: Callable[..., Any] = torch.nn.Module.__call__
_gate = steady_steps.gate
_Tensor = torch.Tensor
_get_ident = threading.get_ident
_main_ident = threading.main_thread().ident
_perf_counter_ns = time.perf_counter_ns
_STATE = control.STATE
_current_autograd_node = torch._C._current_autograd_node  # not None inside a backward


# -- installing -------------------------------------------------------------------------------------------------
def _install() -> None:
    global _original, _forget_child
    # Dynamo keeps torch's own __call__ as "unpatched" when it is first imported: import it before patching.
    try:
        import torch._dynamo.utils
    except Exception as err:
        internal_errors.current().record("module hooks", "import torch._dynamo", err)
    _mark_for_dynamo()
    _original = torch.nn.Module.__call__
    _forget_child = forks.on_child("module hooks", _let_go_in_child)
    _register_compile_callbacks()
    if not _compiling:
        torch.nn.Module.__call__ = _call  # type: ignore[method-assign]


def _uninstall() -> None:
    global _original
    if _original is None:
        return
    _leave_class_mode_locked()
    _root_classes.clear()
    if torch.nn.Module.__call__ is _call:
        torch.nn.Module.__call__ = _original  # type: ignore[method-assign]
    _unregister_compile_callbacks()
    _original = None
    if _forget_child is not None:
        _forget_child.remove()


def _let_go_in_child() -> None:
    """In a child forked from the capture (``tpudiag.forks``): torch's own ``__call__`` back on nn.Module and the
    classes, no listener; with ``_original`` None the compile callbacks leave ``__call__`` alone.  No lock taken:
    another thread of the parent may have held it at the fork."""
    global _lock, _listeners, _original, _roots_only, _known_roots, _class_mode
    _lock = threading.Lock()
    original, _original = _original, None
    _listeners, _roots_only, _known_roots, _class_mode = (), False, False, False
    _unpatch_classes()
    if original is not None and _Module.__call__ is _call:
        _Module.__call__ = original  # type: ignore[method-assign]


def _on_compile_start(*_args: Any) -> None:
    global _compiling
    try:
        with _lock:
            _compiling += 1
            _leave_class_mode_locked()
            if _original is not None and torch.nn.Module.__call__ is _call:
                torch.nn.Module.__call__ = _original  # type: ignore[method-assign]
    except Exception as err:
        internal_errors.current().record("module hooks", "compile start callback", err)


def _on_compile_end(*_args: Any) -> None:
    global _compiling
    try:
        with _lock:
            _compiling = max(0, _compiling - 1)
            if not _compiling and _original is not None and torch.nn.Module.__call__ is _original:
                torch.nn.Module.__call__ = _call  # type: ignore[method-assign]
                _apply_mode_locked()
    except Exception as err:
        internal_errors.current().record("module hooks", "compile end callback", err)


# -- class mode (known roots only) ----------------------------------------------------------------------------
def _torch_owned(cls: type[Any]) -> bool:
    """No class between ``cls`` and nn.Module defines a ``__call__`` (other than the wrapper)."""
    for klass in cls.__mro__:
        if klass is _Module:
            return True
        own = klass.__dict__.get("__call__")
        if own is not None and own is not _call:
            return False
    return False


def _note_root(cls: type[Any]) -> None:
    """A root call of a class not seen as a root before (rare: once per class).  Not one made inside a backward:
    gradient checkpointing calls each checkpointed block again there, outside any module call; noted, every block
    class would carry the wrapper in class mode, and each of its nested calls in the forward would pay its frame."""
    if _current_autograd_node() is not None:
        return
    try:
        with _lock:
            if cls not in _root_classes and len(_root_classes) <= MAX_ROOT_CLASSES:  # one past: no class mode
                _root_classes[cls] = _torch_owned(cls)
                _apply_mode_locked()
    except Exception as err:
        internal_errors.current().record("module hooks", "note a root class", err)


def _apply_mode_locked() -> None:
    """Class mode while every listener allows it and every root class seen can carry the wrapper, else the
    wrapper on nn.Module (under ``_lock``)."""
    wanted = (
        _known_roots
        and not _compiling
        and _original is not None
        and 0 < len(_root_classes) <= MAX_ROOT_CLASSES
        and all(_root_classes.values())
    )
    if wanted and not _class_mode:
        _enter_class_mode_locked()
    elif not wanted and _class_mode:
        _leave_class_mode_locked()


def _enter_class_mode_locked() -> None:
    global _class_mode
    if _Module.__call__ is not _call:
        return  # somebody else's patch sits on ours: leave it be
    for cls in _root_classes:  # the classes first: their root calls are entered all along
        if "__call__" in cls.__dict__:
            continue
        try:
            cls.__call__ = _call  # type: ignore[method-assign]
        except Exception as err:  # a class that refuses it (its metaclass): never tried again
            internal_errors.current().record("module hooks", "class mode", err)
            _root_classes[cls] = False
            _unpatch_classes()
            return
        _patched.append(cls)
    _Module.__call__ = _original  # type: ignore[method-assign,assignment]
    _class_mode = True


def _leave_class_mode_locked() -> None:
    """Back to the wrapper on nn.Module (unless a compile is running or another patch sits there)."""
    global _class_mode
    if not _class_mode:
        return
    _class_mode = False
    if not _compiling and _original is not None and _Module.__call__ is _original:
        _Module.__call__ = _call  # type: ignore[method-assign]
    _unpatch_classes()


def _unpatch_classes() -> None:
    while _patched:
        cls = _patched.pop()
        try:
            if cls.__dict__.get("__call__") is _call:
                delattr(cls, "__call__")
        except Exception as err:
            internal_errors.current().record("module hooks", "class mode", err)


def _register_compile_callbacks() -> None:
    global _callbacks
    if _callbacks is not None:
        return
    try:
        from tpudiag.collectors import compile_callbacks  # kept across the script's ``torch._dynamo.reset()``

        compile_callbacks.register(_on_compile_start, _on_compile_end)
        _callbacks = (_on_compile_start, _on_compile_end)
    except Exception as err:
        internal_errors.current().record("module hooks", "register compile callbacks", err)


def _unregister_compile_callbacks() -> None:
    global _callbacks
    if _callbacks is None:
        return
    try:
        from tpudiag.collectors import compile_callbacks

        compile_callbacks.remove(*_callbacks)
    except Exception as err:
        internal_errors.current().record("module hooks", "remove compile callbacks", err)
    _callbacks = None


_marked = False


def _skip_frame(code: Any, with_callees: bool) -> None:
    """Dynamo skips frames of ``code`` (and, ``with_callees``, every frame they call)."""
    from torch._dynamo.eval_frame import set_code_exec_strategy  # type: ignore[attr-defined]
    from torch._dynamo.types import FrameAction, FrameExecStrategy  # type: ignore[attr-defined]

    callees = FrameAction.SKIP if with_callees else FrameAction.DEFAULT
    set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, callees))


def _mark_for_dynamo() -> None:
    """The wrapper's frame is skipped by Dynamo (frames it calls are not); listener frames are skipped with all
    they call.  Private API (torch >= 2.5), so a failure only costs the marking, recorded."""
    global _marked
    if _marked:
        return
    _marked = True
    try:
        _skip_frame(_call.__code__, with_callees=False)
        # Every function the wrapper calls but the module's own ``__call__``: in a compiled function's graph-break
        # gap Dynamo's frame callback is live, and a frame of ours it caught would be compiled (a different set of
        # graphs) or, compiled under ``_lock`` (``_note_root``), would deadlock on the compile-start callback.
        for fn in (_enter_all, _exit_all, _note_root, _on_compile_start, _on_compile_end, steady_steps.settle,
                   steady_steps.key):  # fmt: skip
            _skip_frame(fn.__code__, with_callees=True)
        if isinstance(compiling, _CompilingFlag):
            _skip_frame(_CompilingFlag.__dict__["_is_compiling_flag"].fget.__code__, with_callees=True)
    except Exception as err:
        internal_errors.current().record("module hooks", "mark frames for Dynamo", err)


def skip_in_dynamo(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a tpudiag callback that torch may call from inside a compiled function's eager parts (optimizer hooks,
    logging handlers): Dynamo skips its frame and everything it calls.  Returns ``fn``."""
    try:
        code = getattr(fn, "__code__", None) or fn.__func__.__code__  # type: ignore[attr-defined]
        _skip_frame(code, with_callees=True)
    except Exception as err:
        internal_errors.current().record("module hooks", "mark frames for Dynamo", err)
    return fn
