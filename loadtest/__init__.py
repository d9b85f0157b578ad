"""Benchmarks and load generation for specd (and any OpenAI-compatible server)."""
