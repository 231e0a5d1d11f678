"""Model definitions (Llama family) and checkpoint loading, used by the worker stage."""
