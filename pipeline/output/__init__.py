"""Token processor stage: detokenization, stop strings, streaming deltas, timings."""
