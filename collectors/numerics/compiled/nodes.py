"""What an FX node of a Dynamo graph says about the user's code: module path, source line, the op it calls."""

from __future__ import annotations

import os
import re
from typing import Any

# The compiled frame's local that holds the root module: ``L['self']``, or ``L['args'][0]`` when the frame is a
# ``*args`` wrapper of ``forward`` (transformers decorates its models' forwards so): that index is not a module.
_ROOT = re.compile(r"^L\['args'\]\[0\]\.?|^L\['[^']*'\]\.?")
_ITEM = re.compile(r"\[(?:'([^']*)'|(\d+))\]")
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
# A module the frame reached through its globals: ``G['act']`` (a global of the compiled function's own module) or
# ``G['__import_pkg_dot_mod'].fn`` (a global of another Python module, as transformers' hub kernels make their
# function-modules, ``apply_rotary_pos_emb``).
_GLOBAL = re.compile(r"^G\['([^']*)'\]\.?")


def module_path(fx_path: str) -> str:
    """``L['self'].layers[1].act`` / ``L['s']._modules['b']`` / ``L['args'][0].model.norm`` -> ``layers.1.act`` /
    ``b`` / ``model.norm``."""
    path = _ROOT.sub("", fx_path)
    path = path.replace("._modules", "").replace("_modules", "")
    path = _ITEM.sub(lambda m: "." + (m.group(1) or m.group(2)), path)
    return path.strip(".")


def _global_name(fx_path: str) -> str | None:
    """``G['__import_pkg_dot_mod'].fn`` -> ``fn``, ``G['act'].inner`` -> ``act.inner``; None for a local path."""
    found = _GLOBAL.match(fx_path)
    if found is None:
        return None
    rest = module_path(fx_path[found.end() :])
    key = found.group(1)
    if key.startswith("__import_"):
        return rest or None
    return f"{key}.{rest}" if rest else key


def module_of(node: Any) -> str | None:
    """The module path of the innermost module the node ran in, as the eager module tracker names it: a module
    outside the root's tree (reached through a global) is named after its caller's path and its global name."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    path = ""
    named: list[tuple[str, str]] = []  # (Dynamo's path, our path) of the globals met so far
    for entry in stack.values():
        fx_path = entry[0] if isinstance(entry, tuple) else str(entry)
        name = _global_name(fx_path)
        if name is None:
            path = module_path(fx_path)
            continue
        # A child of a global module already on the stack (``G['helper'].inner``) extends that module's path.
        owner = next((n for n in reversed(named) if fx_path.startswith((n[0] + ".", n[0] + "["))), None)
        if owner is not None:
            path = f"{owner[1]}.{module_path(fx_path[len(owner[0]) :])}"
        else:
            path = f"{path}.{name}" if path else name
        named.append((fx_path, path))
    return path or None


def source_of(node: Any) -> str | None:
    """``file:line`` of the innermost user frame in the node's stack trace."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    frames = _FRAME.findall(trace)
    if not frames:
        return None
    path, line = frames[-1]
    try:
        rel = os.path.relpath(path)
        path = rel if not rel.startswith("..") else path
    except ValueError:
        pass
    return f"{path}:{line}"


def source_text(node: Any) -> str | None:
    """The user's source line of the node (the line after the innermost ``File ...`` entry)."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln for ln in trace.splitlines() if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if _FRAME.search(lines[i]) and i + 1 < len(lines):
            return lines[i + 1].strip()
    return None


def target_name(node: Any) -> str:
    """``torch.tanh``, ``torch.nn.functional.layer_norm``, ``Tensor.sum``."""
    t = node.target
    if node.op == "call_method":
        return f"Tensor.{t}"
    if node.op == "call_module":
        return str(t)
    module = getattr(t, "__module__", None) or ""
    name = getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or str(t)
    # Torch's C functions are methods of a private class (``_VariableFunctionsClass.tanh``): ``torch.tanh``.
    name = str(name).removeprefix("_VariableFunctionsClass.")
    if module.startswith("torch._C") or not module:
        module = "torch"
    return f"{module}.{name}" if not str(name).startswith(module) else str(name)
