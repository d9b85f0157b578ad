"""specd's CPU attention kernel (engine/model/attention.py): SDPA's result over the slot and
paged caches, and a row's output bit-identical whatever else the call holds."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from engine.model import attention
from engine.model.attention import BUILDS, attend, cpu_has_flags, kernel_available, reference

pytestmark = pytest.mark.skipif(
    not kernel_available(), reason="specd's attention kernel needs AVX2 and a C++ compiler"
)

H, G, D = 9, 3, 64  # SmolLM2-135M's heads, KV heads, head size


def slot_case(B=3, q=5, kv=700, slots=4, dtype=torch.float32, seed=0):
    """Queries, a slot cache and a causal mask: row b in slot ``slots - 1 - b``, its queries at
    positions ending at a different length each (some keys past every row's length: padding)."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(slots, G, kv + 8, D, generator=g).to(dtype)
    vc = torch.randn(slots, G, kv + 8, D, generator=g).to(dtype)
    qs = torch.randn(B, H, q, D, generator=g).to(dtype)
    slot_t = torch.arange(slots - 1, slots - 1 - B, -1)
    ends = torch.tensor([kv - 1 - 37 * b for b in range(B)])
    pos = ends[:, None] - torch.arange(q - 1, -1, -1)[None, :]  # [B, q]
    mask = (torch.arange(kv)[None, None, :] <= pos[:, :, None]).unsqueeze(1)
    return qs, kc, vc, mask, slot_t


def close(a, b, dtype):
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    return (a.float() - b.float()).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q,kv", [(1, 64), (1, 1300), (8, 300), (16, 2100), (40, 90)])
def test_slot_cache_matches_sdpa(dtype, q, kv):
    """Decode, verify and prefill shapes, one split and several (1300 and 2100 keys), against
    SDPA over the gathered keys in float32."""
    qs, kc, vc, mask, slot_t = slot_case(q=q, kv=kv, dtype=dtype)
    got = attend(qs, kc, vc, mask, slot_t, None)
    assert got.shape == (qs.shape[0], q, H * D) and got.dtype == dtype
    assert close(got, reference(qs, kc, vc, mask, slot_t, None), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_cache_matches_sdpa(dtype):
    """Each row's keys scattered over a pool in any order (read_idx), a tree-like mask: every
    query sees a different subset, not a prefix."""
    g = torch.Generator().manual_seed(1)
    B, q, kv, pool = 2, 6, 600, 1400
    kc = torch.randn(pool, G, D, generator=g).to(dtype)
    vc = torch.randn(pool, G, D, generator=g).to(dtype)
    qs = torch.randn(B, H, q, D, generator=g).to(dtype)
    read_idx = torch.stack([torch.randperm(pool, generator=g)[:kv] for _ in range(B)])
    mask = (torch.rand(B, 1, q, kv, generator=g) < 0.4) | (torch.arange(kv) < 5)
    got = attend(qs, kc, vc, mask, torch.arange(B), read_idx)
    assert close(got, reference(qs, kc, vc, mask, torch.arange(B), read_idx), dtype)


def test_a_query_that_sees_nothing_gets_zeros():
    qs, kc, vc, mask, slot_t = slot_case(B=2, q=3, kv=100)
    mask[1, :, 1] = False
    got = attend(qs, kc, vc, mask, slot_t, None).view(2, 3, H, D)
    assert torch.equal(got[1, 1], torch.zeros(H, D))
    assert got[1, 0].abs().sum() > 0 and got[0, 1].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_whatever_the_call(dtype):
    """Row 1's query 3 alone (batch 1, one query), within its row's 8 queries, within a batch of
    4 rows, and on one thread: the same bits (the invariance the forward's determinism rests
    on), over a context that spans several splits."""
    qs, kc, vc, mask, slot_t = slot_case(B=4, q=8, kv=1500, slots=5, dtype=dtype)
    whole = attend(qs, kc, vc, mask, slot_t, None).view(4, 8, H * D)
    row = attend(qs[1:2], kc, vc, mask[1:2], slot_t[1:2], None).view(1, 8, H * D)
    one = attend(qs[1:2, :, 3:4], kc, vc, mask[1:2, :, 3:4], slot_t[1:2], None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = attend(qs, kc, vc, mask, slot_t, None).view(4, 8, H * D)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole[1], row[0]) and torch.equal(row[0, 3], one[0, 0])
    assert torch.equal(whole, single)
    # the control: another row's query is not the same bits (the check can fail)
    assert not torch.equal(whole[2, 3], one[0, 0])


def test_the_layer_runs_the_kernel():
    """The decoder layer's attention on CPU is the kernel's (profiled), not SDPA."""
    from torch.profiler import ProfilerActivity, profile

    from engine.model.layer import LayerInputs, LayerShape, decoder_layer
    from engine.model.weights import LayerWeights

    hidden, inter = 96, 128
    g = torch.Generator().manual_seed(2)

    def m(o, i):
        return torch.randn(o, i, generator=g) * 0.05

    w = LayerWeights(
        input_norm=torch.ones(hidden),
        qkv=None,
        q=m(6 * 32, hidden),
        q_bias=None,
        k=m(2 * 32, hidden),
        k_bias=None,
        v=m(2 * 32, hidden),
        v_bias=None,
        o=m(hidden, 6 * 32),
        post_norm=torch.ones(hidden),
        gate_up=None,
        gate=m(inter, hidden),
        up=m(inter, hidden),
        down=m(hidden, inter),
        q_norm=None,
        k_norm=None,
    )
    shape = LayerShape(6, 2, 32, 1e-5, "silu")
    kc, vc = torch.zeros(2, 2, 33, 32), torch.zeros(2, 2, 33, 32)
    pos = torch.tensor([[3, 4]])
    mask = (torch.arange(8)[None, None, :] <= pos[:, :, None]).unsqueeze(1)
    cos, sin = torch.ones(1, 1, 2, 32), torch.zeros(1, 1, 2, 32)
    at = LayerInputs(cos, sin, mask, torch.tensor([1]), pos, None, shape)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decoder_layer(torch.randn(1, 2, hidden), w, kc, vc, at)
    names = {e.name for e in prof.events()}
    assert "specd_attention::attend" in names and not any("scaled_dot" in n for n in names)
    assert kc[1, :, 3:5].abs().sum() > 0  # the new keys written where they belong


OTHER_BUILDS = [b[0] for b in BUILDS if b[0] != attention.isa() and cpu_has_flags(list(b[1]))]


@pytest.mark.parametrize("build", OTHER_BUILDS or [pytest.param("none", marks=pytest.mark.skip)])
def test_the_builds_this_cpu_does_not_pick_match_sdpa(build):
    """Each build this CPU could run but does not pick (AVX2 on an AVX-512 machine, plain AVX-512
    beside AVX-512 BF16) built and checked in a process of its own: it agrees with SDPA and
    keeps a row's bits whatever the batch."""
    code = (
        "import torch\n"
        "from engine.model import attention as a\n"
        f"assert a.isa() == {build!r} and a.kernel_available()\n"
        "import tests.engine.model.test_attention_kernel as t\n"
        "t.test_slot_cache_matches_sdpa(torch.bfloat16, 8, 1300)\n"
        "t.test_paged_cache_matches_sdpa(torch.float32)\n"
        "t.test_a_row_is_the_same_bits_whatever_the_call(torch.bfloat16)\n"
        "print('build ok')\n"
    )
    env = os.environ | {"SPECD_ATTN_ISA": build}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0 and "build ok" in out.stdout, out.stderr[-2000:]
