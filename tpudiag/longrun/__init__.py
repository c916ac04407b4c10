"""Staying attached to a long job (issue 21): an always-on pulse of every step, trace windows instead of one
continuous trace, and triggers that open a window when something goes wrong.

- ``probes``: per-step figures other collectors contribute to the pulse (the memory collector, plugins);
- ``control``: the process-wide channel through which triggers, the manual trigger and the Python API ask for a
  window, and through which the numerics collector learns that a window wants every op checked;
- ``triggers``: when a step is slow enough to open a window, and the rate limit on trigger windows (pure);
- ``schedule``: the default window schedule (first steps, then a few steps at a regular interval), parsed from the
  ``torch.profiler.schedule`` form users know (pure);
- ``manual``: ``tpudiag trigger RUN`` and ``tpudiag.trigger()``: a request file in the run folder that every rank polls;
- ``analyst``: each finished window analysed and spooled by a low-priority process of its own, and the disk cap.
"""
