"""Per-sample gradient norms and clipped sums layer by layer (fast gradient clipping, ghost norms).

The DP primitive needs, for a batch, each example's gradient norm and the sum of the clipped gradients
sum_i f_i g_i, f_i = min(1, C / ||g_i||). Neither needs every per-sample gradient of the whole model at once:

1. One forward pass of the batch records each parameterised layer's input a; one backward pass of the summed
   per-example losses to the layer *outputs* gives each example's output gradient b_i at every layer (the
   per-example loss only touches its own row, so the batch backward is every example's backward at once). Each
   layer's b is taken by a hook on its output as the backward computes it, and its norms at once; a layer whose
   per-sample gradients are then kept drops a and b before the backward goes on.
2. A layer's per-sample gradient is a function of (a_i, b_i) alone. Linear on [B, d]: b_i a_i^T, whose norm is
   ||a_i|| ||b_i||. Conv2d: b_i U_i^T with U_i [D, T] the unfolded input and b_i [P, T] (T positions); its squared
   norm is taken either directly (a convolution weight gradient with the examples of a chunk as groups), or by
   the ghost-norm identity ||b_i U_i^T||^2 = <U_i^T U_i, b_i^T b_i> when the two T x T Gram matrices cost fewer
   multiply-adds than the gradient: T (D + P) < P D (Bu et al.'s mixed ghost norm, with the cost in time rather
   than memory).
   GroupNorm's per-sample gradients are [B, C] (from its own backward kernel and the statistics its forward
   saved) and are kept. Any other layer: its own parameters' per-sample gradients by vmap over the layer alone
   (the fallback).
3. The clipped sum of a layer is its ordinary batch weight gradient with b_i scaled by f_i: for Linear a matrix
   product, for Conv2d the convolution's weight gradient, for kept per-sample gradients a weighted sum. This is
   the weighted second backward of fast gradient clipping, restricted to the weight gradients it needs. A
   convolution whose per-sample gradients are too large to keep for the whole batch is streamed instead: taken
   chunk by chunk and weighed as soon as the chunk's norms are known (book-keeping, Bu et al. 2023), so that
   each per-sample gradient is computed once.

A model this cannot follow (a parameterised layer called twice, a parameter used outside its layer's forward)
raises :class:`Untraceable`; the primitive then takes the whole-model vmap path. A layer output changed in place
later (an in-place ReLU) is followed: each output's hook and gradient edge are taken as the layer returns.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.func import functional_call, grad, vmap

TensorDict = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

CHUNK_ELEMENTS = 1 << 24
"""At most this many floats of one layer's per-sample gradients exist at once (64 MB in float32)."""
GROUPED_ELEMENTS = 1_310_720
GROUPED_CHUNK = 64
"""Per-sample convolution gradients are taken for at most GROUPED_CHUNK examples and GROUPED_ELEMENTS floats at a
time: on one CPU thread, chunks whose gradients fit in cache ran up to twice as fast as the whole batch. Measured
(docs/performance.md): a width-128 ConvNet's middle convolution (147,456 weights) was fastest 6-10 examples at a
time (8 here; 14, the previous bound's, was 15% slower at batch 16), a width-32 one (9,216 weights) 64 at a time."""
PATCH_INPUTS = 36
"""On the CPU, a convolution with at most this many inputs per output channel (C_in x kernel: a 3x3 first layer on
1 to 4 channels) takes its per-sample weight gradients as one batched matrix product of its unfolded input and its
output gradients, not as a grouped convolution, whose oneDNN kernel is slow with so few channels a group. Measured
(benchmarks/first_layer.py, AVX-512 EPYC, one thread, width 32, batch 16): 0.33 ms against 0.67 on one channel of
28x28, 0.90 against 2.54 on three of 32x32, 1.07 against 1.89 on four; on eight channels the product was the slower
(1.84 against 1.40); at width 128 the two are within 5-25%."""
GPU_ELEMENTS = 1 << 27
"""On a GPU, at most this many floats of one layer's per-sample gradients (512 MB in float32), and no cache-sized
chunks: there every chunk costs kernel launches (and a streamed chunk a read-back of its norms) while the device
idles. On an H200 at batch 256 the CPU's bounds made the step 2.58 times slower at width 128 (20.7 ms against 8.0)
and 1.30 times at width 32 (docs/performance.md)."""


def _limits(t: torch.Tensor) -> tuple[int, int, int]:
    """(CHUNK_ELEMENTS, GROUPED_ELEMENTS, GROUPED_CHUNK) for a batch on the CPU; GPU_ELEMENTS for the first two and
    no bound on examples on any other device."""
    if t.device.type == "cpu":
        return CHUNK_ELEMENTS, GROUPED_ELEMENTS, GROUPED_CHUNK
    return GPU_ELEMENTS, GPU_ELEMENTS, GPU_ELEMENTS


class Untraceable(Exception):
    """The model uses its parameters in a way the layer-wise path cannot follow."""


@dataclass
class LayerTrace:
    """One parameterised layer in one batch: its input and its per-example output gradients."""

    module: nn.Module
    names: dict[str, str]
    """The layer's own trainable parameters: local name -> name in the params dict."""
    inputs: torch.Tensor
    output_grads: torch.Tensor
    stats: tuple[torch.Tensor, torch.Tensor] | None = None
    """A GroupNorm's per-example group means and inverse deviations, [N, groups] each, from its forward."""
    streamed: bool = False
    """A convolution whose per-sample weight gradients are too large to keep for the whole batch: they are taken
    chunk by chunk, with every streamed layer's at once, and weighed as soon as the chunk's norms are known
    (:func:`streamed_chunks`), instead of taken once for the norms and a weight gradient after."""
    kept: list[TensorDict] = field(default_factory=list)
    """Per-sample gradients that were materialised anyway (small layers, fallback layers), by local name: chunks
    of consecutive examples [n, *shape] in batch order (a convolution's come chunk by chunk, and are not copied
    into one tensor)."""

    def release(self) -> None:
        """Drop the input and output gradient once the kept per-sample gradients are all the sum needs."""
        self.inputs = self.inputs.new_empty((0,))
        self.output_grads = self.output_grads.new_empty((0,))


def trace_layers(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    params: Mapping[str, torch.Tensor],
    loss_fn: LossFn,
    visit: Callable[[LayerTrace], None] | None = None,
) -> list[LayerTrace]:
    """Forward and backward of the batch at ``params``: every parameterised layer's input and output gradients.

    ``loss_fn`` is a mean over examples (as ``F.cross_entropy``); it is multiplied by the batch size so that the
    output gradients are those of each example's own loss. ``visit`` is called on each layer's trace as soon as
    its output gradient arrives, inside the backward pass; a layer whose per-sample gradients it kept (and did not
    stream) then drops its input and output gradient at once, instead of holding them to the end of the backward
    (at width 128, batch 256, about 300 of the 430 MB the traces held).
    """
    owners = _owners(model, frozenset(params))
    traces = _trace(model, x, y, params, loss_fn, owners, visit, every_output=_MANY_ROOTS.get(model, False))
    if traces is None:  # a layer the first one's gradient does not pass through: ask for every layer's output
        _MANY_ROOTS[model] = True
        traces = _trace(model, x, y, params, loss_fn, owners, visit, every_output=True)
    assert traces is not None
    return traces


_MANY_ROOTS: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
"""Models whose first traced layer is not upstream of every other (branches): their backward asks for every
traced layer's output gradient, not only the first's."""


def _trace(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    params: Mapping[str, torch.Tensor],
    loss_fn: LossFn,
    owners: dict[str, tuple[nn.Module, dict[str, str]]],
    visit: Callable[[LayerTrace], None] | None,
    *,
    every_output: bool,
) -> list[LayerTrace] | None:
    """:func:`trace_layers` by one forward and one backward. As each traced layer returns, a hook on its output
    is registered to take the output gradient as the backward computes it, and the output's gradient edge is kept
    where the backward is to ask for it: the first traced layer's alone (every other layer's lies on its way in a
    chain of layers) unless ``every_output``. No layer output is held past its own use in the forward: holding
    them cost about a tenth of a small DP step's forward (their memory is not reused). Hook and edge are taken
    before anything after the layer runs, so an output changed in place later (an in-place ReLU) still gives the
    gradient of the layer's own output. None when some layer's gradient did not arrive that way (the caller then
    asks for every output)."""
    inputs: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple[torch.Size, torch.dtype, torch.device]] = {}
    stats: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {}
    traces: dict[str, LayerTrace] = {}
    roots: list[GradientEdge] = []

    def arrived(prefix: str) -> Callable[[torch.Tensor], None]:
        def hook(g: torch.Tensor) -> None:
            module, names = owners[prefix]
            layer = LayerTrace(module, names, inputs.pop(prefix), g.detach(), stats=stats.get(prefix))
            traces[prefix] = layer
            if visit is not None:
                visit(layer)
                if layer.kept and not layer.streamed:
                    layer.release()

        return hook

    def returned(prefix: str, layer_input: torch.Tensor, output: torch.Tensor) -> None:
        module = owners[prefix][0]
        inputs[prefix] = layer_input
        shapes[prefix] = (output.shape, output.dtype, output.device)
        if isinstance(module, nn.GroupNorm):
            stats[prefix] = _group_stats(output, module)
        if not output.requires_grad:
            return
        if every_output or len(shapes) == 1:  # a root: its node does not run, its gradient is captured
            output.register_hook(arrived(prefix))
            roots.append(get_gradient_edge(output))
        else:
            _on_gradient(output, arrived(prefix))

    out = _recorded_forward(model, x, params, owners, returned)
    if set(shapes) != set(owners):
        raise Untraceable("some parameters are used outside their layer's forward")
    with torch.enable_grad():
        total = loss_fn(out, y) * x.shape[0]
    del out
    if roots:
        torch.autograd.grad(total, roots, allow_unused=True)
    roots.clear()  # the edges hold the graph: it goes with the loss
    del total
    prefixes = list(shapes)
    missing = [p for p in prefixes if p not in traces]
    if missing and not every_output:
        return None
    for prefix in missing:  # a layer the loss does not depend on: its output gradient is zero
        shape, dtype, device = shapes[prefix]
        arrived(prefix)(torch.zeros(shape, dtype=dtype, device=device))
    return [traces[p] for p in prefixes]


def _on_gradient(output: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
    """Have ``hook`` called with ``output``'s gradient when the backward runs the node that made ``output`` (not
    at all if no gradient reaches it): a pre-hook on that node, taken now, so that an in-place change of ``output``
    later does not move it. The same gradient as ``Tensor.register_hook``'s, without its handle and hook dictionary
    (about 5 us a layer); a leaf (no node) takes the tensor hook. Not for a root of the backward, whose node does
    not run."""
    node = output.grad_fn
    if node is None:
        output.register_hook(hook)
        return
    index = output.output_nr

    def prehook(grads: tuple[torch.Tensor | None, ...]) -> None:
        if grads[index] is not None:
            hook(grads[index])

    node.register_prehook(prehook)


def _recorded_forward(
    model: nn.Module,
    x: torch.Tensor,
    params: Mapping[str, torch.Tensor],
    owners: dict[str, tuple[nn.Module, dict]],
    returned: Callable[[str, torch.Tensor, torch.Tensor], None],
) -> torch.Tensor:
    """The model's output at ``params``; ``returned(prefix, its input detached, its output)`` is called as each
    traced layer returns, in call order."""
    called: set[str] = set()

    def recorded(prefix: str, forward: Callable[..., object]) -> Callable[..., object]:
        def forward_recorded(*args: object, **kwargs: object) -> object:
            output = forward(*args, **kwargs)
            if prefix in called:
                raise Untraceable(f"layer {prefix!r} is called more than once")
            if len(args) != 1 or not isinstance(args[0], torch.Tensor) or not isinstance(output, torch.Tensor):
                raise Untraceable(f"layer {prefix!r} does not map one tensor to one tensor")
            called.add(prefix)
            returned(prefix, args[0].detach(), output)
            return output

        return forward_recorded

    # Each layer's forward is wrapped on the instance for the pass (its own ``forward`` attribute, put back after):
    # forward hooks cost about 4 times as much a step (7 hooks: 60 us against 13 on a tiny ConvNet).
    previous = [(module, module.__dict__.get("forward")) for module, _ in owners.values()]
    try:
        for prefix, (module, _) in owners.items():
            module.__dict__["forward"] = recorded(prefix, module.forward)
        with torch.enable_grad():
            if _own_parameters(params, owners):  # no parameter swapping: about 5% of a small DP step
                out = model(x)
            else:
                leaves = {name: p.detach().requires_grad_(True) for name, p in params.items()}
                out = functional_call(model, (leaves, dict(model.named_buffers())), (x,))
    finally:
        for module, forward in previous:
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = forward
    return out


def _group_stats(output: torch.Tensor, module: nn.GroupNorm) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The mean and inverse deviation [N, groups] that a GroupNorm's forward saved for its backward (read before
    the backward frees them), or None where autograd holds them under other names (they are then recomputed)."""
    node = output.grad_fn
    mean, rstd = getattr(node, "_saved_result1", None), getattr(node, "_saved_result2", None)
    expected = (output.shape[0], module.num_groups)
    if not (isinstance(mean, torch.Tensor) and isinstance(rstd, torch.Tensor)):
        return None
    if mean.shape != expected or rstd.shape != expected:
        return None
    return mean.detach(), rstd.detach()


def _own_parameters(
    params: Mapping[str, torch.Tensor], owners: Mapping[str, tuple[nn.Module, Mapping[str, str]]]
) -> bool:
    """Whether ``params`` are the model's own trainable parameters (or detached views of them), so that the forward
    pass can run the model as it is: each is the tensor its owning layer holds (``owners``, :func:`_owners`), and
    every one has an owner. Read from the layers' own parameters, not by a walk of the model (21 us against 51 on
    a ConvNet). Only the layer outputs' gradients are asked for, so the parameters' ``.grad`` is left untouched
    either way."""
    owned = 0
    for module, local in owners.values():
        for name, full in local.items():
            mine, value = module._parameters.get(name), params[full]
            if (
                mine is None
                or not mine.requires_grad
                or mine.data_ptr() != value.data_ptr()
                or mine.shape != value.shape
                or mine.stride() != value.stride()
                or mine.dtype != value.dtype
                or mine.device != value.device
            ):
                return False
        owned += len(local)
    return owned == len(params)


_Edge = tuple["weakref.ref[nn.Module]", str, "weakref.ref[nn.Module]"]
_OWNERS: weakref.WeakKeyDictionary[
    nn.Module, dict[frozenset[str], tuple[dict[str, tuple[weakref.ref[nn.Module], dict[str, str]]], tuple[_Edge, ...]]]
] = weakref.WeakKeyDictionary()
"""Per model and set of parameter names, the layers that own them and every (parent, name, child) step of the paths
from the model to them, held by weak references: a model whose own parameters are at its top (its prefix is "") is
one of its layers, and must not keep its own entry alive."""


def _owners(model: nn.Module, names: frozenset[str]) -> dict[str, tuple[nn.Module, dict[str, str]]]:
    """The layers that own the parameters ``names``: prefix -> (layer, its local name -> params-dict name). Kept per
    model and set of names, since walking the modules on every DP step cost about 3% of a small step; the kept ones
    are used while every step of the paths to them still holds the same child (what ``get_submodule`` would find:
    3 us against 26 for a ConvNet)."""
    by_names = _OWNERS.setdefault(model, {})
    known = by_names.get(names)
    if known is not None:
        layers, edges = known
        if all(_holds(parent(), name, child()) for parent, name, child in edges):
            return {prefix: (layer(), local) for prefix, (layer, local) in layers.items()}
    found = {}
    for prefix, module in model.named_modules():
        local = {
            name: f"{prefix}.{name}" if prefix else name
            for name, _ in module.named_parameters(recurse=False)
            if (f"{prefix}.{name}" if prefix else name) in names
        }
        if local:
            found[prefix] = (module, local)
    edges: dict[tuple[int, str], _Edge] = {}
    for prefix in found:
        parent = model
        for name in prefix.split(".") if prefix else []:
            child = parent.get_submodule(name)
            edges[(id(parent), name)] = (weakref.ref(parent), name, weakref.ref(child))
            parent = child
    layers = {prefix: (weakref.ref(module), local) for prefix, (module, local) in found.items()}
    by_names[names] = (layers, tuple(edges.values()))
    return found


def _holds(parent: nn.Module | None, name: str, child: nn.Module | None) -> bool:
    """Whether ``parent`` (alive) holds the live module ``child`` as its submodule ``name``."""
    return parent is not None and child is not None and parent._modules.get(name) is child


def layer_sq_norms(layer: LayerTrace, params: Mapping[str, torch.Tensor], *, for_sum: bool = True) -> TensorDict:
    """Squared per-sample gradient norm of each of the layer's parameters, shape [B] each, by params-dict name.

    ``for_sum``: a clipped sum follows, so per-sample gradients that are cheap to hold are kept for it.
    """
    module, a, b = layer.module, layer.inputs, layer.output_grads
    if isinstance(module, nn.Linear):
        local = _linear_sq_norms(a, b)
    elif isinstance(module, nn.Conv2d) and _plain_conv(module):
        rules = _conv_rules(module, a, b, keep=for_sum)
        layer.streamed = for_sum and "weight" in layer.names and rules.streams
        if layer.streamed:  # the weight's norms come with its chunks
            return {layer.names["bias"]: b.flatten(2).sum(2).pow(2).sum(1)} if "bias" in layer.names else {}
        local, layer.kept = _conv2d_sq_norms(module, a, b, keep=for_sum, rules=rules)
    else:
        grads = (
            _group_norm_grads(module, a, b, layer.stats)
            if isinstance(module, nn.GroupNorm)
            else _fallback_grads(layer, params)
        )
        layer.kept = [grads]
        local = {name: g.flatten(1).pow(2).sum(1) for name, g in grads.items()}
    return {layer.names[name]: local[name] for name in layer.names}


def layer_weighted_sums(layer: LayerTrace, factors: torch.Tensor) -> TensorDict:
    """sum_i factors_i g_i for each of the layer's parameters (the clipped sum when factors are the clip factors)."""
    module, a, b = layer.module, layer.inputs, layer.output_grads
    if layer.kept:
        local, start, batch = {}, 0, factors.shape[0]
        for chunk in layer.kept:
            n = next(iter(chunk.values())).shape[0]
            f = (factors if n == batch else factors[start : start + n]).view(1, n)
            for name, g in chunk.items():
                weights = f if f.dtype == g.dtype else f.to(g.dtype)
                part = torch.mm(weights, g.reshape(n, -1)).view(g.shape[1:])  # what f @ g computes, in fewer calls
                local[name] = local[name] + part if name in local else part
            start += n
    elif isinstance(module, nn.Linear):
        scaled = b * factors.view(-1, *([1] * (b.dim() - 1)))
        flat_a, flat_b = a.reshape(-1, a.shape[-1]), scaled.reshape(-1, scaled.shape[-1])
        local = {"weight": flat_b.T @ flat_a, "bias": flat_b.sum(0)}
    else:
        scaled = b * factors.view(-1, 1, 1, 1)
        weight = torch.nn.grad.conv2d_weight(
            a, module.weight.shape, scaled, module.stride, module.padding, module.dilation, module.groups
        )
        local = {"weight": weight, "bias": scaled.sum((0, 2, 3))}
    return {layer.names[name]: local[name] for name in layer.names}


def _linear_sq_norms(a: torch.Tensor, b: torch.Tensor) -> TensorDict:
    batch = a.shape[0]
    a3, b3 = a.reshape(batch, -1, a.shape[-1]), b.reshape(batch, -1, b.shape[-1])
    return {"weight": _outer_sum_sq_norms(a3, b3), "bias": b3.sum(1).pow(2).sum(1)}


def _conv2d_sq_norms(
    module: nn.Conv2d, a: torch.Tensor, b: torch.Tensor, *, keep: bool, rules: ConvRules | None = None
) -> tuple[TensorDict, list[TensorDict]]:
    """Squared per-sample norms of a convolution's weight and bias, and the per-sample gradients where a sum
    follows and they are small enough to keep: then the clipped sum is a weighted sum of them. The ghost norm is
    taken where nothing is kept and it is cheaper, and also instead of keeping where it costs less than half the
    per-sample gradients (its clipped sum is a second weight gradient; measured in docs/performance.md: at width
    128 the 7x7 layer's ghost norm is the faster, at widths 64 and 256 the 14x14 one's kept gradients)."""
    batch = a.shape[0]
    rules = rules or _conv_rules(module, a, b, keep=keep)
    bias = b.flatten(2).sum(2)
    keep, chunk = rules.keep, rules.chunk
    if rules.ghost_only:
        return {"weight": _conv2d_ghost_sq_norms(module, a, b), "bias": bias.pow(2).sum(1)}, []
    squares, kept = [], []
    for start in range(0, batch, chunk):
        grads = _per_sample_conv2d_weight(module, a[start : start + chunk], b[start : start + chunk])
        squares.append(torch.linalg.vector_norm(grads.flatten(1), dim=1).pow(2))
        if keep:
            kept.append({"weight": grads, "bias": bias[start : start + chunk]})
    norms = {"weight": torch.cat(squares) if len(squares) > 1 else squares[0], "bias": bias.pow(2).sum(1)}
    return norms, kept


class ConvRules(NamedTuple):
    """How a convolution's per-example norms are taken for one batch shape (:func:`_conv_rules`)."""

    streams: bool
    """Before a clipped sum, its per-sample weight gradients are too large to keep for the whole batch and the ghost
    norm is not cheaper: they are streamed (:func:`streamed_chunks`)."""
    keep: bool
    """Its per-sample gradients are kept for the clipped sum."""
    ghost_only: bool
    """Its weight's norms are ghost norms, nothing is kept (the clipped sum is a second weight gradient)."""
    chunk: int
    """Examples a grouped per-sample convolution takes at once (:func:`_grouped_chunk`)."""


_CONV_RULES: dict[tuple, ConvRules] = {}


def _conv_rules(module: nn.Conv2d, a: torch.Tensor, b: torch.Tensor, *, keep: bool) -> ConvRules:
    """The cost rules of :func:`_conv2d_sq_norms` and of streaming for this layer and batch shape (``keep``: a
    clipped sum follows), worked out once per shape and the rules' current bounds: working them out took about 14 us
    a layer on every DP step (a query has three convolutions at most shapes)."""
    weight = module.weight
    key = (weight.shape, module.groups, tuple(a.shape), tuple(b.shape[2:]), a.device.type, keep)
    key += (CHUNK_ELEMENTS, GROUPED_ELEMENTS, GROUPED_CHUNK, GPU_ELEMENTS, uses_ghost_norm)
    rules = _CONV_RULES.get(key)
    if rules is not None:
        return rules
    positions, d, p = _conv_sizes(module, b)
    ghost = uses_ghost_norm(positions, d, p)
    fits = a.shape[0] * weight.numel() <= _limits(a)[0]
    kept = keep and fits and not (ghost and uses_ghost_norm(2 * positions, d, p))
    rules = ConvRules(keep and not fits and not ghost, kept, not kept and ghost, _grouped_chunk(module, a))
    if len(_CONV_RULES) < 4096:  # a few shapes a run (Poisson batches of a few dozen sizes); a bound all the same
        _CONV_RULES[key] = rules
    return rules


def _conv_sizes(module: nn.Conv2d, b: torch.Tensor) -> tuple[int, int, int]:
    """A convolution's T output positions, D inputs per output channel (C_in / groups x kernel) and P outputs per
    group, for the cost rules (:func:`uses_ghost_norm`) and the Gram matrices."""
    positions = b.shape[2] * b.shape[3]
    return positions, math.prod(module.weight.shape[1:]), module.weight.shape[0] // module.groups


def _conv2d_ghost_sq_norms(module: nn.Conv2d, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The ghost norm of a convolution's per-sample weight gradients, over chunks of examples whose unfolded
    inputs take at most GROUPED_ELEMENTS floats: a whole batch's (58 MB at width 128, batch 256, 7x7) would be
    fresh memory, and a page fault per page, on every step. Without groups the unfolded inputs and the output
    gradients enter the Gram matrices as transposed views, not copies."""
    batch, groups = a.shape[0], module.groups
    positions, d, p = _conv_sizes(module, b)
    chunk = max(1, _limits(a)[1] // (groups * d * positions))
    parts = []
    for start in range(0, batch, chunk):
        ac, bc = a[start : start + chunk], b[start : start + chunk]
        n = ac.shape[0]
        unfolded = unfold_input(module, ac)
        if groups == 1:
            a3, b3 = unfolded.transpose(1, 2), bc.flatten(2).transpose(1, 2)
        else:
            a3 = unfolded.view(n, groups, d, positions).transpose(2, 3).reshape(n * groups, positions, d)
            b3 = bc.reshape(n, groups, p, positions).transpose(2, 3).reshape(n * groups, positions, p)
        parts.append(_outer_sum_sq_norms(a3, b3).view(n, groups).sum(1))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def unfold_input(module: nn.Conv2d, a: torch.Tensor, *, copies: bool | None = None) -> torch.Tensor:
    """The convolution's input patches [N, D, T], as ``F.unfold`` gives them. On a GPU (or with ``copies``) by a pad
    and one copy of a strided view: CUDA's unfold launches a kernel per example (256 at batch 256, most of a
    width-128 step's launches), the copy one. Same values either way (they are copies of the input)."""
    dilation = tuple(module.dilation)
    if copies is None:
        copies = a.device.type != "cpu"
    if not copies or dilation != (1, 1):
        return F.unfold(a, module.kernel_size, dilation=module.dilation, padding=module.padding, stride=module.stride)
    (kh, kw), (sh, sw), (ph, pw) = module.kernel_size, module.stride, module.padding
    patches = F.pad(a, (pw, pw, ph, ph)).unfold(2, kh, sh).unfold(3, kw, sw)  # [N, C, H', W', kh, kw], a view
    n, channels, rows, cols = patches.shape[:4]
    return patches.permute(0, 1, 4, 5, 2, 3).reshape(n, channels * kh * kw, rows * cols)


def streamed_chunks(layers: list[LayerTrace]) -> Iterator[tuple[int, int, list[LayerTrace]]]:
    """The streamed layers' per-sample gradients, chunk by chunk of consecutive examples: (start, stop, each
    layer's trace of the chunk, its per-sample weight and bias gradients kept). At most GROUPED_CHUNK examples a
    chunk, and GROUPED_ELEMENTS floats of the largest layer's gradients, as for one layer."""
    batch = layers[0].inputs.shape[0]
    chunk = min(_grouped_chunk(layer.module, layer.inputs) for layer in layers)
    for start in range(0, batch, chunk):
        stop = min(batch, start + chunk)
        parts = []
        for layer in layers:
            a, b = layer.inputs[start:stop], layer.output_grads[start:stop]
            grads = {"weight": _per_sample_conv2d_weight(layer.module, a, b), "bias": b.flatten(2).sum(2)}
            parts.append(LayerTrace(layer.module, layer.names, a, b, kept=[grads]))
        yield start, stop, parts


def _grouped_chunk(module: nn.Conv2d, a: torch.Tensor) -> int:
    """How many examples' per-sample weight gradients of ``module`` are taken at once (GROUPED_CHUNK and
    GROUPED_ELEMENTS on the CPU, :func:`_limits`)."""
    _, grouped, examples = _limits(a)
    return max(1, min(examples, grouped // module.weight.numel()))


def _per_sample_conv2d_weight(module: nn.Conv2d, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each example's weight gradient, [n, *weight.shape]: one convolution weight gradient with the examples as
    groups (the batch folded into the channels), which the CPU and GPU convolution kernels do fast; on the CPU, a
    convolution with at most PATCH_INPUTS inputs per output (a first layer's: 1 to 4 channels, 3x3) by one batched
    product of its patches [n, D, T] with its output gradients (:data:`PATCH_INPUTS`)."""
    n = a.shape[0]
    weight = module.weight
    if a.device.type == "cpu" and module.groups == 1 and math.prod(weight.shape[1:]) <= PATCH_INPUTS:
        patches = unfold_input(module, a, copies=True)
        product = torch.bmm(patches, b.flatten(2).transpose(1, 2))  # [n, D, P]
        return product.transpose(1, 2).contiguous().view(n, *weight.shape)
    grads = torch.nn.grad.conv2d_weight(
        a.reshape(1, n * a.shape[1], *a.shape[2:]),
        (n * weight.shape[0], *weight.shape[1:]),
        b.reshape(1, n * b.shape[1], *b.shape[2:]),
        module.stride,
        module.padding,
        module.dilation,
        n * module.groups,
    )
    return grads.view(n, *weight.shape)


def uses_ghost_norm(positions: int, inputs: int, outputs: int) -> bool:
    """Whether the ghost norm (two T x T Gram matrices per example: T^2 (D + P) multiply-adds) costs less than
    the per-sample gradient itself (T P D) for a layer with D inputs and P outputs at each of T positions."""
    return positions * (inputs + outputs) < outputs * inputs


def _outer_sum_sq_norms(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """||sum_t b_t a_t^T||_F^2 per example for a [N, T, D] and b [N, T, P]: the squared norm of a linear map's
    per-sample weight gradient over T positions, by whichever of three exact ways costs least."""
    n, positions, d = a.shape
    p = b.shape[-1]
    if positions == 1:  # an outer product: ||b a^T|| = ||a|| ||b||
        return a.pow(2).sum((1, 2)) * b.pow(2).sum((1, 2))
    ghost = uses_ghost_norm(positions, d, p)
    per_example = positions * positions if ghost else p * d
    chunk = max(1, _limits(a)[0] // per_example)
    parts = []
    for start in range(0, n, chunk):
        ac, bc = a[start : start + chunk], b[start : start + chunk]
        if ghost:
            parts.append((torch.bmm(ac, ac.transpose(1, 2)) * torch.bmm(bc, bc.transpose(1, 2))).sum((1, 2)))
        else:
            parts.append(torch.linalg.vector_norm(torch.bmm(bc.transpose(1, 2), ac), dim=(1, 2)).pow(2))
    return torch.cat(parts)


def fallback_layers(model: nn.Module) -> list[str]:
    """The parameterised layers of ``model`` that the layer-wise query does not compute in closed form (anything but
    Linear, zero-padded Conv2d and GroupNorm), as "name (Type)": their per-example gradients are materialised one
    example at a time (vmap), which costs memory and time in proportion to their parameters times the batch size."""
    found = []
    for name, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        native = isinstance(module, (nn.Linear, nn.GroupNorm)) or (
            isinstance(module, nn.Conv2d) and _plain_conv(module)
        )
        if not native:
            found.append(f"{name or 'the model'!r} ({type(module).__name__})")
    return found


def _plain_conv(module: nn.Conv2d) -> bool:
    return module.padding_mode == "zeros" and not isinstance(module.padding, str)


def _group_norm_grads(
    module: nn.GroupNorm, a: torch.Tensor, b: torch.Tensor, stats: tuple[torch.Tensor, torch.Tensor] | None = None
) -> TensorDict:
    """GroupNorm normalises each example alone, so its affine gradients per example are sums over positions: for
    channel c of group g, sum_t b_t (a_t - mu_g) r_g and sum_t b_t, with the group's mean mu_g and inverse
    deviation r_g (``stats``, from the forward pass, or recomputed). Both come from one pass of GroupNorm's own
    backward kernel over the batch taken as one example whose channels are every example's (groups stay whole)."""
    n, channels, groups = a.shape[0], a.shape[1], module.num_groups
    positions = math.prod(a.shape[2:])
    if stats is None:
        _, mean, rstd = torch.native_group_norm(a, None, None, n, channels, positions, groups, module.eps)
    else:
        mean, rstd = stats
    wide = (1, n * channels, positions)
    _, weight, bias = torch.ops.aten.native_group_norm_backward(
        b.reshape(wide),
        a.reshape(wide),
        mean.reshape(1, n * groups),
        rstd.reshape(1, n * groups),
        a.new_ones(n * channels),
        1,
        n * channels,
        positions,
        n * groups,
        [False, True, True],
    )
    return {"weight": weight.view(n, channels), "bias": bias.view(n, channels)}


def _fallback_grads(layer: LayerTrace, params: Mapping[str, torch.Tensor]) -> TensorDict:
    """The layer's own parameters' per-sample gradients: vmap over the layer of the vector-Jacobian product with
    each example's output gradient. Parameters of sub-layers and buffers stay fixed at their params-dict values."""
    module = layer.module
    own = {local: params[full].detach() for local, full in layer.names.items()}
    prefix = next(iter(layer.names.values()))[: -len(next(iter(layer.names)))]
    fixed = {
        name[len(prefix) :]: value.detach()
        for name, value in params.items()
        if name.startswith(prefix) and name[len(prefix) :] not in own
    }
    fixed.update(dict(module.named_buffers()))

    def contribution(p: TensorDict, ai: torch.Tensor, bi: torch.Tensor) -> torch.Tensor:
        return (functional_call(module, {**fixed, **p}, (ai.unsqueeze(0),)) * bi.unsqueeze(0)).sum()

    return vmap(grad(contribution), in_dims=(None, 0, 0))(own, layer.inputs, layer.output_grads)
