"""Which rank this process is, as early as it can be known.

torchrun / torchelastic set ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``TORCHELASTIC_RESTART_COUNT`` before the
worker's interpreter starts; SLURM and MPI set their own names.  ``torch.multiprocessing.spawn`` sets nothing:
its workers learn their rank at ``init_process_group`` (``RankIdentity.update_from_process_group``), and until
then the spawn index stands in.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

# (rank, local rank, world size) variable names, most specific launcher first.
_RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_LOCAL_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
_WORLD_VARS = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_JOB_VARS = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "TORCH_TPU_XPROF_SESSION_ID")


def _int(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        raw = env.get(name)
        if raw is not None and raw.strip().lstrip("-").isdigit():
            return int(raw)
    return None


@dataclass
class RankIdentity:
    rank: int | None
    local_rank: int | None = None
    world_size: int | None = None
    attempt: int = 0
    job_id: str | None = None
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    backend: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, fallback_rank: int | None = None) -> RankIdentity:
        env = os.environ if env is None else env
        rank = _int(env, _RANK_VARS)
        job = next((env[n] for n in _JOB_VARS if env.get(n)), None)
        return cls(
            rank=rank if rank is not None else fallback_rank,
            local_rank=_int(env, _LOCAL_VARS),
            world_size=_int(env, _WORLD_VARS),
            attempt=_int(env, ("TORCHELASTIC_RESTART_COUNT",)) or 0,
            job_id=job,
        )

    def update_from_process_group(self) -> bool:
        """Take rank, world size and backend from the default process group; False when there is none yet."""
        try:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                return False
            self.rank = int(dist.get_rank())
            self.world_size = int(dist.get_world_size())
            self.backend = str(dist.get_backend())
        except Exception:  # a process group in a state we do not understand: keep what we know
            return False
        return True
