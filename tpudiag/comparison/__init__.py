"""Two runs compared, and the CI gate built on the comparison.

``source`` turns a run of the store (or a snapshot file) into a ``snapshot.Snapshot``; ``compare.compare`` takes
two snapshots and returns the comparison (``fingerprint``, ``steps_diff``, ``ops_diff``, ``numerics_diff``,
``compile_diff``, with the statistics in ``stats``); ``rules`` evaluates the gate on it; ``render`` and
``ci_output`` write it as text, markdown, GitHub annotations and JUnit XML; ``dashboard_view`` feeds the
dashboard's Compare page.  Nothing here imports torch.
"""
