"""Host -> device copies (engine/transfer.py): the values, dtypes and shapes arrive as given,
from lists and from CPU tensors; on CUDA without a sync (tests/engine/round/test_round.py counts the
round's syncs there)."""

import pytest
import torch

from engine.transfer import copy_into, to_device
from tests.helpers import TEST_DEVICE


@pytest.mark.parametrize("dtype", [torch.long, torch.float32, torch.bool])
def test_lists_arrive_with_their_dtype(dtype):
    values = [[1, 0, 3], [0, 5, 0]]
    t = to_device(values, dtype, TEST_DEVICE)
    assert t.device.type == TEST_DEVICE.type and t.dtype == dtype
    assert t.cpu().tolist() == torch.tensor(values, dtype=dtype).tolist()


def test_tensors_keep_their_dtype_unless_told():
    host = torch.arange(6).reshape(2, 3)
    assert torch.equal(to_device(host, None, TEST_DEVICE).cpu(), host)
    assert to_device(host, torch.float32, TEST_DEVICE).dtype == torch.float32
    assert to_device([], torch.long, TEST_DEVICE).shape == (0,)


def test_copy_into_fills_a_static_buffer_in_place():
    buf = torch.zeros(2, 3, dtype=torch.long, device=TEST_DEVICE)
    ptr = buf.data_ptr()
    copy_into(buf, torch.arange(6).reshape(2, 3))
    assert buf.data_ptr() == ptr and buf.cpu().tolist() == [[0, 1, 2], [3, 4, 5]]
