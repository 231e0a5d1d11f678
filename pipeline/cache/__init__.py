"""Cache messager stage: layer-wise KV transfer for prefill/decode disaggregation."""
