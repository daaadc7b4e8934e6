"""Models adapt to the input: ConvNet depth and head size, MLP, clear errors; which parameters cannot change the
output."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedaudit.models import ModelError, ModelSpec, build_model, default_depth, inert_parameters


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


class _Bypass(nn.Sequential):
    """A Sequential whose own forward also passes the convolution's output around the normalisation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self[0](x)
        return (out + self[1](out)).flatten(1)


def _without_effect(model: nn.Module, shape: tuple[int, ...]) -> set[str]:
    """The parameters that a large random change leaves the output of, in float64 (a slow loop, one at a time)."""
    model = model.double()
    x = torch.randn(4, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    base = model(x)
    found = set()
    for name, p in model.named_parameters():
        with torch.no_grad():
            saved = p.clone()
            p.add_(torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(1)))
            moved = float((model(x) - base).abs().max())
            p.copy_(saved)
        if moved < 1e-9:
            found.add(name)
    return found


@pytest.mark.parametrize(
    ("build", "shape", "expected"),
    [
        (lambda: build_model(ModelSpec("convnet", (1, 28, 28), 10, width=8, depth=3)), (1, 28, 28), 3),
        (lambda: build_model(ModelSpec("convnet", (3, 8, 8), 10, width=4, depth=2)), (3, 8, 8), 2),
        (lambda: build_model(ModelSpec("mlp", (1, 8, 8), 10, width=16, depth=2)), (1, 8, 8), 0),
        (
            lambda: nn.Sequential(nn.Conv2d(1, 4, 3), nn.InstanceNorm2d(4), nn.Flatten(), nn.Linear(144, 3)),
            (1, 8, 8),
            1,
        ),
        # groups of two channels keep the differences between a group's channels: the bias matters
        (lambda: nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(144, 3)), (1, 8, 8), 0),
        (lambda: nn.Sequential(nn.Conv2d(1, 4, 3, bias=False), nn.GroupNorm(4, 4), nn.Flatten()), (1, 8, 8), 0),
        (lambda: nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.GroupNorm(4, 4), nn.Flatten()), (1, 8, 8), 0),
        (lambda: _Bypass(nn.Conv2d(1, 4, 3), nn.GroupNorm(4, 4)), (1, 8, 8), 0),
    ],
)
def test_inert_parameters_are_those_a_slow_loop_finds_without_effect_on_the_output(build, shape, expected) -> None:
    torch.manual_seed(0)
    model = build()
    inert = inert_parameters(model)
    assert len(inert) == expected
    assert inert == _without_effect(model, shape)
