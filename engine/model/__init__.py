"""The target (and a draft model): the runner, the decoder layer and its weights, loading and
4-bit weights, and the forward strategies (eager, compiled, graph-captured, batch-invariant), which
see the runner only as a :class:`~engine.model.stack.Stack`. The KV memory it reads and writes is
a layer below (engine/kv/)."""
