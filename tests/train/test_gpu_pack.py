"""scripts/gpu_train_pack.py: the parts a GPU fit's inputs travel in, within the call limit."""

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "gpu_train_pack", Path(__file__).resolve().parents[2] / "scripts" / "gpu_train_pack.py"
)
assert spec and spec.loader
pack = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pack)


@pytest.mark.parametrize(
    "weights,data,budget", [(100, 10, 40), (97, 0, 97), (50, 39, 40), (5, 1, 6)]
)
def test_the_parts_cover_the_weights_and_every_call_fits(weights, data, budget):
    parts = pack.plan_parts(weights, data, budget)
    assert sum(parts) == weights and all(p >= 0 for p in parts)
    loads = parts[:-1] + [parts[-1] + data]  # the last call also carries the rows
    assert all(load <= budget for load in loads)
    assert len(parts) == -(-(weights + data) // budget)  # the fewest calls


def test_rows_over_one_calls_budget_are_refused():
    with pytest.raises(ValueError, match="rows"):
        pack.plan_parts(10, 41, 40)


def test_split_parts_join_back_to_the_file(tmp_path):
    src = tmp_path / "w.bin"
    src.write_bytes(bytes(range(256)) * 7)
    sizes = pack.plan_parts(src.stat().st_size, 100, 700)
    names = [tmp_path / f"part{i}" for i in range(len(sizes))]
    pack.split_file(src, sizes, names)
    assert b"".join(n.read_bytes() for n in names) == src.read_bytes()
