"""Shared by the benchmarks that measure fedaudit against Opacus: the paper's ConvNet and its Opacus twin."""

from __future__ import annotations

import torch
from opacus import GradSampleModule
from torch import nn

from fedaudit.models import ModelSpec, build_model


def convnet_and_opacus_twin(width: int, device: torch.device) -> tuple[nn.Module, GradSampleModule]:
    """The ConvNet (28x28 input, depth 3) and a GradSampleModule around an identical copy of it."""
    spec = ModelSpec("convnet", (1, 28, 28), 10, width=width, depth=3)
    torch.manual_seed(0)
    model = build_model(spec).to(device)
    reference = build_model(spec).to(device)
    reference.load_state_dict(model.state_dict())
    return model, GradSampleModule(reference, loss_reduction="sum")
