"""4-bit matmuls (engine/model/q4_matmul.py): specd's kernel (AVX-512 VNNI, or AVX2) computes
x8 @ W.T of the stored weights (d, m as fp16) and the activations rounded to 8 bits a group (x8 =
``activations_8bit(x)``) to bf16 rounding, each output row from its input row alone (bitwise
the same whatever else is in the batch), inside compiled graphs too; torch's kernel serves
where specd's does not apply. The AVX2 build gives the AVX-512 build's bits (checked in a process
of its own where this CPU runs the AVX-512 one)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from engine.model.q4_matmul import (
    BUILDS,
    GROUP,
    activations_8bit,
    cpu_has_flags,
    dequantized,
    isa,
    kernel_available,
    pack,
    q4_linear,
)

needs_kernel = pytest.mark.skipif(
    not kernel_available(),
    reason="specd's 4-bit kernel needs AVX-512 VNNI + BF16 or AVX2, and a C++ compiler",
)


def weights(out: int, cols: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (out, cols)).astype(np.uint8)
    d = rng.uniform(0.001, 0.03, (out, cols // GROUP)).astype(np.float32)
    m = rng.uniform(-0.25, 0.05, (out, cols // GROUP)).astype(np.float32)
    return q, d, m


@needs_kernel
@pytest.mark.parametrize("out,cols", [(16, 32), (48, 96), (80, 64), (576, 576), (208, 1536)])
def test_specd_kernel_computes_the_stored_weights(out, cols):
    """Column counts that are not a multiple of the 4- or 2-block tiles, rows 1..19 (the
    8-row tiles, and their tails)."""
    q, d, m = weights(out, cols)
    w = pack(q, d, m, torch.bfloat16)
    assert w.kernel == "specd" and w.packed.shape == (out // 16, cols // GROUP, 320)
    ref_w = dequantized(q, d, m)  # [out, cols] float32
    for rows in (1, 2, 3, 4, 5, 8, 9, 16, 19):
        x = torch.randn(rows, cols, dtype=torch.bfloat16)
        y = q4_linear(x, w)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out)
        ref = activations_8bit(x) @ ref_w.T
        # bf16 output: within a rounding step of the value (plus fp32 summation order)
        err = (y.float() - ref).abs()
        assert (err <= ref.abs() * 2**-8 + 1e-3 * ref.abs().max()).all(), err.max()


@needs_kernel
def test_specd_kernel_rows_do_not_depend_on_the_batch():
    q, d, m = weights(96, 128, seed=1)
    w = pack(q, d, m, torch.bfloat16)
    x = torch.randn(21, 128, dtype=torch.bfloat16)
    batched = q4_linear(x, w)
    for rows in (1, 2, 3, 7, 8, 13):
        assert torch.equal(q4_linear(x[:rows], w), batched[:rows])
    alone = torch.cat([q4_linear(x[i : i + 1], w) for i in range(21)])
    assert torch.equal(alone, batched)
    assert torch.equal(q4_linear(x.view(3, 7, 128), w), batched.view(3, 7, 96))  # [..., in]


@needs_kernel
def test_specd_kernel_inside_a_compiled_graph():
    """The op is opaque to inductor (its fake gives the shape): the compiled function's output
    is the eager kernel's, bit for bit."""
    q, d, m = weights(64, 96, seed=2)
    w = pack(q, d, m, torch.bfloat16)
    fn = torch.compile(lambda x: torch.relu(q4_linear(x, w)) * 2, fullgraph=True, dynamic=False)
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    assert torch.equal(fn(x), torch.relu(q4_linear(x, w)) * 2)


def test_torch_kernel_serves_other_dtypes():
    """float32 or float16 activations: torch's layout, scales held in the activation dtype,
    the same matrix."""
    q, d, m = weights(48, 64, seed=3)
    full = torch.from_numpy(np.repeat(d, GROUP, 1) * q + np.repeat(m, GROUP, 1))
    for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 0.01)):
        w = pack(q, d, m, dtype)
        assert w.kernel == "torch" and w.scale_zero is not None and w.dtype == dtype
        x = torch.randn(5, 64, dtype=dtype)
        ref = x.float() @ full.T
        assert torch.allclose(q4_linear(x, w).float(), ref, atol=tol * ref.abs().max().item())


def test_kernel_switch_off(monkeypatch):
    """SPECD_Q4_KERNEL=0 keeps torch's kernel (checked in a fresh cache of the probe)."""
    monkeypatch.setenv("SPECD_Q4_KERNEL", "0")
    kernel_available.cache_clear()
    try:
        assert not kernel_available()
        q, d, m = weights(32, 64)
        assert pack(q, d, m, torch.bfloat16).kernel == "torch"
    finally:
        monkeypatch.undo()
        kernel_available.cache_clear()


@needs_kernel
def test_prefetch_distance_changes_no_result():
    """``mm`` prefetches the weights ahead of its reads; ``mm_ahead`` at any distance (0: none,
    or past the buffer's end) computes the same bits."""
    q, d, m = weights(208, 1536, seed=2)
    w = pack(q, d, m, torch.bfloat16)
    x = torch.randn(11, 1536, dtype=torch.bfloat16)
    ref = torch.ops.specd_q4.mm_ahead(x, w.packed, 0)
    assert torch.equal(torch.ops.specd_q4.mm(x, w.packed), ref)
    for ahead in (1, 16, 10_000):
        assert torch.equal(torch.ops.specd_q4.mm_ahead(x, w.packed, ahead), ref)


def test_activations_8bit_rounds_each_group_of_32():
    """The reference of the kernel's activations: per row and group, 255 levels spanning
    [-amax, amax] (the group's largest magnitude kept exactly), ties to even, zero kept zero;
    the error of an element at most half a step (amax / 254)."""
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    x[1, 32:64] = 0
    x8 = activations_8bit(x)
    g = x.float().view(3, 3, 32)
    amax = g.abs().amax(-1, keepdim=True)
    err = (x8.view(3, 3, 32) - g).abs()
    assert (err <= amax / 254 * (1 + 1e-5)).all()
    assert torch.equal(x8[1, 32:64], torch.zeros(32))
    steps = x8.view(3, 3, 32) / (amax / 127).clamp(min=1e-30)
    assert torch.allclose(steps, steps.round(), atol=1e-3)  # on the grid
    top = g.abs().argmax(-1, keepdim=True)
    assert torch.allclose(x8.view(3, 3, 32).gather(-1, top), g.gather(-1, top), rtol=1e-6)


@needs_kernel
def test_specd_kernel_error_against_the_dense_product_is_8_bit():
    """Against x @ W.T unrounded, the kernel's error is that of 8-bit activations: within
    sum_g amax_g / 254 * sum_(k in g) |w_k| (plus bf16 output rounding)."""
    q, d, m = weights(576, 1536, seed=4)
    w_full = dequantized(q, d, m)  # [out, in]
    x = torch.randn(5, 1536, dtype=torch.bfloat16)
    y = q4_linear(x, pack(q, d, m, torch.bfloat16)).float()
    ref = x.float() @ w_full.T
    amax = x.float().view(5, -1, GROUP).abs().amax(-1)  # [rows, groups]
    wsum = w_full.abs().view(576, -1, GROUP).sum(-1)  # [out, groups]
    bound = (amax / 254) @ wsum.T + ref.abs() * 2**-8 + 1e-3 * ref.abs().max()
    assert ((y - ref).abs() <= bound).all()


def identity_weight(n: int):
    """q = 1 on the diagonal, d = 1, m = 0: output column c is input c (w = I)."""
    q = np.eye(n, dtype=np.uint8)
    return pack(q, np.ones((n, n // GROUP), np.float32), np.zeros((n, n // GROUP), np.float32),
                torch.bfloat16)  # fmt: skip


@needs_kernel
def test_specd_kernel_activations_are_exactly_the_reference():
    """Through identity weights the kernel returns its 8-bit activations themselves, each
    s * xq rounded once to bf16: bit for bit ``activations_8bit``, ties to even included
    (amax 127 makes s = 1, so 2.5 -> 2, 3.5 -> 4, -2.5 -> -2)."""
    w = identity_weight(64)
    x = torch.randn(9, 64, dtype=torch.bfloat16) * 3
    x[8, :32] = 0
    x[8, 0], x[8, 1:4] = 127, torch.tensor([2.5, 3.5, -2.5], dtype=torch.bfloat16)
    y = q4_linear(x, w)
    assert torch.equal(y, activations_8bit(x).to(torch.bfloat16))
    assert y[8, 1:4].tolist() == [2.0, 4.0, -2.0]


@needs_kernel
def test_specd_kernel_zero_tiny_and_non_finite_groups():
    """A zero or tiny group (amax < 1e-30) contributes nothing; a NaN or an infinity makes its
    row NaN (not a finite value made up from it), and only its row."""
    q, d, m = weights(48, 64, seed=5)
    w = pack(q, d, m, torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    x[1] = 0
    x[2, :32], x[2, 32:] = 1e-35, 0
    x[3, 7] = float("nan")
    x[4, 40] = float("inf")
    y = q4_linear(x, w)
    assert torch.equal(y[1], torch.zeros(48, dtype=torch.bfloat16))
    assert torch.equal(y[2], torch.zeros(48, dtype=torch.bfloat16))
    assert y[3].isnan().all() and y[4].isnan().all()
    assert torch.equal(y[0], q4_linear(x[:1], w)[0])
    ref = activations_8bit(x)
    assert ref[3].isnan().any() and torch.equal(ref[1], torch.zeros(64))


OTHER_BUILDS = [b[0] for b in BUILDS if b[0] != isa() and cpu_has_flags(list(b[2]))]
BITS_CASES = """
import numpy as np, torch
from engine.model.q4_matmul import GROUP, _pack_specd
out = []
for n, k, seed in ((48, 96, 0), (576, 1536, 1), (208, 576, 2)):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (n, k)).astype(np.uint8)
    d = rng.uniform(0.001, 0.03, (n, k // GROUP)).astype(np.float32)
    m = rng.uniform(-0.25, 0.05, (n, k // GROUP)).astype(np.float32)
    w = _pack_specd(q, d, m)
    for rows in (1, 3, 4, 5, 8, 9, 17):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        x[0, :GROUP] = 0  # a group that rounds to zero
        if rows > 3:
            x[3, GROUP : 2 * GROUP] = float("inf")  # a non-finite group: that row is NaN
        out.append(torch.ops.specd_q4.mm(x, w).view(torch.int16))
"""


@needs_kernel
@pytest.mark.parametrize("build", OTHER_BUILDS or [pytest.param("none", marks=pytest.mark.skip)])
def test_the_builds_this_cpu_does_not_pick_give_the_same_bits(build, tmp_path):
    """Each build this CPU could run but does not pick (AVX2 on an AVX-512 machine), in a process
    of its own, gives this process's build's output bit for bit (tiles of 1-8 rows and their
    tails, a zero group, a non-finite one)."""
    ns: dict = {}
    exec(BITS_CASES, ns)  # this process's build
    code = (
        "from engine.model import q4_matmul as q\n"
        f"assert q.isa() == {build!r} and q.kernel_available()\n"
        + BITS_CASES
        + f"torch.save(out, {str(tmp_path / 'other.pt')!r})\n"
    )
    env = os.environ | {"SPECD_Q4_ISA": build}
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr[-2000:]
    other = torch.load(tmp_path / "other.pt")
    assert len(other) == len(ns["out"]) == 21
    assert all(torch.equal(a, b) for a, b in zip(ns["out"], other))
