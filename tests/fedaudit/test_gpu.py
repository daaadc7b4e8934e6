"""The CUDA path: the DP primitive, training, resume and attacks on a GPU agree with the CPU (skipped without CUDA)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import FAST_ARGS, invoke

from fedaudit.models import ModelSpec, build_model
from fedaudit.privacy.primitive import dp_gradient, per_sample_gradients

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ON_GPU = tuple(a if a != "cpu" else "cuda" for a in FAST_ARGS)


def test_per_sample_gradients_on_the_gpu_equal_the_cpu():
    torch.manual_seed(0)
    model = build_model(ModelSpec("convnet", (1, 28, 28), 10, width=16, depth=3))
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    cpu = per_sample_gradients(model, x, y)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # the same float32 arithmetic, not TensorFloat-32
        gpu = per_sample_gradients(model.cuda(), x.cuda(), y.cuda())
    for name, grad in cpu.items():
        torch.testing.assert_close(gpu[name].cpu(), grad, rtol=1e-3, atol=1e-5)


def test_dp_gradient_noise_on_the_gpu_has_the_right_scale():
    torch.manual_seed(0)
    model = build_model(ModelSpec("mlp", (1, 8, 8), 10, width=16, depth=1)).cuda()
    x, y = torch.zeros(0, 1, 8, 8, device="cuda"), torch.zeros(0, dtype=torch.long, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    noise = torch.cat(
        [
            g.flatten()
            for g in dp_gradient(
                model, x, y, noise_multiplier=2.0, max_grad_norm=0.5, expected_batch_size=4.0, generator=generator
            ).grads.values()
        ]
    )
    assert noise.device.type == "cuda" and abs(float(noise.std()) - 2.0 * 0.5 / 4.0) < 0.02


@pytest.mark.parametrize(
    "algorithm",
    [
        ("--algorithm", "fedavg"),
        ("--algorithm", "fedlap", "--ipc", "2", "--trajectories", "1", "--max-loops", "2", "--real-batches", "2"),
    ],
)
def test_training_resume_and_attack_on_the_gpu(tmp_path, algorithm, fixed_secrets):
    args = (*ON_GPU, *algorithm, "--dp", "--rounds", "2")
    full, part = tmp_path / "full", tmp_path / "part"
    assert invoke("train", *args, "--out", full).exit_code == 0
    assert json.loads((full / "manifest.json").read_text())["device"] == "cuda"
    assert invoke("train", *args[:-1], "1", "--out", part).exit_code == 0
    assert invoke("train", "--resume", part, "--rounds", "2", "--no-progress").exit_code == 0
    assert (part / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    cpu = tmp_path / "cpu"
    shutil.copytree(full, cpu)  # before the attack: a copy of an attacked run without its attacks' files is refused
    result = invoke("attack", full, "--device", "cuda", "--no-progress", "--bootstrap", "50")
    assert result.exit_code == 0, result.output
    assert invoke("attack", cpu, "--device", "cpu", "--no-progress", "--bootstrap", "50").exit_code == 0
    for name in ("loss-threshold", "grad-norm-threshold"):
        on_gpu, on_cpu = (json.loads((run / "attacks" / name / "metrics.json").read_text()) for run in (full, cpu))
        assert on_gpu["auc"] == pytest.approx(on_cpu["auc"], abs=2e-3)


def test_the_same_seed_gives_the_same_convnet_run_on_the_gpu(tmp_path, fixed_secrets):
    args = tuple(
        (
            "--dataset digits --model convnet --width 16 --algorithm fedlap --dp --ipc 2 --trajectories 1 "
            "--max-loops 2 --real-batches 2 --rounds 2 --batch-size 32 --device cuda --no-progress"
        ).split()
    )
    for name in ("a", "b"):
        assert invoke("train", *args, "--out", tmp_path / name).exit_code == 0
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


def test_the_layer_wise_dp_query_on_the_gpu_equals_the_cpu():
    from fedaudit.privacy.primitive import clipped_sum

    torch.manual_seed(0)
    model = build_model(ModelSpec("convnet", (1, 28, 28), 10, width=64, depth=3))
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    cpu, cpu_norms = clipped_sum(model, x, y, 0.5)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        gpu, gpu_norms = clipped_sum(model.cuda(), x.cuda(), y.cuda(), 0.5)
    torch.testing.assert_close(gpu_norms.cpu(), cpu_norms, rtol=1e-3, atol=1e-5)
    for name, value in cpu.items():
        torch.testing.assert_close(gpu[name].cpu(), value, rtol=1e-3, atol=1e-5)


def test_clients_on_cuda_streams_equal_clients_one_after_another(tmp_path, fixed_secrets):
    from safetensors.torch import load_file

    args = (*ON_GPU, "--algorithm", "fedlap", "--dp", "--ipc", "2", "--trajectories", "1", "--rounds", "2")
    for name, parallel in (("together", "5"), ("one", "1"), ("again", "5")):
        assert invoke("train", *args, "--parallel-clients", parallel, "--out", tmp_path / name).exit_code == 0
    models = {name: load_file(str(tmp_path / name / "model.safetensors")) for name in ("together", "one", "again")}
    for key, value in models["one"].items():
        torch.testing.assert_close(models["together"][key], value, rtol=1e-5, atol=1e-6)
    assert (tmp_path / "together" / "model.safetensors").read_bytes() == (
        tmp_path / "again" / "model.safetensors"
    ).read_bytes()


def test_a_canary_run_on_the_gpu_is_repeatable_and_passes_verify_and_its_audit(tmp_path, fixed_secrets):
    """The query recording on CUDA: two runs with the same seed and client secrets write the same query logs and
    model bit for bit, verify's independent checks of noise, clipping, sampling and secrecy pass (the secrecy check
    traces each kept query's noise, drawn on the GPU, to its client's secret), and the canary audit is not
    flagged."""
    args = (*ON_GPU, "--dp", "--width", "32", "--rounds", "3", "--local-epochs", "2", "--canaries", "500")
    for name in ("a", "b"):
        result = invoke("train", *args, "--out", tmp_path / name)
        assert result.exit_code == 0, result.output
    logs = sorted((tmp_path / "a" / "queries").glob("round-*.safetensors"))
    assert len(logs) == 3
    for path in [*logs, tmp_path / "a" / "model.safetensors"]:
        assert (tmp_path / "b" / path.relative_to(tmp_path / "a")).read_bytes() == path.read_bytes()
    run = tmp_path / "a"
    result = invoke("verify", run)
    assert result.exit_code == 0, result.output
    assert all(c["passed"] is not False for c in json.loads((run / "verification.json").read_text())["checks"])
    result = invoke("attack", run, "--method", "canary", "--device", "cuda", "--no-progress")
    assert result.exit_code == 0, result.output
    for view in ("update-projection-canary", "query-sum-canary", "query-llr-canary"):
        metrics = json.loads((run / "attacks" / view / "metrics.json").read_text())
        assert metrics["epsilon_lower_bound_exceeds_accountant"] is False


def test_secure_noise_on_the_gpu_passes_verify(tmp_path):
    """--secure-noise draws its keystream on the host and adds the noise on the GPU in float64."""
    args = (*ON_GPU, "--dp", "--secure-noise", "--rounds", "2", "--canaries", "200")
    assert invoke("train", *args, "--out", tmp_path / "run").exit_code == 0
    result = invoke("verify", tmp_path / "run")
    assert result.exit_code == 0, result.output
