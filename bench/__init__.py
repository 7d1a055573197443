"""Benchmarks: `dilocox bench <name>`; results as Markdown + JSON under bench/results/<timestamp>/."""
