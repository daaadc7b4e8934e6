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


@pytest.mark.parametrize("width", [2, 8, 32, 128])
def test_the_convnet_s_pooling_gives_avg_pool2d_s_floats_to_the_bit(width) -> None:
    """The known answer is torch's own avg_pool2d: on the ConvNet's shapes (batches of 1 to 256, 28x28 down to 3x3,
    odd sizes whose last row is dropped, values from 2^-20 to 2^20) the CPU's depthwise-convolution pooling, taken
    wherever the input is large enough (checked), gives the
    same output, the same input gradient and the same second-order gradient (FedLAP's matching differentiates
    through it), bit for bit; in float64 and with one channel it is avg_pool2d itself."""
    from unittest import mock

    import torch.nn.functional as F

    from fedaudit.models import CONV_POOL_ELEMENTS, AvgPool2x2

    pool = AvgPool2x2()
    generator = torch.Generator().manual_seed(width)
    convolved = 0
    for batch, size in [(1, 28), (16, 28), (16, 14), (16, 7), (256, 7), (3, 32), (5, 3), (2, 2), (128, 28), (700, 7)]:
        scale = 2.0 ** float(torch.randint(-20, 21, (), generator=generator))
        x = (torch.randn(batch, width, size, size, generator=generator) * scale).requires_grad_(True)
        with mock.patch.object(F, "conv2d", wraps=F.conv2d) as conv:
            ours = pool(x)
        assert conv.called == (x.numel() >= CONV_POOL_ELEMENTS)
        convolved += conv.called
        theirs = F.avg_pool2d(x, 2)
        assert torch.equal(ours, theirs), (batch, size)
        upstream = torch.randn(ours.shape, generator=generator)
        (g_ours,) = torch.autograd.grad(ours, x, upstream, create_graph=True)
        (g_theirs,) = torch.autograd.grad(theirs, x, upstream, create_graph=True)
        assert torch.equal(g_ours, g_theirs), (batch, size)
    assert convolved >= 2
    weight = torch.randn(10, width * 7 * 7, generator=generator, requires_grad=True)
    x = torch.randn(CONV_POOL_ELEMENTS // (width * 196) + 1, width, 14, 14, generator=generator, requires_grad=True)

    def matching(pooled: torch.Tensor) -> torch.Tensor:  # d/dx of the weight gradient's squared norm
        (gw,) = torch.autograd.grad((pooled.flatten(1) @ weight.t()).logsumexp(1).sum(), weight, create_graph=True)
        return torch.autograd.grad(gw.square().sum(), x)[0]

    assert torch.equal(matching(pool(x)), matching(F.avg_pool2d(x, 2)))
    double = torch.randn(300, width, 14, 14, dtype=torch.float64, generator=generator)
    assert torch.equal(pool(double), F.avg_pool2d(double, 2))
    model = build_model(ModelSpec("convnet", (1, 28, 28), 10, width=width, depth=3))
    assert sum(isinstance(m, AvgPool2x2) for m in model.modules()) == 3
