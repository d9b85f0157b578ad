"""Which fast path a runner gets.

:func:`make_fast` picks the compiled fixed-shape forward (engine/model/compiled.py) or, where the
mode asks for it or the device is CUDA, the graph-captured one (engine/model/cuda_graphs.py); the
runner builds it at construction and drops it after a failure, running eagerly from then on;
:func:`path_of` names the path a runner takes now.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from engine.model.compiled import CompileConfig, FastForward
from engine.model.cuda_graphs import GraphForward
from engine.model.q4_matmul import Q4Weight

if TYPE_CHECKING:
    from engine.model.stack import Stack
    from engine.model.weights import LayerWeights

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


def make_fast(runner: Stack, cfg: CompileConfig, k_max: int) -> FastForward:
    """The fast path of ``runner`` for ``cfg`` (:func:`fast_mode` picks its kind)."""
    mode = fast_mode(cfg, runner.device)
    if mode != cfg.mode:
        log.warning("compile.mode %s on %s runs as %s, fused", cfg.mode, runner.device, mode)
        cfg = dataclasses.replace(cfg, fuse=True)  # the compiler asked for, inside the graphs
    if mode == "cuda-graphs":
        return GraphForward(runner, cfg, k_max)
    return FastForward(runner, cfg, k_max)


def path_of(fast: FastForward | None, weights: list[LayerWeights]) -> str:
    """The path small forwards take through ``fast`` over ``weights`` (a runner's:
    ``ModelRunner.path``): ``cuda-graphs`` (captured; on CPU a replay re-runs the forward),
    ``compiled``, or ``eager`` (none built, or dropped after a failure); with 4-bit layers,
    ``+q4-<kernel>`` names the matmul kernel they run on."""
    path = (
        "eager" if fast is None else "cuda-graphs" if isinstance(fast, GraphForward) else "compiled"
    )
    kernels = {w.kernel for lw in weights for w in lw if isinstance(w, Q4Weight)}
    return path + "".join(f"+q4-{k}" for k in sorted(kernels))
