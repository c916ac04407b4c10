"""Distributed jobs: every rank of a torchrun / ``torch.multiprocessing.spawn`` job captured into one run.

- ``launch``: ``tpudiag capture -m torch.distributed.run ...`` runs the launcher without collectors and every
  worker through ``python -m tpudiag.distributed.worker`` (torchrun's ``PYTHON_EXEC``);
- ``spawn``: workers started by ``torch.multiprocessing.spawn`` inside a captured script are captured too;
- ``identity``: which rank a process is (environment first, ``init_process_group`` when the launcher sets none);
- ``session`` / ``probe``: the per-rank capture session and its distributed probe (rank, backend, parameter and
  gradient fingerprints);
- ``shards``: every rank writes Parquet shards in a hive layout (``<table>/run_id=<id>/rank=<r>/``);
- ``merge``: the shards of a job loaded into the store as one run;
- ``analysis``: the cross-rank questions (stragglers, collective mismatch, rank divergence, compile divergence)
  as pure functions; ``report_section`` puts them in ``tpudiag report``.
"""
