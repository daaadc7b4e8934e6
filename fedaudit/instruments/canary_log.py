"""The canary log of canary clients: what ``fedaudit.flower.CanaryClients`` records for a Flower app (read by
``fedaudit attack --flower-log``) and what a client-level DP run with ``--canary-clients`` keeps in its run directory
(read by ``fedaudit attack --method canary``).

Format ``fedaudit-flower-canaries``, version 2 (version 1, without ``sample_rate``, is read too): one NumPy ``.npz``
archive of typed arrays (no pickled objects, no
JSON), rewritten atomically after every round, so a run that stops early leaves the log of the rounds it finished.
Its fields (m canaries, T rounds, d the number of floating-point model parameters):

- ``format`` (str), ``version`` (int), ``seed`` (int): what the file is, and the seed the canaries were drawn from;
- ``included`` (int8[m]): the secret inclusion bits (probability 1/2 each); training never reads the excluded ones;
- ``scale`` (float): a canary's update norm before clipping, in units of ``clipping_norm``;
- ``clipping_norm``, ``noise_multiplier`` (float): the DP mechanism's C and sigma (for local DP, the noise of one
  client's release over C); ``mechanism``, ``strategy`` (str): what was wrapped, in words;
- ``dimension`` (int): d; ``delta`` (float): the delta the audit and the accountant use;
- ``round_cosines`` (float64[T, m]): cos(aggregate update of round t, canary direction i), for every canary,
  included or not; ``round_norms`` (float64[T]): the norm of each round's aggregate update;
- ``released`` (int8[T]): 1 where the strategy released an aggregate; ``sampled`` (int64[T]): clients sampled in
  the round, canary clients included; ``population`` (int64[T]): real nodes plus included canary clients;
  ``sample_rate`` (float64[T]): each client's probability of being sampled where the sample is Poisson (a
  client-level DP run of fedaudit), NaN where exactly ``sampled`` of ``population`` were drawn (Flower's sampler);
  ``equal_weights`` (int8[T]): 1 where every aggregated reply had the same weight;
- ``final_cosines`` (float64[m]), ``final_norm`` (float): the same for the final model minus the initial one;
- ``flower_epsilon``, ``flower_delta`` (float, NaN when Flower reports none) and ``flower_report`` (str): what
  Flower itself reports about privacy, in words;
- ``flower_version``, ``fedaudit_version`` (str).
"""

from __future__ import annotations

import io
import math
import zipfile
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from fedaudit.errors import UserError

FORMAT = "fedaudit-flower-canaries"
VERSION = 2
READABLE = (1, 2)  # version 1 logs have no sample_rate (Flower's sampler draws exactly n of N)
_ZIP_MAGIC = b"PK\x03\x04"
_COSINE_SLACK = 1e-6  # float rounding of a cosine


class CanaryLogError(UserError):
    """A file given as a Flower canary log that is not one (one sentence naming the file)."""


@dataclass(frozen=True)
class CanaryLog:
    """One Flower canary log (see the module's docstring for each field)."""

    seed: int
    included: np.ndarray
    scale: float
    clipping_norm: float
    noise_multiplier: float
    mechanism: str
    strategy: str
    dimension: int
    delta: float
    round_cosines: np.ndarray
    round_norms: np.ndarray
    released: np.ndarray
    sampled: np.ndarray
    population: np.ndarray
    equal_weights: np.ndarray
    final_cosines: np.ndarray
    final_norm: float
    sample_rate: np.ndarray
    flower_epsilon: float
    flower_delta: float
    flower_report: str
    flower_version: str
    fedaudit_version: str

    @property
    def canaries(self) -> int:
        return int(len(self.included))

    @property
    def rounds(self) -> int:
        return int(len(self.round_norms))

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The archive's arrays, typed as the format says."""
        arrays = {"format": np.array(FORMAT), "version": np.array(VERSION, dtype=np.int64)}
        for field in fields(self):
            value = getattr(self, field.name)
            kind = _KINDS[field.name]
            arrays[field.name] = np.array(value) if kind is str else np.asarray(value, dtype=kind)
        return arrays

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        np.savez_compressed(buffer, **self.to_arrays())
        return buffer.getvalue()

    def write(self, path: str | Path) -> None:
        """Write the log atomically (a temporary file in the same folder, then a rename)."""
        from fedaudit.rundir import atomic_write_bytes

        atomic_write_bytes(Path(path), self.to_bytes())


_KINDS: dict[str, type] = {
    "seed": np.int64,
    "included": np.int8,
    "scale": np.float64,
    "clipping_norm": np.float64,
    "noise_multiplier": np.float64,
    "mechanism": str,
    "strategy": str,
    "dimension": np.int64,
    "delta": np.float64,
    "round_cosines": np.float64,
    "round_norms": np.float64,
    "released": np.int8,
    "sampled": np.int64,
    "population": np.int64,
    "equal_weights": np.int8,
    "final_cosines": np.float64,
    "final_norm": np.float64,
    "sample_rate": np.float64,
    "flower_epsilon": np.float64,
    "flower_delta": np.float64,
    "flower_report": str,
    "flower_version": str,
    "fedaudit_version": str,
}
_PER_ROUND = ("round_norms", "released", "sampled", "population", "equal_weights", "sample_rate")
_ARRAYS = {"included": 1, "round_cosines": 2, "final_cosines": 1, **{name: 1 for name in _PER_ROUND}}


def read_log(path: str | Path) -> CanaryLog:
    """Read and check a Flower canary log; anything that is not a whole log of this version is a
    :class:`CanaryLogError` in one sentence."""
    path = Path(path)
    arrays = _load(path)
    if "format" not in arrays or arrays["format"].dtype.kind != "U" or str(arrays["format"]) != FORMAT:
        raise CanaryLogError(f"{path} is not a fedaudit Flower canary log (its format field is not {FORMAT!r}).")
    version = arrays.get("version")
    if version is None or version.shape != () or version.dtype.kind not in "iu":
        raise CanaryLogError(f"{path} has no readable format version.")
    if int(version) not in READABLE:
        raise CanaryLogError(
            f"{path} is a Flower canary log of version {int(version)}; this fedaudit reads versions "
            f"{' and '.join(map(str, READABLE))}."
        )
    if int(version) == 1 and "round_norms" in arrays:  # Flower's sampler: exactly n of N each round
        arrays = {**arrays, "sample_rate": np.full(arrays["round_norms"].shape, np.nan)}
    missing = sorted(set(_KINDS) - set(arrays))
    if missing:
        raise CanaryLogError(f"{path} lacks the field(s) {', '.join(missing)} of a Flower canary log.")
    values = {name: _typed(path, name, arrays[name]) for name in _KINDS}
    log = CanaryLog(**values)
    _check(path, log)
    return log


def _load(path: Path) -> dict[str, np.ndarray]:
    if not path.exists():
        raise CanaryLogError(f"The Flower canary log {path} does not exist.")
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise CanaryLogError(f"Cannot read the Flower canary log {path}: {exc.strerror or exc}.") from exc
    if magic != _ZIP_MAGIC:
        raise CanaryLogError(f"{path} is not a fedaudit Flower canary log (not an .npz archive).")
    try:
        with np.load(path, allow_pickle=False) as data:
            return {key: data[key] for key in data.files}
    except ValueError as exc:
        if "pickle" in str(exc):
            raise CanaryLogError(
                f"{path} holds pickled objects, which a Flower canary log never does and fedaudit does not load."
            ) from exc
        raise CanaryLogError(f"{path} is damaged or truncated ({exc}).") from exc
    except (OSError, EOFError, zipfile.BadZipFile, KeyError) as exc:
        raise CanaryLogError(f"{path} is damaged or truncated ({type(exc).__name__}).") from exc


def _typed(path: Path, name: str, array: np.ndarray) -> object:
    kind = _KINDS[name]
    if kind is str:
        if array.dtype.kind != "U" or array.shape != ():
            raise CanaryLogError(f"{path}: the field {name} is not a text.")
        return str(array)
    if array.dtype.kind != np.dtype(kind).kind:
        raise CanaryLogError(f"{path}: the field {name} has type {array.dtype}, not {np.dtype(kind)}.")
    if name in _ARRAYS:
        if array.ndim != _ARRAYS[name]:
            raise CanaryLogError(f"{path}: the field {name} has {array.ndim} dimension(s), not {_ARRAYS[name]}.")
        return array.astype(kind, copy=False)
    if array.shape != ():
        raise CanaryLogError(f"{path}: the field {name} is not a single number.")
    return int(array) if np.dtype(kind).kind == "i" else float(array)


def _check(path: Path, log: CanaryLog) -> None:
    """Shapes that agree and values in range; one sentence for the first problem found."""
    if log.included.size < 4:
        raise CanaryLogError(f"{path}: the log holds fewer than 4 canaries.")
    m = log.included.size
    if log.round_norms.size < 1:
        raise CanaryLogError(f"{path}: the log holds no round.")
    rounds = log.round_norms.size
    if log.round_cosines.shape != (rounds, m):
        raise CanaryLogError(
            f"{path}: round_cosines has shape {log.round_cosines.shape}, but the log has {rounds} round(s) and "
            f"{m} canaries."
        )
    for name in _PER_ROUND:
        if getattr(log, name).shape != (rounds,):
            raise CanaryLogError(f"{path}: {name} has {getattr(log, name).size} entries for {rounds} round(s).")
    if log.final_cosines.shape != (m,):
        raise CanaryLogError(f"{path}: final_cosines has {log.final_cosines.size} entries for {m} canaries.")
    if not np.isin(log.included, (0, 1)).all():
        raise CanaryLogError(f"{path}: the inclusion bits are not all 0 or 1.")
    for name in ("round_cosines", "final_cosines"):
        values = getattr(log, name)
        if not np.isfinite(values).all() or np.abs(values).max(initial=0.0) > 1 + _COSINE_SLACK:
            raise CanaryLogError(f"{path}: {name} holds values that are not cosines.")
    if not np.isin(log.released, (0, 1)).all() or not np.isin(log.equal_weights, (0, 1)).all():
        raise CanaryLogError(f"{path}: released and equal_weights must be 0 or 1.")
    if not log.released.any():
        raise CanaryLogError(f"{path}: no round released an aggregate.")
    poisson = np.isfinite(log.sample_rate)
    if (log.sampled[~poisson] < 1).any() or (log.sampled < 0).any() or (log.population < log.sampled).any():
        raise CanaryLogError(f"{path}: a round sampled fewer than 1 client or more clients than its population.")
    if ((log.sample_rate[poisson] <= 0) | (log.sample_rate[poisson] > 1)).any():
        raise CanaryLogError(f"{path}: a sample rate is not in (0, 1].")
    numbers = {
        "scale": (log.scale, 1.0, math.inf),
        "clipping_norm": (log.clipping_norm, 0.0, math.inf),
        "noise_multiplier": (log.noise_multiplier, 0.0, math.inf),
    }
    for name, (value, low, high) in numbers.items():
        if not (math.isfinite(value) and low <= value < high) or (name == "clipping_norm" and value <= 0):
            raise CanaryLogError(f"{path}: {name} {value!r} is out of range.")
    if not 0.0 < log.delta < 1.0:
        raise CanaryLogError(f"{path}: delta {log.delta!r} is not in (0, 1).")
    if log.dimension < 1 or not (np.isfinite(log.round_norms).all() and (log.round_norms >= 0).all()):
        raise CanaryLogError(f"{path}: the model dimension or the update norms are out of range.")
