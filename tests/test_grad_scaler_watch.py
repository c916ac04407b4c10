"""Finding a live GradScaler without touching the script (collectors/numerics/grad_scaler.py)."""

from __future__ import annotations

import gc
import warnings

import torch

from tpudiag.collectors.numerics.grad_scaler import RESCAN_S, ScalerWatch


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_scaler_counts_once_it_has_scaled_a_loss_and_while_it_lives() -> None:
    clock = _Clock()
    watch = ScalerWatch(clock)
    assert not watch.scaling()  # none alive: one scan
    scaler = torch.amp.GradScaler("cpu")
    assert not watch.scaling()  # made after the scan: not looked for again before RESCAN_S
    clock.now += RESCAN_S
    assert not watch.scaling()  # found, but it has not scaled anything yet
    scaler.scale(torch.ones(()))
    assert watch.scaling()  # known since the scan: no new scan needed
    del scaler
    gc.collect()
    assert not watch.scaling()  # gone (held weakly)


def test_a_disabled_scaler_or_a_subclass() -> None:
    import torch.cuda.amp

    off = torch.amp.GradScaler("cpu", enabled=False)
    off.scale(torch.ones(()))
    assert not ScalerWatch().scaling()
    with warnings.catch_warnings():  # deprecated in favour of torch.amp's, which it subclasses
        warnings.simplefilter("ignore", FutureWarning)
        legacy = torch.cuda.amp.GradScaler(enabled=False)  # disabled: no CUDA here
    watch = ScalerWatch()
    assert not watch.scaling()
    legacy._enabled, legacy._scale = True, torch.ones(())  # as on a CUDA machine after its first scale()
    assert watch.scaling()
    del off
