"""Steps of a job without an optimizer step: serving, generation, evaluation (issue 21, for every long job).

The pulse's steps end at optimizer steps (``collectors/step_points.py``).  A script that never steps an optimizer
(a serving loop, ``generate``, a long evaluation) had one step from its first forward to its exit: no pulse, no
trigger, and its first trace window never closed, so the profiler ran for the whole job (measured on a 20 s
inference loop: 4.3x fewer forwards than plain and 2.4 GB more memory).

So the trace collector also ends steps at root module calls (outermost ``nn.Module`` calls of the main thread):

- **No optimizer step yet** (``by_root``): a root call of the module that began the step in progress, or a second
  root call in a row of another module, ends that step and begins the next.  A ``generate`` loop's steps are its
  decoding steps; a diffusion pipeline's are its denoiser calls (the text encoder and the decoder fall in a
  neighbouring step); a module called once before the loop does not hold the loop's steps.  The first
  ``FIRST_CALLS`` such calls stay in the first step: a training script's warm-up forwards before its first optimizer
  step (lazy initialisation, a compile warm-up, a shape probe) do not shift its steps' numbers, which the pulse,
  the memory readings and the numerics collector share.
- **Once an optimizer has stepped**, only optimizer steps end steps (a step's several forwards, for gradient
  accumulation or a second input, stay one step), until a step outlasts ``max(LONG_STEP_S, LONG_STEP_MEDIANS x its
  rolling median)`` while its root module is called again: an evaluation phase between training steps.  Its root
  calls are then steps, until the next optimizer step.  A window open when the evaluation began closes after its
  steps, not at the evaluation's end.

The step that ends at a root call ends when that call begins (its duration holds the time until the next call; its
gap is nil).  Only the main thread's root calls count, as only its optimizer steps do, and never one made inside
the autograd engine's backward: gradient checkpointing (``torch.utils.checkpoint``, HF's
``gradient_checkpointing_enable()``) calls each checkpointed module again during the backward, outside any module
call, so those calls are root calls too.  Counted, a model whose checkpointed block is one module (shared weights)
made 24 steps of its first training step's backward, the first window closed inside it, and every later step's
number was off by 24.  A script whose first optimizer step follows more than ``FIRST_CALLS`` forwards counts the
later ones as steps of their own, once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LONG_STEP_S = 60.0
LONG_STEP_MEDIANS = 4.0
FIRST_CALLS = 8  # without an optimizer step, the first step holds this many calls of its root (warm-up forwards)


class RootSteps:
    """Whether a root call begins a new step (see the module's docstring); the pulse's state of it."""

    def __init__(self, in_backward: Callable[[], bool] | None = None) -> None:
        self.in_backward = in_backward or _in_backward  # whether this thread runs the autograd engine's backward
        self.by_root = True  # root calls end steps: no optimizer step yet, or one outlasted (``begins``)
        self.step_root = 0  # id() of the module whose call began the step in progress
        self.last_root = 0  # id() of the module of the last root call
        self.waiting = FIRST_CALLS - 1  # calls that would begin a step, still held in the first one

    def began(self, key: int) -> None:
        """A step began with a root call of the module ``key`` (its id)."""
        self.step_root = self.last_root = key

    def begins(self, key: int, now_ns: int, started_ns: int, median_s: float | None) -> bool:
        """A root call of module ``key`` during the step that began at ``started_ns``: whether it begins a new step
        (``by_root`` then stays on until the next optimizer step).  A call made inside a backward (a checkpointed
        module's forward, recomputed) is not seen at all."""
        if self.by_root:
            if self.in_backward():
                return False
            last, self.last_root = self.last_root, key
            if key != self.step_root and key != last:
                return False
            if self.waiting:
                self.waiting -= 1
                return False
            return True
        self.last_root = key
        if key != self.step_root:
            return False
        limit = max(LONG_STEP_S, LONG_STEP_MEDIANS * median_s) if median_s else LONG_STEP_S
        if (now_ns - started_ns) * 1e-9 < limit or self.in_backward():
            return False
        self.by_root = True
        self.waiting = 0  # (a training job's evaluation: every call from here on)
        return True

    def optimizer_stepped(self) -> None:
        self.by_root = False


_current_autograd_node = torch._C._current_autograd_node


def _in_backward() -> bool:
    return _current_autograd_node() is not None
