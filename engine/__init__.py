"""specd engine: speculative decoding over a target model and a drafter.

One noun per module; ARCHITECTURE.md (repository root) walks a request through them.
"""
