"""Per-record membership signals of a model: loss, confidence, logit-scaled confidence (black-box) and gradient norm
(white-box), computed wherever the records are (by ``fedaudit attack`` here, or at a site that keeps its records).

Black-box signals come from one forward pass per batch without gradient
tracking; the logits are promoted to float64 before the softmax so that the
tiny losses of well-fitted members stay distinct instead of rounding to 0.
The white-box signal is the L2 norm of the per-example gradient of the loss
with respect to all trainable parameters, from the shared DP primitive
(:func:`fedaudit.privacy.primitive.per_sample_sq_norms`, layer by layer) without clipping.
How the audit reads them (orientation, the signal of what crossed the wire) is in
:mod:`fedaudit.attacks.membership.signals`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from fedaudit.privacy.primitive import per_sample_sq_norms, trainable_params

MODEL_SIGNALS: tuple[str, ...] = ("loss", "confidence", "logit-confidence", "grad-norm")
OUTPUT_SIGNALS: tuple[str, ...] = ("loss", "confidence", "logit-confidence")
PER_LAYER_PREFIX = "grad_norm:"


@dataclass(frozen=True)
class Signals:
    """Signal values of a set of records: ``values[name]`` has shape [N]; ``per_layer`` holds extra [N] columns."""

    values: dict[str, np.ndarray]
    per_layer: dict[str, np.ndarray] = field(default_factory=dict)


def output_signals(logits: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Loss, confidence p_y and logit-scaled confidence log p_y - log sum_{y' != y} p_y' of each row, in float64.

    The logit-scaled confidence is computed as z_y - logsumexp_{y' != y} z_y', which is
    exact where p_y is close to 1 (1 - p_y would round to 0).
    """
    z = logits.to(torch.float64)
    z_true = z.gather(1, y.view(-1, 1)).squeeze(1)
    loss = torch.logsumexp(z, dim=1) - z_true
    others = z.scatter(1, y.view(-1, 1), float("-inf"))
    return {"loss": loss, "confidence": torch.exp(-loss), "logit-confidence": z_true - torch.logsumexp(others, dim=1)}


def layer_groups(model: nn.Module) -> dict[str, list[str]]:
    """Trainable parameter names grouped by the module that owns them (a layer's weight and bias together)."""
    groups: dict[str, list[str]] = {}
    for name in trainable_params(model):
        groups.setdefault(name.rpartition(".")[0] or name, []).append(name)
    return groups


def compute_signals(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    signals: Sequence[str],
    *,
    per_layer: bool = False,
    batch_size: int = 64,
    device: str | torch.device = "cpu",
    progress: bool = False,
    desc: str = "signals",
) -> Signals:
    """Compute the requested ``signals`` for the records (x, y) with ``model``, in batches.

    Args:
        model: the audited model; it is put in eval mode.
        x, y: records and labels (any device; batches are moved to ``device``).
        signals: names from :data:`SIGNALS`.
        per_layer: with ``grad-norm``, also the gradient norm of each layer's parameters,
            as columns ``grad_norm:<layer>``.
        batch_size: records per forward pass / per-sample gradient batch.
        progress: show a tqdm bar over records.
    """
    unknown = [s for s in signals if s not in MODEL_SIGNALS]
    if unknown:
        raise ValueError(f"unknown signal {unknown[0]!r}; choose from {', '.join(MODEL_SIGNALS)}")
    model = model.eval().to(device)
    wanted_outputs = [s for s in signals if s in OUTPUT_SIGNALS]
    want_grads = "grad-norm" in signals
    groups = layer_groups(model) if want_grads and per_layer else {}
    params = trainable_params(model)
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in (*signals, *(PER_LAYER_PREFIX + g for g in groups))}
    with tqdm(total=len(y), desc=desc, unit="rec", disable=not progress, leave=False) as bar:
        for xb, yb in _batches(x, y, batch_size, device):
            if wanted_outputs:
                with torch.no_grad():
                    outputs = output_signals(model(xb), yb)
                for name in wanted_outputs:
                    parts[name].append(outputs[name].cpu())
            if want_grads:
                squares = per_sample_sq_norms(model, xb, yb, params=params)
                parts["grad-norm"].append(torch.stack(list(squares.values())).sum(0).sqrt().detach().cpu())
                for group, names in groups.items():
                    parts[PER_LAYER_PREFIX + group].append(
                        torch.stack([squares[n] for n in names]).sum(0).sqrt().detach().cpu()
                    )
            bar.update(len(yb))
    arrays = {name: float64_values(chunks) for name, chunks in parts.items()}
    return Signals(
        values={name: arrays[name] for name in signals},
        per_layer={name: arrays[name] for name in arrays if name.startswith(PER_LAYER_PREFIX)},
    )


def _batches(
    x: torch.Tensor, y: torch.Tensor, batch_size: int, device: str | torch.device
) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    for start in range(0, len(y), batch_size):
        yield x[start : start + batch_size].to(device), y[start : start + batch_size].to(device)


def float64_values(chunks: list[torch.Tensor]) -> np.ndarray:
    """Chunks of per-record values as one float64 array."""
    return torch.cat(chunks).to(torch.float64).numpy() if chunks else np.zeros(0, dtype=np.float64)
