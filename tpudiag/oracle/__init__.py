"""The CPU float64 oracle, shared by the numerics collector and ``tpudiag repro``.

``ops``: re-run one aten op from copies of its own inputs; ``copies``: reusable float64 copies of tensors;
``graph``: replay a captured FX graph (a torch.compile region) on the CPU in float64.
"""
