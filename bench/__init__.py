"""Benchmarks: every figure is measured beside its baseline in the same run and reported as a ratio."""
