"""Which rank this process is, as early as it can be known.

torchrun / torchelastic set ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``TORCHELASTIC_RESTART_COUNT`` before the
worker's interpreter starts; SLURM and MPI set their own names.  ``torch.multiprocessing.spawn`` sets nothing:
its workers learn their rank at ``init_process_group`` (``RankIdentity.update_from_process_group``), and until
then the spawn index stands in.
"""

from __future__ import annotations

import json
import os
import socket
import sys
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
    device_ids: list[int] | None = None  # TorchTPU: global device id (chip) of each rank of the world group

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
        self.device_ids = tpu_device_ids()
        return True


def tpu_device_ids() -> list[int] | None:
    """TorchTPU's rank -> global device id of the world group, or None (no TorchTPU, or a group it does not drive).

    Launchers assign ranks with no topology input, so TorchTPU says the rank -> chip mapping is arbitrary; its
    ``get_device_assignment`` (``torch_tpu._internal.distributed.device_mesh``) returns the list, indexed by rank,
    from the TPU process group's backend (``[]`` for any other backend).  Only when ``torch_tpu`` is already
    imported by the script: never imported here.
    """
    if "torch_tpu" not in sys.modules:
        return None
    try:
        from torch_tpu._internal.distributed.device_mesh import get_device_assignment

        ids = [int(i) for i in get_device_assignment()]
    except Exception:  # an API that moved or failed: the rank record just lacks it
        return None
    return ids or None


def chip_of(device_ids_json: str | None, rank: int) -> int | None:
    """The chip (global device id) of ``rank`` from a rank record's ``device_ids`` (JSON list indexed by rank)."""
    try:
        ids = json.loads(device_ids_json) if device_ids_json else None
    except ValueError:
        return None
    if not isinstance(ids, list) or not 0 <= rank < len(ids) or not isinstance(ids[rank], int):
        return None
    return int(ids[rank])
