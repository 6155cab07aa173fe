"""Benchmark harness behind `lamina bench`."""
