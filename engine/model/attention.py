"""Attention over the KV caches on CPU: specd's kernel (``engine/model/csrc/attention.cpp``, op
``specd_attention::attend``), else torch's SDPA.

The kernel reads each KV head's keys and values once for all the query heads of its group and
all of a row's queries, straight from the slot or paged cache (no gathered copy), skips keys no
query may see (padding, a causal prefill's upper triangle), and splits long contexts over the
threads with a combine step. A row's output is a function of its own query, keys and mask
alone, whatever the batch, the number of queries, the threads or which rows share a call
(csrc/attention.cpp says how): the forward's attention is batch invariant by construction.

It is built at first use, for AVX-512 where the CPU has it (with bf16 rows' scores as bf16 pair
products where it has AVX-512 BF16), else for AVX2 (the same source; the loops vectorize in
either), and used for float32 and bfloat16 on CPU whenever it builds and agrees with a reference
at load; everywhere else (no compiler, no AVX2, CUDA, float16), or with
``SPECD_ATTN_KERNEL=0``, attention runs on torch's SDPA.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.model.q4_matmul import build_extension, cpu_has_flags, probe_kernel

log = logging.getLogger("specd.attention")
_SRC = Path(__file__).with_name("csrc") / "attention.cpp"
# the builds, best first: (name, the CPU flags it needs, more compiler flags)
# (-ffp-contract=off: the kernel's arithmetic is its source, csrc/attention.cpp says why;
# avx512bf16: bf16 rows' scores as bf16 pair products)
BUILDS = (
    (
        "avx512bf16",
        ("avx512f", "avx512bw", "avx512vl", "fma", "avx512_bf16"),
        ("-mprefer-vector-width=512", "-ffp-contract=off"),
    ),
    (
        "avx512",
        ("avx512f", "avx512bw", "avx512vl", "fma"),
        ("-mprefer-vector-width=512", "-ffp-contract=off"),
    ),
    ("avx2", ("avx2", "fma"), ("-ffp-contract=off",)),
)


def isa() -> str | None:
    """The build this CPU runs: the first of :data:`BUILDS` whose flags it lists, or None
    (``SPECD_ATTN_ISA`` names one, to test the AVX2 build on an AVX-512 machine)."""
    wanted = os.environ.get("SPECD_ATTN_ISA")
    for name, flags, _ in BUILDS:
        if (wanted is None or wanted == name) and cpu_has_flags(list(flags)):
            return name
    return None


_probed: list[bool] = []  # the probe's result, once a process


def kernel_available() -> bool:
    """specd's attention kernel is built, loaded and agrees with SDPA (probed once per
    process, before any forward is compiled: a compiled graph reads the result as a constant;
    ``SPECD_ATTN_KERNEL=0`` switches it off)."""
    if not _probed:
        _probed.append(_probe())
    return _probed[0]


def _probe() -> bool:
    if os.environ.get("SPECD_ATTN_KERNEL", "1") == "0":
        return False
    build = next((b for b in BUILDS if b[0] == isa()), None)
    if build is None:
        return False
    name, flags, extra = build
    return probe_kernel(
        f"specd's attention kernel ({name})",
        list(flags),
        lambda: _load(name, flags, extra),
        _self_test,
        log,
        fallback="using torch's SDPA",
    )


@functools.cache
def _load(name: str, flags: tuple[str, ...], extra: tuple[str, ...]) -> None:
    build_extension(f"specd_attention_{name}", _SRC, list(flags), extra)
    torch.library.register_fake("specd_attention::attend")(_attend_fake)


def _attend_fake(q, kc, vc, mask, slot_t, read_idx, scale):
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1] * q.shape[3])


_sdpa_only = [False]  # inside only_sdpa()


HEAD_DIMS = (32, 64, 128, 256)  # the head sizes the kernel is built for


def uses_kernel(x: torch.Tensor, head_dim: int) -> bool:
    """Whether the decoder layer's attention runs specd's kernel for activations like ``x``
    (decided where a forward is traced: a compiled graph keeps the choice of its compile)."""
    if _sdpa_only[0] or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if head_dim not in HEAD_DIMS:
        return False
    return kernel_available()


@contextlib.contextmanager
def only_sdpa() -> Iterator[None]:
    """Forwards run (and graphs compiled) inside attend with torch's SDPA: the side-by-side
    benchmarks and the tests' controls."""
    was, _sdpa_only[0] = _sdpa_only[0], True
    try:
        yield
    finally:
        _sdpa_only[0] = was


def attend(
    qs: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    mask: torch.Tensor,
    slot_t: torch.Tensor,
    read_idx: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of queries ``qs`` ``[batch, heads, q, head_dim]`` (rotated) over the cache
    ``kc`` / ``vc`` (slots ``[slots, kv_heads, max_len + 1, head_dim]``, each row's keys in
    slot ``slot_t[b]`` ``[batch]``; paged ``[pool positions, kv_heads, head_dim]``, row b's
    key j at ``read_idx[b, j]`` ``[batch, kv_len]``), each query seeing the keys its ``mask``
    ``[batch, 1, q, kv_len]`` (bool) allows. Returns ``[batch, q, heads * head_dim]``."""
    empty = slot_t.new_empty(0) if read_idx is None else read_idx
    return torch.ops.specd_attention.attend(qs, kc, vc, mask, slot_t, empty, qs.shape[-1] ** -0.5)


def reference(qs, kc, vc, mask, slot_t, read_idx) -> torch.Tensor:
    """:func:`attend` by gathering the keys and running SDPA in float32 (tests, self-test)."""
    if read_idx is None:
        kv_len = mask.shape[-1]
        keys, vals = kc[slot_t, :, :kv_len], vc[slot_t, :, :kv_len]
    else:
        keys, vals = kc[read_idx].transpose(1, 2), vc[read_idx].transpose(1, 2)
    o = F.scaled_dot_product_attention(
        qs.float(), keys.float(), vals.float(), attn_mask=mask, enable_gqa=True
    )  # [batch, heads, q, head_dim]
    return o.transpose(1, 2).flatten(2).to(qs.dtype)


def _self_test() -> bool:
    g = torch.Generator().manual_seed(0)
    B, H, G, q, D, S, kv = 2, 6, 2, 5, 32, 3, 40
    kc = torch.randn(S, G, kv + 1, D, generator=g)
    vc = torch.randn(S, G, kv + 1, D, generator=g)
    qs = torch.randn(B, H, q, D, generator=g)
    slot_t = torch.tensor([2, 0])
    pos = torch.tensor([[30, 31, 32, 33, 34], [3, 4, 5, 6, 7]])
    mask = (torch.arange(kv)[None, None, :] <= pos[:, :, None]).unsqueeze(1)
    ok = True
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        args = (qs.to(dtype), kc.to(dtype), vc.to(dtype), mask, slot_t)
        got = torch.ops.specd_attention.attend(*args, slot_t.new_empty(0), D**-0.5)
        ok &= bool((got.float() - reference(*args, None).float()).abs().max() <= tol)
    return ok
