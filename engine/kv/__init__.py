"""KV memory: the slot and paged caches the model writes, their block bookkeeping and the prefix
caches the scheduler drives. Below the model, which reads and writes it, and the scheduler,
which sizes it."""
