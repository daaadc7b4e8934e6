"""Models: the paper's ConvNet, an MLP for small inputs, and the user's own (``--model package.module:factory``).

All are plain ``nn.Module``s without in-place state (no BatchNorm), so that per-sample gradients (vmap over
functional_call) and double backward work. A user's factory is called with ``(input_shape, num_classes)``; the
module is imported by name when a run is trained and again when it is attacked, so it must be importable there
(docs/your-data.md).
"""

from __future__ import annotations

import importlib
import math
import re
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedaudit.errors import UserError
from fedaudit.seeding import Stream, derive_seed

ARCHITECTURES = ("convnet", "mlp")
_FACTORY = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


class ModelError(UserError):
    """A model configuration that cannot be built (one clear sentence)."""


class AvgPool2x2(nn.AvgPool2d):
    """AvgPool2d(2, stride 2) that on the CPU, for a float32 batch of two channels or more and at least
    :data:`CONV_POOL_ELEMENTS` values, is computed as a depthwise convolution with weights 1/4: the same floats (each
    window's four values summed in the same order, and a quarter is exact; tests/fedaudit/test_models.py compares
    forward, backward and second order), in less time than ATen's pooling kernels, whose backward is slow on one
    thread (1.04-1.33x a plain ConvNet step, 1.00-1.25x a DP step: benchmarks/pooling.py). Elsewhere it is avg_pool2d
    itself: a GPU's pooling is fast, and its convolutions may round through TF32."""

    def __init__(self) -> None:
        super().__init__(kernel_size=2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cpu_float = x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 4
        if not cpu_float or x.shape[1] < 2 or x.numel() < CONV_POOL_ELEMENTS:
            return super().forward(x)
        channels = x.shape[1]
        return F.conv2d(x, x.new_full((channels, 1, 2, 2), 0.25), stride=2, groups=channels)


CONV_POOL_ELEMENTS = 1 << 16
"""Below this many input values oneDNN's set-up (about 0.15 ms a call, forward and backward) costs more than the
convolution saves: a batch of 32 digits' 8x8 maps at width 8 pooled in 229 us that way against 107 us."""


class ConvNet(nn.Module):
    """ConvNet of the dataset-distillation literature used by FedLAP-DP.

    ``depth`` blocks of Conv3x3 -> GroupNorm(width, width) -> ReLU -> AvgPool2d(2),
    then a linear head. GroupNorm with one group per channel is instance norm
    with an affine transform: it normalises each example on its own, so
    per-sample gradients are well defined (BatchNorm would mix examples).
    """

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, width: int = 128, depth: int = 3) -> None:
        super().__init__()
        channels, height, width_px = input_shape
        if depth < 1:
            raise ModelError(f"ConvNet depth must be at least 1, got {depth}.")
        if min(height, width_px) < 2**depth:
            raise ModelError(
                f"ConvNet of depth {depth} halves the image {depth} times, which needs inputs of at least "
                f"{2**depth}x{2**depth} pixels, but the data is {height}x{width_px}; use a smaller --depth."
            )
        layers: list[nn.Module] = []
        in_channels = channels
        for _ in range(depth):
            layers += [
                nn.Conv2d(in_channels, width, kernel_size=3, padding=1),
                nn.GroupNorm(width, width, affine=True),
                nn.ReLU(),
                AvgPool2x2(),
            ]
            in_channels = width
            height, width_px = height // 2, width_px // 2
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(width * height * width_px, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


class MLP(nn.Module):
    """Fully connected ReLU network on flattened inputs (``depth`` hidden layers of ``width`` units)."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, width: int = 128, depth: int = 2) -> None:
        super().__init__()
        if depth < 0:
            raise ModelError(f"MLP depth must be at least 0, got {depth}.")
        in_features = input_shape[0] * input_shape[1] * input_shape[2]
        layers: list[nn.Module] = [nn.Flatten()]
        for _ in range(depth):
            layers += [nn.Linear(in_features, width), nn.ReLU()]
            in_features = width
        layers.append(nn.Linear(in_features, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@dataclass(frozen=True)
class ModelSpec:
    """What is needed to rebuild a model from a run directory (no pickled objects)."""

    arch: str
    input_shape: tuple[int, int, int]
    num_classes: int
    width: int
    depth: int


def default_depth(arch: str, input_shape: tuple[int, int, int]) -> int:
    """The paper's depth 3 for a ConvNet, fewer for small images so that blocks still see 2x2 pixels or more.

    8x8 digits get depth 2 (8 -> 4 -> 2); 28x28 and 32x32 images get 3. An MLP gets two hidden layers.
    """
    if arch != "convnet":
        return 2
    size = min(input_shape[1], input_shape[2])
    depth = 0
    while depth < 3 and size // 2 >= 2:
        size //= 2
        depth += 1
    return max(depth, 1)


# torch's global generator draws a model's initial values: one model at a time takes it (fedaudit.train in threads)
_GLOBAL_GENERATOR = threading.RLock()


def build_model(spec: ModelSpec) -> nn.Module:
    """Build the model described by ``spec`` with PyTorch's default initialisation, drawn from torch's global
    generator, whose state is put back afterwards (a notebook's own torch.manual_seed keeps its stream) and which no
    other thread's model draws from meanwhile (:func:`seeded_model` seeds it)."""
    with _GLOBAL_GENERATOR, torch.random.fork_rng(devices=[]):
        return _built(spec)


def seeded_model(spec: ModelSpec, seed: int) -> nn.Module:
    """:func:`build_model` with torch's global generator seeded by ``seed`` for its initialisation alone: the same
    model in every thread, and the caller's generator left as it was."""
    with _GLOBAL_GENERATOR, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _built(spec)


def _built(spec: ModelSpec) -> nn.Module:
    if spec.width < 1:
        raise ModelError(f"Model width must be at least 1, got {spec.width}.")
    if spec.arch == "convnet":
        return ConvNet(spec.input_shape, spec.num_classes, width=spec.width, depth=spec.depth)
    if spec.arch == "mlp":
        return MLP(spec.input_shape, spec.num_classes, width=spec.width, depth=spec.depth)
    if ":" in spec.arch:
        return _user_model(spec)
    known = ", ".join(ARCHITECTURES)
    raise ModelError(f"Unknown model '{spec.arch}'; choose one of: {known}, or your own as package.module:factory.")


def is_user_model(arch: str) -> bool:
    """Whether ``arch`` names a user's factory (``package.module:factory``)."""
    return ":" in arch


def _user_model(spec: ModelSpec) -> nn.Module:
    """The model the user's factory returns for the spec's input shape and classes, checked to be trainable here."""
    arch = spec.arch
    if not _FACTORY.match(arch):
        raise ModelError(f"--model {arch!r} must be package.module:factory (a Python module path and a function).")
    module_name, factory_name = arch.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelError(
            f"--model {arch}: cannot import {module_name} ({exc}); put the folder that holds it on PYTHONPATH."
        ) from exc
    except (Exception, SystemExit) as exc:  # the user's module: an error or an exit at import is bad input
        raise ModelError(f"--model {arch}: importing {module_name} raised {_said(exc)}") from exc
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ModelError(f"--model {arch}: {module_name} has no function {factory_name}.")
    try:
        model = factory(tuple(spec.input_shape), spec.num_classes)
    except (Exception, SystemExit) as exc:  # the user's code: any failure, exits included, is theirs to fix
        raise ModelError(f"--model {arch}: the factory raised {_said(exc)}") from exc
    if not isinstance(model, nn.Module):
        raise ModelError(f"--model {arch}: the factory returned a {type(model).__name__}, not a torch.nn.Module.")
    for name, layer in model.named_modules():
        tracks = isinstance(layer, nn.modules.batchnorm._BatchNorm) or (
            isinstance(layer, nn.modules.instancenorm._InstanceNorm) and layer.track_running_stats
        )
        if tracks:
            raise ModelError(
                f"--model {arch}: layer {name!r} ({type(layer).__name__}) mixes the records of a batch and keeps "
                "running statistics that are not federated, so one record's gradient cannot be bounded; replace it "
                "with nn.GroupNorm (as Opacus' ModuleValidator.fix does)."
            )
    if not any(p.requires_grad for p in model.parameters()):
        raise ModelError(f"--model {arch}: the factory's model has no trainable parameters.")
    _dry_run(model, spec)
    return model


def _said(exc: BaseException) -> str:
    """An exception of the user's code in a few words: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _dry_run(model: nn.Module, spec: ModelSpec) -> None:
    """Two zero records through the user's model before any training: it must take the data's input shape and give
    one output per class (a model with more outputs than classes would train without a word and mislabel every
    record). In eval mode and without gradients, so no random number is drawn and nothing is learnt."""
    training = model.training
    records = torch.zeros(2, *spec.input_shape)
    try:
        model.eval()
        with torch.no_grad():
            output = model(records)
    except (Exception, SystemExit) as exc:
        raise ModelError(
            f"--model {spec.arch}: the factory's model does not take records of shape {tuple(spec.input_shape)} "
            f"({_said(exc)})."
        ) from exc
    finally:
        model.train(training)
    if not isinstance(output, torch.Tensor) or tuple(output.shape) != (2, spec.num_classes):
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise ModelError(
            f"--model {spec.arch}: the factory's model gives output {shape} for 2 records, but the data has "
            f"{spec.num_classes} classes: it must return one logit per class, shape (2, {spec.num_classes})."
        )


def num_parameters(model: nn.Module) -> int:
    """Number of trainable scalars in ``model``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def inert_parameters(model: nn.Module) -> frozenset[str]:
    """Names of the parameters that cannot change ``model``'s output: the bias of a convolution whose output goes
    straight into a normalisation of each channel on its own (GroupNorm with one group per channel, InstanceNorm),
    inside an ``nn.Sequential``.

    The normalisation subtracts each channel's mean, and with it any constant added to the channel, so such a
    bias has a zero gradient for every input. Computed in floating point that gradient is rounding noise
    (about 1e-8 in float32), which gradient matching must leave out: its cosine with anything is noise.
    """
    inert: set[str] = set()
    for prefix, module in model.named_modules():
        if type(module).forward is not nn.Sequential.forward:  # a chain only when Sequential's own forward runs
            continue
        children = list(module.named_children())
        for (name, layer), (_, following) in zip(children, children[1:]):
            if isinstance(layer, nn.Conv2d) and layer.bias is not None and _normalises_each_channel(following, layer):
                inert.add(f"{prefix}.{name}.bias" if prefix else f"{name}.bias")
    return frozenset(inert)


def _normalises_each_channel(module: nn.Module, conv: nn.Conv2d) -> bool:
    """Whether ``module`` subtracts the mean of each of ``conv``'s output channels over its positions."""
    if isinstance(module, nn.GroupNorm):
        return module.num_groups == module.num_channels == conv.out_channels
    return (
        isinstance(module, nn.InstanceNorm2d)
        and not module.track_running_stats  # with running statistics it would not subtract the instance's mean
        and module.num_features == conv.out_channels
    )


def initial_params(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """The global model of round 0 of a run with ``seed`` (its parameters in the model's order): training starts
    from it, and an audit of round 1 differentiates at it."""
    model = seeded_model(spec, derive_seed(seed, Stream.INIT))
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def fresh_params(
    model: nn.Module, like: dict[str, torch.Tensor], generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """A newly initialised network drawn from ``generator`` (PyTorch's default ranges: U(+-1/sqrt(fan_in)) for
    convolution and linear weights and biases, 1 and 0 for normalisation layers); thread-safe, unlike a reseeded
    global generator."""
    params: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if not own:
            continue
        weight = own.get("weight")
        is_norm = isinstance(module, (nn.GroupNorm, nn.LayerNorm, nn.BatchNorm2d, nn.InstanceNorm2d))
        for name, p in own.items():
            full = f"{prefix}.{name}" if prefix else name
            if is_norm:
                params[full] = torch.ones_like(p) if name == "weight" else torch.zeros_like(p)
                continue
            fan_in = weight[0].numel() if weight is not None and weight.dim() > 1 else p.numel()
            bound = 1.0 / math.sqrt(max(1, fan_in))
            draw = torch.rand(p.shape, generator=generator, device=generator.device, dtype=p.dtype)
            params[full] = ((2 * draw - 1) * bound).to(p.device)
    return {name: params[name].to(like[name].device, like[name].dtype) for name in like}
