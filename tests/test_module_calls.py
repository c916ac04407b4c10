"""``collectors/module_calls``: listeners that need only root calls (the trace collector between trace windows, the
numerics collector between watched steps) cost nested calls nothing, and enters and exits stay paired whatever
changes in between."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from tpudiag.collectors import module_calls


class Recorder:
    def __init__(self, roots_only: bool, flip_at: str | None = None) -> None:
        self.roots_only = roots_only
        self.flip_at = flip_at  # a module's class name: entering it switches roots_only mid-forward
        self.entered: list[str] = []
        self.exited: list[str] = []

    def enter(self, module: torch.nn.Module, args: Any, kwargs: Any) -> str:
        name = type(module).__name__
        self.entered.append(name)
        if name == self.flip_at:
            self.roots_only = not self.roots_only
            module_calls.refresh()
        return name

    def exit(self, module: torch.nn.Module, token: Any, output: Any, failed: bool) -> None:
        assert token == type(module).__name__
        self.exited.append(token)


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(4, 2)))


def _run(*listeners: Recorder) -> None:
    for listener in listeners:
        module_calls.add(listener)
    try:
        model = _model()
        for _ in range(2):
            model(torch.randn(3, 4))
    finally:
        for listener in listeners:
            module_calls.remove(listener)


def test_a_roots_only_listener_sees_each_root_call_once() -> None:
    roots = Recorder(roots_only=True)
    _run(roots)
    assert roots.entered == ["Sequential", "Sequential"] and roots.exited == roots.entered


def test_one_listener_wanting_every_call_gives_every_listener_every_call() -> None:
    roots, every = Recorder(roots_only=True), Recorder(roots_only=False)
    _run(roots, every)
    expected = ["Sequential", "Linear", "Sequential", "Tanh", "Linear"] * 2
    assert every.entered == expected and roots.entered == expected
    assert sorted(every.exited) == sorted(expected)


def test_a_switch_mid_forward_keeps_every_enter_paired_with_its_exit() -> None:
    # Roots only, then every call, then back to roots only from inside the nested Sequential's Tanh on: the calls
    # entered are exited, the calls skipped are neither.
    flips = Recorder(roots_only=True)
    module_calls.add(flips)
    try:
        model = _model()
        model(torch.randn(3, 4))
        assert flips.entered == ["Sequential"]
        flips.roots_only = False
        module_calls.refresh()
        model(torch.randn(3, 4))
        flips.flip_at = "Tanh"  # back to roots only inside the nested Sequential
        model(torch.randn(3, 4))
    finally:
        module_calls.remove(flips)
    assert sorted(flips.entered) == sorted(flips.exited)
    assert flips.entered[1:6] == ["Sequential", "Linear", "Sequential", "Tanh", "Linear"]
    # After the flip at Tanh the inner Linear and the rest were skipped.
    assert flips.entered[6:] == ["Sequential", "Linear", "Sequential", "Tanh"]


def test_an_exception_inside_a_nested_call_leaves_the_depth_at_zero() -> None:
    roots = Recorder(roots_only=True)
    module_calls.add(roots)
    try:
        bad = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(5, 5))
        for _ in range(2):
            with contextlib.suppress(RuntimeError):
                bad(torch.randn(2, 4))
        torch.nn.Linear(4, 4)(torch.randn(2, 4))
    finally:
        module_calls.remove(roots)
    assert roots.entered == ["Sequential", "Sequential", "Linear"] and roots.exited == roots.entered


def test_a_listener_that_enters_with_no_exit_is_not_exited_and_the_others_are() -> None:
    class EnterOnly(Recorder):
        def enter(self, module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
            super().enter(module, args, kwargs)
            return module_calls.NO_EXIT

        def exit(self, module: torch.nn.Module, token: Any, output: Any, failed: bool) -> None:
            self.exited.append(type(module).__name__)

    quiet, every = EnterOnly(roots_only=False), Recorder(roots_only=False)
    _run(quiet, every)
    assert quiet.entered == every.entered and len(every.entered) == 10
    assert quiet.exited == [] and sorted(every.exited) == sorted(every.entered)
