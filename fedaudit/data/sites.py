"""A federation whose sites keep their records: ``--dataset sites``, one data file per client.

Each site reads its own file (any format of your own data: ``npz:``, ``csv:``, ``folder:``) and does with it what the
server does with a whole dataset elsewhere, on its own: it holds out a test split when the file has none,
standardises its records with their own statistics, and draws which of its training records its client trains on
(the members) and which it holds out as non-members, at random from the run's seed and its client id, so that the
membership audit stays valid (a non-member was as likely as a member to be trained on). It describes every training
record by a keyed hash (HMAC-SHA256) of its raw values and label, under a key only the site can compute
(:func:`site_key`), so that the run can check later that the site still holds the records it trained on, while the
hashes tell nobody else whether a given record was a member.

With the local engine, ``--site-data SPEC`` names each client's file in client order and the run reads them all here,
every one exactly as its site would (:func:`load_sites`); in a Flower deployment each SuperNode reads its own
(:func:`read_site`) and the server never reads a record. Labels are the class numbers the files give (shared by every
site), not renumbered per file; the number of classes is one more than the largest label of any site.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass

import numpy as np
import torch

from fedaudit.data.partition import Partition
from fedaudit.data.readers import DataError
from fedaudit.data.registry import Dataset
from fedaudit.data.user import is_user_dataset, read_records, standardise
from fedaudit.seeding import Stream, numpy_rng

SITES = "sites"
HASH_BYTES = 32  # HMAC-SHA256


@dataclass(frozen=True)
class SiteData:
    """One site's records, as its client trains and is audited on them."""

    client: int
    train_x: torch.Tensor  # float32 [n, C, H, W], standardised with the site's own statistics
    train_y: torch.Tensor  # int64 [n], the class numbers the file gives
    test_x: torch.Tensor
    test_y: torch.Tensor
    members: np.ndarray  # sorted indices into train: the records the client trains on
    heldout: np.ndarray  # sorted indices into train: the site's non-members
    hashes: np.ndarray  # uint8 [n, 32]: HMAC-SHA256 (the site's key) of each training record's raw values and label
    fingerprint: str
    source: str

    @property
    def num_classes(self) -> int:
        """One more than the largest label the site holds (the federation takes the largest over its sites)."""
        return int(torch.cat([self.train_y, self.test_y]).max()) + 1


def is_sites(name: str) -> bool:
    """Whether ``--dataset`` names a federation whose sites keep their records."""
    return str(name).strip().lower() == SITES


KEY_DOMAIN = b"fedaudit site record key\0"
MAX_SITE_VALUES = 3 * 1024 * 1024  # values in one record: a 1024 x 1024 colour image
MAX_SITE_CLASSES = 100_000  # a label past it would size the model (and the server's memory) by one site's word


def site_key(*arrays: np.ndarray) -> bytes:
    """The secret a site keys its records' hashes with: the SHA-256 of a domain tag and all of its file's arrays
    (training and test, as float32 values and int64 labels). Only whoever holds the whole file can compute it; the
    file's fingerprint, which the server sees, is another hash and does not give it."""
    digest = hashlib.sha256(KEY_DOMAIN)
    for array in arrays:
        kind = np.int64 if np.issubdtype(np.asarray(array).dtype, np.integer) else np.float32
        digest.update(np.ascontiguousarray(array, dtype=kind).tobytes())
    return digest.digest()


def record_hashes(x: np.ndarray, y: np.ndarray, key: bytes) -> np.ndarray:
    """HMAC-SHA256 under the site's ``key`` of each record's raw float32 values and int64 label: uint8 [N, 32].

    A plain hash would let anyone who holds a run directory test whether a candidate record was a member (and try
    each label): keyed, the hashes tell the server and the run's readers nothing about any record, while the site,
    which can always recompute them, proves that its records are those the run recorded."""
    values = np.ascontiguousarray(x, dtype=np.float32).reshape(len(x), -1)
    labels = np.ascontiguousarray(y, dtype=np.int64)
    out = np.empty((len(x), HASH_BYTES), dtype=np.uint8)
    for i in range(len(x)):
        digest = hmac.new(key, values[i].tobytes() + labels[i].tobytes(), hashlib.sha256).digest()
        out[i] = np.frombuffer(digest, dtype=np.uint8)
    return out


def read_site(
    spec: str,
    client: int,
    *,
    seed: int,
    holdout_fraction: float,
    label_column: str | None = None,
    image_size: int | None = None,
) -> SiteData:
    """Client ``client``'s site: its file read, split, standardised and described (module docstring)."""
    if not is_user_dataset(spec):
        raise DataError(f"Client {client}'s data {spec!r} must be npz:PATH, csv:PATH or folder:DIR.")
    x, y, x_test, y_test, source, fingerprint = read_records(spec, label_column=label_column, image_size=image_size)
    if (y < 0).any() or (len(y_test) and (y_test < 0).any()):
        raise DataError(f"{source} has negative labels; a site's labels are the class numbers 0, 1, ... it shares.")
    largest = max(int(y.max(initial=0)), int(np.max(y_test, initial=0)))
    if largest >= MAX_SITE_CLASSES:  # the federation's classes are the largest label + 1: the model's output
        raise DataError(
            f"{source} has label {largest}; a site's labels are the class numbers 0, 1, ... it shares, fewer than "
            f"{MAX_SITE_CLASSES:,}."
        )
    if len(y) < 2:
        raise DataError(f"{source} holds {len(y)} training record(s); a site needs at least two.")
    heldout_count = int(holdout_fraction * len(y))
    if len(y) - heldout_count < 1:
        raise DataError(f"{source}: --holdout-fraction {holdout_fraction:g} leaves its client no record to train on.")
    order = numpy_rng(seed, Stream.SITE_SPLIT, client).permutation(len(y))
    heldout, members = np.sort(order[:heldout_count]), np.sort(order[heldout_count:])
    hashes = record_hashes(x, y, site_key(x, y, x_test, y_test))
    train, test = standardise(x, x_test)
    return SiteData(
        client=client,
        train_x=train,
        train_y=torch.from_numpy(np.asarray(y, dtype=np.int64)),
        test_x=test,
        test_y=torch.from_numpy(np.asarray(y_test, dtype=np.int64)),
        members=members.astype(np.int64),
        heldout=heldout.astype(np.int64),
        hashes=hashes,
        fingerprint=fingerprint,
        source=source,
    )


@dataclass(frozen=True, eq=False)
class SiteReport:
    """What a site tells the server of its records, and all the server learns of them: how many there are, which
    positions of its file are members and which held out, the hashes of those records, the number of test records,
    the records' shape, the classes it holds and its file's fingerprint. No record."""

    client: int
    records: int
    members: np.ndarray
    heldout: np.ndarray
    tests: int
    classes: int
    shape: tuple[int, int, int]
    fingerprint: str
    member_hashes: np.ndarray
    heldout_hashes: np.ndarray

    @classmethod
    def of(cls, site: SiteData) -> SiteReport:
        channels, height, width = (int(n) for n in site.train_x.shape[1:])
        return cls(
            client=site.client,
            records=len(site.train_y),
            members=site.members,
            heldout=site.heldout,
            tests=len(site.test_y),
            classes=site.num_classes,
            shape=(channels, height, width),
            fingerprint=site.fingerprint,
            member_hashes=site.hashes[site.members],
            heldout_hashes=site.hashes[site.heldout],
        )

    def summary(self) -> dict[str, object]:
        """The report without its hashes, as JSON values (what every site is told of the federation)."""
        return {
            "client": self.client,
            "records": self.records,
            "members": self.members.tolist(),
            "heldout": self.heldout.tolist(),
            "tests": self.tests,
            "classes": self.classes,
            "shape": list(self.shape),
            "fingerprint": self.fingerprint,
        }

    def digest(self) -> str:
        """A SHA-256 of the report's summary (counts, positions, shape, classes, fingerprint)."""
        return hashlib.sha256(json.dumps(self.summary(), sort_keys=True).encode()).hexdigest()

    def compact(self) -> dict[str, object]:
        """What every site is told of this site during the run: its counts, shape, classes and fingerprint, and the
        digest of its report (which of its records are members stays between it and the server)."""
        summary = self.summary()
        return {
            **{k: v for k, v in summary.items() if k not in ("members", "heldout")},
            "members": len(self.members),
            "heldout": len(self.heldout),
            "digest": self.digest(),
        }

    @classmethod
    def from_compact(cls, data: dict) -> tuple[SiteReport, str]:
        """A report with the counts of :meth:`compact` (its positions stand in: the first members, then the held-out
        records) and the digest of the real one."""
        members, heldout = int(data["members"]), int(data["heldout"])
        stand_in = {**data, "members": list(range(members)), "heldout": list(range(members, members + heldout))}
        return cls.from_summary(stand_in), str(data["digest"])

    @classmethod
    def from_summary(cls, data: dict) -> SiteReport:
        """A report rebuilt from :meth:`summary` (its hashes empty)."""
        empty = np.zeros((0, HASH_BYTES), dtype=np.uint8)
        channels, height, width = (int(n) for n in data["shape"])
        if not 1 <= int(data["classes"]) <= MAX_SITE_CLASSES or not 0 < channels * height * width <= MAX_SITE_VALUES:
            raise DataError(  # a site's word sizes the server's model: a claim past any dataset is refused
                f"client {data['client']}'s site reports {data['classes']} classes of records of shape "
                f"{channels}x{height}x{width}, which no federation's data has."
            )
        return cls(
            client=int(data["client"]),
            records=int(data["records"]),
            members=np.asarray(data["members"], dtype=np.int64),
            heldout=np.asarray(data["heldout"], dtype=np.int64),
            tests=int(data["tests"]),
            classes=int(data["classes"]),
            shape=(channels, height, width),
            fingerprint=str(data["fingerprint"]),
            member_hashes=empty,
            heldout_hashes=empty,
        )


def federation(reports: list[SiteReport], records: Dataset | None = None) -> tuple[Dataset, Partition]:
    """The federation as one dataset and partition, from its sites' reports in client order: each site's training
    records follow the previous site's, so client k's members are its reported positions shifted by the records of
    the sites before it. Without ``records`` (the server of a deployment) the dataset holds none, only their shape,
    classes and fingerprint; the sites evaluate the model on their own test records."""
    shape = _one_shape(reports)
    offsets = np.cumsum([0] + [report.records for report in reports])
    partition = Partition(
        clients=tuple(offset + report.members for offset, report in zip(offsets, reports)),
        holdout=np.concatenate([offset + report.heldout for offset, report in zip(offsets, reports)]),
    )
    if records is not None:
        return records, partition
    nothing = torch.zeros((0, *shape), dtype=torch.float32)
    shell = Dataset(
        name=SITES,
        train_x=nothing,
        train_y=torch.zeros(0, dtype=torch.int64),
        test_x=nothing,
        test_y=torch.zeros(0, dtype=torch.int64),
        num_classes=max(report.classes for report in reports),
        source=f"the records of {len(reports)} sites, kept at the sites",
        fingerprint=sites_fingerprint([report.fingerprint for report in reports]),
    )
    return shell, partition


def _one_shape(reports: list[SiteReport]) -> tuple[int, int, int]:
    """The shape every site's records share (a federation trains one model on them)."""
    shapes = {report.shape for report in reports}
    if len(shapes) > 1:
        listed = ", ".join(f"client {r.client} {r.shape}" for r in reports)
        raise DataError(
            f"The sites' records have different shapes ({listed}); every site must hold records of one shape."
        )
    return next(iter(shapes))


def sites_fingerprint(fingerprints: list[str]) -> str:
    """The federation's data fingerprint: a hash of its sites' fingerprints in client order."""
    return hashlib.sha256("\n".join(fingerprints).encode()).hexdigest()


def load_sites(
    specs: tuple[str, ...],
    *,
    seed: int,
    holdout_fraction: float,
    label_column: str | None = None,
    image_size: int | None = None,
) -> tuple[Dataset, Partition, list[SiteReport]]:
    """Every site's file read here, each exactly as its site reads it (the local engine's view of a federation):
    one dataset whose training records are the sites' one after the other, the partition that gives each client its
    members and holds out the sites' non-members (:func:`federation`), and the sites' reports."""
    sites = [
        read_site(
            spec, k, seed=seed, holdout_fraction=holdout_fraction, label_column=label_column, image_size=image_size
        )
        for k, spec in enumerate(specs)
    ]
    reports = [SiteReport.of(site) for site in sites]
    _one_shape(reports)
    records = Dataset(
        name=SITES,
        train_x=torch.cat([site.train_x for site in sites]),
        train_y=torch.cat([site.train_y for site in sites]),
        test_x=torch.cat([site.test_x for site in sites]),
        test_y=torch.cat([site.test_y for site in sites]),
        num_classes=max(site.num_classes for site in sites),
        source=", ".join(site.source for site in sites),
        fingerprint=sites_fingerprint([site.fingerprint for site in sites]),
        test_sites=tuple(len(site.test_y) for site in sites),
    )
    dataset, partition = federation(reports, records)
    return dataset, partition, reports


def locate(indices: np.ndarray, site_records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which site holds each training record ``indices`` (as :func:`federation` numbers them) and its position in
    that site's file."""
    offsets = np.concatenate([[0], np.cumsum(site_records)])
    site = np.searchsorted(offsets, indices, side="right") - 1
    return site.astype(np.int64), (indices - offsets[site]).astype(np.int64)


def recorded_hashes(membership: dict[str, np.ndarray], site: int, positions: np.ndarray) -> np.ndarray | None:
    """The hashes membership.npz recorded for site ``site``'s records at ``positions`` (members or held out); None
    where a position is neither."""
    offset = int(np.sum(membership["site_records"][:site]))
    members = membership[f"client_{site}"] - offset
    heldout_all = membership["holdout"] - offset
    heldout = np.sort(heldout_all[(heldout_all >= 0) & (heldout_all < int(membership["site_records"][site]))])
    out = np.empty((len(positions), HASH_BYTES), dtype=np.uint8)
    for i, p in enumerate(positions):
        j = np.searchsorted(members, p)
        if j < len(members) and members[j] == p:
            out[i] = membership[f"member_hashes_{site}"][j]
            continue
        j = np.searchsorted(heldout, p)
        if j < len(heldout) and heldout[j] == p:
            out[i] = membership[f"heldout_hashes_{site}"][j]
            continue
        return None
    return out
