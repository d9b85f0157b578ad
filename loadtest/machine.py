"""What a results file says of the machine it ran on: only figures of one run on one machine
compare, and the CPUs of the project's machines differ between sessions."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

# the instruction sets specd's CPU kernels choose between (engine/model/q4_matmul.py, attention.py)
_SHOWN = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")


def cpu_description() -> str:
    """``<model name>, <n> threads, <flags>``: /proc/cpuinfo's model name (and family, which
    tells AMD's Zen generations apart), torch's thread count and the kernel-relevant flags."""
    name, family, flags = platform.processor() or "unknown CPU", "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "model name":
                name = value
            elif key == "cpu family" and not family:
                family = value
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    shown = " ".join(f for f in _SHOWN if f in flags) or "flags unknown"
    fam = f" (family {family})" if family else ""
    return f"{name}{fam}, {torch.get_num_threads()} threads, {shown}"
