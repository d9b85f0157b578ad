"""4-bit weight matrices (groups of 32 inputs, ``w = d * q + m``, q in 0..15: GGUF's Q4_1) and
their matmul on CPU, by one of two kernels:

- **specd's kernel** (``engine/model/csrc/q4_avx512.cpp`` for AVX-512 VNNI, else
  ``q4_avx2.cpp`` for AVX2 with the same result bit for bit; op ``specd_q4::mm``), built
  on first use with torch's C++ extension loader (a C++ compiler and ninja; once, then cached).
  It rounds the activations to 8 bits per row and group of 32 (:func:`activations_8bit`, as
  llama.cpp's Q4_1 x Q8_1 dot products do) and multiplies them with the nibbles as they are
  stored (``VPDPBUSD``), keeping d and m as the file's fp16 values. It reads the weights once per
  8 rows, and a row costs one instruction per 64 weights, so a verify of 2-4 tokens costs about
  what a decode does (the AVX2 build: per 4 rows). Used for bf16 activations on a CPU with
  AVX-512 VNNI and BF16, or AVX2, whenever it builds and passes its self-test at load.
- **torch's** ``_weight_int4pack_mm_for_cpu``, with the scales and ``zero = m + 8 d`` held in the
  activation dtype: everywhere else (no compiler, another CPU, float16 or float32), or with
  ``SPECD_Q4_KERNEL=0``.

A :class:`Q4Weight` is packed for one of them at load (:func:`pack`) and every forward of the
process runs it through that kernel, so decode, verify and prefill compute with one model.
Both kernels compute each row of the output from that row of the input alone.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from engine.fallback import warn_fallback

log = logging.getLogger("specd.q4")
GROUP = 32
_CSRC = Path(__file__).with_name("csrc")
# the builds of specd's kernel, best first: (name, source, the CPU flags it needs); both give
# the same bits (q4_avx2.cpp says how)
BUILDS = (
    (
        "avx512",
        _CSRC / "q4_avx512.cpp",
        ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni")
        + ("f16c", "fma"),
    ),
    ("avx2", _CSRC / "q4_avx2.cpp", ("avx2", "f16c", "fma")),
)


def isa() -> str | None:
    """The build of specd's kernel this CPU runs: the first of :data:`BUILDS` whose flags it
    lists, or None (``SPECD_Q4_ISA`` names one, to test the AVX2 build on an AVX-512 machine)."""
    wanted = os.environ.get("SPECD_Q4_ISA")
    for name, _, flags in BUILDS:
        if (wanted is None or wanted == name) and cpu_has_flags(list(flags)):
            return name
    return None


_torch_only = [False]  # only_torch_kernel()


class Q4Weight:
    """A 4-bit matrix ``[out, in]``. specd's layout: ``packed`` uint8 ``[out/16, in/32, 320]``
    with the scales inside, ``scale_zero`` None. torch's: ``packed`` in its int4 layout,
    ``scale_zero`` ``[in/32, out, 2]``. ``dtype``: the activations'. ``split``: for a fused
    matrix, the output sizes of its parts in column order (e.g. Q, K, V), else None."""

    def __init__(
        self,
        packed: torch.Tensor,
        scale_zero: torch.Tensor | None,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        split: tuple[int, ...] | None = None,
    ):
        self.packed, self.scale_zero, self.shape = packed, scale_zero, tuple(shape)
        self.split, self.dtype = split, dtype

    @property
    def kernel(self) -> str:
        return "torch" if self.scale_zero is not None else "specd"

    def __repr__(self):
        fused = f" fused {self.split}" if self.split else ""
        return f"Q4Weight{self.shape} {self.kernel}{fused}"


# -- specd's kernel ------------------------------------------------------------------------------
def cpu_has_flags(wanted: list[str]) -> bool:
    """Whether /proc/cpuinfo lists every flag of ``wanted`` (its spelling, e.g. ``avx512_bf16``)."""
    try:
        flags = next(
            (ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")),
            "",
        ).split()
    except OSError:
        return False
    return all(f in flags for f in wanted)


def probe_kernel(
    what: str,
    flags: list[str],
    load: Callable[[], None],
    self_test: Callable[[], bool],
    logger: logging.Logger,
    fallback: str = "it is not used",
) -> bool:
    """Whether a C++ kernel runs here: the CPU lists ``flags``, ``load`` builds and loads it,
    and ``self_test`` agrees with its reference. A failure is logged on ``logger`` (``fallback``:
    what serves instead), never raised."""
    if not cpu_has_flags(flags):
        return False
    try:
        load()
        ok = self_test()
    except Exception as e:  # noqa: BLE001 -- no compiler or ninja, a failed build
        warn_fallback(logger, what, e, fallback)
        return False
    if not ok:
        logger.warning("%s disagrees with its reference; %s", what, fallback)
    return ok


@functools.cache
def kernel_available() -> bool:
    """specd's kernel is built, loaded and agrees with a dense reference (probed once per
    process; ``SPECD_Q4_KERNEL=0`` switches it off)."""
    if os.environ.get("SPECD_Q4_KERNEL", "1") == "0":
        return False
    build = next((b for b in BUILDS if b[0] == isa()), None)
    if build is None:
        return False
    return probe_kernel(
        f"specd's 4-bit kernel ({build[0]})",
        list(build[2]),
        _load_library,
        _self_test,
        log,
        fallback="using torch's",
    )


def build_extension(name: str, src: Path, flags: list[str], extra: tuple[str, ...] = ()) -> None:
    """Build (once per source and flags, cached by torch's C++ extension loader) and load an
    OpenMP op library compiled for the CPU ``flags`` (``extra``: more compiler flags). The
    interpreter's folder goes on PATH where it holds ninja (a venv's, where the venv is not
    activated): the loader needs it."""
    from torch.utils.cpp_extension import load

    # the build folder is named by the source and flags too: checkouts of different sources (a
    # worktree beside the main one, an upgrade) never rebuild each other's library in turn, nor
    # wait on each other's build lock
    digest = hashlib.sha256(src.read_bytes() + repr((flags, extra)).encode()).hexdigest()[:10]
    here = str(Path(sys.executable).parent)
    if (Path(here) / "ninja").exists() and here not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
    cflags = ["-O3", "-fopenmp"] + ["-m" + f.replace("_", "") for f in flags] + list(extra)
    load(
        f"{name}_{digest}",
        [str(src)],
        extra_cflags=cflags,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )


@functools.cache
def _load_library() -> None:
    """Build and load the op (:func:`build_extension`), once per process."""
    name, src, flags = next(b for b in BUILDS if b[0] == isa())
    build_extension(f"specd_q4_{name}", src, list(flags))
    torch.library.register_fake("specd_q4::mm")(
        lambda x, packed: x.new_empty(x.shape[0], packed.shape[0] * 16)
    )


def _self_test() -> bool:
    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, (48, 96)).astype(np.uint8)
    d = rng.uniform(0.001, 0.02, (48, 3)).astype(np.float32)
    m = rng.uniform(-0.2, 0.0, (48, 3)).astype(np.float32)
    w = _pack_specd(q, d, m)
    x = torch.randn(11, 96, dtype=torch.bfloat16)
    ref = activations_8bit(x) @ dequantized(q, d, m).T
    y = torch.ops.specd_q4.mm(x, w).float()
    return bool((y - ref).abs().max() <= 0.02 * ref.abs().max())


def dequantized(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> torch.Tensor:
    """The float32 matrix ``[out, in]`` of q, d, m as specd's kernel holds them (fp16 d, m)."""
    d16, m16 = (np.asarray(a, np.float16).astype(np.float32) for a in (d, m))
    return torch.from_numpy(np.repeat(d16, GROUP, 1) * q + np.repeat(m16, GROUP, 1))


def activations_8bit(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[rows, in]`` as specd's kernel multiplies it (float32): each row's groups of 32
    rounded to 8 bits, ``s * round(x * (127 / amax))`` with ``s = amax / 127`` (fp32 arithmetic,
    ties to even). A group with ``amax < 1e-30`` becomes zero; one holding a NaN or an infinity
    becomes NaN (the kernel's output row is then NaN)."""
    g = x.float().reshape(x.shape[0], -1, GROUP)  # [rows, groups, 32]
    amax = g.abs().amax(-1, keepdim=True)
    bad = ~torch.isfinite(g).all(-1, keepdim=True)
    small = ~(amax >= 1e-30) & ~bad
    safe = torch.where(small | bad, torch.ones_like(amax), amax)
    # tensor / tensor: IEEE division, as the kernel's (torch's scalar / tensor can be a bit off)
    out = torch.round(g * (torch.full_like(safe, 127.0) / safe)) * (safe / 127.0)
    out = torch.where(small, torch.zeros_like(out), out)
    return torch.where(bad, torch.full_like(out, float("nan")), out).reshape(x.shape)


def _pack_specd(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> torch.Tensor:
    """q ``[out, in]`` 0..15, d and m ``[out, in/32]`` -> uint8 ``[out/16, in/32, 320]`` (the
    byte layout is described in engine/model/csrc/q4_avx512.cpp)."""
    n, k = q.shape
    nb, g = n // 16, k // GROUP
    six = q.reshape(nb, 16, g, 4, 2, 4)  # [block, column, group, chunk, half, input]
    byte = (six[..., 0, :] | six[..., 1, :] << 4).astype(np.uint8)  # [block, col, group, chunk, 4]
    data = byte.transpose(0, 2, 3, 1, 4).reshape(nb, g, 256)

    def scales(a: np.ndarray) -> np.ndarray:  # [out, in/32] -> [block, group, 32 bytes]
        h = np.ascontiguousarray(np.asarray(a, np.float16).reshape(nb, 16, g).transpose(0, 2, 1))
        return h.view(np.uint8).reshape(nb, g, 32)

    return torch.from_numpy(np.ascontiguousarray(np.concatenate([data, scales(d), scales(m)], -1)))


# -- torch's kernel ------------------------------------------------------------------------------
# specd::q4_mm, an opaque op, so that inductor calls torch's kernel as it is (inductor's own
# lowering of the aten op routes it through a kernel that re-packs the weight on every call).
# Defined through torch.library.Library rather than torch.library.custom_op: a lower per-call
# overhead, paid by every matmul of a step.
_LIB = torch.library.Library("specd", "DEF")
_LIB.define("q4_mm(Tensor x, Tensor packed, Tensor scale_zero) -> Tensor")


def _q4_mm_cpu(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scale_zero)


_LIB.impl("q4_mm", _q4_mm_cpu, "CPU")


@torch.library.register_fake("specd::q4_mm")
def _q4_mm_fake(x, packed, scale_zero):
    return x.new_empty(x.shape[0], scale_zero.shape[1])


def _pack_torch(q: np.ndarray, d: np.ndarray, m: np.ndarray, dtype: torch.dtype):
    # packed in row chunks (the packed layout is blocked by 64 rows, so chunks concatenate):
    # the int32 copy the packer takes is 8x the nibbles, 226 MB for the LM head in one piece
    step = 4096
    packed = torch.cat(
        [
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                torch.from_numpy(q[i : i + step].astype(np.int32)), 1
            )
            for i in range(0, q.shape[0], step)
        ]
    )
    dt, mt = torch.from_numpy(d), torch.from_numpy(m)
    scale_zero = torch.stack([dt, mt + 8 * dt], -1).transpose(0, 1).contiguous().to(dtype)
    return packed, scale_zero  # scale_zero [in/32, out, 2]


# -- both ----------------------------------------------------------------------------------------
def pack(
    q: np.ndarray,
    d: np.ndarray,
    m: np.ndarray,
    dtype: torch.dtype,
    split: tuple[int, ...] | None = None,
) -> Q4Weight:
    """q ``[out, in]`` 0..15 and d, m ``[out, in/32]`` (float32) -> a :class:`Q4Weight` for
    specd's kernel where it serves (bf16, ``out`` a multiple of 16), else torch's."""
    d, m = np.asarray(d, np.float32), np.asarray(m, np.float32)
    specd = not _torch_only[0] and dtype == torch.bfloat16 and q.shape[0] % 16 == 0
    if specd and kernel_available():
        return Q4Weight(_pack_specd(q, d, m), None, q.shape, dtype, split)
    packed, scale_zero = _pack_torch(q, d, m, dtype)
    return Q4Weight(packed, scale_zero, q.shape, dtype, split)


@contextlib.contextmanager
def only_torch_kernel() -> Iterator[None]:
    """Weights packed inside are packed for torch's kernel (the side-by-side benchmark)."""
    _torch_only[0] = True
    try:
        yield
    finally:
        _torch_only[0] = False


def q4_mm(x: torch.Tensor, w: Q4Weight) -> torch.Tensor:
    """``x [tokens, in] @ W.T -> [tokens, out]`` by the kernel ``w`` was packed for (torch's
    through the opaque op inside a compiled graph)."""
    if w.scale_zero is None:
        return torch.ops.specd_q4.mm(x, w.packed)
    if torch.compiler.is_compiling():
        return torch.ops.specd.q4_mm.default(x, w.packed, w.scale_zero)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.packed, GROUP, w.scale_zero)


def q4_linear(x: torch.Tensor, w: Q4Weight) -> torch.Tensor:
    """``x [..., in] @ W.T`` for a 4-bit weight; returns ``[..., out]``."""
    y = q4_mm(x.reshape(-1, x.shape[-1]), w)
    return y.view(*x.shape[:-1], y.shape[-1])
