"""A Flower deployment: a TLS SuperLink and SuperNodes as separate processes on 127.0.0.1, one per client (or one per
site that keeps its own records). The module's tests share the SuperLink; each starts and stops its own SuperNodes.

fedaudit is the server; each SuperNode's node config names its client and the file of its secret. With a public
--noise-seed (which the sites allow) the runs must equal the local engine's, byte for byte; by default each site
draws its noise from its own secret, which the server never sees and cannot regenerate; a federation that cannot
carry a run is refused with one sentence.
"""

from __future__ import annotations

import json

import pytest
from federation import Federation, SuperLink
from helpers import FAST_ARGS, assert_user_error, engine_independent_digest, update_distances

pytest.importorskip("flwr.superlink.grid", reason="the flower extra is not installed")  # `make test` installs it

CLIENTS = 3
SITES = 2  # where two sites show what three would: every ClientApp is a process of its own (seconds to start)


def dp_args(clients: int) -> tuple[str, ...]:
    return (*FAST_ARGS, "--num-clients", str(clients), "--rounds", "2", "--dp")


DP = dp_args(CLIENTS)
BASE = (*DP, "--noise-seed", "0")  # public noise, so that a deployment's run can equal the local engine's
ALGORITHMS = {
    "fedavg": ("--algorithm", "fedavg"),
    # with what a client keeps between rounds and what crossed the wire: every path of the message seam
    "fedlap": (
        *"--algorithm fedlap --ipc 2 --trajectories 1 --max-loops 2 --real-batches 2 --image-steps 2".split(),
        *"--init previous --save-transmitted".split(),
    ),
}


@pytest.fixture(scope="module")
def superlink(tmp_path_factory):
    """One running SuperLink for the module's tests; stopped, by pid, after the last of them."""
    link = SuperLink(tmp_path_factory.mktemp("superlink"))
    try:
        yield link
    finally:
        link.close()


@pytest.fixture
def federation(superlink, tmp_path):
    """The SuperLink with no SuperNodes of this test yet; every SuperNode the test starts is stopped, by pid, after
    it."""
    fed = Federation(superlink, tmp_path / "federation")
    try:
        yield fed
    finally:
        fed.close()


def deployment_args(fed: Federation) -> tuple[str, ...]:
    return ("--engine", "flower", "--superlink", fed.address, "--root-certificates", str(fed.tls["ca"]))


def test_each_site_draws_its_noise_from_a_secret_the_server_never_holds(tmp_path, cli, federation):
    """Three sites with their own secrets (DP-FedAvg, gradient canaries, two rounds: each round's ClientApp is a new
    process that reads its site's secret back; at most two sites at work at once). DP-FedAvg on sites equals the
    local engine with a public --noise-seed in the test of sites that keep their records, FedLAP-DP in the
    kill-and-resume test. Nothing the server received or wrote, nor the SuperLink's files,
    holds a secret or a key derived from one; the server, replaying every client with all it holds (the records of a
    plain deployment, the seed, the global models), gets updates as far from the sites' as independent noise puts
    two updates of the same records (where the old derivation gave the same update); verify's secrecy check finds
    no public stream in the kept queries."""
    import stat

    from fedaudit.attacks.conformance.checks import verify
    from fedaudit.privacy.randomness import client_key
    from fedaudit.rundir import RunDirectory

    for client in range(CLIENTS):
        federation.start_supernode(client)
    args = (*DP, *ALGORITHMS["fedavg"], "--canaries", "200", "--save-transmitted")
    deployed, replay = tmp_path / "deployed", tmp_path / "replay"
    window = ("--parallel-clients", "2")  # two sites at work at once: the third gets its round when one replies
    result = cli("train", *args, *deployment_args(federation), *window, "--wait-seconds", "120", "--out", deployed)
    assert result.exit_code == 0, result.output + federation.log("supernode-0")
    config = json.loads((deployed / "config.json").read_text())
    assert config["engine"] == "flower" and config["flower"]["superlink"] == federation.address
    assert config["parallel_clients"] == 2
    randomness = json.loads((deployed / "manifest.json").read_text())["randomness"]
    assert randomness["source"] == "client-secrets" and not (deployed / "client-secrets.json").exists()
    secrets = []
    for client in range(CLIENTS):
        path = federation.secret_path(client)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600  # readable by its owner only
        stored = json.loads(path.read_text())
        assert stored["client"] == client and list(stored["runs"]) == [randomness["run_id"]]
        entry = stored["runs"][randomness["run_id"]]
        assert sorted(entry["rounds"]) == ["0", "1"]  # the rounds it answered, each once
        secret = bytes.fromhex(entry["secret"])
        secrets += [secret, client_key(secret, randomness["run_id"], client)]
    kept = [deployed, federation.directory, federation.superlink.directory]
    kept = [p for folder in kept for p in folder.rglob("*") if p.is_file()]
    kept = [p for p in kept if not p.name.startswith("secret.json") and not p.name.startswith(".secret.json")]
    for path in kept:
        data = path.read_bytes()
        assert not any(s in data or s.hex().encode() in data for s in secrets), path

    # the server's best replay, from the run seed; and how far apart independent noise puts two updates
    assert cli("train", *args, "--noise-seed", "0", "--out", replay).exit_code == 0
    assert cli("train", *args, "--noise-seed", "1", "--out", tmp_path / "other").exit_code == 0
    distances, apart = update_distances(deployed, replay), update_distances(tmp_path / "other", replay)
    assert len(distances) == CLIENTS and all(d >= 0.75 * a > 0.5 for d, a in zip(distances, apart)), (distances, apart)
    verification = verify(RunDirectory(deployed))
    assert verification.passed, [c.sentence for c in verification.checks if not c.passed]
    assert "not traced" in verification.check("secrecy").sentence  # the server holds no secret to trace to


def test_a_client_claimed_twice_is_refused(tmp_path, cli, federation):
    federation.start_supernode(1)
    federation.start_supernode(2, node_config="client-id=1")
    out = tmp_path / "run"
    result = cli(
        "train", *BASE, *ALGORITHMS["fedavg"], *deployment_args(federation), "--wait-seconds", "90", "--out", out
    )
    assert_user_error(result, mentions="claim client 1")


def test_missing_sites_and_bad_connections_are_one_sentence(tmp_path, cli, federation):
    federation.start_supernode(0)
    args = (*BASE, *ALGORITHMS["fedavg"], *deployment_args(federation))
    line = assert_user_error(cli("train", *args, "--wait-seconds", "5", "--out", tmp_path / "a"))
    assert "No SuperNode hosts client" in line and "of 3 clients connected" in line  # client 0's may be slow to say
    wrong_ca = tmp_path / "other-ca"
    from federation import make_tls_files

    other = make_tls_files(wrong_ca)["ca"]
    bad = (*BASE, "--engine", "flower", "--superlink", federation.address, "--root-certificates", str(other))
    assert "Cannot use the SuperLink" in assert_user_error(cli("train", *bad, "--out", tmp_path / "b"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # a failed deployment creates nothing
    assert not list(tmp_path.glob(".*.partial-*"))


@pytest.mark.parametrize(
    ("extra", "mentions"),
    [
        (("--engine", "flower", "--superlink", "127.0.0.1:1"), "--root-certificates"),
        (("--engine", "flower", "--superlink", "127.0.0.1", "--insecure"), "HOST:PORT"),
        (("--superlink", "127.0.0.1:9000", "--insecure"), "--engine flower"),
        (("--insecure",), "--superlink"),
        (("--engine", "flower", "--superlink", "h:1", "--root-certificates", "/nonexistent/ca.crt"), "readable"),
        (("--engine", "flower", "--superlink", "h:1", "--insecure", "--wait-seconds", "0"), "--wait-seconds"),
        (  # a site's control variate would reach the server beside the secure sum
            (
                *("--engine", "flower", "--superlink", "h:1", "--insecure", "--algorithm", "scaffold"),
                *(
                    "--local-steps",
                    "2",
                    "--dp",
                    "--dp-level",
                    "client",
                    "--noise-at",
                    "clients",
                    "--max-update-norm",
                    "1",
                ),
            ),
            "secure sum",
        ),
        (  # SecAgg+ adds 2^22 levels a site modulo 2^32
            (
                *("--engine", "flower", "--superlink", "h:1", "--insecure", "--num-clients", "1001"),
                *("--dp", "--dp-level", "client", "--noise-at", "clients", "--max-update-norm", "1"),
            ),
            "at most 1000 sites a round",
        ),
    ],
)
def test_bad_deployment_options_are_one_sentence(tmp_path, cli, extra, mentions):
    out = tmp_path / "run"
    assert_user_error(cli("train", *FAST_ARGS, *extra, "--out", out), mentions=mentions)
    assert not out.exists()


def test_a_site_killed_mid_round_stops_the_round_and_the_run_resumes_exactly(tmp_path, cli, federation, monkeypatch):
    from fedaudit.engine.deployment import DeploymentEngine

    for client in range(SITES):  # the site that dies declares a heartbeat every 3 s (not Flower's 30 s)
        federation.start_supernode(client, public_noise=True, heartbeat_seconds=3 if client == 1 else None)
    args = (*dp_args(SITES), "--noise-seed", "0", *ALGORITHMS["fedlap"])
    local, deployed = tmp_path / "local", tmp_path / "deployed"
    assert cli("train", *args, "--out", local).exit_code == 0

    exchange = DeploymentEngine._exchange

    def kill_in_round_two(self, requests, round_number, deadline):
        if round_number == 2:
            federation.kill("supernode-1")  # SIGKILL: the site is gone without a word
            # the site comes back (a new node id) while the server waits for the dead one's heartbeat (6 s); the
            # server knows nothing of it until it resumes
            federation.start_supernode(1, public_noise=True)
        return exchange(self, requests, round_number, deadline)

    monkeypatch.setattr(DeploymentEngine, "_exchange", kill_in_round_two)
    result = cli("train", *args, *deployment_args(federation), "--wait-seconds", "120", "--out", deployed)
    line = assert_user_error(result, mentions="SuperNode of client 1")
    assert "round 2" in line and "--resume" in line
    manifest = json.loads((deployed / "manifest.json").read_text())
    assert (manifest["status"], manifest["rounds_done"]) == ("failed", 1)

    monkeypatch.undo()
    result = cli("train", "--resume", deployed, "--wait-seconds", "120", "--no-progress")
    assert result.exit_code == 0, result.output + federation.log("supernode-1")
    assert engine_independent_digest(deployed) == engine_independent_digest(local)
    assert (deployed / "model.safetensors").read_bytes() == (local / "model.safetensors").read_bytes()
    ledgers = [json.loads((run / "privacy.json").read_text()) for run in (deployed, local)]
    assert ledgers[0] == ledgers[1]
    assert len(list((deployed / "transmitted").glob("round-*/client-*.safetensors"))) == 2 * SITES


def test_a_site_whose_data_changed_during_the_run_is_refused(monkeypatch):
    """The engine compares each reply's data fingerprint with the one the site reported at the start (a stand-in
    grid answers for the site: no processes needed)."""
    from types import SimpleNamespace

    import torch
    from flwr.app import Array, ArrayRecord, ConfigRecord
    from flwr.supercore.task_identity import TaskIdentity

    from fedaudit.algorithms.base import ClientData, RoundContext
    from fedaudit.config import RunConfig
    from fedaudit.engine.deployment import DeploymentEngine, DeploymentError

    for name in ("_task_id", "_run_id", "_node_id"):  # what the engine's session would have set
        monkeypatch.setattr(TaskIdentity, name, 1)
    engine = DeploymentEngine(RunConfig(), num_clients=1, membership=[])

    def reply(fingerprint: str) -> SimpleNamespace:
        info = ConfigRecord(
            {"client": 0, "num_examples": 3, "metrics": "{}", "events": "[]", "fingerprint": fingerprint}
        )
        payload = ArrayRecord({"delta": Array(torch.zeros(2).numpy())})
        return SimpleNamespace(
            content={"info": info, "payload": payload},
            has_error=lambda: False,
            metadata=SimpleNamespace(reply_to_message_id="m0"),
        )

    answers: list[SimpleNamespace] = []
    engine._grid = SimpleNamespace(push_messages=lambda messages: ["m0"], pull_messages=lambda ids: [answers.pop()])
    engine.site_map.node_of, engine.site_map.fingerprint = {0: 7}, {0: "a" * 64}
    data = ClientData(0, torch.zeros(3, 1, 2, 2), torch.zeros(3, dtype=torch.long))
    ctx = RoundContext(0, 2, RunConfig(), torch.device("cpu"))
    args = (None, None, {"w": torch.zeros(2)}, [data], ctx, None, {})
    answers.append(reply("a" * 64))
    assert engine.run_clients(*args)[0].client_id == 0
    answers.append(reply("b" * 64))
    with pytest.raises(DeploymentError, match="data at client 0's site changed during the run"):
        engine.run_clients(*args)
    engine._grid = None  # nothing to close: there was no session


@pytest.mark.parametrize("window", [None, 1, 2, 5])
def test_at_most_parallel_clients_sites_are_at_work_at_once(window, monkeypatch):
    """With --parallel-clients N the engine keeps at most N messages outstanding and sends the next one as soon as a
    reply comes; without it every selected site gets its round at once (a stand-in grid answers one reply per
    pull, oldest first)."""
    from types import SimpleNamespace

    from fedaudit.config import RunConfig
    from fedaudit.engine import deployment

    monkeypatch.setattr(deployment, "POLL_SECONDS", 0.0)  # the stand-in grid answers at once
    engine = deployment.DeploymentEngine(RunConfig(parallel_clients=window), num_clients=5, membership=[])
    outstanding: list[str] = []
    most = 0

    def push(messages: list[str]) -> list[str]:
        nonlocal most
        outstanding.extend(messages)
        most = max(most, len(outstanding))
        return list(messages)

    def pull(ids: list[str]) -> list[SimpleNamespace]:
        done = outstanding.pop(0)
        return [SimpleNamespace(has_error=lambda: False, metadata=SimpleNamespace(reply_to_message_id=done))]

    engine._grid = SimpleNamespace(push_messages=push, pull_messages=pull)
    requests = {client: f"m{client}" for client in range(4)}
    replies = engine._exchange(requests, 1, float("inf"))
    assert sorted(replies) == [0, 1, 2, 3] and not outstanding
    assert most == (4 if window is None else min(window, 4))


def test_sites_that_keep_their_records_train_and_are_audited_where_the_records_are(tmp_path, cli, federation):
    """Two sites, each with its own file and no file in common; this process (the server) is never allowed to read
    a data file. DP-FedAvg equals the same run trained here from the two files, byte for byte, and the attack
    computed at the sites gives the local attack's scores; a site whose records changed is refused. (FedLAP-DP's
    messages, with client state and what crossed the wire, are the kill-and-resume test's: a site's own file changes
    where the records come from, not what the algorithm sends.)"""
    import numpy as np
    from sklearn.datasets import load_digits

    import fedaudit.data.sites as sites_module
    import fedaudit.data.user as user

    digits = load_digits()
    x, y = digits.images.astype(np.float32)[:, None], digits.target
    files = []
    for k, part in enumerate(np.array_split(np.random.default_rng(1).permutation(len(y)), SITES)):
        folder = tmp_path / f"site-{k}"
        folder.mkdir()
        np.savez(folder / "records.npz", x=x[part], y=y[part])
        files.append(folder / "records.npz")
        federation.start_supernode(
            k, node_config=f'client-id={k} data="npz:{folder / "records.npz"}"', public_noise=True
        )
    sites = ("--dataset", "sites", "--rounds", "1")
    local_sites = tuple(f"--site-data=npz:{f}" for f in files)
    local, deployed = tmp_path / "fedavg-local", tmp_path / "fedavg-deployed"
    base = (*dp_args(SITES), "--noise-seed", "0", *ALGORITHMS["fedavg"], *sites)
    assert cli("train", *base, *local_sites, "--out", local).exit_code == 0
    attack = ("--signal", "loss", "--signal", "grad-norm", "--method", "threshold", "--no-progress")
    real = user.read_records
    user.read_records = sites_module.read_records = lambda *a, **k: pytest.fail("the server read a data file")
    try:
        result = cli("train", *base, *deployment_args(federation), "--wait-seconds", "120", "--out", deployed)
        assert result.exit_code == 0, result.output + federation.log("supernode-0")
        assert engine_independent_digest(deployed) == engine_independent_digest(local)
        config = json.loads((deployed / "config.json").read_text())
        assert config["data"]["sites"] == [] and "records" not in json.dumps(config)
        remote = cli("attack", deployed, *attack, *deployment_args(federation)[2:])
        assert remote.exit_code == 0, remote.output + federation.log("supernode-1")
    finally:
        user.read_records = sites_module.read_records = real
    assert cli("attack", local, *attack).exit_code == 0
    for result in ("loss-threshold", "grad-norm-threshold"):
        for table in ("scores.csv", "roc.csv"):
            mine = (deployed / "attacks" / result / table).read_bytes()
            assert mine == (local / "attacks" / result / table).read_bytes(), (result, table)
    changed = np.load(files[-1])
    np.savez(files[-1], x=changed["x"], y=(changed["y"] + 1) % 10)  # the site's records are no longer the run's
    line = assert_user_error(cli("attack", deployed, *attack, *deployment_args(federation)[2:]))
    assert f"Client {SITES - 1}'s site holds other records than the run was trained on" in line


def test_noise_shares_reach_the_server_only_summed_under_secagg_plus(tmp_path, cli, federation):
    """Client-level DP with the noise in shares on three sites, one round: the round's payloads are summed under
    Flower's SecAgg+ (its workflow's stages and its client mod at every site), so the server keeps no site's payload,
    only the sum, which is the local engine's sum of the same shares (a public --noise-seed) to SecAgg+'s
    quantisation; the models agree to it, verify's checks pass on the sum, and the report says the server saw the
    sum alone. The sites seed their rounding by client, round and the model sent, so the same round asked again
    (here: the same run trained again) sums to the same bytes, as a resumed round must."""
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import load_file

    from fedaudit.attacks.conformance.client_level import verify_client_level
    from fedaudit.rundir import RunDirectory

    for client in range(CLIENTS):
        federation.start_supernode(client, public_noise=True)
    args = (
        *FAST_ARGS,
        *("--num-clients", str(CLIENTS), "--rounds", "1", "--dp", "--dp-level", "client", "--noise-at", "clients"),
        *("--max-update-norm", "0.5", "--noise-multiplier", "1", "--noise-seed", "0", "--save-transmitted"),
    )
    local, deployed, again = tmp_path / "local", tmp_path / "deployed", tmp_path / "again"
    assert cli("train", *args, "--out", local).exit_code == 0
    for out in (deployed, again):
        result = cli("train", *args, *deployment_args(federation), "--wait-seconds", "120", "--out", out)
        assert result.exit_code == 0, result.output + federation.log("supernode-0")
    folder = deployed / "transmitted" / "round-0001"
    assert sorted(p.name for p in folder.iterdir()) == ["secure-sum.safetensors"]  # no site's payload
    with safe_open(str(folder / "secure-sum.safetensors"), "np") as file:
        assert file.metadata()["clients"] == "0,1,2"
    summed = load_file(str(folder / "secure-sum.safetensors"))
    sent = [load_file(str(p)) for p in sorted((local / "transmitted" / folder.name).glob("client-*"))]
    assert len(sent) == CLIENTS
    for name, total in summed.items():
        # within a few quantisation steps: R = C (1 + 10 sigma / sqrt(3)) over 2^21, three sites
        assert np.abs(total - sum(s[name] for s in sent)).max() < 1e-4, name
    mine, theirs = load_file(str(deployed / "model.safetensors")), load_file(str(local / "model.safetensors"))
    assert max(float(np.abs(mine[k] - theirs[k]).max()) for k in mine) < 1e-4
    assert (again / "model.safetensors").read_bytes() == (deployed / "model.safetensors").read_bytes()
    repeated = load_file(str(again / "transmitted" / "round-0001" / "secure-sum.safetensors"))
    assert repeated.keys() == summed.keys() and all(np.array_equal(repeated[k], summed[k]) for k in summed)
    verification = verify_client_level(RunDirectory(deployed))
    assert verification.passed, [c.sentence for c in verification.checks if not c.passed]
    assert verification.check("shares").details["updates"] == CLIENTS
    clear = json.loads((deployed / "checkpoints" / "round-0001.json").read_text())["clients"]
    assert [sorted(entry) for entry in clear] == [["bytes_up", "client", "local_steps"]] * CLIENTS  # no loss in clear
    assert cli("report", deployed, "--out", tmp_path / "report", "--format", "md").exit_code == 0
    report = (tmp_path / "report" / "report.md").read_text()  # a public noise seed: anyone can remove the noise
    assert "public --noise-seed" in report and "need not be trusted" not in report and "saw only the sum" not in report


def test_a_site_refuses_to_send_its_share_in_clear_beside_other_sites():
    """A server that skips the secure sum (by fault or on purpose) for a round of several sites gets no share."""
    from fedaudit.config import RunConfig
    from fedaudit.engine.deployment import _no_share_in_clear

    shares = RunConfig.from_dict(
        {"privacy": {"dp": True, "dp_level": "client", "noise_at": "clients", "max_update_norm": 1.0}}
    )
    config = json.dumps(shares.to_dict())
    with pytest.raises(RuntimeError, match="under SecAgg"):
        _no_share_in_clear({"config": config, "sites": 2, "participants": 2})
    for claimed in (0, 2, 5):  # one site asked, more participants named: its share is a fraction of the noise
        with pytest.raises(RuntimeError, match="under SecAgg"):
            _no_share_in_clear({"config": config, "sites": 1, "participants": claimed})
    _no_share_in_clear({"config": config, "sites": 1, "participants": 1})  # alone: its share is the whole noise
    _no_share_in_clear({"config": json.dumps(RunConfig().to_dict()), "sites": 3})  # no shares


@pytest.mark.parametrize("answer", ["error", "silence", "garbled"])
def test_a_site_that_fails_or_falls_silent_in_a_secure_round_is_one_sentence(monkeypatch, answer):
    """SecAgg+'s set-up stage with two sites, one of which answers with an error, not at all, or with a reply that
    is not of the protocol (a stand-in grid answers for the sites): the round ends with one sentence naming that
    site's client and the stage, or the stage and what did not fit."""
    from types import SimpleNamespace

    import torch
    from flwr.supercore.task_identity import TaskIdentity

    from fedaudit.algorithms.base import RoundContext
    from fedaudit.config import RunConfig
    from fedaudit.engine.deployment import DeploymentEngine, DeploymentError

    for name in ("_task_id", "_run_id", "_node_id"):  # what the engine's session would have set
        monkeypatch.setattr(TaskIdentity, name, 1)
    engine = DeploymentEngine(RunConfig(), num_clients=2, membership=[])
    engine.site_map.node_of = {0: 7, 1: 8}
    engine._context = SimpleNamespace(run_id=1, node_id=0, run_config={})
    engine.round_timeout, engine.clip = 0.3, (1.0, 1.0)
    sent: dict[str, int] = {}

    def push(messages):
        ids = [f"m{len(sent) + i}" for i in range(len(messages))]
        sent.update(zip(ids, (m.metadata.dst_node_id for m in messages)))
        return ids

    def pull(ids):  # client 0's site (node 7) answers; client 1's (node 8) fails, says nothing or says nonsense
        failed = SimpleNamespace(code=0, reason="the site's disk is full")
        return [
            SimpleNamespace(
                has_error=lambda node=sent[mid]: node == 8 and answer == "error",
                error=failed,
                metadata=SimpleNamespace(reply_to_message_id=mid, src_node_id=sent[mid]),
                content=SimpleNamespace(config_records={}),  # no public keys
            )
            for mid in ids
            if sent[mid] == 7 or answer != "silence"
        ]

    engine._grid = SimpleNamespace(push_messages=push, pull_messages=pull)
    ctx = RoundContext(0, 2, RunConfig(), torch.device("cpu"), participants=2)
    requests = {0: SimpleNamespace(content=None), 1: SimpleNamespace(content=None)}
    with pytest.raises(DeploymentError) as raised:
        engine._secure_exchange(requests, ctx, {"w": torch.zeros(2)})
    sentence = str(raised.value)
    if answer == "garbled":
        assert sentence.startswith("Round 1's secure sum failed in SecAgg+'s set-up stage (KeyError"), sentence
        return
    assert sentence.count(".") <= 2 and "Client 1" in sentence and "round 1" in sentence, sentence
    if answer == "error":
        assert "the site's disk is full" in sentence and "node 8" in sentence
    else:
        assert "set-up stage of the secure sum within 0.3 s" in sentence


def test_a_sites_error_is_its_own_sentence_without_flowers_wrapper():
    """A SuperNode that could not say which client it hosts was reported as "<class 'RuntimeError'>:<'...'>"; the
    round's failures already read without it: both use one function now."""
    from types import SimpleNamespace

    from fedaudit.engine.deployment import error_reason

    wrapped = SimpleNamespace(reason="<class 'ValueError'>:<'invalid literal for int() with base 10: 'abc''>")
    assert error_reason(wrapped) == "invalid literal for int() with base 10: 'abc'"
    plain = SimpleNamespace(reason="this run's sites keep their records, but this SuperNode names no data.")
    assert error_reason(plain) == "this run's sites keep their records, but this SuperNode names no data"
