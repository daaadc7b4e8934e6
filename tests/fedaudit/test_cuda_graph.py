"""When FedLAP's image step is captured as a CUDA graph (the capture itself runs in tests/fedaudit/test_gpu.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

import fedaudit.algorithms.fedlap as fedlap_module
from fedaudit.algorithms.base import ClientData, RoundContext, get_algorithm
from fedaudit.config import FederatedConfig, FedLAPConfig, PrivacyConfig, RunConfig
from fedaudit.cuda_graph import GRAPHS_ENV, graphs_enabled
from fedaudit.models import ModelSpec, build_model


def test_graphs_are_taken_on_cuda_unless_turned_off(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.delenv(GRAPHS_ENV, raising=False)
    assert graphs_enabled(cuda)
    assert not graphs_enabled(torch.device("cpu"))
    with ThreadPoolExecutor(1) as pool:  # clients at once capture too (on the high-priority capture stream)
        assert pool.submit(graphs_enabled, cuda).result()
    for off in ("0", " 0 "):
        monkeypatch.setenv(GRAPHS_ENV, off)
        assert not graphs_enabled(cuda)
    monkeypatch.setenv(GRAPHS_ENV, "1")
    assert graphs_enabled(cuda)


def test_a_cpu_client_takes_no_graph(monkeypatch):
    """On the CPU the image step stays the eager function: FedLAP builds no GraphedStep there."""
    built = []
    monkeypatch.setattr(fedlap_module, "GraphedStep", lambda fn: built.append(fn))
    config = RunConfig(
        federated=FederatedConfig(algorithm="fedlap", rounds=1, batch_size=8),
        privacy=PrivacyConfig(dp=False),
        fedlap=FedLAPConfig(ipc=1, trajectories=1, max_loops=1, real_batches=1, image_steps=1),
    ).resolved()
    model = build_model(ModelSpec("convnet", (1, 8, 8), 10, width=4, depth=2))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    data = ClientData(0, torch.randn(20, 1, 8, 8), torch.arange(20) % 2)
    ctx = RoundContext(round=0, rounds=1, config=config, device=torch.device("cpu"))
    get_algorithm(config).client_update(model, params, data, ctx, torch.Generator().manual_seed(0))
    assert built == []
