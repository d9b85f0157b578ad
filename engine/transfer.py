"""Host -> device copies that never make the host wait.

A plain ``torch.tensor(values, device="cuda")`` or ``cpu_tensor.to("cuda")`` copies from pageable
host memory, which CUDA does synchronously: the host waits for every kernel already queued on the
stream, so each such copy in a round is a device sync (``torch.cuda.set_sync_debug_mode`` flags
it) and the host can no longer run ahead of the GPU. :func:`to_device` stages the values in
pinned memory (PyTorch's caching host allocator, which keeps a block until the copy that reads
it is done) and copies without blocking. On CPU it is the plain constructor.

Invariant: the round's only blocking device->host transfer is its one read (engine/round/output.py);
every host->device copy made while serving goes through here.
"""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """``values`` (a host list, or a CPU tensor) as a tensor on ``device``, without a device
    sync (pinned, non-blocking copy on CUDA). ``dtype`` None keeps the values' own dtype."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu" or device.type != "cuda":  # no host copy to make
            return values.to(device=device, dtype=dtype or values.dtype)
        host = values.to(dtype=dtype or values.dtype)
    elif device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    else:
        host = torch.tensor(values, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Fill ``dst`` (e.g. a CUDA graph's static input) from the host tensor ``src`` without a
    device sync (pinned, non-blocking on CUDA)."""
    if dst.device.type == "cuda" and src.device.type == "cpu":
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)
