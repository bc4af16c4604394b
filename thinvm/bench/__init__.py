"""Benchmarks: the A/B harness, its scenarios, host probes and reports.

Imports run one way: types (the scenario model, options) <- results
(statistics, chosen rows, result files) <- report (tables, docs, plots);
quiet, cpu, probe and environment look at the host; scenarios (one module
per family, the registry in its __init__) build Scenarios from types;
runner runs them and is what `thinvm bench` calls.
"""
