"""A request's way through the engine: admission, the scheduler, the prefill and a scored prompt's
log-probabilities (its record is engine/records/sequence.py)."""
