"""The target (and a draft model): the runner, the decoder layer and its weights, the KV cache,
loading and 4-bit weights, and the forward strategies (eager, compiled, graph-captured,
batch-invariant)."""
