"""Benchmarks behind every performance claim: `pipeline bench NAME`."""
