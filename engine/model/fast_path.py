"""Which fast path a runner gets, and the one way out of it.

:func:`make_fast` picks the compiled fixed-shape forward (engine/model/compiled.py) or, where the
mode asks for it or the device is CUDA, the graph-captured one (engine/model/cuda_graphs.py);
:func:`disable` drops it after a failure, so the runner runs eagerly from then on.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from engine.fallback import warn_fallback
from engine.model.compiled import CompileConfig, FastForward
from engine.model.cuda_graphs import GraphForward
from engine.model.q4_matmul import Q4Weight

if TYPE_CHECKING:
    from engine.model.runner import ModelRunner

log = logging.getLogger("specd.fast_forward")


def fast_mode(cfg: CompileConfig, device: torch.device) -> str:
    """The fast path a runner on ``device`` gets for ``cfg.mode``: on CUDA, inductor's guardless
    graphs are not used (under torch 2.11 one tripped a device-side index assert, which ends
    the process's CUDA context: every request after it would fail); CUDA runs
    "cuda-graphs" whatever the mode asks, and an inductor mode's graphs there capture inductor's
    groups with their guards (``fuse``, :func:`make_fast`)."""
    if device.type == "cuda" and cfg.backend == "inductor" and cfg.mode != "cuda-graphs":
        return "cuda-graphs"
    return cfg.mode


def make_fast(runner: ModelRunner, cfg: CompileConfig, k_max: int) -> FastForward:
    """The fast path of ``runner`` for ``cfg`` (:func:`fast_mode` picks its kind)."""
    mode = fast_mode(cfg, runner.device)
    if mode != cfg.mode:
        log.warning("compile.mode %s on %s runs as %s, fused", cfg.mode, runner.device, mode)
        cfg = dataclasses.replace(cfg, fuse=True)  # the compiler asked for, inside the graphs
    if mode == "cuda-graphs":
        return GraphForward(runner, cfg, k_max)
    return FastForward(runner, cfg, k_max)


def attach(runner: ModelRunner, cfg: CompileConfig, k_max: int) -> None:
    """Give ``runner`` a compiled path (compiled lazily: call :func:`warm_up` before serving)."""
    if cfg.enabled:
        runner.fast = make_fast(runner, cfg, k_max)


def warm_up(runner: ModelRunner) -> None:
    """Compile and run every bucket of ``runner``'s fast path (if any, and ``warmup`` is set); on
    any failure warn and stay eager."""
    fast = runner.fast
    if fast is None or not fast.cfg.warmup:
        return
    try:
        fast.warm_up()
    except Exception as e:  # noqa: BLE001 -- a compile failure must never kill the server
        disable(runner, e)


def disable(runner: ModelRunner, err: Exception) -> None:
    """Drop ``runner``'s compiled path after ``err`` (logged); it runs eagerly from then on."""
    warn_fallback(log, f"compiled {runner.name} forward", err, "running eagerly from now on")
    runner.fast = None


def path_of(runner: ModelRunner) -> str:
    """The path ``runner``'s small forwards take now: ``cuda-graphs`` (captured; on CPU a replay
    re-runs the forward), ``compiled``, or ``eager`` (none attached, or dropped after a
    failure); with 4-bit layers, ``+q4-<kernel>`` names the matmul kernel they run on."""
    fast = runner.fast
    path = (
        "eager" if fast is None else "cuda-graphs" if isinstance(fast, GraphForward) else "compiled"
    )
    kernels = {w.kernel for lw in runner.weights for w in lw if isinstance(w, Q4Weight)}
    return path + "".join(f"+q4-{k}" for k in sorted(kernels))
