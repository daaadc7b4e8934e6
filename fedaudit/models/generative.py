"""The class-conditional generator that Fedssyn's clients train on their records: a conditional VAE.

Fedssyn's authors use a class-conditional DDPM (1000 diffusion steps, 500 epochs); that costs GPU-days, and a
fedaudit run must train one generator per client on a CPU in minutes. A conditional variational autoencoder
(Sohn et al., 2015) with multilayer perceptrons does: the encoder maps (image, one-hot label) to a Gaussian over a
small latent space, the decoder maps (latent, one-hot label) back to an image, and training minimises each record's
negative evidence lower bound (squared reconstruction error plus ``beta`` times the Kullback-Leibler term). New
records of class c are the decoder's output for latent draws from N(0, I). How good they are is measured, not
assumed: ``benchmarks/generator.py`` trains a classifier on generated records only and tests it on real ones
(docs/algorithms.md has the figures).

Under DP every step is one query of the shared DP primitive (:func:`fedaudit.privacy.primitive.dp_gradient`):
the module's forward returns each record's own loss, with the latent noise of the reparameterisation trick passed
in with the record, so each record's gradient depends on that record alone and is clipped and noised like a
classifier's. The class frequencies that the generated labels follow are a DP query of the same primitive too
(:func:`class_counts`: one-hot per-record gradients of norm 1, so the clipped sum is the histogram).

In a canary run the generator's queries carry the client's canaries too: an input canary is a record of the
generator's data like any other (and is counted), a gradient canary's per-record gradient is ten times the
clipping norm along a fixed random direction in :data:`CANARY_PARAMETERS` (zero in every other parameter, and in
the class counts), and every query is logged where it is released (:mod:`fedaudit.instruments.queries`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fedaudit.privacy.accounting import SGMEvent
from fedaudit.privacy.primitive import QueryRecorder, TensorDict, dp_gradient
from fedaudit.privacy.randomness import Source

BETA = 1.0  # weight of the KL term; the reconstruction term is the squared error of the normalised pixels
# The generator's parameters a gradient canary's direction spans: the encoder's output layer, 12,800 weights and 32
# biases whatever the image size (the whole generator has up to 650,000, too many to hold a direction per canary).
CANARY_PARAMETERS = ("enc_out.weight", "enc_out.bias")
# A new DP query's batch for a sampling rate: (inputs, labels, per-record gradients of the gradient canaries drawn,
# the query's source, which its noise comes from too): ClientData.dp_batch.
BatchDraw = Callable[[float], tuple[torch.Tensor, torch.Tensor, TensorDict | None, Source]]


class ConditionalVAE(nn.Module):
    """A conditional VAE on flattened images; ``forward`` takes packed (image, latent noise, one-hot label) rows
    and returns each row's negative ELBO, so that a batch's mean is the training loss of the DP primitive."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, *, hidden: int = 400, latent: int = 16) -> None:
        super().__init__()
        self.input_shape = tuple(input_shape)
        self.num_classes = num_classes
        self.latent = latent
        self.pixels = math.prod(self.input_shape)
        self.enc1 = nn.Linear(self.pixels + num_classes, hidden)
        self.enc2 = nn.Linear(hidden, hidden)
        self.enc_out = nn.Linear(hidden, 2 * latent)
        self.dec1 = nn.Linear(latent + num_classes, hidden)
        self.dec2 = nn.Linear(hidden, hidden)
        self.dec_out = nn.Linear(hidden, self.pixels)

    def pack(self, x: torch.Tensor, y: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Rows of (flattened image, latent noise, one-hot label): the input of :meth:`forward`."""
        onehot = F.one_hot(y, self.num_classes).to(x.dtype)
        return torch.cat([x.flatten(start_dim=1), noise, onehot], dim=1)

    def decode(self, z: torch.Tensor, onehot: torch.Tensor) -> torch.Tensor:
        """Images [B, *input_shape] for latents ``z`` and one-hot labels."""
        h = F.relu(self.dec1(torch.cat([z, onehot], dim=1)))
        h = F.relu(self.dec2(h))
        return self.dec_out(h).view(-1, *self.input_shape)

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        """Each row's negative ELBO, shape [B, 1]."""
        x, noise, onehot = packed.split([self.pixels, self.latent, self.num_classes], dim=1)
        h = F.relu(self.enc1(torch.cat([x, onehot], dim=1)))
        h = F.relu(self.enc2(h))
        mean, log_var = self.enc_out(h).chunk(2, dim=1)
        z = mean + torch.exp(0.5 * log_var) * noise
        reconstruction = self.decode(z, onehot).flatten(start_dim=1)
        squared = (reconstruction - x).pow(2).sum(dim=1)
        kl = 0.5 * (mean.pow(2) + log_var.exp() - 1.0 - log_var).sum(dim=1)
        return (0.5 * squared + BETA * kl).unsqueeze(1)


def mean_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The batch loss the DP primitive differentiates: the mean of the rows' own losses."""
    return out.mean()


def train_generator(
    model: ConditionalVAE,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    generator: torch.Generator,
    noise_multiplier: float | None = None,
    max_grad_norm: float = 1.0,
    draw: BatchDraw | None = None,
    recorder: QueryRecorder | None = None,
) -> tuple[list[SGMEvent], dict[str, float]]:
    """Train ``model`` on (x, y) with Adam: shuffled minibatches, or, with ``noise_multiplier``, DP-SGD steps on
    Poisson batches of rate B / n (epochs * floor(n / B) queries). Returns the DP events and, without DP, the first
    and last epoch's mean loss.

    Under DP every batch comes from ``draw`` (the client's :meth:`ClientData.dp_batch` over (x, y) and, in a canary
    run, its canaries), which also hands over the query's own source of noise; ``generator`` draws the rest (the
    shuffles and the latent noise of the reparameterisation trick). ``recorder`` logs each query. Under DP there is
    no loss to return (on the real batches, without noise, it would tell of the records)."""
    n = int(y.shape[0])
    if noise_multiplier is not None and draw is None:
        raise ValueError("DP training of the generator draws each batch, and its noise, through a query's source.")
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    epoch_losses: list[float] = []
    steps_per_epoch = max(1, n // batch_size)
    for _ in range(epochs):
        losses = []
        if noise_multiplier is None:
            order = torch.randperm(n, generator=generator, device=generator.device).to(x.device)
            batches = [(x[idx], y[idx], None, None) for idx in order.split(batch_size)]
        else:
            assert draw is not None
            batches = (draw(batch_size / n) for _ in range(steps_per_epoch))
        for xb, yb, extra, source in batches:
            noise = torch.randn(
                (len(yb), model.latent), generator=generator, device=generator.device, dtype=x.dtype
            ).to(x.device)
            packed = model.pack(xb, yb, noise)
            optimizer.zero_grad(set_to_none=False)
            if noise_multiplier is None:
                loss = model(packed).mean()
                loss.backward()
                losses.append(loss.detach())
            else:
                result = dp_gradient(
                    model,
                    packed,
                    yb,
                    noise_multiplier=noise_multiplier,
                    max_grad_norm=max_grad_norm,
                    expected_batch_size=batch_size,
                    generator=source,
                    loss_fn=mean_loss,
                    extra=extra,
                    recorder=recorder,
                )
                for name, p in model.named_parameters():
                    p.grad = result.grads[name]
            optimizer.step()
        epoch_losses.append(float(torch.stack(losses).double().mean()) if losses else math.nan)
    events = (
        []
        if noise_multiplier is None
        else [SGMEvent(noise_multiplier=noise_multiplier, sample_rate=batch_size / n, steps=epochs * steps_per_epoch)]
    )
    metrics = (  # under DP a loss on the real batch would be a function of the records without noise
        {"generator_loss_first": epoch_losses[0], "generator_loss_last": epoch_losses[-1]}
        if epochs and noise_multiplier is None
        else {}
    )
    return events, metrics


class _Counter(nn.Module):
    """One weight per class; a record's gradient is its one-hot label (norm 1) under :func:`_own_class`."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.weight = nn.Linear(1, num_classes, bias=False)

    def forward(self, ones: torch.Tensor) -> torch.Tensor:
        return self.weight(ones)


def _own_class(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return out.gather(1, y.unsqueeze(1)).mean()


def class_counts(
    y: torch.Tensor,
    num_classes: int,
    *,
    generator: Source,
    noise_multiplier: float | None = None,
    recorder: QueryRecorder | None = None,
) -> tuple[torch.Tensor, list[SGMEvent]]:
    """The number of records of each class (float64 [num_classes]): exact, or, with ``noise_multiplier``, one query of
    the DP primitive over all records (sampling rate 1; each record's contribution is its one-hot label, norm 1, so
    the noise is N(0, sigma^2) per class). Returns the counts and the DP events; ``recorder`` logs the query;
    ``generator`` is the query's own source."""
    counter = _Counter(num_classes).to(y.device)
    ones = torch.ones((int(y.shape[0]), 1), device=y.device)
    result = dp_gradient(
        counter,
        ones,
        y,
        noise_multiplier=noise_multiplier or 0.0,
        max_grad_norm=1.0,
        expected_batch_size=1.0,
        generator=generator,
        loss_fn=_own_class,
        recorder=recorder,
    )
    counts = result.grads["weight.weight"].flatten().to(torch.float64)  # the noisy sum: divided by 1
    if noise_multiplier is None:
        return counts.round(), []
    return counts, [SGMEvent(noise_multiplier=noise_multiplier, sample_rate=1.0, steps=1)]


def allocate(counts: torch.Tensor, total: int) -> torch.Tensor:
    """``total`` labels in proportion to the (possibly noisy) class counts, negative counts as zero, by largest
    remainder (ties to the lower class); uniform over all classes when no count is positive. Shape [total], sorted."""
    weights = counts.clamp(min=0).to(torch.float64)
    if float(weights.sum()) <= 0:
        weights = torch.ones_like(weights)
    exact = weights / weights.sum() * total
    whole = exact.floor().to(torch.long)
    left = total - int(whole.sum())
    order = sorted(range(len(exact)), key=lambda c: (-(float(exact[c]) - int(whole[c])), c))
    for c in order[:left]:
        whole[c] += 1
    return torch.repeat_interleave(torch.arange(len(whole), device=counts.device), whole)


def sample(model: ConditionalVAE, labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One generated record per label: the decoder's output for a latent drawn from N(0, I)."""
    z = torch.randn((len(labels), model.latent), generator=generator, device=generator.device).to(labels.device)
    onehot = F.one_hot(labels, model.num_classes).to(z.dtype)
    model.eval()
    with torch.no_grad():
        return model.decode(z, onehot)
