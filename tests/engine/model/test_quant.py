"""GGUF Q4_1 layers kept 4-bit (engine/model/quant.py) on the real SmolLM2 file: the converted
matrices are the file's weights (logits equal the dense model's to float32 rounding), and
speculation over the 4-bit target is lossless against the same target decoding alone."""

import dataclasses

import numpy as np
import pytest
import torch

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.model.compiled import CompileConfig
from engine.model.loader import resolve_source
from engine.model.q4_matmul import GROUP, Q4Weight
from engine.model.quant import (
    _blocks,
    _q8_0_blocks,
    _row_perm,
    convert_q4_1,
    convert_q8_0_head,
    native_q4,
)
from engine.model.runner import ModelRunner
from engine.model.weights import ModelWeights
from engine.records.params import SamplingParams, SpecParams
from tests.conftest import REAL_SPEC
from tests.helpers import float32_q4_engine

pytestmark = pytest.mark.real_model


def test_q4_1_block_layout():
    d, m = np.float16(0.5), np.float16(-1.0)
    qs = np.array([(j % 16) | ((15 - j % 16) << 4) for j in range(16)], dtype=np.uint8)
    raw = np.concatenate([np.frombuffer(d.tobytes() + m.tobytes(), np.uint8), qs])[
        None
    ]  # 1 row, 1 block
    q, dd, mm = _blocks(raw, 1, GROUP)
    assert q[0, :16].tolist() == list(range(16)) and q[0, 16:].tolist() == list(range(15, -1, -1))
    assert dd[0, 0] == 0.5 and mm[0, 0] == -1.0
    assert sorted(_row_perm(8, 2).tolist()) == list(range(8))
    q8 = np.arange(-128, 128, 8, dtype=np.int8)  # one Q8_0 block: d, then 32 int8
    q, dd = _q8_0_blocks(
        np.concatenate([np.frombuffer(d.tobytes(), np.uint8), q8.view(np.uint8)])[None], 1, GROUP
    )
    assert q[0].tolist() == q8.tolist() and dd[0, 0] == 0.5
    u = q8.astype(np.int32) + 128  # the two-nibble split of convert_q8_0_head is exact
    assert (16 * 0.5 * ((u >> 4) - 8) + 0.5 * ((u & 15) - 8) + 8 * 0.5 == 0.5 * q8).all()


def test_converted_weights_are_the_files(real_fp32):
    model, tok = real_fp32
    path = resolve_source(REAL_SPEC).location
    fused_layers, n = convert_q4_1(path, model)
    assert n == 210  # 30 x 7
    unfused_layers, n = convert_q4_1(path, model, fuse=False)
    assert n == 210
    head = convert_q8_0_head(path, model)
    assert head is not None
    dense = ModelRunner(model, 1, 256)
    q4 = ModelRunner(model, 1, 256, weights=ModelWeights(fused_layers, head))
    unfused = ModelRunner(model, 1, 256, weights=ModelWeights(unfused_layers, head))
    assert q4.head is not None
    assert q4.head.shape == (49152, 2 * 576)  # [x, x] @ [high nibbles | low nibbles].T
    assert all(
        w.qkv is not None
        and w.qkv.split == (576, 192, 192)
        and w.q is None
        and w.k is None
        and w.v is None
        and isinstance(w.o, Q4Weight)
        and isinstance(w.down, Q4Weight)
        for w in q4.weights
    )
    assert all(
        w.gate_up is not None
        and w.gate_up.split == (1536, 1536)
        and w.gate is None
        and w.up is None
        for w in q4.weights
    )
    projections = ("q", "k", "v", "o", "gate", "up", "down")
    assert all(
        w.qkv is None and w.gate_up is None and isinstance(getattr(w, f), Q4Weight)
        for w in unfused.weights
        for f in projections
    )
    ids = tok("def fibonacci(n):\n    ", return_tensors=None)["input_ids"]
    a = dense.forward([ids], [0], logits="all").logits
    b = q4.forward([ids], [0], logits="all").logits
    assert torch.allclose(a, b, atol=5e-3, rtol=0), (a - b).abs().max()
    c = unfused.forward([ids], [0], logits="all").logits
    assert torch.allclose(b, c, atol=1e-5, rtol=0), (b - c).abs().max()  # fusing changes no sum


def test_speculation_over_the_4bit_target_is_lossless(real_fp32):
    """In float32 (exact), the builder's pieces over the 4-bit weights: a float32 config's
    native_q4 keeps dense weights (torch's float32 int4 matmul is slow), which is checked first."""
    cfg = EngineConfig.from_dict(
        {
            "model": {"dtype": "float32", "native_q4": True},
            "max_running": 4,
            "max_model_len": 512,
            "drafter": {"method": "ngram"},
        }
    )
    dense = build_engine(cfg, real_fp32).engine
    assert isinstance(dense.target.weights[0].q, torch.Tensor)  # dense in float32
    engine = float32_q4_engine(
        dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, source=REAL_SPEC)), real_fp32
    )
    assert isinstance(engine.target.weights[0].qkv, Q4Weight)
    _, tok = real_fp32
    prompts = [
        tok(t, return_tensors=None)["input_ids"]
        for t in (
            "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
            "The days: Monday, Tuesday, Wednesday, Thursday, Friday. Again: Monday,",  # n-gram
        )
    ]
    # 12 tokens: torch's float32 int4 matmul is unvectorised (~14 ms a matrix at 10 rows), and
    # drafts are kept and rejected within them
    greedy = SamplingParams(temperature=0, max_tokens=12)
    plain = [s.output_ids for s in engine.generate(prompts, greedy, SpecParams(enabled=False))]
    spec = engine.generate(prompts, greedy, SpecParams(k=4))
    assert [s.output_ids for s in spec] == plain
    accepted, drafted = sum(s.accepted for s in spec), sum(s.drafted for s in spec)
    assert 0 < accepted < drafted


def test_4bit_layer_weights_trace_through_the_compiled_path(real_fp32):
    """The 4-bit LayerWeights (fused qkv and gate_up) pass through dynamo as the compiled layer's
    argument (backend "eager": the trace without inductor; one graph for every layer): the
    fast path's logits are the eager 4-bit forward's."""
    model, tok = real_fp32
    weights = native_q4(REAL_SPEC, model)
    assert weights is not None
    ccfg = CompileConfig(enabled=True, backend="eager", batch_buckets=[4], q_buckets=[4])
    eager = ModelRunner(model, 4, 128, weights=weights)
    traced = ModelRunner(model, 4, 128, weights=weights, compile=ccfg, k_max=3)
    assert traced.weights[0] is eager.weights[0] and isinstance(traced.weights[0].o, Q4Weight)
    ids = tok("The capital of France is", return_tensors=None)["input_ids"]
    out = []
    for r in (eager, traced):
        s = r.cache.allocate()
        r.forward([ids], [s])  # prefill: eager (longer than the q bucket)
        r.cache.commit(s, len(ids))
        out.append(r.forward(torch.tensor([[5, 6, 7]]), [s], counts=[3], logits="all").logits)
    assert traced.fast is not None and traced.fast.calls == 1
    # padded to the bucket's 4 rows x 4 tokens, the int4 kernel blocks rows differently: fp32
    # rounding apart, no more
    assert torch.allclose(out[0], out[1], atol=1e-3, rtol=0), (out[0] - out[1]).abs().max()
    assert torch.equal(out[0].argmax(-1), out[1].argmax(-1))
