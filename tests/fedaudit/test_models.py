"""Models adapt to the input: ConvNet depth and head size, MLP, clear errors."""

from __future__ import annotations

import pytest
import torch

from fedaudit.models import ModelError, ModelSpec, build_model, default_depth


@pytest.mark.parametrize("shape, depth", [((1, 8, 8), 2), ((1, 28, 28), 3), ((3, 32, 32), 3), ((1, 4, 4), 1)])
def test_convnet_default_depth_fits_the_input_and_produces_logits(shape, depth) -> None:
    assert default_depth("convnet", shape) == depth
    model = build_model(ModelSpec("convnet", shape, 10, width=8, depth=depth))
    assert model(torch.randn(3, *shape)).shape == (3, 10)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert len(norms) == depth and all(m.num_groups == m.num_channels == 8 for m in norms)  # GroupNorm(C, C)


def test_mlp_and_errors() -> None:
    assert build_model(ModelSpec("mlp", (1, 8, 8), 10, width=16, depth=2))(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    with pytest.raises(ModelError, match="at least 16x16"):
        build_model(ModelSpec("convnet", (1, 8, 8), 10, width=8, depth=4))
    with pytest.raises(ModelError, match="Unknown model"):
        build_model(ModelSpec("resnet", (1, 8, 8), 10, width=8, depth=1))
