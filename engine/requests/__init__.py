"""A request and its way through the engine: its state, admission, the scheduler, the prefill."""
