"""Benchmarks of specd itself: they import the engine (or start specd from its config), unlike the
load generator around them (``python -m loadtest``), which drives any OpenAI-compatible server.

Each runs as ``python -m loadtest.bench.<name>`` (``--help`` for its options):

* ``engine_speed``: batch-1 tok/s on real prompts, plain vs fixed K vs K controllers, per drafter,
  beside transformers' ``generate()``;
* ``steps``: per-step forward latency, eager vs compiled;
* ``synthetic``: achieved speedup against the speculative-decoding bound at a set acceptance rate;
* ``replay_k``: offline, noise-free replay of K controllers over n-gram traces;
* ``servers``: specd against llama.cpp and ``transformers serve`` on the same machine;
* ``compare_guidellm``: ``python -m loadtest`` cross-checked against GuideLLM on one specd.

Every forward or generation they time goes through :mod:`engine.kcontrol.timing` (device
synchronised before and after); a server they start goes through :mod:`loadtest.server_proc`.
"""
