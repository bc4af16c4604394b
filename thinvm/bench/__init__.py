"""Benchmarks: the A/B harness, its scenarios, host probes and reports."""
