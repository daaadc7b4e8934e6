"""A training step replayed as a CUDA graph: its kernels launched by one call instead of one Python call each.

FedLAP's image step runs a few hundred small kernels (a forward, a backward that keeps its graph, the layer-wise
matching loss, the backward of all that, an SGD step) on a synthetic set of a few dozen images: on a GPU the host
spends about 16 ms launching them and the device about 0.4 ms running them. The step's shapes do not change within a
client's round, and without augmentation it draws nothing at random, so it can be captured once and replayed
(docs/performance.md, "On a GPU"). ``FEDAUDIT_CUDA_GRAPHS=0`` turns capture off (the eager steps, for comparison
or debugging); ``FEDAUDIT_CUDA_GRAPHS=all`` also captures the DP query on a padded batch
(:func:`fedaudit.privacy.primitive.padded_clipped_sum`), experimental until a GPU has measured it.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

GRAPHS_ENV = "FEDAUDIT_CUDA_GRAPHS"
Group = Mapping[str, torch.Tensor] | Sequence[torch.Tensor]
_CAPTURE = threading.Lock()  # one capture at a time, on the capture stream of its device
_REFUSED: list[str] = []  # a capture that failed: no step of this process is captured after it (its error)
_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def graphs_enabled(device: torch.device) -> bool:
    """Whether steps on ``device`` are captured: on CUDA, unless FEDAUDIT_CUDA_GRAPHS=0."""
    return device.type == "cuda" and os.environ.get(GRAPHS_ENV, "1").strip() != "0"


def queries_graphed(device: torch.device) -> bool:
    """Whether the DP query itself is captured too (on a padded batch, :func:`fedaudit.privacy.primitive.dp_gradient`):
    on CUDA with FEDAUDIT_CUDA_GRAPHS=all only, until a GPU has measured it and checked it against the eager query."""
    return device.type == "cuda" and os.environ.get(GRAPHS_ENV, "").strip() == "all"


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream every capture on ``device`` records on: a high-priority one. PyTorch hands out streams round robin
    from a pool of 32 per priority; clients that run at once take theirs from the default priority's pool, so after
    32 of them one would be the capture stream torch.cuda.graph takes by default, and the work that client enqueued
    during a capture would be recorded into the graph instead of running (seen on an H200: a client's new CUDA
    generator refused a stream that was capturing). No client draws from the high-priority pool."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[index] = torch.cuda.Stream(index, priority=-1)
    return _CAPTURE_STREAMS[index]


def _clear_blas_workspaces() -> None:
    """Drop cuBLAS's cached workspaces (one per handle and stream), before and after a capture, as PyTorch's own
    graph trees do: the capture then allocates its matrix products' workspace in the graph's own memory. Otherwise
    every graph would record the one workspace of the capture stream and of the autograd thread's handle (the
    backward's products), and two clients replaying their graphs at once on their own streams would write the same
    workspace."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def _tensors(group: Group) -> list[torch.Tensor]:
    return list(group.values()) if isinstance(group, Mapping) else list(group)


def _map(fn: Callable[[torch.Tensor], torch.Tensor], out: Any) -> Any:
    """``fn`` on every tensor of a step's result (a tensor, or tuples, lists and dictionaries of them)."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, Mapping):
        return {key: _map(fn, value) for key, value in out.items()}
    if isinstance(out, tuple | list):
        return type(out)(_map(fn, value) for value in out)
    return out


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class GraphedStep:
    """A step ``fn(*groups)`` that updates its state in place, captured as a CUDA graph and replayed.

    ``groups`` are dictionaries or sequences of tensors whose shapes never change between calls. The first
    ``warmup`` calls run ``fn`` eagerly (they initialise what a capture must not: cuDNN's handles, an optimiser's
    momentum buffers); the next captures ``fn`` on the graph's own copies of the groups and every call from then on
    copies its groups into those copies and replays. A group that is the same object as in the previous call is not
    copied again, so a caller must not change a group's tensors in place between calls. Everything ``fn`` writes in
    place (parameters, buffers) is written by each replay as by an eager call. Its result (a tensor, or tuples,
    lists and dictionaries of tensors) comes back as new tensors, or with ``copy_outputs=False`` as the graph's own
    tensors (in new containers), which the next call overwrites. If the capture fails, a warning says so, and this
    step and every step of the process that had not been captured yet run eagerly from then on: a capture whose end
    failed can leave CUDA's allocator mid-capture, which the next capture would trip on.
    """

    warmup = 2

    def __init__(self, fn: Callable[..., Any], *, copy_outputs: bool = True) -> None:
        self.fn = fn
        self.copy_outputs = copy_outputs
        self.calls = 0
        self.replays = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.failed = False
        self._static: list[Group] = []
        self._sources: list[Group] = []
        self._output: Any = None

    def __call__(self, *groups: Group) -> Any:
        self.calls += 1
        if self.failed or self.calls <= self.warmup:
            return self.fn(*groups)
        if self.graph is None and not self._capture(groups):
            return self.fn(*groups)
        self._load(groups)
        assert self.graph is not None
        self.graph.replay()
        self.replays += 1
        return _map(torch.clone if self.copy_outputs else _same, self._output)

    def _capture(self, groups: Sequence[Group]) -> bool:
        """Record ``fn`` on copies of ``groups``; nothing runs (the first replay is the step). False, and the step
        eager for good, where the capture fails or an earlier one in this process did."""
        if _REFUSED:
            self.failed = True
            return False
        self._static = [
            {name: t.detach().clone() for name, t in g.items()}
            if isinstance(g, Mapping)
            else [t.detach().clone() for t in g]
            for g in groups
        ]
        self._sources = list(groups)
        device = _tensors(self._static[0])[0].device
        with _CAPTURE:
            if _REFUSED:  # another thread's capture failed meanwhile
                self.failed = True
                self._static = []
                return False
            graph = torch.cuda.CUDAGraph()
            caller = torch.cuda.current_stream(device)
            _clear_blas_workspaces()
            try:
                with torch.cuda.graph(graph, stream=capture_stream(device), capture_error_mode="thread_local"):
                    self._output = _map(torch.Tensor.detach, self.fn(*self._static))
            except RuntimeError as error:
                self.failed = True
                _REFUSED.append(str(error))
                warnings.warn(
                    f"CUDA graph capture failed, this process's steps run eagerly from now on: {error}", stacklevel=3
                )
                return False
            finally:
                # torch.cuda.graph leaves the capture stream current when the capture's end raises: the caller's
                # eager work (this step, then its client's) would go on the stream every capture records on
                if torch.cuda.current_stream(device) != caller:
                    torch.cuda.set_stream(caller)
                _clear_blas_workspaces()
        self.graph = graph
        return True

    def _load(self, groups: Sequence[Group]) -> None:
        for i, group in enumerate(groups):
            if group is not self._sources[i]:
                torch._foreach_copy_(_tensors(self._static[i]), _tensors(group))
                self._sources[i] = group
