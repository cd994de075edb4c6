"""Benchmarks: each module exposes run() -> list of result rows; run_all collects them."""
