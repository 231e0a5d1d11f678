"""Layers and the kernels the models call: a model is a plain composition of these.

- ops: the dispatch to the C (CPU) and CUDA kernels, with one check of the layouts per
  call (KV write, paged attention, block copy, layer signal); ops_ref: the torch reference
- ops_fused: the fused CPU kernels (add + RMSNorm, RoPE + KV write, SwiGLU, small-M GEMV)
- norm (RMSNorm), rotary (RoPE tables), attention (the step's AttentionMetadata)
- fused_decoder: the CPU float32 decoder stack over the fused kernels
"""
