"""Token processor stage: detokenization, stop strings, streaming deltas, timings.

It reads the engine's ``messages.engine_outputs`` and sends ``messages.answers`` to the
gateway; ``pipeline.outputs`` (vLLM's ``RequestOutput``) is what the in-process ``LLM``
builds from those answers, not part of this stage.
"""
