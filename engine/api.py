"""The engine as the server sees it: the one module ``server/`` imports. Everything it needs to
build an engine from a config, drive it from the HTTP threads through the worker, and read what
comes back, named once here so the engine's layers can move beneath it."""

from engine.builder import Built, build_engine
from engine.config import EngineConfig
from engine.model.loader import prepare, resolve_device
from engine.records.output import StepOutput
from engine.records.params import SamplingParams, SpecParams
from engine.requests.admission import (
    DrainTimeoutError,
    EngineError,
    NotAcceptingError,
    QueueFullError,
    Reservation,
)
from engine.sampling.grammar import GrammarCompiler
from engine.worker.worker import EngineWorker

__all__ = [
    "Built",
    "DrainTimeoutError",
    "EngineConfig",
    "EngineError",
    "EngineWorker",
    "GrammarCompiler",
    "NotAcceptingError",
    "QueueFullError",
    "Reservation",
    "SamplingParams",
    "SpecParams",
    "StepOutput",
    "build_engine",
    "prepare",
    "resolve_device",
]
