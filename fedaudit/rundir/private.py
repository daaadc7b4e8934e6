"""What a client-level DP run holds that only its server (or its simulated clients) may see, and that a copy for
others (``fedaudit export``) therefore leaves out.

Client-level DP protects each client against whoever sees the released models, not against the server: the server
samples each round's clients from its secret and, with the noise at the server, receives their updates before the
noise. The run directory is the server's, and it records what the guarantee assumes nobody else learns: each
round's sample (the checkpoints' ``round-NNNN.json``; its size and the un-noised statistics of the clients' updates
in ``server-metrics.csv``), the updates as they arrived (``transmitted/``), and the
clients' own states (SCAFFOLD's control variates move with each client's unclipped update). A copy for others leaves
these files out and lists them in its ``export.json``; the copy checks without them. Its manifest still holds their
hashes, which a guess of a round's sample would match: each private record carries a salt from the server's secret
(``salt``), and nothing that counts the sample stays public (a round's time grows with its clients, so
``wall_seconds`` is private too).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fedaudit.privacy.randomness import SECRETS_FILE, SERVER_SECRET_FILE

SERVER_METRICS = "server-metrics.csv"
SECRET_FILES = (SECRETS_FILE, SERVER_SECRET_FILE)  # never in a copy
EXPORT_RECORD = "export.json"  # in a copy for others: the files it leaves out, and why (not hashed: not the run's)
EXPORT_FORMAT = "fedaudit-export"
MAX_EXPORT_RECORD_BYTES = 16 << 20
# the columns of metrics.csv that are public in a client-level run: the released model's quality, the accountant's
# epsilon, and the clipping norm (under adaptive clipping, moved only by noised counts); not the time a round took,
# which grows with the clients it sampled
PUBLIC_METRICS = ("round", "test_accuracy", "test_loss", "epsilon", "clip_norm")
SALT = "salt"  # a private record's field (JSON), column (CSV) or metadata key (safetensors), from the server's secret

_STATE = re.compile(r"checkpoints/round-\d{4,}\.json")
_CLIENT_STATES = re.compile(r"checkpoints/round-\d{4,}-clients\.safetensors")
_SENT = re.compile(r"transmitted/round-\d{4,}/client-\d+\.safetensors")


def client_level(config: Mapping[str, Any] | None) -> bool:
    """Whether ``config`` (config.json's object) is a client-level DP run's."""
    privacy = config.get("privacy") if isinstance(config, Mapping) else None
    return isinstance(privacy, Mapping) and bool(privacy.get("dp")) and privacy.get("dp_level") == "client"


def private_columns(columns: Iterable[str], *, client_level: bool) -> list[str]:
    """The metrics columns only the server may see: in a client-level run, every one but :data:`PUBLIC_METRICS`
    (the round's number of clients and bytes count its sample; the clipped fraction and median norm are un-noised)."""
    if not client_level:
        return []
    return [column for column in columns if column not in PUBLIC_METRICS]


def private_reason(relative: str, config: Mapping[str, Any] | None) -> str | None:
    """Why a copy for others leaves out the run's file ``relative`` (its path in the run, with '/'), or None when
    the file is for anyone who may read the run."""
    if not client_level(config):
        return None
    assert isinstance(config, Mapping)
    if relative == SERVER_METRICS:
        return "each round's number of clients and the un-noised clipped fraction and median norm of their updates"
    if _STATE.fullmatch(relative):
        return "each round's sample of clients, drawn from the server's secret"
    if _CLIENT_STATES.fullmatch(relative):
        return "the clients' own states, which move with their unclipped updates"
    if relative.startswith("transmitted/"):
        return "what the round's clients sent, as the server received it"
    return None


def names_clients(names: Iterable[str], config: Mapping[str, Any] | None) -> list[str]:
    """The run's files whose very names tell a client-level run's sample (what each client sent, a file per client
    and round): the manifest that a copy keeps names them, so no copy for others can leave them out unseen."""
    if not client_level(config):
        return []
    return [name for name in names if _SENT.fullmatch(name)]


def left_out(root: Path) -> dict[str, str]:
    """The files a copy for others says it left out (its ``export.json``); empty for a run itself. A record that is
    not one fedaudit wrote excuses nothing."""
    path = root / EXPORT_RECORD
    try:
        if not path.is_file() or path.stat().st_size > MAX_EXPORT_RECORD_BYTES:
            return {}
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return {}
    files = data.get("left_out") if isinstance(data, dict) and data.get("format") == EXPORT_FORMAT else None
    if not isinstance(files, dict):
        return {}
    return {str(k): str(v) for k, v in files.items() if isinstance(k, str)}


def excused(root: Path, config: Mapping[str, Any] | None) -> frozenset[str]:
    """The files whose absence from ``root`` is no problem: those its export record lists that the run's own
    configuration makes private (a record cannot excuse the absence of any other file), in a copy (a directory that
    holds the clients' or the server's secret is the run itself, whose records a planted export.json would
    otherwise let anyone delete)."""
    if any((root / name).exists() for name in SECRET_FILES):
        return frozenset()
    return frozenset(name for name in left_out(root) if private_reason(name, config) is not None)


def export_record(names: Iterable[str], config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The export record of a copy that leaves out the private ones of ``names``."""
    files = {name: reason for name in sorted(names) if (reason := private_reason(name, config)) is not None}
    return {"format": EXPORT_FORMAT, "left_out": files}
