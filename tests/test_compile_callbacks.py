"""tpudiag's compile callbacks outlive the script's ``torch._dynamo.reset()`` (collectors/compile_callbacks.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch._dynamo.callback import callback_handler

from tpudiag.collectors import compile_callbacks


def test_callbacks_stay_registered_across_a_reset_and_leave_with_remove() -> None:
    seen: list[str] = []

    def start(*_args: Any) -> None:
        seen.append("start")

    def end(*_args: Any) -> None:
        seen.append("end")

    def other(*_args: Any) -> None:
        seen.append("other")

    compile_callbacks.register(start, end)
    callback_handler.register_start_callback(other)
    try:
        torch._dynamo.reset()
        # Torch's clear still clears what is not tpudiag's; tpudiag's are back.
        assert other not in callback_handler.start_callbacks
        assert start in callback_handler.start_callbacks and end in callback_handler.end_callbacks
        torch.compile(lambda t: t + 1, backend="eager")(torch.ones(2))
        assert seen[0] == "start" and seen[-1] == "end"
    finally:
        compile_callbacks.remove(start, end)
    assert start not in callback_handler.start_callbacks and end not in callback_handler.end_callbacks
    assert "clear" not in vars(callback_handler)  # torch's own clear again
    seen.clear()
    torch._dynamo.reset()
    torch.compile(lambda t: t + 2, backend="eager")(torch.ones(2))
    assert seen == []
