"""The machine a benchmark's figures come from, in one line that every script prints above its table; and the
``fedaudit`` program the scripts that start fedaudit commands start.

Figures are only comparable on the same device with the same thread count, so each script names them: the
accelerator (its name, memory and CUDA version) or the CPU model, the cores, torch's version and its threads.

torch is imported only where the line needs it (an accelerator's properties, this process's thread count): a script
that only starts ``fedaudit`` processes names the CPU and the threads those run with, and reads torch's version from
its installed metadata, without spending seconds importing torch itself.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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


def torch_version() -> str:
    """torch's version: the imported module's, or where torch is not imported, its installed distribution's."""
    torch = sys.modules.get("torch")
    return torch.__version__ if torch is not None else importlib.metadata.version("torch")


def describe(device: str | torch.device = "cpu", threads: int | None = None) -> str:
    """``device: ...`` naming where the figures below were measured; ``threads`` where they ran in other processes."""
    if str(device).partition(":")[0] == "cuda":
        import torch

        props = torch.cuda.get_device_properties(torch.device(device))
        where = f"{props.name} ({props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda})"
    else:
        where = f"CPU, {cpu_model()}"
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    return f"device: {where}; {os.cpu_count()} CPU cores; torch {torch_version()}, {threads} torch thread(s)"


KEEP_ALLOCATED = {
    "MALLOC_MMAP_THRESHOLD_": "1000000000",
    "MALLOC_TRIM_THRESHOLD_": "4000000000",
    "MALLOC_TOP_PAD_": "268435456",
}
"""glibc's allocator told to keep what it has: a harness that alternates step kinds otherwise makes it hand memory
back and fault it in again on the next step (1,260 page faults a step, about 5.5 us each on a 2-core VM), which moved
its figures by 30%."""


def keep_allocated_memory() -> None:
    """Run this script again, at once, with :data:`KEEP_ALLOCATED` in its environment, unless it already has it: the
    allocator reads it before the process's first allocation, so it cannot be set from inside."""
    if any(os.environ.get(name) != value for name, value in KEEP_ALLOCATED.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **KEEP_ALLOCATED})


_PROGRAM: list[str] = []  # the fedaudit program given with --fedaudit, if any


def add_program_option(parser: argparse.ArgumentParser) -> None:
    """``--fedaudit PROGRAM``: the fedaudit program the script starts, to measure another installation's."""
    parser.add_argument(
        "--fedaudit",
        metavar="PROGRAM",
        help="the fedaudit program to start (another installation's, to compare them) [default: the one beside this "
        "interpreter]",
    )


def use_program(program: str | None) -> None:
    """Start ``program`` (the value of --fedaudit) for every fedaudit command from now on; None: the default."""
    _PROGRAM[:] = [] if program is None else [program]


def fedaudit_command() -> list[str]:
    """The fedaudit command line's start: --fedaudit's program, else the one beside this interpreter, else
    ``python -m fedaudit.cli``."""
    if _PROGRAM:
        return list(_PROGRAM)
    script = Path(sys.executable).with_name("fedaudit")
    return [str(script)] if script.exists() else [sys.executable, "-m", "fedaudit.cli"]
