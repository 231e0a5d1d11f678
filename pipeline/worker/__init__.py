"""Worker stage: weights, KV cache memory, the persistent batch, sampling."""
