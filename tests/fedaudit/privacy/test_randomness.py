"""Where a client's draws come from: the documented derivation from its secret (against an independent computation
and pinned values), fresh sources per query, the secret files (mode 0600, read back, bad ones refused in one
sentence), the secure sampler's distribution, and the CLI: other records with the same seed give independent noise,
a resumed run reads its secrets back and goes on exactly, and a run whose secrets are missing or wrong says so."""

from __future__ import annotations

import hashlib
import hmac
import json
import random
import stat
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    FAST_ARGS,
    assert_user_error,
    digit_halves,
    engine_independent_digest,
    interrupt_in_round,
    update_distances,
)
from scipy import stats

import fedaudit.privacy.randomness as randomness
from fedaudit.privacy.primitive import noisy_sum, poisson_sample
from fedaudit.privacy.randomness import (
    SECRET_BYTES,
    QueryDraws,
    SecretError,
    SecretKeys,
    SecretStore,
    SecureStream,
    SeededKeys,
    add_gaussian,
    client_key,
    site_round_keys,
    site_secret_path,
)
from fedaudit.seeding import Stream, derive_seed

SECRET = bytes(range(100, 132))
RUN_ID = "0123456789abcdef0123456789abcdef"


def _spec_mac(key: bytes, *parts: bytes) -> bytes:
    """docs/accounting.md's HMAC-SHA256 over length-prefixed parts, written out here."""
    return hmac.new(key, b"".join(len(p).to_bytes(4, "big") + p for p in parts), hashlib.sha256).digest()


def test_the_derivation_is_the_documented_one_and_does_not_change_between_versions():
    key = _spec_mac(SECRET, b"fedaudit/client-key/v1", RUN_ID.encode(), (3).to_bytes(8, "big"))
    assert client_key(SECRET, RUN_ID, 3) == key
    keys = SecretKeys(key)
    round_digest = _spec_mac(key, b"round", (7).to_bytes(8, "big"))
    assert keys.round_seed(7) == int.from_bytes(round_digest[:8], "big") & (2**63 - 1)
    query_digest = _spec_mac(key, b"query", (7).to_bytes(8, "big"), (2).to_bytes(8, "big"))
    assert keys.query_key(7, 2) == query_digest
    assert keys.query_seed(7, 2) == int.from_bytes(query_digest[:8], "big") & (2**63 - 1)
    # pinned: a change here would make every run's --resume draw other noise than the run it continues
    assert keys.query_seed(7, 2) == 1322869292116500630
    assert keys.round_seed(0) == 4481198826465364206


def test_a_cpu_generator_holds_all_of_its_key_not_32_bits_of_a_seed():
    """torch's manual_seed keeps the low 32 bits of a seed on the CPU: two queries whose seeds shared them drew the
    same sample and noise, and trying 2**32 seeds found any query's. A query's CPU generator is keyed by all 32 bytes
    instead, as docs/accounting.md writes it, checked here against Python's own Mersenne Twister."""
    key = bytes(range(7, 39))
    words = struct.unpack("<624I", hashlib.shake_256(b"fedaudit/mt19937-state/v1" + key).digest(2496))
    python = random.Random()
    python.setstate((3, (*words, 624), None))
    expected = torch.tensor([(python.getrandbits(32) & 0xFFFFFF) * 2.0**-24 for _ in range(64)])
    assert torch.equal(torch.rand(64, generator=randomness.keyed_generator(key)), expected)
    low_bits_kept = bytes([key[0] ^ 1, *key[1:]])  # another seed with the same low 32 bits
    seeded = [torch.Generator().manual_seed(randomness._seed_of(k)) for k in (key, low_bits_kept)]
    assert torch.equal(torch.rand(64, generator=seeded[0]), torch.rand(64, generator=seeded[1]))  # the old keying
    for other in (low_bits_kept, key[:31] + bytes([key[31] ^ 1])):
        assert not torch.equal(torch.rand(64, generator=randomness.keyed_generator(other)), expected)
    keys = SecretKeys(client_key(SECRET, RUN_ID, 0))
    for source, digest in (
        (keys.query_source(3, 1, "cpu"), keys.query_key(3, 1)),
        (keys.round_generator(3, "cpu"), _spec_mac(keys.key, b"round", (3).to_bytes(8, "big"))),
        (
            SeededKeys(9, 4).query_source(2, 5, "cpu"),
            hashlib.sha256(derive_seed(9, Stream.QUERY, 2, 4, 5).to_bytes(8, "big")).digest(),
        ),
    ):
        assert torch.equal(
            torch.normal(0.0, 1.0, (40,), generator=source),
            torch.normal(0.0, 1.0, (40,), generator=randomness.keyed_generator(digest)),
        )


def test_keys_differ_between_clients_runs_rounds_and_queries():
    seeds = {
        SecretKeys(client_key(SECRET, run, client)).query_seed(m, j)
        for run in (RUN_ID, "f" * 32)
        for client in range(3)
        for m in range(3)
        for j in range(3)
    }
    assert len(seeds) == 2 * 3 * 3 * 3
    with pytest.raises(SecretError, match="32 bytes"):
        client_key(SECRET[:16], RUN_ID, 0)


def test_a_public_seeds_keys_are_the_seeding_streams():
    keys = SeededKeys(9, 4)
    assert keys.round_seed(2) == derive_seed(9, Stream.CLIENT, 2, 4)  # what every run without DP always drew
    assert keys.query_seed(2, 5) == derive_seed(9, Stream.QUERY, 2, 4, 5)
    assert keys.round_generator(2, "cpu").initial_seed() == derive_seed(9, Stream.CLIENT, 2, 4)


def test_each_query_draws_from_a_fresh_source_whatever_came_before():
    keys = SecretKeys(client_key(SECRET, RUN_ID, 0))
    first = QueryDraws(keys, 3, torch.device("cpu"))
    for _ in range(4):
        torch.rand(1000, generator=first.next())  # earlier queries drew various amounts
    second = QueryDraws(keys, 3, torch.device("cpu"))
    second.made = 4
    assert torch.equal(torch.rand(50, generator=first.next()), torch.rand(50, generator=second.next()))
    assert first.made == second.made == 5


def test_the_secure_stream_is_uniform_and_gaussian_and_repeatable():
    key = bytes(range(32))
    u = SecureStream(key).uniform(200_000)
    assert u.min() >= 0 and u.max() < 1 and stats.kstest(u, "uniform").pvalue > 1e-4
    z = SecureStream(key).standard_normal(200_000)
    assert stats.kstest(z, "norm").pvalue > 1e-4
    assert abs(z.mean()) < 0.01 and abs(z.var() - 1) < 0.01 and abs(stats.kurtosis(z)) < 0.05
    assert np.array_equal(SecureStream(key).standard_normal(10), SecureStream(key).standard_normal(10))
    assert not np.array_equal(SecureStream(key).uniform(10), SecureStream(bytes(32)).uniform(10))
    stream = SecureStream(key)  # draws continue the keystream
    assert not np.array_equal(stream.uniform(10), stream.uniform(10))


def test_secure_noise_is_added_in_float64_and_rounded_once():
    total = torch.full((1000,), 1.0e4, dtype=torch.float32)
    released = add_gaussian(total, 1e-3, SecureStream(bytes(32)))
    noise = SecureStream(bytes(32)).standard_normal(1000) * 1e-3
    assert released.dtype == torch.float32
    assert torch.equal(released, (torch.tensor(1.0e4, dtype=torch.float64) + torch.from_numpy(noise)).float())
    released = noisy_sum(
        {"w": torch.zeros(100_000)}, noise_multiplier=2.0, max_grad_norm=1.5, generator=SecureStream(bytes(32))
    )
    assert float(released["w"].std()) == pytest.approx(3.0, rel=0.02)
    assert len(poisson_sample(10_000, 0.1, generator=SecureStream(bytes(32)))) == pytest.approx(1000, abs=120)


# --- files -------------------------------------------------------------------------------------------------------


def test_a_store_writes_its_secrets_private_and_reads_them_back(tmp_path):
    store = SecretStore(RUN_ID)
    keys = store.keys(2, secure=False)
    path = tmp_path / "client-secrets.json"
    store.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = SecretStore.read(path, RUN_ID)
    assert again.keys(2, secure=False).key == keys.key and again.missing([0, 2]) == [0]
    assert len(store.secrets[2]) == SECRET_BYTES and store.secrets[2] != bytes(SECRET_BYTES)


def _write(path: Path, content: str | bytes, mode: int = 0o600) -> Path:
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    path.chmod(mode)
    return path


GOOD = {"format": "fedaudit-client-secrets", "format_version": 1, "run_id": RUN_ID, "clients": {"0": "ab" * 32}}


@pytest.mark.parametrize(
    ("content", "mode", "says"),
    [
        (json.dumps(GOOD), 0o644, "can be read by other users"),
        ("{not json", 0o600, "is not JSON"),
        ("[1, 2]", 0o600, "not a JSON object"),
        (json.dumps({**GOOD, "format": "x"}), 0o600, "is not a fedaudit-client-secrets file"),
        (json.dumps({**GOOD, "run_id": "f" * 32}), 0o600, "the secrets of another run"),
        (json.dumps({**GOOD, "clients": {"0": "ab" * 16}}), 0o600, "16 bytes; a client secret is 32"),
        (json.dumps({**GOOD, "clients": {"0": "zz" * 32}}), 0o600, "is not hex"),
        (json.dumps({**GOOD, "clients": {"x": "ab" * 32}}), 0o600, "not a client number"),
        (json.dumps({**GOOD, "clients": []}), 0o600, "no 'clients' object"),
        (json.dumps({**GOOD, "clients": {"\u00b2": "ab" * 32}}), 0o600, "not a client number"),
        ("[" * 100_000 + "]" * 100_000, 0o600, "is not JSON"),
    ],
)
def test_a_bad_secrets_file_is_one_sentence(tmp_path, content, mode, says):
    path = _write(tmp_path / "client-secrets.json", content, mode)
    with pytest.raises(SecretError, match=says) as raised:
        SecretStore.read(path, RUN_ID)
    assert "\n" not in str(raised.value)


def test_a_missing_or_huge_secrets_file_is_one_sentence(tmp_path):
    with pytest.raises(SecretError, match="is missing"):
        SecretStore.read(tmp_path / "client-secrets.json", RUN_ID)
    huge = tmp_path / "huge.json"
    with huge.open("wb") as handle:
        handle.truncate(randomness.MAX_SECRETS_BYTES + 1)
    huge.chmod(0o600)
    with pytest.raises(SecretError, match="larger than any fedaudit writes"):
        SecretStore.read(huge, RUN_ID)


def test_a_site_makes_its_secret_once_per_run_keeps_it_private_and_reads_it_back(tmp_path):
    path = site_secret_path(1, None, str(tmp_path / "data"))
    assert path == tmp_path / "data" / "fedaudit-client-1-secret.json"
    first = site_round_keys(path, RUN_ID, 1, 0, "inputs of round 1", secure=False)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = site_round_keys(path, RUN_ID, 1, 0, "inputs of round 1", secure=False)  # a restarted site, a resend
    assert again.key == first.key
    assert site_round_keys(path, RUN_ID, 1, 1, "inputs of round 2", secure=False).key == first.key
    other = site_round_keys(path, "f" * 32, 1, 0, "inputs of round 1", secure=False)
    assert other.key != first.key and len(json.loads(path.read_text())["runs"]) == 2
    with pytest.raises(SecretError, match="client 1's secrets, not client 2's"):
        site_round_keys(path, RUN_ID, 2, 0, "x", secure=False)
    path.chmod(0o640)
    with pytest.raises(SecretError, match="can be read by other users"):
        site_round_keys(path, RUN_ID, 1, 0, "inputs of round 1", secure=False)
    assert site_secret_path(1, str(tmp_path / "s.json"), None) == tmp_path / "s.json"
    with pytest.raises(SecretError, match="names no file for the client's secret"):
        site_secret_path(1, None, None)


def test_a_site_answers_a_round_once_so_a_server_cannot_cancel_its_noise(tmp_path):
    """Asked for the same round again with another global model, a site would draw the same sample and noise at
    another point: the difference of its two answers would hold no noise. It refuses; the same inputs again (a
    resend, a resumed run) are answered, with the same draws."""
    path = tmp_path / "secret.json"
    site_round_keys(path, RUN_ID, 0, 4, "global model A", secure=False)
    with pytest.raises(SecretError, match="answered round 5 of this run already, for other inputs"):
        site_round_keys(path, RUN_ID, 0, 4, "global model B", secure=False)
    site_round_keys(path, RUN_ID, 0, 4, "global model A", secure=False)
    assert json.loads(path.read_text())["runs"][RUN_ID]["rounds"] == {"4": "global model A"}


def test_a_site_refuses_what_a_server_could_use_to_grow_or_break_its_file(tmp_path, monkeypatch):
    path = tmp_path / "secret.json"
    for bad in ("../../etc", "ab" * 40, "é" * 32, 7):
        with pytest.raises(SecretError, match="not a fedaudit run id"):
            site_round_keys(path, bad, 0, 0, "x", secure=False)
    assert not path.exists()
    monkeypatch.setattr(randomness, "MAX_SITE_RUNS", 3)
    for k in range(3):
        site_round_keys(path, f"{k:032x}", 0, 0, "x", secure=False)
    with pytest.raises(SecretError, match="already holds the secrets of 3 runs"):
        site_round_keys(path, f"{9:032x}", 0, 0, "x", secure=False)
    site_round_keys(path, f"{1:032x}", 0, 1, "y", secure=False)  # the runs it holds go on


def test_a_site_takes_no_key_from_the_server_and_public_noise_only_when_it_allows_it(tmp_path):
    """What a deployment's ClientApp decides for each task (fedaudit.engine.simulation.client_keys_for): a simulated
    client takes the key its server sent; a site refuses one, a --noise-seed unless its node config allows it, and
    less noise than its node config's least (and a client-level round, whose noise the server adds)."""
    from fedaudit.config import PrivacyConfig, RunConfig
    from fedaudit.engine.simulation import SiteSecret, client_keys_for

    def privacy(**kw):
        return RunConfig(privacy=PrivacyConfig(dp=True, **{"noise_multiplier": 1.0, "max_grad_norm": 1.0, **kw}))

    dp, seeded = privacy(), privacy(noise_seed=4)
    site = SiteSecret(str(tmp_path / "secret.json"), None)
    key, task = bytes(range(32)), {"run": RUN_ID, "round": 0}
    assert client_keys_for({**task, "key": key.hex()}, dp, 1, None).key == key  # a simulation's client
    with pytest.raises(RuntimeError, match="a site draws its noise from its own secret only"):
        client_keys_for({**task, "key": key.hex()}, dp, 1, site, "inputs")
    at_site = client_keys_for(task, dp, 1, site, "inputs")
    assert at_site.key == site_round_keys(tmp_path / "secret.json", RUN_ID, 1, 0, "inputs", secure=False).key != key
    with pytest.raises(RuntimeError, match="public-noise=true"):
        client_keys_for(task, seeded, 1, site, "inputs")
    allowed = client_keys_for(task, seeded, 1, SiteSecret(None, None, public_noise=True))
    assert allowed.query_seed(0, 0) == SeededKeys(4, 1).query_seed(0, 0)
    assert client_keys_for(task, RunConfig(), 1, site).round_seed(3) == SeededKeys(0, 1).round_seed(3)
    with pytest.raises(SecretError, match="names no file for the client's secret"):
        client_keys_for(task, dp, 1, SiteSecret(None, None), "inputs")
    strict = SiteSecret(str(tmp_path / "secret.json"), None, min_noise_multiplier=1.5)
    central = RunConfig(
        privacy=PrivacyConfig(dp=True, dp_level="client", noise_multiplier=5.0, max_update_norm=1.0)
    )  # however much noise: the server adds it, after the site's update left in clear
    weak_ones = (
        (dp, "noise multiplier 1, and its site accepts no less than 1.5"),
        (RunConfig(), "no DP"),
        (central, "client-level DP \\(its update sent in clear, the noise added by the server\\)"),
    )
    for weak, says in weak_ones:
        with pytest.raises(RuntimeError, match=says):
            client_keys_for(task, weak, 1, strict, "inputs")
    assert client_keys_for(task, privacy(noise_multiplier=2.0), 1, strict, "inputs").key == at_site.key


def test_a_simulated_run_is_not_resumed_at_sites_that_hold_other_secrets(tmp_path):
    from fedaudit.config import PrivacyConfig, RunConfig
    from fedaudit.privacy.randomness import RunRandomness

    config = RunConfig(privacy=PrivacyConfig(dp=True, noise_multiplier=1.0, max_grad_norm=1.0))
    store = SecretStore(RUN_ID)
    store.keys(0, secure=False)
    store.save(tmp_path / "client-secrets.json")
    here = RunRandomness.resumed(config, "client-secrets", RUN_ID, tmp_path / "client-secrets.json", at_sites=False)
    assert here.keys(0).key == store.keys(0, secure=False).key
    with pytest.raises(SecretError, match="on the local engine or Flower's simulation, not at sites"):
        RunRandomness.resumed(config, "client-secrets", RUN_ID, tmp_path / "client-secrets.json", at_sites=True)


def test_a_rounds_inputs_digest_ignores_how_it_runs_and_sees_what_it_computes():
    """A site answers a round once per digest: the device's kind is in it (a CUDA generator draws other noise than a
    CPU one from the same key, so a server asking for a round on each would get two independent answers at one
    point, charged once), which GPU and how many clients at once are not."""
    from fedaudit.config import RunConfig
    from fedaudit.engine.simulation import round_inputs

    config = {**RunConfig().to_dict(), "device": "cuda"}
    task = {"config": json.dumps(config), "round": 2, "rounds": 5}
    tensors = [{"w": torch.ones(3)}, {}, {}]
    first = round_inputs(task, tensors)
    moved = {**config, "device": "cuda:1", "parallel_clients": 4, "flower": {**config["flower"], "superlink": "h:1"}}
    assert round_inputs({**task, "config": json.dumps(moved)}, tensors) == first
    assert round_inputs({**task, "config": json.dumps({**config, "device": "cpu"})}, tensors) != first
    assert round_inputs(task, [{"w": torch.tensor([1.0, 1.0, 1.5])}, {}, {}]) != first
    assert round_inputs({**task, "rounds": 6}, tensors) != first
    changed = {**config, "federated": {**config["federated"], "client_lr": 0.1}}
    assert round_inputs({**task, "config": json.dumps(changed)}, tensors) != first


# --- from the command line ---------------------------------------------------------------------------------------

DP_ONE_ROUND = (*FAST_ARGS, *"--dp --noise-multiplier 1 --max-grad-norm 1 --rounds 1 --num-clients 2".split())


def _distances(cli, tmp_path: Path, name: str, *extra: str) -> list[float]:
    """|A - B| / |A| of every client's update between runs of one seed and settings on other records."""
    runs = []
    for records in digit_halves(tmp_path):
        out = tmp_path / f"{name}-{records.stem}"
        args = (*DP_ONE_ROUND, "--dataset", f"npz:{records}", "--partition", "iid", "--seed", "7")
        result = cli("train", *args, *extra, "--save-transmitted", "--out", out)
        assert result.exit_code == 0, result.output
        runs.append(out)
    return update_distances(*runs)


def test_the_same_seed_on_other_records_gives_independent_noise(tmp_path, cli):
    """The server's view: with client secrets the two runs' updates are as far apart as independent noise makes
    them; with a shared public --noise-seed they differ only by the records' clipped sums."""
    secret = _distances(cli, tmp_path, "secret")
    public = _distances(cli, tmp_path, "public", "--noise-seed", "7")
    assert all(d >= 1.2 for d in secret), secret
    assert all(d < 0.3 for d in public), public


def test_a_resumed_run_reads_its_secrets_back_and_goes_on_exactly(tmp_path, cli, monkeypatch, fixed_secrets):
    args = (*FAST_ARGS, "--dp", "--rounds", "3", "--client-fraction", "0.4", "--num-clients", "5")
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert cli("train", *args, "--out", whole).exit_code == 0
    interrupt_in_round(monkeypatch, 2)
    assert cli("train", *args, "--out", resumed).exit_code == 1
    monkeypatch.undo()
    known = set(json.loads((resumed / "client-secrets.json").read_text())["clients"])
    made = []
    real = randomness.new_secret
    monkeypatch.setattr(randomness, "new_secret", lambda: made.append(1) or real())
    result = cli("train", "--resume", resumed, "--no-progress")
    assert result.exit_code == 0, result.output
    assert engine_independent_digest(resumed) == engine_independent_digest(whole)
    # the clients of round 1 were read back; only clients taking part for the first time got a new secret
    assert len(made) == len(set(json.loads((resumed / "client-secrets.json").read_text())["clients"]) - known)


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (lambda p, run_id: p.unlink(), "client-secrets.json is missing"),
        (lambda p, run_id: p.chmod(0o644), "can be read by other users"),
        (lambda p, run_id: _write(p, "{"), "is not JSON"),
        (lambda p, run_id: _write(p, json.dumps(GOOD)), "the secrets of another run"),
        (lambda p, run_id: _write(p, json.dumps({**GOOD, "run_id": run_id, "clients": {"0": "ab" * 31}})), "31 bytes"),
    ],
)
def test_resuming_without_this_runs_secrets_is_one_sentence_and_writes_nothing(tmp_path, cli, dp_run, damage, says):
    import shutil

    run = Path(shutil.copytree(dp_run, tmp_path / "run"))
    damage(run / "client-secrets.json", json.loads((run / "manifest.json").read_text())["randomness"]["run_id"])
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "client-secrets.json"}
    assert_user_error(cli("train", "--resume", run, "--rounds", "4"), mentions=says)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "client-secrets.json"} == before


def test_a_dp_run_keeps_its_secrets_private_and_apart_from_the_hashed_files(dp_run, plain_run):
    secrets = dp_run / "client-secrets.json"
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o600
    manifest = json.loads((dp_run / "manifest.json").read_text())
    assert "client-secrets.json" not in manifest["files"]
    assert manifest["randomness"]["source"] == "client-secrets" and len(manifest["randomness"]["run_id"]) == 32
    for value in json.loads(secrets.read_text())["clients"].values():
        for path in dp_run.rglob("*"):
            if path.is_file() and path != secrets:
                assert value.encode() not in path.read_bytes() and bytes.fromhex(value) not in path.read_bytes()
    assert not (plain_run / "client-secrets.json").exists()  # nothing to keep secret without DP
    assert json.loads((plain_run / "manifest.json").read_text())["randomness"]["source"] == "run-seed"


def test_noise_options_need_dp_and_a_valid_seed(tmp_path, cli):
    out = tmp_path / "run"
    assert_user_error(cli("train", *FAST_ARGS, "--noise-seed", "3", "--out", out), mentions="add --dp")
    assert_user_error(cli("train", *FAST_ARGS, "--secure-noise", "--out", out), mentions="add --dp")
    assert_user_error(cli("train", *FAST_ARGS, "--dp", "--noise-seed", "-1", "--out", out), mentions="--noise-seed")
    assert not out.exists()


def test_export_leaves_the_secrets_out_and_the_copy_reads_but_does_not_resume(tmp_path, cli, dp_run):
    copy = tmp_path / "copy"
    result = cli("export", dp_run, "--out", copy)
    assert result.exit_code == 0 and "left out: client-secrets.json" in result.output
    assert not (copy / "client-secrets.json").exists() and not (copy / ".fedaudit.lock").exists()
    assert {p.name for p in copy.iterdir()} >= {"manifest.json", "config.json", "model.safetensors", "privacy.json"}
    report = cli("report", copy, "--out", tmp_path / "report.md", "--format", "md")
    assert report.exit_code == 0, report.output
    assert "client-secrets.json (left out of this copy of the run)" in (tmp_path / "report.md").read_text()
    assert_user_error(cli("train", "--resume", copy, "--rounds", "4"), mentions="client-secrets.json is missing")
    assert_user_error(cli("export", dp_run, "--out", copy), mentions="already exists")
