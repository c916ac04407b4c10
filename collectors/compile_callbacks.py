"""tpudiag's Dynamo compile start/end callbacks, kept registered when the script calls ``torch._dynamo.reset()``.

``torch._dynamo.reset()`` clears every compile callback (``callback_handler.clear()``).  The module-call wrapper
relies on its callbacks to hand Dynamo torch's own ``nn.Module.__call__`` while it compiles
(``collectors/module_calls.py``); after a reset the wrapper stayed in place during compiles, Dynamo traced it,
guarded on ``torch.compiler``'s compiling flag (true while tracing, false at run time) and recompiled at every call
until its recompile limit.  Seen on a compiled tiny GPT-2 decoding token by token after a ``torch._dynamo.reset()``:
8 graphs and "recompile limit exceeded" under the capture against 2 graphs without it.  Scripts, notebooks and
test suites call ``reset()`` between models.

So the callbacks go through here: the handler's ``clear`` is wrapped (on the handler object, once, while any
tpudiag callback is registered) to register them again after it has cleared the rest.  Torch's own ``clear`` runs
first and unchanged, whatever it raises.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from tpudiag import internal_errors

Callback = Callable[..., None]

_lock = threading.Lock()
_starts: list[Callback] = []
_ends: list[Callback] = []
_clear: Any = None  # the handler's own ``clear`` while it is wrapped


def _handler() -> Any:
    from torch._dynamo.callback import callback_handler

    return callback_handler


def register(start: Callback | None = None, end: Callback | None = None) -> None:
    """Register ``start`` and ``end`` with Dynamo's callback handler, for as long as ``remove`` is not called."""
    handler = _handler()
    with _lock:
        if start is not None:
            handler.register_start_callback(start)
            _starts.append(start)
        if end is not None:
            handler.register_end_callback(end)
            _ends.append(end)
        _wrap_clear(handler)


def remove(start: Callback | None = None, end: Callback | None = None) -> None:
    handler = _handler()
    with _lock:
        if start is not None and start in _starts:
            _starts.remove(start)
            if start in handler.start_callbacks:
                handler.remove_start_callback(start)
        if end is not None and end in _ends:
            _ends.remove(end)
            if end in handler.end_callbacks:
                handler.remove_end_callback(end)
        if not _starts and not _ends:
            _unwrap_clear(handler)


def _wrap_clear(handler: Any) -> None:
    global _clear
    if _clear is not None:
        return
    own = handler.clear

    def clear() -> None:
        try:
            own()
        finally:
            _register_again(handler)

    handler.clear = clear
    _clear = own


def _unwrap_clear(handler: Any) -> None:
    global _clear
    if _clear is None:
        return
    if "clear" in vars(handler):
        del handler.clear
    _clear = None


def _register_again(handler: Any) -> None:
    try:
        with _lock:
            for start in _starts:
                if start not in handler.start_callbacks:
                    handler.register_start_callback(start)
            for end in _ends:
                if end not in handler.end_callbacks:
                    handler.register_end_callback(end)
    except Exception as err:
        internal_errors.current().record("compile callbacks", "register again after torch._dynamo.reset()", err)
