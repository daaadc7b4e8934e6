"""Layer-wise per-sample norms and clipped sums (fast gradient clipping, ghost norms) against a per-example loop.

Every layer rule is checked in float64 against one backward per example: Linear, Conv2d by the per-sample
gradient (kept or not) and by the ghost norm, GroupNorm, the vmap fallback for other layers, and the whole-model
fallback for models the layer-wise path cannot follow.
"""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from helpers import loop_grads
from torch import nn

from fedaudit.cuda_graph import GRAPHS_ENV, queries_graphed
from fedaudit.models import ModelSpec, build_model
from fedaudit.privacy import layers, primitive
from fedaudit.privacy.primitive import (
    add_noise,
    clip_and_sum,
    clipped_sum,
    dp_gradient,
    padded_clipped_sum,
    padded_size,
    per_sample_gradients,
    per_sample_sq_norms,
    trainable_params,
)

SPECS = {
    "convnet": ModelSpec("convnet", (1, 16, 16), 10, width=8, depth=2),
    "convnet-rgb": ModelSpec("convnet", (3, 8, 8), 4, width=6, depth=3),
    # The third convolution sees 4x4 positions at width 64: T (D + P) < P D, so the ghost norm is the cheaper rule.
    "convnet-ghost": ModelSpec("convnet", (1, 16, 16), 10, width=64, depth=3),
    "mlp": ModelSpec("mlp", (1, 8, 8), 10, width=16, depth=2),
}


class Scale(nn.Module):
    """A layer with a parameter that no layer rule knows: it goes through the vmap fallback."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.gain)


class Block(nn.Module):
    """A layer that owns a parameter and a sub-layer: the fallback must hold the sub-layer's parameters fixed."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.inner = nn.Linear(features, features)
        self.shift = nn.Parameter(torch.full((features,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x + self.shift) * 2


class Mixed(nn.Module):
    """Strided, dilated, grouped and bias-free convolutions, LayerNorm, a custom layer and a composite layer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, kernel_size=3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(4, 6, kernel_size=(3, 2), dilation=(1, 2), groups=2, bias=False)
        self.norm = nn.LayerNorm(24)
        self.scale = Scale(24)
        self.block = Block(24)
        self.head = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv1(x))
        h = self.conv2(h).flatten(1)
        return self.head(self.block(self.scale(self.norm(h))))


class Grouped(nn.Module):
    """GroupNorms with several channels a group (the ConvNet's has one), on shifted inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 6, kernel_size=3, padding=1)
        self.norm = nn.GroupNorm(2, 6)
        self.shift = nn.GroupNorm(3, 6)
        self.head = nn.Linear(6 * 16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.conv(x) + 3.0))
        return self.head(self.shift(h).flatten(1))


class Tied(nn.Module):
    """A layer called twice: the layer-wise path cannot follow it, the whole-model fallback must."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.layer(torch.tanh(self.layer(x)))))


class InPlace(nn.Module):
    """Layer outputs changed in place after their layer returns: the first traced layer's (the backward's root) by
    a scaling, a GroupNorm's by ReLU(inplace=True). The layer-wise path follows it: each output's hook, gradient
    edge and GroupNorm statistics are taken as the layer returns, before the change."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, kernel_size=3, padding=1)
        self.norm = nn.GroupNorm(3, 3)
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Linear(3 * 5 * 5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        h.mul_(2.0)
        return self.head(self.act(self.norm(h)).flatten(1))


class Branched(nn.Module):
    """Two branches from the input and a layer the loss does not depend on: the first traced layer's output
    gradient does not pass through the other branch, so the backward must ask for every layer's."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Linear(6, 4)
        self.right = nn.Linear(6, 4)
        self.unused = nn.Linear(6, 2)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.unused(x)
        return self.head(torch.cat([torch.tanh(self.left(x)), torch.tanh(self.right(x))], dim=1))


def _model_and_batch(name: str, batch: int = 7, seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    if name in SPECS:
        spec = SPECS[name]
        model, shape, classes = build_model(spec), spec.input_shape, spec.num_classes
    else:
        model, shape, classes = {
            "mixed": (Mixed, (2, 8, 8), 5),
            "grouped": (Grouped, (2, 4, 4), 4),
            "tied": (Tied, (6,), 3),
            "inplace": (InPlace, (2, 5, 5), 3),
            "branched": (Branched, (6,), 3),
        }[name]
        model = model()
    model = model.double()
    x = torch.randn(batch, *shape, dtype=torch.float64)
    y = torch.randint(0, classes, (batch,))
    return model, x, y


def _loop_clipped_sum(grads: dict[str, torch.Tensor], clip: float) -> dict[str, torch.Tensor]:
    summed = {name: torch.zeros_like(g[0]) for name, g in grads.items()}
    for i in range(len(next(iter(grads.values())))):
        norm = sum(float(g[i].pow(2).sum()) for g in grads.values()) ** 0.5
        factor = min(1.0, clip / (norm + 1e-6))
        for name, g in grads.items():
            summed[name] += factor * g[i]
    return summed


ALL = [*sorted(SPECS), "mixed", "grouped", "tied", "inplace", "branched"]


@pytest.mark.parametrize("name", ALL)
def test_sq_norms_equal_the_per_example_loop(name: str) -> None:
    model, x, y = _model_and_batch(name)
    reference = loop_grads(model, x, y)
    ours = per_sample_sq_norms(model, x, y)
    assert list(ours) == list(reference)
    for key, g in reference.items():
        torch.testing.assert_close(ours[key], g.flatten(1).pow(2).sum(1), rtol=1e-9, atol=1e-14)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("clip", [1e-3, 0.5, 1e3])
def test_clipped_sum_equals_the_per_example_loop(name: str, clip: float) -> None:
    model, x, y = _model_and_batch(name, batch=9, seed=1)
    reference = loop_grads(model, x, y)
    summed, norms = clipped_sum(model, x, y, clip)
    expected = _loop_clipped_sum(reference, clip)
    assert list(summed) == list(expected)
    for key in expected:
        torch.testing.assert_close(summed[key], expected[key], rtol=1e-9, atol=1e-13)
    flat = torch.cat([g.flatten(1) for g in reference.values()], dim=1)
    torch.testing.assert_close(norms, flat.norm(dim=1), rtol=1e-9, atol=1e-14)


def _convolutions_match_the_loop(seed: int) -> None:
    """The clipped sum and norms of the models with every kind of convolution equal the per-example loop's."""
    for name in ("convnet", "convnet-rgb", "mixed"):
        model, x, y = _model_and_batch(name, batch=5, seed=seed)
        reference = loop_grads(model, x, y)
        summed, norms = clipped_sum(model, x, y, 0.05)
        expected = _loop_clipped_sum(reference, 0.05)
        for key in expected:
            torch.testing.assert_close(summed[key], expected[key], rtol=1e-9, atol=1e-13)
        flat = torch.cat([g.flatten(1) for g in reference.values()], dim=1)
        torch.testing.assert_close(norms, flat.norm(dim=1), rtol=1e-9, atol=1e-14)


@pytest.mark.parametrize("ghost", [True, False])
@pytest.mark.parametrize("keep", [True, False])
def test_both_convolution_rules_on_every_layer(monkeypatch: pytest.MonkeyPatch, ghost: bool, keep: bool) -> None:
    """Force the ghost norm (or the per-sample gradient, kept or recomputed for the sum) on every convolution."""
    monkeypatch.setattr(layers, "uses_ghost_norm", lambda *_: ghost)
    if not keep:
        monkeypatch.setattr(layers, "CHUNK_ELEMENTS", 1)
    monkeypatch.setattr(layers, "GROUPED_ELEMENTS", 1)  # one example per grouped convolution: chunking exercised
    _convolutions_match_the_loop(seed=2)


@pytest.mark.parametrize("patches", [0, 10**9])
@pytest.mark.parametrize("keep", [True, False])
def test_both_per_sample_convolution_kernels_on_every_layer(
    monkeypatch: pytest.MonkeyPatch, patches: int, keep: bool
) -> None:
    """Every convolution's per-sample weight gradients by the grouped convolution (PATCH_INPUTS 0) or by the batched
    product of its patches (every ungrouped one): strided, dilated, several channels, kept for the sum or streamed."""
    monkeypatch.setattr(layers, "PATCH_INPUTS", patches)
    monkeypatch.setattr(layers, "uses_ghost_norm", lambda *_: False)
    if not keep:
        monkeypatch.setattr(layers, "CHUNK_ELEMENTS", 1)
    _convolutions_match_the_loop(seed=3)


def test_a_first_convolution_on_the_cpu_takes_the_product_of_its_patches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule: on the CPU, the 3x3 convolutions on one and three channels (9 and 27 inputs an output) take the
    patches' product, the ones on 8 channels (72) the grouped convolution."""
    unfolded: list[int] = []
    unfold = layers.unfold_input

    def spy(module: nn.Conv2d, a: torch.Tensor, *, copies: bool | None = None) -> torch.Tensor:
        if copies:  # the per-sample product's patches (a ghost norm's are taken on the CPU's own path)
            unfolded.append(a.shape[1])
        return unfold(module, a, copies=copies)

    monkeypatch.setattr(layers, "unfold_input", spy)
    for name, channels in (("convnet", 1), ("convnet-rgb", 3)):
        unfolded.clear()
        model, x, y = _model_and_batch(name, batch=4)
        per_sample_sq_norms(model, x, y)
        assert unfolded == [channels]  # the first layer alone; the width-8 and width-6 ones have 72 and 54 inputs


def test_the_ghost_rule_is_chosen_where_it_is_cheaper() -> None:
    assert layers.uses_ghost_norm(positions=16, inputs=64 * 9, outputs=64)  # 4x4 positions, width 64
    assert not layers.uses_ghost_norm(positions=196, inputs=128 * 9, outputs=128)  # 14x14 positions, width 128
    assert layers.uses_ghost_norm(positions=49, inputs=128 * 9, outputs=128)  # 7x7 positions, width 128
    assert not layers.uses_ghost_norm(positions=784, inputs=9, outputs=32)  # the first layer on 28x28


@pytest.mark.parametrize(("width", "ghost"), [(128, True), (64, False)])
def test_before_a_sum_the_ghost_norm_replaces_kept_gradients_only_at_half_their_cost(width: int, ghost: bool) -> None:
    """Kept per-sample gradients make the clipped sum a weighted sum, the ghost norm needs a weight gradient after
    it: on 7x7 positions the ghost norm costs 0.43 of the gradients at width 128 (taken), 0.85 at width 64 (kept)."""
    conv = nn.Conv2d(width, width, kernel_size=3, padding=1)
    a, b = torch.randn(2, width, 7, 7), torch.randn(2, width, 7, 7)
    norms, kept = layers._conv2d_sq_norms(conv, a, b, keep=True)
    assert (kept == []) is ghost
    direct = torch.stack(
        [torch.nn.grad.conv2d_weight(a[i : i + 1], conv.weight.shape, b[i : i + 1], 1, 1) for i in range(2)]
    )
    torch.testing.assert_close(norms["weight"], direct.flatten(1).pow(2).sum(1), rtol=1e-4, atol=1e-4)


def test_a_traced_forward_leaves_every_layer_as_it_was() -> None:
    """The pass records each layer by wrapping its forward on the instance: afterwards no layer holds a wrapper (after
    a pass that raised Untraceable, too), and a forward a user set on an instance is the one it holds again, and
    the one the pass ran."""
    model, x, y = _model_and_batch("mixed")
    own = model.head.forward
    ran: list[int] = []
    model.head.__dict__["forward"] = lambda h: ran.append(len(h)) or own(h)
    users = model.head.__dict__["forward"]
    before = per_sample_sq_norms(model, x, y)
    assert ran == [len(x)]
    assert model.head.__dict__["forward"] is users
    assert all("forward" not in module.__dict__ for module in model.modules() if module is not model.head)
    del model.head.__dict__["forward"]
    torch.testing.assert_close(per_sample_sq_norms(model, x, y), before, rtol=0, atol=0)
    model, x, y = _model_and_batch("tied")
    with pytest.raises(layers.Untraceable):
        layers.trace_layers(model, x, y, trainable_params(model), F.cross_entropy)
    assert all("forward" not in module.__dict__ for module in model.modules())


def test_the_fallbacks_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer-wise path uses the vmap fallback for unknown layers and gives up on a layer called twice, not on
    layer outputs changed in place after their layer returned."""
    calls: list[str] = []
    fallback = layers._fallback_grads
    monkeypatch.setattr(
        layers, "_fallback_grads", lambda layer, params: calls.append("layer") or fallback(layer, params)
    )
    model, x, y = _model_and_batch("mixed")
    per_sample_sq_norms(model, x, y)
    assert calls.count("layer") == 3  # LayerNorm, Scale, Block
    model, x, y = _model_and_batch("tied")
    with pytest.raises(layers.Untraceable):
        layers.trace_layers(model, x, y, trainable_params(model), F.cross_entropy)
    model, x, y = _model_and_batch("inplace")
    traces = layers.trace_layers(model, x, y, trainable_params(model), F.cross_entropy)
    assert [type(layer.module).__name__ for layer in traces] == ["Conv2d", "GroupNorm", "Linear"]
    assert traces[1].stats is not None  # read from the GroupNorm's own node, before the in-place ReLU replaced it
    assert all("forward" not in module.__dict__ for module in model.modules())


@pytest.mark.parametrize("name", ["convnet", "mixed"])
def test_functional_parameters_and_frozen_layers(name: str) -> None:
    """``params`` replaces the module's own parameters, in fallback layers too; frozen parameters get no gradient."""
    model, x, y = _model_and_batch(name, seed=3)
    frozen = next(iter(trainable_params(model)))
    model.get_parameter(frozen).requires_grad_(False)
    params = {name: p.detach() + 0.1 * torch.randn_like(p) for name, p in trainable_params(model).items()}
    summed, _ = clipped_sum(model, x, y, 0.3, params=params)
    assert frozen not in summed
    expected = _loop_clipped_sum(loop_grads(model, x, y, params=params), 0.3)
    assert list(summed) == list(expected)
    for key in expected:
        torch.testing.assert_close(summed[key], expected[key], rtol=1e-9, atol=1e-13)


def test_extra_rows_and_empty_batches() -> None:
    """Gradient canaries (``extra``) are clipped with the batch; an empty batch leaves only them."""
    model, x, y = _model_and_batch("convnet", seed=4)
    reference = loop_grads(model, x, y)
    extra = {name: 3 * torch.randn(4, *g.shape[1:], dtype=g.dtype) for name, g in reference.items()}
    both = {name: torch.cat([reference[name], extra[name]]) for name in reference}
    summed, norms = clipped_sum(model, x, y, 0.2, extra=extra)
    expected = _loop_clipped_sum(both, 0.2)
    for key in expected:
        torch.testing.assert_close(summed[key], expected[key], rtol=1e-9, atol=1e-13)
    assert norms.shape == (len(y) + 4,)
    summed, norms = clipped_sum(model, x[:0], y[:0], 0.2, extra=extra)
    expected = _loop_clipped_sum(extra, 0.2)
    for key in expected:
        torch.testing.assert_close(summed[key], expected[key], rtol=1e-9, atol=1e-13)
    assert norms.shape == (4,)
    assert all(v.shape == (0,) for v in per_sample_sq_norms(model, x[:0], y[:0]).values())


def test_dp_gradient_keeps_its_noise_stream() -> None:
    """Same seed, same noise: the layer-wise query equals the per-sample query of before up to float rounding."""
    spec = ModelSpec("convnet", (1, 28, 28), 10, width=16, depth=3)
    torch.manual_seed(5)
    model = build_model(spec)
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    ours = dp_gradient(
        model,
        x,
        y,
        noise_multiplier=0.7,
        max_grad_norm=0.5,
        expected_batch_size=30,
        generator=torch.Generator().manual_seed(11),
    )
    summed, norms = clip_and_sum(per_sample_gradients(model, x, y), 0.5)
    before = add_noise(
        summed,
        noise_multiplier=0.7,
        max_grad_norm=0.5,
        expected_batch_size=30,
        generator=torch.Generator().manual_seed(11),
    )
    assert list(ours.grads) == list(before)
    for key in before:
        torch.testing.assert_close(ours.grads[key], before[key], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.per_sample_norms, norms, rtol=1e-4, atol=1e-6)


def test_a_layer_replaced_after_a_query_is_traced_anew(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers that own the parameters are kept per model between queries; a layer swapped for another of the
    same name is found again (layer by layer: the whole-model fallback is not taken), so the next clipped sum is the
    new model's (against the per-example loop)."""
    import fedaudit.privacy.primitive as primitive

    model, x, y = _model_and_batch("convnet", batch=5, seed=4)
    clipped_sum(model, x, y, 0.05)
    last = max((name for name, m in model.named_modules() if isinstance(m, nn.Linear)), key=len)
    parent, _, child = last.rpartition(".")
    old = model.get_submodule(last)
    torch.manual_seed(9)
    replacement = nn.Linear(old.in_features, old.out_features).double()
    setattr(model.get_submodule(parent) if parent else model, child, replacement)
    monkeypatch.setattr(primitive, "per_sample_gradients", lambda *a, **k: pytest.fail("took the fallback"))
    summed, _ = clipped_sum(model, x, y, 0.05)
    monkeypatch.undo()
    expected = _loop_clipped_sum(loop_grads(model, x, y), 0.05)
    for key in expected:
        torch.testing.assert_close(summed[key], expected[key], rtol=1e-9, atol=1e-13)


def test_a_convolution_s_rules_follow_the_bounds_they_were_worked_out_under(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cost rules kept per batch shape are those of the bounds in force: changing a bound or the ghost-norm rule
    (as the tests above do) is not answered from what was worked out before."""
    conv = nn.Conv2d(8, 8, 3, padding=1)
    a, b = torch.randn(6, 8, 5, 5), torch.randn(6, 8, 5, 5)
    first = layers._conv_rules(conv, a, b, keep=True)
    assert first == layers._conv_rules(conv, a, b, keep=True)
    assert first.keep and not first.streams and not first.ghost_only and first.chunk == layers.GROUPED_CHUNK
    monkeypatch.setattr(layers, "GROUPED_ELEMENTS", 1)
    assert layers._conv_rules(conv, a, b, keep=True).chunk == 1
    monkeypatch.setattr(layers, "CHUNK_ELEMENTS", 1)
    assert layers._conv_rules(conv, a, b, keep=True).streams
    monkeypatch.setattr(layers, "uses_ghost_norm", lambda *_: True)
    ghost = layers._conv_rules(conv, a, b, keep=True)
    assert ghost.ghost_only and not ghost.keep and not ghost.streams
    monkeypatch.undo()
    assert layers._conv_rules(conv, a, b, keep=True) == first
    assert not layers._conv_rules(conv, a, b, keep=False).keep


def test_a_container_replaced_after_a_query_is_traced_anew() -> None:
    """The kept owners are checked step by step along their paths: a container (the ConvNet's ``features``) swapped
    for a copy with other weights, whose layers have the same names, is seen, and the next clipped sum and norms are
    the new model's (against the per-example loop); the kept owners are then the new layers."""
    import copy

    model, x, y = _model_and_batch("convnet", batch=5, seed=4)
    clipped_sum(model, x, y, 0.05)
    before = layers._owners(model, frozenset(trainable_params(model)))
    features = copy.deepcopy(model.features)
    torch.manual_seed(11)
    with torch.no_grad():
        for p in features.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model.features = features
    summed, norms = clipped_sum(model, x, y, 0.05)
    expected = _loop_clipped_sum(loop_grads(model, x, y), 0.05)
    for key in expected:
        torch.testing.assert_close(summed[key], expected[key], rtol=1e-9, atol=1e-13)
    after = layers._owners(model, frozenset(trainable_params(model)))
    assert after.keys() == before.keys()
    for prefix, (module, _) in after.items():
        assert module is model.get_submodule(prefix)
        assert prefix == "classifier" or module is not before[prefix][0]


def test_group_norm_gradients_hold_in_float32_on_inputs_far_from_zero() -> None:
    """The per-example GroupNorm rule subtracts the group mean from sums over positions: on inputs whose mean is a
    thousand times their spread it still agrees with a float64 loop to float32 precision."""
    torch.manual_seed(6)
    norm = nn.GroupNorm(2, 8)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    a = 1000.0 + torch.randn(5, 8, 6, 6)
    b = torch.randn(5, 8, 6, 6)
    ours = layers._group_norm_grads(norm, a, b)  # the group statistics recomputed
    expected = {name: [] for name in ("weight", "bias")}
    reference = norm.double()
    for i in range(5):
        out = reference(a[i : i + 1].double())
        weight, bias = torch.autograd.grad((out * b[i : i + 1].double()).sum(), [reference.weight, reference.bias])
        expected["weight"].append(weight)
        expected["bias"].append(bias)
    for name, rows in expected.items():
        torch.testing.assert_close(ours[name].double(), torch.stack(rows), rtol=2e-3, atol=2e-3)


def test_the_module_s_own_parameters_are_traced_without_swapping_them() -> None:
    """Differentiating at the module's own parameters runs the module as it is (no parameter swapping) and leaves
    their ``.grad`` alone; the result is the functional path's (parameters passed as copies)."""
    model, x, y = _model_and_batch("convnet", seed=7)
    own = trainable_params(model)
    owners = layers._owners(model, frozenset(own))
    assert layers._own_parameters(own, owners)
    copies = {name: p.clone() for name, p in own.items()}
    assert not layers._own_parameters(copies, owners)
    assert not layers._own_parameters({**own, "stranger": torch.zeros(1)}, owners)  # a parameter no layer owns
    first = next(iter(own))
    model.get_parameter(first).requires_grad_(False)
    assert not layers._own_parameters(own, owners)  # a frozen one: it would take no gradient
    model.get_parameter(first).requires_grad_(True)
    summed, norms = clipped_sum(model, x, y, 0.3)
    assert all(p.grad is None for p in model.parameters())
    again, again_norms = clipped_sum(model, x, y, 0.3, params=copies)
    for key in summed:
        torch.testing.assert_close(summed[key], again[key], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(norms, again_norms, rtol=1e-12, atol=1e-15)


def test_group_norm_statistics_come_from_the_forward_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """The traced GroupNorms carry the statistics their forward saved, and the clipped sum is the same when they
    are recomputed instead (autograd keeping them under other names)."""
    model, x, y = _model_and_batch("grouped", seed=8)
    traced = layers.trace_layers(model, x, y, trainable_params(model), F.cross_entropy)
    norms = [layer for layer in traced if isinstance(layer.module, nn.GroupNorm)]
    assert len(norms) == 2 and all(layer.stats is not None for layer in norms)
    assert [layer.stats[0].shape for layer in norms] == [(7, 2), (7, 3)]
    summed, _ = clipped_sum(model, x, y, 0.4)
    monkeypatch.setattr(layers, "_group_stats", lambda output, module: None)
    recomputed, _ = clipped_sum(model, x, y, 0.4)
    for key in summed:
        torch.testing.assert_close(summed[key], recomputed[key], rtol=1e-12, atol=1e-15)


def test_streamed_convolutions_leave_an_overflowed_example_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-sample convolution gradients too large to keep are streamed chunk by chunk (here one example a chunk):
    the clipped sum is the per-example loop's, and an example whose gradient is not finite adds nothing."""
    monkeypatch.setattr(layers, "CHUNK_ELEMENTS", 1)
    monkeypatch.setattr(layers, "GROUPED_ELEMENTS", 1)
    chunks = []
    real = layers.streamed_chunks
    monkeypatch.setattr(primitive, "streamed_chunks", lambda traced: (chunks.append(1), real(traced))[1])
    model, x, y = _model_and_batch("convnet", batch=5, seed=9)
    summed, _ = clipped_sum(model, x, y, 0.3)
    assert chunks
    expected = _loop_clipped_sum(loop_grads(model, x, y), 0.3)
    for key in expected:
        torch.testing.assert_close(summed[key], expected[key], rtol=1e-9, atol=1e-13)
    broken = x.clone()
    broken[2, 0, 0, 0] = float("inf")
    with_inf, norms = clipped_sum(model, broken, y, 0.3)
    rest = torch.tensor([0, 1, 3, 4])
    without, _ = clipped_sum(model, x[rest], y[rest], 0.3)
    assert not bool(torch.isfinite(norms[2])) and bool(torch.isfinite(norms[rest]).all())
    for key in without:
        torch.testing.assert_close(with_inf[key], without[key], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", ["branched", "convnet", "mixed"])
def test_every_layer_s_output_gradient_arrives_on_the_first_query_and_the_next(name: str) -> None:
    """The backward asks for the first traced layer's output gradient alone; on a model where that does not reach
    every layer (branches, an unused layer) the trace is taken again asking for every output, and so are the
    model's later traces. Both queries equal the per-example loop."""
    model, x, y = _model_and_batch(name, batch=5, seed=3)
    expected = _loop_clipped_sum(loop_grads(model, x, y), 0.5)
    for _ in range(2):
        summed, _ = clipped_sum(model, x, y, 0.5)
        for key in expected:
            torch.testing.assert_close(summed[key], expected[key], rtol=1e-9, atol=1e-13)
        assert layers._MANY_ROOTS.get(model, False) == (name == "branched")


def test_a_layer_whose_per_sample_gradients_are_kept_drops_its_input_and_output_gradient_in_the_backward() -> None:
    """GroupNorm's and the small convolutions' per-sample gradients are taken as their output gradient arrives;
    their input and output gradient are then dropped, where the ghost-norm and Linear layers keep theirs for the
    weighted sum. The norms a visit takes in the backward are the ones taken after it."""
    model, x, y = _model_and_batch("convnet-ghost", batch=6)
    params = trainable_params(model)
    during: dict[str, torch.Tensor] = {}
    traced = layers.trace_layers(
        model, x, y, params, F.cross_entropy, lambda layer: during.update(layers.layer_sq_norms(layer, params))
    )
    kinds = [type(layer.module).__name__ for layer in traced]
    held = [layer.inputs.numel() > 0 and layer.output_grads.numel() > 0 for layer in traced]
    assert held == [not layer.kept for layer in traced]
    assert {k for k, h in zip(kinds, held) if not h} == {"Conv2d", "GroupNorm"} and "Linear" in {
        k for k, h in zip(kinds, held) if h
    }
    assert any(h for k, h in zip(kinds, held) if k == "Conv2d")  # the ghost-norm convolution keeps its own
    after = {}
    for layer in layers.trace_layers(model, x, y, params, F.cross_entropy):
        after.update(layers.layer_sq_norms(layer, params))
    assert during.keys() == after.keys()
    for key in after:
        torch.testing.assert_close(during[key], after[key], rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    "kernel, stride, padding, groups",
    [(3, 1, 1, 1), (3, 2, 1, 1), (5, 1, 2, 2), ((3, 5), (2, 1), (1, 2), 1), (1, 1, 0, 4), (3, 1, 0, 1)],
)
def test_the_gpu_s_unfold_gives_the_patches_of_f_unfold(kernel, stride, padding, groups):
    """The GPU's unfold (a pad and one copy of a strided view, layers.unfold_input) takes the same patches in the same
    order as F.unfold, which the CPU uses: bit for bit, for square and oblong kernels, strides, paddings, groups."""
    module = nn.Conv2d(4, 8, kernel, stride=stride, padding=padding, groups=groups)
    a = torch.randn(5, 4, 13, 11)
    expected = F.unfold(a, module.kernel_size, dilation=module.dilation, padding=module.padding, stride=module.stride)
    assert torch.equal(layers.unfold_input(module, a, copies=True), expected)
    assert torch.equal(layers.unfold_input(module, a), expected)  # the CPU's own path


# --- the query on a padded batch (what a CUDA graph of it computes, run eagerly here) ---------------------------


def _padded(x: torch.Tensor, y: torch.Tensor, extra: int, seed: int) -> tuple[torch.Tensor, ...]:
    """The batch with ``extra`` rows of random finite inputs and labels after it (zeros would hide a leak)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn((extra, *x.shape[1:]), generator=g, dtype=x.dtype)
    labels = torch.randint(0, int(y.max()) + 1, (extra,), generator=g)
    real = torch.arange(len(x) + extra) < len(x)
    return torch.cat([x, rows]), torch.cat([y, labels]), real


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("clip", [1e-3, 0.5])
def test_a_padded_batch_gives_the_real_rows_clipped_sum_and_norms(name: str, clip: float) -> None:
    model, x, y = _model_and_batch(name, batch=9, seed=1)
    params = trainable_params(model)
    padded = padded_clipped_sum(model, *_padded(x, y, 7, seed=2), clip, params=params)
    if primitive._layer_squares(model, x, y, params, F.cross_entropy, for_sum=True) is None:
        assert padded is None  # a model the layer-wise path cannot follow takes the eager query
        return
    assert padded is not None
    summed, norms, overflowed = padded
    reference = loop_grads(model, x, y)
    expected = _loop_clipped_sum(reference, clip)
    assert list(summed) == list(expected) and not bool(overflowed)
    for key in expected:
        torch.testing.assert_close(summed[key], expected[key], rtol=1e-9, atol=1e-13)
    flat = torch.cat([g.flatten(1) for g in reference.values()], dim=1)
    torch.testing.assert_close(norms[:9], flat.norm(dim=1), rtol=1e-9, atol=1e-14)


def test_an_overflow_in_any_row_is_reported_and_a_large_padding_row_changes_nothing() -> None:
    """The caller takes the eager query when the flag is set: a real row's overflow (left out of the sum there), or a
    padding row's (whose factor 0 times infinity would make the sums NaN)."""
    model, x, y = _model_and_batch("convnet", batch=6, seed=3)
    params = trainable_params(model)
    rows, labels, real = _padded(x, y, 4, seed=4)
    for row in (2, 8):
        broken = rows.clone()
        broken[row, 0, 0, 0] = float("inf")
        assert bool(padded_clipped_sum(model, broken, labels, real, 0.5, params=params)[2]), row
    far = rows.clone()
    far[8] *= 1e30  # a padding row of huge inputs: its gradient is finite, its factor 0, nothing is added
    summed, _, overflowed = padded_clipped_sum(model, far, labels, real, 0.5, params=params)
    assert not bool(overflowed)
    expected = _loop_clipped_sum(loop_grads(model, x, y), 0.5)
    for key in expected:
        torch.testing.assert_close(summed[key], expected[key], rtol=1e-9, atol=1e-13)


def test_a_model_whose_layer_streams_takes_the_eager_query(monkeypatch: pytest.MonkeyPatch) -> None:
    """Streamed chunks read their norms back: not capturable, so no padded query."""
    monkeypatch.setattr(layers, "CHUNK_ELEMENTS", 1)
    model, x, y = _model_and_batch("convnet", batch=5, seed=5)
    assert padded_clipped_sum(model, *_padded(x, y, 3, seed=6), 0.5, params=trainable_params(model)) is None


@pytest.mark.parametrize("expected", [1.0, 16.0, 100.0, 256.0, 1000.5])
def test_the_padded_size_holds_six_standard_deviations_above_the_mean(expected: float) -> None:
    size = padded_size(expected)
    assert size % 8 == 0 and expected + 6 * math.sqrt(expected) <= size < expected + 6 * math.sqrt(expected) + 8


def test_the_query_is_captured_only_on_cuda_when_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """FEDAUDIT_CUDA_GRAPHS=all captures the DP query too, on CUDA only; on the CPU dp_gradient takes no padded path."""
    cuda = torch.device("cuda")
    for value, graphed in ((None, False), ("1", False), ("0", False), ("all", True), (" all ", True)):
        if value is None:
            monkeypatch.delenv(GRAPHS_ENV, raising=False)
        else:
            monkeypatch.setenv(GRAPHS_ENV, value)
        assert queries_graphed(cuda) is graphed
        assert not queries_graphed(torch.device("cpu"))
    calls = []
    monkeypatch.setattr(primitive, "padded_clipped_sum", lambda *a, **k: calls.append(1))
    model, x, y = _model_and_batch("convnet", batch=4, seed=7)
    dp_gradient(
        model, x, y, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4, generator=torch.Generator()
    )
    assert calls == []


class _EagerStep:
    """GraphedStep's stand-in on the CPU: every call runs the step eagerly; ``fail`` marks the capture (the call
    after the warmups) as failed, as GraphedStep does when CUDA refuses it (it then runs the step eagerly)."""

    warmup = 2

    def __init__(self, fn, copy_outputs: bool = True, *, fail: bool = False) -> None:
        self.fn, self.calls, self.fail, self.failed = fn, 0, fail, False

    def __call__(self, *groups):
        self.calls += 1
        self.failed = self.fail and self.calls > self.warmup
        return self.fn(*groups)


def _stand_in_steps(monkeypatch: pytest.MonkeyPatch, *, fail: bool = False) -> list[_EagerStep]:
    """Every GraphedStep the DP query builds from now on is an :class:`_EagerStep`, listed in the list returned."""
    made: list[_EagerStep] = []

    def build(fn, copy_outputs: bool = True) -> _EagerStep:
        made.append(_EagerStep(fn, copy_outputs, fail=fail))
        return made[-1]

    monkeypatch.setattr(primitive, "GraphedStep", build)
    return made


def _assert_padded_equals_eager(
    monkeypatch: pytest.MonkeyPatch, model: nn.Module, batches: list, expected: float
) -> None:
    """dp_gradient of every batch through the padded path (where it takes it) gives the eager query's norms and
    gradients."""
    results = {}
    for padded in (True, False):
        monkeypatch.setattr(primitive, "queries_graphed", lambda device, padded=padded: padded)
        results[padded] = [
            dp_gradient(
                model,
                x,
                y,
                noise_multiplier=0.0,
                max_grad_norm=0.5,
                expected_batch_size=expected,
                generator=torch.Generator(),
            )
            for x, y in batches
        ]
    for ours, eager in zip(results[True], results[False]):
        torch.testing.assert_close(ours.per_sample_norms, eager.per_sample_norms, rtol=1e-9, atol=1e-14, equal_nan=True)
        for name, value in eager.grads.items():
            torch.testing.assert_close(ours.grads[name], value, rtol=1e-9, atol=1e-13)


def test_dp_gradient_through_the_padded_query_equals_the_eager_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """dp_gradient's captured path with the capture replaced by eager calls (its CUDA graph runs in test_gpu.py):
    batches of every size up to padded_size(B) give the eager query's gradients and norms; an overflowed batch and
    one beyond the padded size take the eager query; canaries (extra rows) never take the padded path."""
    made = _stand_in_steps(monkeypatch)
    model, data, labels = _model_and_batch("convnet", batch=60, seed=8)
    data[50, 0, 0, 0] = float("inf")
    expected = 8.0
    size = padded_size(expected)
    batches = [(data[:n], labels[:n]) for n in (8, 3, size, 11, 1)]
    batches += [(data[45:55], labels[45:55]), (data[: size + 1], labels[: size + 1])]
    _assert_padded_equals_eager(monkeypatch, model, batches, expected)
    assert len(made) == 1 and made[0].calls == 6  # five batches and the overflowed one; not the one beyond
    extra = {name: torch.randn(2, *p.shape, dtype=p.dtype) for name, p in model.named_parameters()}
    monkeypatch.setattr(primitive, "queries_graphed", lambda device: True)
    dp_gradient(
        model,
        data[:4],
        labels[:4],
        noise_multiplier=0.0,
        max_grad_norm=0.5,
        expected_batch_size=expected,
        generator=torch.Generator(),
        extra=extra,
    )
    assert made[0].calls == 6


def test_a_query_whose_capture_failed_is_the_eager_query_from_then_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a failed capture the padded query is not run again (it would cost the padding's rows on every query
    for nothing): the next queries take the eager query, and every result is the eager one."""
    made = _stand_in_steps(monkeypatch, fail=True)
    model, data, labels = _model_and_batch("convnet", batch=40, seed=9)
    _assert_padded_equals_eager(monkeypatch, model, [(data[:n], labels[:n]) for n in (8, 5, 11, 7, 9, 3)], 8.0)
    assert len(made) == 1 and made[0].calls == made[0].warmup + 1  # the warmups and the failed capture, no more


def test_no_cache_keeps_a_model_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caches keyed by a model (its captured queries, the layers that own its parameters) hold it weakly: a model
    no longer used is freed with what was made for it, also one whose parameters are its own (a single layer, whose
    prefix is ""). Engines make models per thread and run (a client's generator, each round's scratch copies)."""
    monkeypatch.setattr(primitive, "GraphedStep", _EagerStep)
    monkeypatch.setattr(primitive, "queries_graphed", lambda device: True)
    gc.collect()
    before = (len(primitive._CAPTURED), len(layers._OWNERS))
    freed = []
    for name in ("convnet", "single"):
        if name == "single":
            torch.manual_seed(3)
            model, x, y = (
                nn.Linear(6, 3).double(),
                torch.randn(5, 6, dtype=torch.float64),
                torch.tensor([0, 1, 2, 0, 1]),
            )
        else:
            model, x, y = _model_and_batch(name, batch=5, seed=3)
        dp_gradient(
            model, x, y, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4.0, generator=torch.Generator()
        )
        assert model in primitive._CAPTURED and model in layers._OWNERS  # the caches did hold it
        freed.append(weakref.ref(model))
        del model
    gc.collect()
    assert [ref() for ref in freed] == [None, None]
    assert (len(primitive._CAPTURED), len(layers._OWNERS)) == before
