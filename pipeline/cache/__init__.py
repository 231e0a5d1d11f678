"""Cache messager stage: layer-wise KV transfer for prefill/decode disaggregation (seed 000).

Not built yet: issue 10 adds it. The worker already publishes the per-layer "KV written"
signal it will block on (``ipc.layer_signal``), and ``runtime.spec.ModelInfo`` carries the
KV cache layout it will map.
"""
