"""The engine thread: the worker that owns the engine, and the channels that carry each request's
outputs."""
