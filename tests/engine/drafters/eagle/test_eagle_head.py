"""The EAGLE-3 head's files (engine/drafters/eagle/head.py) and where a config finds them
(engine/builder.head_folder): our own format round-trips; heads written by SpecForge or EAGLE
(``layers.0.*`` or ``model.`` names, ``pytorch_model.bin``, no aux layer ids, no ``d2t``) load
with their vocabulary maps; a Hub id is read through the Hugging Face cache."""

from __future__ import annotations

import json

import pytest
import torch

from engine import builder
from engine.drafters.eagle.head import load_head, save_head
from tests.eagle_builders import HIDDEN, VOCAB, random_head

# config.json as EAGLE's own training writes it for a published head (e.g.
# yuhuili/EAGLE3-LLaMA3.1-Instruct-8B), at this test's tiny size: a plain Llama config with
# draft_vocab_size and no eagle_config (the taps are the target's defaults)
EAGLE_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "initializer_range": 0.02,
    "intermediate_size": 2 * HIDDEN,
    "max_position_embeddings": 2048,
    "model_type": "llama",
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 1,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.28.1",
    "use_cache": True,
    "vocab_size": VOCAB,
    "draft_vocab_size": 12,
}


def test_head_files_round_trip(tmp_path):
    head = random_head(1)
    save_head(head, tmp_path, dtype=torch.float32)
    cfg = (tmp_path / "config.json").read_text()
    assert '"LlamaForCausalLMEagle3"' in cfg and '"draft_vocab_size": 12' in cfg
    back = load_head(tmp_path)
    for (name, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name
    assert back.config.aux_layers == head.config.aux_layers
    assert torch.equal(back.draft_to_target, head.draft_to_target)


def test_loader_reads_specforge_names(tmp_path):
    """SpecForge / EAGLE write ``layers.0.*`` (or ``midlayer.*``), may add ``embed_tokens`` and
    leave out the aux layer ids (then the target's defaults apply)."""
    from safetensors.torch import save_file

    head = random_head(2, layers=30)
    state = {k.replace("midlayer.", "layers.0."): v for k, v in head.state_dict().items()}
    state["embed_tokens.weight"] = torch.randn(VOCAB, HIDDEN)
    save_file(state, str(tmp_path / "model.safetensors"))
    cfg = head.config.to_json()
    del cfg["eagle_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    back = load_head(tmp_path, target_layers=30)
    assert back.config.aux_layers == (2, 15, 27)
    assert back.embed_tokens is not None
    assert torch.equal(back.fc.weight, head.fc.weight)
    assert torch.equal(back.draft_to_target, head.draft_to_target)
    assert torch.equal(back.t2d, head.t2d)
    with pytest.raises(ValueError, match="aux layers"):
        load_head(tmp_path)


def test_loader_reads_an_eagle_pytorch_model_bin(tmp_path):
    """EAGLE's published heads ship ``pytorch_model.bin`` (float16, ``midlayer.*``, ``d2t`` /
    ``t2d``) and a config.json without aux layer ids."""
    head = random_head(3, layers=32)
    state = {k: v.half() if v.is_floating_point() else v for k, v in head.state_dict().items()}
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(EAGLE_CONFIG))
    back = load_head(tmp_path, target_layers=32)
    c = back.config
    assert (c.draft_vocab_size, c.vocab_size, c.target_hidden_size) == (12, VOCAB, HIDDEN)
    assert c.aux_layers == (2, 16, 29)
    assert torch.equal(back.draft_to_target, head.draft_to_target)
    assert torch.equal(back.t2d, head.t2d)
    assert torch.equal(back.lm_head.weight, head.lm_head.weight.half().float())
    assert back.embed_tokens is None  # the target's embedding drafts


def test_loader_reads_model_prefixed_names_without_a_vocabulary_map(tmp_path):
    """``model.``-prefixed names and no ``d2t``: a head over the whole target vocabulary."""
    from safetensors.torch import save_file

    head = random_head(4, draft_vocab=VOCAB)
    state = {f"model.{k}": v for k, v in head.state_dict().items() if k not in ("d2t", "t2d")}
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(head.config.to_json()))
    back = load_head(tmp_path)
    assert torch.equal(back.draft_to_target, torch.arange(VOCAB))
    assert bool(back.t2d.all())
    assert torch.equal(back.midlayer.self_attn.q_proj.weight, head.midlayer.self_attn.q_proj.weight)


def test_loader_rebuilds_t2d_and_needs_d2t_for_a_smaller_vocabulary(tmp_path):
    """vLLM reads ``d2t`` alone: a file without ``t2d`` gets it rebuilt from ``d2t``; one without
    ``d2t`` whose draft vocabulary is smaller than the target's cannot be read."""
    from safetensors.torch import save_file

    head = random_head(6)
    state = {k: v for k, v in head.state_dict().items() if k != "t2d"}
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(head.config.to_json()))
    back = load_head(tmp_path)
    assert torch.equal(back.t2d, head.t2d) and int(back.t2d.sum()) == 12
    del state["d2t"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no d2t"):
        load_head(tmp_path)


def test_loader_needs_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(EAGLE_CONFIG))
    with pytest.raises(FileNotFoundError, match=r"pytorch_model\.bin"):
        load_head(tmp_path, target_layers=32)


def test_a_hub_id_is_read_through_the_hub_cache(tmp_path, monkeypatch):
    """A source that is neither a folder nor under the repository is a Hub id: its head files
    come from ``snapshot_download`` (the cache alone under ``HF_HUB_OFFLINE=1``); where the Hub
    has nothing, a clear error names the source."""
    import huggingface_hub

    save_head(random_head(5), tmp_path / "snap")
    asked = []

    def snapshot(repo_id, allow_patterns=None, **_):
        asked.append((repo_id, allow_patterns))
        if repo_id != "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B":
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        return str(tmp_path / "snap")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    folder = builder.head_folder("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B")
    assert folder == tmp_path / "snap"
    assert asked[0][1] == builder.HEAD_FILES
    assert load_head(folder).config.draft_vocab_size == 12
    with pytest.raises(FileNotFoundError, match="LocalEntryNotFoundError: not cached"):
        builder.head_folder("no-such/head")
    assert len(asked) == 2
    monkeypatch.chdir(tmp_path)  # the repository's own head, found relative to the repository
    assert builder.head_folder("models/smollm2-135m-eagle3").name == "smollm2-135m-eagle3"
    # a mistyped local path never reaches the Hub: an owner that is a folder here or in the
    # repository, a relative or absolute path, more than owner/name
    (tmp_path / "heads").mkdir()
    for typo in ("models/smollm2-135m-eagle", "heads/mine", "./mine", "/no/such", "a/b/c"):
        with pytest.raises(FileNotFoundError, match=r"no folder with config\.json"):
            builder.head_folder(typo)
    assert len(asked) == 2
