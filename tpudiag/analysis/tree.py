"""Event-tree analysis: nesting, self time, module and phase attribution.

Pure functions over plain columns.  Self time is computed from the nesting of complete events on each thread
(torch's own "Self CPU" from ``key_averages`` can go negative with stacks on).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MODULE_PREFIX = "module::"
BACKWARD_PREFIX = "autograd::engine::evaluate_function: "


@dataclass(frozen=True)
class Nesting:
    parent: list[int]  # -1 for roots
    depth: list[int]
    self_ns: list[int]


def nest(
    threads: Sequence[tuple[str, str]], start_ns: Sequence[int], dur_ns: Sequence[int]
) -> Nesting:
    """Parent, depth and self time of each event from containment on its (process, thread).

    An event that starts inside another but ends after it (partial overlap, e.g. async device work) is not its
    child.  Equal intervals nest in input order.
    """
    n = len(start_ns)
    parent = [-1] * n
    depth = [0] * n
    child_time = [0] * n
    order = sorted(range(n), key=lambda i: (threads[i], start_ns[i], -dur_ns[i], i))
    stack: list[int] = []
    current: tuple[str, str] | None = None
    for i in order:
        if threads[i] != current:
            stack.clear()
            current = threads[i]
        s, e = start_ns[i], start_ns[i] + dur_ns[i]
        # Pop what ended before this event starts, then what only partially overlaps it (not a container).
        while stack and start_ns[stack[-1]] + dur_ns[stack[-1]] <= s and dur_ns[i] > 0:
            stack.pop()
        while stack and start_ns[stack[-1]] + dur_ns[stack[-1]] < e:
            stack.pop()
        if stack:
            p = stack[-1]
            parent[i] = p
            depth[i] = depth[p] + 1
            child_time[p] += dur_ns[i]
        stack.append(i)
    self_ns = [max(0, dur_ns[i] - child_time[i]) for i in range(n)]
    return Nesting(parent=parent, depth=depth, self_ns=self_ns)


@dataclass(frozen=True)
class Attribution:
    module: list[str | None]
    phase: list[str | None]
    source_loc: list[str | None]


def attribute_modules(
    names: Sequence[str],
    processes: Sequence[str],
    start_ns: Sequence[int],
    seq_nr: Sequence[int | None],
    parent: Sequence[int],
    module_sources: dict[str, str] | None = None,
) -> Attribution:
    """Module path, phase and source location of every event.

    Forward: the innermost enclosing ``module::<path>`` annotation.  Backward: the ops under
    ``autograd::engine::evaluate_function: XBackward0`` belong to the module of the forward op that created that
    autograd node, found through the autograd sequence number they share.
    """
    n = len(names)
    module: list[str | None] = [None] * n
    phase: list[str | None] = [None] * n
    module_sources = module_sources or {}
    # Parents before children: sorting by start time is enough since a parent starts no later than its child.
    order = sorted(range(n), key=lambda i: (start_ns[i], i))
    forward_module_of_seq: dict[tuple[str, int], str] = {}
    for i in order:
        name = names[i]
        p = parent[i]
        if name.startswith(MODULE_PREFIX):
            module[i] = name[len(MODULE_PREFIX):]
            phase[i] = "forward"
        elif name.startswith(BACKWARD_PREFIX):
            phase[i] = "backward"
            s = seq_nr[i]
            module[i] = forward_module_of_seq.get((processes[i], s)) if s is not None else None
            if module[i] is None and p >= 0:
                module[i] = module[p]
        elif p >= 0:
            module[i] = module[p]
            phase[i] = phase[p]
        if phase[i] == "forward" and seq_nr[i] is not None and module[i] is not None:
            forward_module_of_seq.setdefault((processes[i], seq_nr[i]), module[i])  # type: ignore[arg-type]
    source = [module_sources.get(m) if m is not None else None for m in module]
    return Attribution(module=module, phase=phase, source_loc=source)
