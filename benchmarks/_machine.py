"""The machine a benchmark's figures come from, in one line that every script prints above its table.

Figures are only comparable on the same device with the same thread count, so each script names them: the
accelerator (its name, memory and CUDA version) or the CPU model, the cores, torch's version and its threads.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it, or the architecture where it does not."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def describe(device: str | torch.device = "cpu", threads: int | None = None) -> str:
    """``device: ...`` naming where the figures below were measured; ``threads`` where they ran in other processes."""
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where = f"{props.name} ({props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda})"
    else:
        where = f"CPU, {cpu_model()}"
    threads = torch.get_num_threads() if threads is None else threads
    return f"device: {where}; {os.cpu_count()} CPU cores; torch {torch.__version__}, {threads} torch thread(s)"
