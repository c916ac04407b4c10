"""The run id every host of a job derives alone, without talking to the others (the one place this order lives).

``--run-id``, else ``TORCH_TPU_XPROF_SESSION_ID`` (set by TorchTPU's launch wrappers, the id XProf's
``session_<id>`` folder uses), else torchrun's ``--rdzv-id`` when the job spans nodes, else ``TORCHELASTIC_RUN_ID``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from tpudiag.distributed import multinode


def derive_run_id(
    explicit: str | None, launcher_args: Sequence[str] = (), env: Mapping[str, str] | None = None
) -> str | None:
    """The job's run id (see the module's docstring); None when nothing applies (the run gets a fresh id)."""
    env = os.environ if env is None else env
    if explicit:
        return multinode.clean_id(explicit)
    session = env.get("TORCH_TPU_XPROF_SESSION_ID", "").strip()
    if session:
        return multinode.clean_id(session)
    job = multinode.job_id(launcher_args, None)
    if job:
        return job
    elastic = env.get("TORCHELASTIC_RUN_ID", "").strip()
    return multinode.clean_id(elastic) if elastic else None
