"""The engine's plain records, at the bottom of its layers: a request's parameters, its sequence
and speculation record, a round's plan, a step's output. They import nothing of the engine but
each other, so every layer above (KV memory, model, K control, drafters, requests, the round) and
the server read the same types."""
