"""``collectors/module_calls``: listeners that need only root calls (the trace collector between trace windows, the
numerics collector between watched steps) cost nested calls nothing, and enters and exits stay paired whatever
changes in between."""

from __future__ import annotations

import contextlib
import gc
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


# -- class mode: known roots only ---------------------------------------------------------------------------------
class KnownRoots(Recorder):
    known_roots = True


class Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).tanh()


class Root(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.out = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(x))


class OwnCall(torch.nn.Module):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


@contextlib.contextmanager
def _listening(*listeners: Recorder) -> Any:
    for listener in listeners:
        module_calls.add(listener)
    try:
        yield
    finally:
        for listener in listeners:
            module_calls.remove(listener)
    assert torch.nn.Module.__call__ is module_calls._torch_call and "__call__" not in Root.__dict__


def test_known_roots_only_puts_the_wrapper_on_the_root_classes_and_takes_it_off_nn_module() -> None:
    roots = KnownRoots(roots_only=True)
    model, x = Root(), torch.randn(3, 4)
    with _listening(roots):
        model(x)  # the first root call of Root: learnt, then class mode
        assert module_calls.class_mode()
        assert torch.nn.Module.__call__ is module_calls._torch_call and Root.__dict__["__call__"] is module_calls._call
        model(x)
        assert roots.entered == ["Root", "Root"] and roots.exited == roots.entered
        torch.nn.Linear(4, 4)(x)  # a root of a class not seen as a root: not entered in class mode
        assert roots.entered == ["Root", "Root"]
        roots.roots_only = False  # wanting every call again: the wrapper back on nn.Module, every call entered
        module_calls.refresh()
        assert not module_calls.class_mode() and torch.nn.Module.__call__ is module_calls._call
        model(x)
        assert roots.entered[2:] == ["Root", "Inner", "Linear", "Linear"]
    assert not module_calls.class_mode()


def test_a_listener_without_known_roots_or_a_root_with_its_own_call_keeps_the_wrapper_on_nn_module() -> None:
    x = torch.randn(3, 4)
    with _listening(KnownRoots(roots_only=True), Recorder(roots_only=True)):
        Root()(x)
        assert not module_calls.class_mode() and torch.nn.Module.__call__ is module_calls._call
    roots = KnownRoots(roots_only=True)
    with _listening(roots):
        Root()(x)
        assert module_calls.class_mode()
        OwnCall()(x)  # a root of a class not learnt: not entered in class mode
        assert roots.entered == ["Root"]
        roots.roots_only = False  # every call wanted: the wrapper back on nn.Module, and the new root learnt
        module_calls.refresh()
        OwnCall()(x)
        assert roots.entered == ["Root", "OwnCall"]
        roots.roots_only = True  # a root class with a __call__ of its own: no class mode any more
        module_calls.refresh()
        assert not module_calls.class_mode() and "__call__" not in Root.__dict__
        Root()(x)
        OwnCall()(x)
        assert roots.entered[2:] == ["Root", "OwnCall"]


def test_class_mode_changes_no_compiled_graph_and_is_off_while_dynamo_compiles() -> None:
    seen_while_compiling: list[tuple[bool, bool]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        seen_while_compiling.append((module_calls.class_mode(), "__call__" in Root.__dict__))
        return gm.forward

    def run(model: torch.nn.Module, fn: Any, x: torch.Tensor) -> list[Any]:
        out = []
        for i in range(4):
            out.append(fn(model, x + i))
            model(x)  # eager root calls between compiled ones
            out.append(fn(model, x[:2] + i))  # a new shape: a recompile, in class mode
        return out

    torch.manual_seed(0)
    model, x = Root(), torch.randn(3, 4)
    torch._dynamo.reset()
    try:
        _compare_compiled(model, x, run, backend, seen_while_compiling)
    finally:  # nothing of these compiles outlives the test (a later test counts the garbage cycles of a step)
        torch._dynamo.reset()
        gc.collect()


def _compare_compiled(
    model: torch.nn.Module, x: torch.Tensor, run: Any, backend: Any, seen_while_compiling: list[tuple[bool, bool]]
) -> None:
    import torch._dynamo.utils as dynamo_utils

    before = dynamo_utils.counters["stats"]["unique_graphs"]
    plain = run(model, torch.compile(lambda m, t: m(t) * 2, backend=backend), x)
    plain_graphs = dynamo_utils.counters["stats"]["unique_graphs"] - before
    torch._dynamo.reset()
    seen_while_compiling.clear()
    with _listening(KnownRoots(roots_only=True)):
        model(x)
        assert module_calls.class_mode()
        before = dynamo_utils.counters["stats"]["unique_graphs"]
        captured = run(model, torch.compile(lambda m, t: m(t) * 2, backend=backend), x)
        graphs = dynamo_utils.counters["stats"]["unique_graphs"] - before
        assert module_calls.class_mode()  # back on after each compile
    assert graphs == plain_graphs and seen_while_compiling and not any(a or b for a, b in seen_while_compiling)
    assert all(torch.equal(a, b) for a, b in zip(plain, captured, strict=True))


def test_class_mode_hands_calls_to_a_tracer_patching_nn_module_call() -> None:
    # torch.fx patches nn.Module.__call__ while it traces: a class carrying the wrapper must still reach fx's patch,
    # or fx would trace into a leaf module instead of recording a call to it.
    plain = [n.op for n in torch.fx.symbolic_trace(Root()).graph.nodes]
    roots = KnownRoots(roots_only=True)
    with _listening(roots):
        torch.nn.Linear(4, 4)(torch.randn(3, 4))  # Linear learnt as a root class: it carries the wrapper
        assert module_calls.class_mode() and "__call__" in torch.nn.Linear.__dict__
        traced = [n.op for n in torch.fx.symbolic_trace(Root()).graph.nodes]
    assert traced == plain and plain.count("call_module") == 2


def test_a_root_class_that_refuses_the_wrapper_keeps_it_on_nn_module_and_every_root_entered() -> None:
    class Refusing(type):
        def __setattr__(cls, name: str, value: Any) -> None:
            raise TypeError("frozen class")

    class Frozen(torch.nn.Module, metaclass=Refusing):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    roots, x = KnownRoots(roots_only=True), torch.randn(3, 4)
    with _listening(roots):
        Frozen()(x)
        Frozen()(x)
        assert not module_calls.class_mode() and torch.nn.Module.__call__ is module_calls._call
        Root()(x)
        assert roots.entered == ["Frozen", "Frozen", "Root"]


def test_depth_is_per_thread_a_root_call_on_another_thread_inside_the_main_threads_call_is_a_root() -> None:
    # The main thread's depth is a module global, the other threads' a threading.local (``module_calls._call``): a
    # call made on another thread while the main thread is inside a root call is that thread's root call, and
    # ``current_depth`` reads each thread's own depth.
    import threading

    roots = Recorder(roots_only=True)
    inner = torch.nn.Linear(4, 4)
    seen: dict[str, int] = {}

    class Outer(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen["main"] = module_calls.current_depth()

            def other() -> None:
                seen["other"] = module_calls.current_depth()
                inner(torch.randn(2, 4))

            thread = threading.Thread(target=other)
            thread.start()
            thread.join()
            return inner(x)  # nested on the main thread: not a root call

    module_calls.add(roots)
    try:
        Outer()(torch.randn(2, 4))
        after = module_calls.current_depth()
    finally:
        module_calls.remove(roots)
    assert roots.entered == ["Outer", "Linear"] and sorted(roots.exited) == sorted(roots.entered)
    assert seen == {"main": 1, "other": 0} and after == 0
