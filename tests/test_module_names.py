"""Module paths of modules outside the model's tree: a module-level module a forward calls through its globals
(transformers' hub kernels turn ``apply_rotary_pos_emb`` into one) is named by that global under the path of the
module that called it, per caller, and the same way in eager rows and in a compiled graph's rows."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tpudiag.collectors.modules import ModuleTracker  # noqa: E402
from tpudiag.collectors.numerics.compiled import nodes  # noqa: E402


class _Scale(torch.nn.Module):
    def forward(self, x: Any) -> Any:
        return x * 0.5


class _Helper(torch.nn.Module):
    """Outside the tree, with a child of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _Scale()

    def forward(self, x: Any) -> Any:
        return self.inner(x).tanh()


shared_act = _Scale()  # a function made a module, as hub kernels do
helper = _Helper()


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: Any) -> Any:
        return helper(shared_act(self.proj(x)))


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])

    def forward(self, x: Any) -> Any:
        for block in self.blocks:
            x = block(x)
        return shared_act(x)


def _eager_names(model: torch.nn.Module, x: Any) -> list[str]:
    seen: list[str] = []
    tracker = ModuleTracker(on_enter=lambda path, *_: seen.append(path))
    tracker.install()
    try:
        model(x)
        model(x)  # the second call reads what the first learnt
    finally:
        tracker.remove()
    return seen


def test_a_global_module_is_named_under_each_caller_in_eager_and_compiled_rows() -> None:
    torch.manual_seed(0)
    model, x = _Model(), torch.randn(2, 4)
    eager = _eager_names(model, x)
    once = eager[: len(eager) // 2]
    assert once == eager[len(eager) // 2 :]
    assert once == [
        "_Model",
        "blocks.0",
        "blocks.0.proj",
        "blocks.0.shared_act",
        "blocks.0.helper",
        "blocks.0.helper.inner",
        "blocks.1",
        "blocks.1.proj",
        "blocks.1.shared_act",
        "blocks.1.helper",
        "blocks.1.helper.inner",
        "shared_act",  # called by the root itself: the root's label is left out, as for its children
    ]

    compiled: set[str] = set()

    def backend(gm: Any, example_inputs: Any) -> Any:
        compiled.update(m for n in gm.graph.nodes if (m := nodes.module_of(n)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(x)
    assert {"blocks.0.shared_act", "blocks.1.helper.inner", "shared_act"} <= compiled <= set(once)


def test_dynamo_paths_of_globals_read_as_module_paths() -> None:
    class Node:
        def __init__(self, *paths: str) -> None:
            self.meta = {"nn_module_stack": {str(i): (p, object) for i, p in enumerate(paths)}}

    attn = "L['self'].model.layers[1].self_attn"
    rope = "G['__import_transformers_dot_models_dot_llama_dot_modeling_llama'].apply_rotary_pos_emb"
    assert nodes.module_of(Node(attn, rope)) == "model.layers.1.self_attn.apply_rotary_pos_emb"
    assert nodes.module_of(Node(attn, "G['helper']", "G['helper'].inner")) == "model.layers.1.self_attn.helper.inner"
    assert nodes.module_of(Node("G['act']")) == "act"
    assert nodes.module_of(Node(attn)) == "model.layers.1.self_attn"


class _Kernel(torch.nn.Module):
    """A hub kernel's function-module: the global one hands the call to a private copy (not a child) of itself; with
    ``fails``, the copy raises (an allocation refused, say)."""

    def __init__(self, private: bool = False, fails: bool = False) -> None:
        super().__init__()
        self.fails = fails
        self.__dict__["copy"] = None if private else _Kernel(private=True, fails=fails)

    def forward(self, x: Any) -> Any:
        if self.copy is not None:
            return self.copy(x)
        if self.fails:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return x.sin()


kernel = _Kernel()
failing = _Kernel(fails=True)


class _KernelUser(torch.nn.Module):
    """Calls ``kernel`` (or ``failing``) through its globals."""

    def __init__(self, fails: bool = False) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.fails = fails

    def forward(self, x: Any) -> Any:
        return (failing if self.fails else kernel)(self.proj(x))


def test_a_private_copy_of_its_callers_class_takes_its_callers_path() -> None:
    """Compiled code skips the copy (transformers' kernels call its forward directly while compiling): eager rows
    must not name an extra level for it, or the two runs' rows of the same ops would not compare."""
    model = torch.nn.Sequential(_KernelUser())
    seen: list[tuple[str, Any]] = []
    tracker = ModuleTracker(on_enter=lambda path, module, *_: seen.append((path, module)))
    tracker.install()
    try:
        model(torch.randn(2, 4))
    finally:
        tracker.remove()
    assert [p for p, _ in seen] == ["Sequential", "0", "0.proj", "0.kernel", "0.kernel"]
    assert seen[-1][1] is kernel.copy


def test_an_errors_traceback_names_its_module_as_the_tracker_does() -> None:
    """The memory collector names an out-of-memory error's module from its traceback: the same path the module
    tracker gave the failing call (not the bare class name of a module outside the tree)."""
    from tpudiag.collectors.memory import _module_of_traceback

    model = torch.nn.Sequential(torch.nn.Sequential(_KernelUser(fails=True)))
    seen: list[str] = []
    tracker = ModuleTracker(on_enter=lambda path, *_: seen.append(path))
    tracker.install()
    try:
        with pytest.raises(RuntimeError) as caught:
            model(torch.randn(2, 4))
    finally:
        tracker.remove()
    assert seen[-1] == "0.0.failing"
    assert _module_of_traceback(caught.value.__traceback__) == seen[-1]
