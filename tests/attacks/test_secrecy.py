"""The secrecy check of `fedaudit verify`: a run whose noise or Poisson sample a holder of its public material can
regenerate fails; faults planted in the real training code, some of a shape the check's list of public streams was
not written for, are caught; correct runs, runs handed over without their secrets and runs that declare public
noise are not flagged; a run trained before client secrets fails and says why."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import FAST_ARGS, invoke

import fedaudit.algorithms.base as base
import fedaudit.attacks.conformance.secrecy as secrecy_module
import fedaudit.privacy.primitive as primitive
import fedaudit.privacy.randomness as randomness
from fedaudit.attacks.conformance.checks import Verification, verify
from fedaudit.attacks.conformance.secrecy import KeptQuery, PublicMaterial, redrawable, secrecy
from fedaudit.privacy.randomness import SeededKeys
from fedaudit.rundir import RunDirectory
from fedaudit.seeding import Stream, make_generator

SEED = 5
CANARY_RUN = (*FAST_ARGS, *f"--dp --canaries 200 --noise-multiplier 1 --rounds 3 --seed {SEED}".split())


def train(out: Path, *extra: str) -> RunDirectory:
    result = invoke("train", *CANARY_RUN, *extra, "--out", out)
    assert result.exit_code == 0, result.output
    return RunDirectory(out)


def secrecy_of(run: RunDirectory):
    verification: Verification = verify(run)
    others = [c.sentence for c in verification.checks if c.name != "secrecy" and not c.passed]
    assert not others, others  # each fault here touches where the randomness comes from, nothing else
    return verification.check("secrecy")


def _keys_from_the_run_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's key factory hands out keys derived from the run seed while the manifest says client secrets."""
    real = randomness.RunRandomness.for_config.__func__

    def planted(cls, config, run_id, *, at_sites):
        made = real(cls, config, run_id, at_sites=at_sites)
        made.keys = lambda client: SeededKeys(config.seed, client, secure=config.privacy.secure_noise)
        return made

    monkeypatch.setattr(randomness.RunRandomness, "for_config", classmethod(planted))


def _one_round_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every query of a client's round draws from one generator of the run seed, in turn (fedaudit before secrets)."""
    streams: dict[tuple[int, int], torch.Generator] = {}

    def next_query(self):
        key = (self.draws.round, self.client_id)
        if key not in streams:
            streams[key] = make_generator(SEED, Stream.CLIENT, *key)
        self.draws.made += 1
        return streams[key]

    monkeypatch.setattr(base.ClientData, "next_query", next_query)


def _sample_from_the_run_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The noise comes from the client's secret, but each query's Poisson sample is drawn from the run seed's stream
    for that query (round, client, query)."""

    def dp_batch(self, sample_rate):
        source = self.next_query()
        public = make_generator(SEED, Stream.QUERY, self.draws.round, self.client_id, self.draws.made - 1)
        idx = base.poisson_sample(self.num_examples, sample_rate, generator=public)
        sampled = base.poisson_sample(self.num_canaries, sample_rate, generator=public)
        extra = {name: g[sampled] for name, g in self.canary_grads.items()}
        self.recorder.batch(idx, self.audit.held[sampled.numpy()], sample_rate)
        return base.DPBatch(self.x[idx], self.y[idx], extra, source)

    monkeypatch.setattr(base.ClientData, "dp_batch", dp_batch)


def _secret_from_the_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client's secret is made from the run seed instead of the operating system's generator."""
    monkeypatch.setattr(randomness, "new_secret", lambda: SEED.to_bytes(32, "big"))


def _noise_from_torchs_global_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    """The noise is drawn from torch's global generator, which the run seeds (the initial model) before every round:
    public, but no stream the check lists. Only its trace to the clients' secrets can catch it."""
    monkeypatch.setattr(
        primitive, "add_gaussians", lambda totals, std, source: [t + std * torch.randn(t.shape) for t in totals]
    )


@pytest.mark.parametrize(
    ("fault", "says"),
    [
        pytest.param(
            _keys_from_the_run_seed, f"seed {SEED}'s stream QUERY keyed as --noise-seed", id="keys-from-the-run-seed"
        ),
        pytest.param(_one_round_stream, "replayed", id="one-stream-per-round-as-before-secrets"),
        pytest.param(_sample_from_the_run_seed, "sample", id="poisson-sample-from-the-run-seed"),
        pytest.param(_secret_from_the_seed, "as the secret", id="secret-made-from-the-seed"),
        pytest.param(_noise_from_torchs_global_generator, "not what its client's secret gives", id="global-torch-rng"),
    ],
)
def test_noise_or_samples_a_holder_of_the_public_material_can_regenerate_fail(tmp_path, monkeypatch, fault, says):
    fault(monkeypatch)
    run = train(tmp_path / "run")
    monkeypatch.undo()
    found = secrecy_of(run)
    assert not found.passed and found.p_value is not None and found.p_value <= 0.001 / 6, found.sentence
    assert says in found.sentence, found.sentence


def test_the_public_streams_alone_catch_the_listed_faults_without_the_secrets(tmp_path, monkeypatch):
    """Handed over without client-secrets.json, a run whose noise is a public stream still fails; one whose noise
    comes from a stream the check does not list passes then (the limit docs/audit.md states)."""
    _keys_from_the_run_seed(monkeypatch)
    listed = train(tmp_path / "listed")
    monkeypatch.undo()
    _noise_from_torchs_global_generator(monkeypatch)
    unlisted = train(tmp_path / "unlisted")
    monkeypatch.undo()
    for run in (listed, unlisted):
        assert invoke("export", run.path, "--out", tmp_path / f"{run.path.name}-copy").exit_code == 0
    assert not secrecy_of(RunDirectory(tmp_path / "listed-copy")).passed
    blind = secrecy_of(RunDirectory(tmp_path / "unlisted-copy"))
    assert blind.passed and "not traced" in blind.sentence


def _noise_from_a_fresh_global_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    """The noise drawn from torch's global generator in a process that never seeded it (fedaudit's model building
    puts it back as it found it): one public stream from which every query draws in turn, mid-stream after the
    first."""
    stream = torch.Generator()  # torch's default seed, as a process starts it
    monkeypatch.setattr(
        primitive,
        "add_gaussians",
        lambda totals, std, source: [t + std * torch.randn(t.shape, generator=stream) for t in totals],
    )


def _round_stream_after_other_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every query of a client's round draws from the client's public round stream after the round's other draws
    (a FedLAP-DP client's initial set, say): no query starts a stream, and the replay as before secrets misses."""
    streams: dict[tuple[int, int], torch.Generator] = {}

    def next_query(self):
        key = (self.draws.round, self.client_id)
        if key not in streams:
            streams[key] = make_generator(SEED, Stream.CLIENT, *key)
            torch.rand(1000, generator=streams[key])
        self.draws.made += 1
        return streams[key]

    monkeypatch.setattr(base.ClientData, "next_query", next_query)


@pytest.mark.parametrize(
    ("fault", "says"),
    [
        pytest.param(
            _noise_from_a_fresh_global_generator, "torch's global generator as a process starts it", id="global"
        ),
        pytest.param(_round_stream_after_other_draws, "client stream of round", id="round-stream-mid-way"),
    ],
)
def test_a_public_stream_used_mid_stream_is_found_without_the_secrets(tmp_path, monkeypatch, fault, says):
    """A copy without client-secrets.json, whose queries drew from the middle of a public stream: the check finds
    the query's sample or noise at its offset in the stream (module midstream) and fails it."""
    fault(monkeypatch)
    run = train(tmp_path / "run")
    monkeypatch.undo()
    assert invoke("export", run.path, "--out", tmp_path / "copy").exit_code == 0
    found = secrecy_of(RunDirectory(tmp_path / "copy"))
    assert not found.passed and says in found.sentence and "from its word" in found.sentence, found.sentence


def test_a_secure_noise_run_whose_keys_are_public_fails_even_in_a_copy_without_its_secrets(tmp_path, monkeypatch):
    """With --secure-noise the queries draw from ChaCha20 keystreams; keys derived from the run seed are caught by
    the sample their public keystreams give (the check does not draw the secure Gaussians)."""
    _keys_from_the_run_seed(monkeypatch)
    run = train(tmp_path / "run", "--secure-noise")
    monkeypatch.undo()
    assert invoke("export", run.path, "--out", tmp_path / "copy").exit_code == 0
    found = secrecy_of(RunDirectory(tmp_path / "copy"))
    assert not found.passed and "secure stream of seed 5's stream QUERY's sample" in found.sentence, found.sentence


def test_correct_runs_pass_and_are_traced_to_their_clients_secrets(tmp_path):
    """The null side, with secure sampling too (tests/attacks/test_conformance.py verifies correct runs of more seeds,
    every check included)."""
    found = secrecy_of(train(tmp_path / "run"))
    assert found.passed, found.sentence
    assert "those their clients' secrets give" in found.sentence and found.details["traced_problems"] == []
    assert found.details["public_tests"] > 100
    secure = secrecy_of(train(tmp_path / "secure", "--secure-noise"))
    assert secure.passed and "their samples are those their clients' secrets give" in secure.sentence


def test_a_run_with_a_public_noise_seed_passes_as_declared(tmp_path):
    found = secrecy_of(train(tmp_path / "run", "--noise-seed", "11"))
    assert found.passed and "Not secret, as declared" in found.sentence and "--noise-seed 11" in found.sentence
    assert found.details["worst_p_value"] < 1e-100  # its noise is indeed the declared public stream
    assert "stream QUERY" in found.details["worst"]


def test_a_run_trained_before_client_secrets_fails_and_cannot_be_resumed(tmp_path, monkeypatch):
    """A run of an older fedaudit: one stream of the run seed per client and round, no randomness record."""
    _one_round_stream(monkeypatch)
    run = train(tmp_path / "run")
    monkeypatch.undo()
    manifest = json.loads(run.manifest_path.read_text())
    del manifest["randomness"]
    run.manifest_path.write_text(json.dumps(manifest))
    run.secrets_path.unlink()
    found = secrecy_of(run)
    assert not found.passed and "before fedaudit kept client secrets" in found.sentence
    before = run.manifest_path.read_bytes()
    result = invoke("train", "--resume", run.path, "--rounds", "4")
    assert result.exit_code == 2 and "cannot be resumed exactly" in result.stderr
    assert run.manifest_path.read_bytes() == before


def test_a_run_whose_sites_keep_their_records_is_not_checked(tmp_path):
    """No whole query leaves a site that keeps its records, so there is nothing to compare."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = digits.images.astype(np.float32)[:, None], digits.target
    sites = []
    for k, part in enumerate(np.array_split(np.arange(len(y)), 2)):
        np.savez(tmp_path / f"site{k}.npz", x=x[part], y=y[part])
        sites.append(f"--site-data=npz:{tmp_path / f'site{k}.npz'}")
    run = train(tmp_path / "run", "--dataset", "sites", "--num-clients", "2", *sites)
    found = secrecy_of(run)
    assert found.passed and found.p_value is None and found.details["not_checked"] is True


def test_secrets_of_another_run_trace_nothing_and_fail(tmp_path):
    first, second = train(tmp_path / "first"), train(tmp_path / "second")
    shutil.copyfile(second.secrets_path, first.secrets_path)
    found = secrecy_of(first)
    assert not found.passed and "the secrets of another run" in found.sentence


def _gpu_query(threads: int | None, population: int = 10_800) -> KeptQuery:
    return KeptQuery(
        label="round 1, client 0, step 0",
        round=0,
        client=0,
        step=0,
        noise=torch.zeros(4, dtype=torch.float64),
        scale=1.0,
        index=None,
        population=population,
        rate=0.02,
        canaries=0,
        device="cuda",
        threads=threads,
    )


def test_a_gpu_s_draws_are_redrawn_only_where_a_gpu_lays_them_out_alike() -> None:
    """torch's CUDA generators spread a draw over at most the GPU's multiprocessors x threads each (an H200: 132 x
    2048 = 270,336, an A100: 108 x 2048 = 221,184); a larger draw, and every draw after it, comes out otherwise on
    a GPU that differs there. Known answers, with the ConvNet of width 128 (its largest tensor 147,456 values)."""
    convnet = {"conv": torch.Size([128, 128, 3, 3]), "fc": torch.Size([10, 2048])}
    h200, a100 = 132 * 2048, 108 * 2048
    cpu = replace(_gpu_query(h200), device="cpu", threads=None)
    assert redrawable(cpu, a100, convnet) and redrawable(_gpu_query(None), a100, convnet)  # earlier runs: as before
    assert redrawable(_gpu_query(h200), h200, convnet)
    assert redrawable(_gpu_query(h200), a100, convnet)  # every draw fits both GPUs' threads
    wide = {**convnet, "wide": torch.Size([512, 512])}  # 262,144 values: within the H200's, beyond the A100's
    assert redrawable(_gpu_query(h200), h200, wide) and not redrawable(_gpu_query(h200), a100, wide)
    assert not redrawable(_gpu_query(h200, population=250_000), a100, convnet)  # the records' inclusion draw
    assert redrawable(_gpu_query(h200, population=221_184), a100, convnet)


def test_noise_drawn_on_another_kind_of_gpu_is_not_checked_rather_than_failed(monkeypatch) -> None:
    """On a GPU whose generators lay a large draw out otherwise, the secret's redraw would differ from a correct run's
    noise (a false alarm): such queries are left out, and with none left the check says so and passes."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(secrecy_module, "_gpu_threads", lambda: 1000)
    public = PublicMaterial(
        seeds=(0,), run_id="run", source="client-secrets", shapes={"w": torch.Size([4])}, secure=False, device="cuda"
    )
    found = secrecy([_gpu_query(2000, population=5000)], public, 0.01)
    assert found.passed and found.n == 0 and found.details["not_checked_on_another_gpu"] == 1
    assert found.sentence.startswith(
        "Not checked: this run's clients drew their noise on a GPU whose generators spread a large draw over 2000 "
        "threads, this one's over 1000"
    )


def test_a_correct_runs_copy_passes_the_search_of_public_streams(tmp_path):
    """The null side of the search at every offset: a correct run's copy, its secrets left out, is searched (its
    secrets would have made the search needless) and passes."""
    run = train(tmp_path / "run")
    assert invoke("export", run.path, "--out", tmp_path / "copy").exit_code == 0
    found = secrecy_of(RunDirectory(tmp_path / "copy"))
    assert found.passed and "not traced" in found.sentence, found.sentence
    assert "mid_stream" in found.details and found.details["mid_stream"] is None
    assert "mid_stream" in secrecy_of(run).details and secrecy_of(run).details["mid_stream"] is None
