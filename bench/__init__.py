"""Benchmarks: real fleets on this machine, policies and baselines side by side in one run."""
