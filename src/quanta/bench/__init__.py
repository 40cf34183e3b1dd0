"""Benchmarks: roofline probe, side-by-side runs against llama.cpp, reports and plots."""
