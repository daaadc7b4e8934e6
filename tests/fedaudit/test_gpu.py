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


def ok(*args) -> None:
    """Run the command line in this process; a failure shows what it said (a GPU session has minutes, not reruns)."""
    result = invoke(*args)
    assert result.exit_code == 0, result.output


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
    ok("train", *args, "--out", full)
    assert json.loads((full / "manifest.json").read_text())["device"] == "cuda"
    ok("train", *args[:-1], "1", "--out", part)
    ok("train", "--resume", part, "--rounds", "2", "--no-progress")
    assert (part / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    cpu = tmp_path / "cpu"
    shutil.copytree(full, cpu)  # before the attack: a copy of an attacked run without its attacks' files is refused
    result = invoke("attack", full, "--device", "cuda", "--no-progress", "--bootstrap", "50")
    assert result.exit_code == 0, result.output
    ok("attack", cpu, "--device", "cpu", "--no-progress", "--bootstrap", "50")
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
        ok("train", *args, "--out", tmp_path / name)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("width, batch", [(64, 64), (128, 256)])
def test_the_layer_wise_dp_query_on_the_gpu_equals_the_cpu(width, batch):
    """The clipped sum and norms on the GPU and the CPU in float32 against the CPU's in float64. Each example enters
    the sum with a factor C / ||g_i|| of at most 1 and a norm of at most C, so a relative error e in the norms moves
    a sum by up to e C B, however much the examples cancel: float32's norms (1e-6 here, measured at 2e-4 of C B on
    the first convolution on the CPU, 9e-5 on a GroupNorm on an H200) are held to e = 1e-5, and leaving one example
    out moves the sums by far more than that. At width 128 and batch 256 the CPU streams the 14x14 convolution's
    per-sample gradients in cache-sized chunks and the GPU keeps them whole (layers.GPU_ELEMENTS)."""
    import copy

    from fedaudit.privacy import layers
    from fedaudit.privacy.primitive import clipped_sum

    clip = 0.5
    torch.manual_seed(0)
    model = build_model(ModelSpec("convnet", (1, 28, 28), 10, width=width, depth=3))
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    exact = copy.deepcopy(model).double()
    truth, truth_norms = clipped_sum(exact, x.double(), y, clip)
    cpu, cpu_norms = clipped_sum(model, x, y, clip)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        gpu, gpu_norms = clipped_sum(model.cuda(), x.cuda(), y.cuda(), clip)
    if width == 128:
        conv = model.features[4]
        assert batch * conv.weight.numel() > layers.CHUNK_ELEMENTS  # streamed on the CPU
        assert batch * conv.weight.numel() <= layers.GPU_ELEMENTS  # kept whole on the GPU
    tolerance = 1e-5 * clip * batch
    lost = clipped_sum(exact, x[1:].double(), y[1:], clip)[0]
    assert max(float((lost[name] - value).norm()) for name, value in truth.items()) > 10 * tolerance
    for norms in (cpu_norms, gpu_norms):
        torch.testing.assert_close(norms.cpu().double(), truth_norms, rtol=1e-4, atol=1e-6)
    for sums in (cpu, gpu):
        for name, value in truth.items():
            assert float((sums[name].cpu().double() - value).norm()) <= tolerance, name


def test_clients_on_cuda_streams_equal_clients_one_after_another(tmp_path, fixed_secrets):
    from safetensors.torch import load_file

    args = (*ON_GPU, "--algorithm", "fedlap", "--dp", "--ipc", "2", "--trajectories", "1", "--rounds", "2")
    for name, parallel in (("together", "5"), ("one", "1"), ("again", "5")):
        ok("train", *args, "--parallel-clients", parallel, "--out", tmp_path / name)
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
    ok("train", *args, "--out", tmp_path / "run")
    result = invoke("verify", tmp_path / "run")
    assert result.exit_code == 0, result.output


def test_a_graphed_step_equals_the_eager_step_and_reads_each_call_s_inputs():
    """GraphedStep replays an SGD step on a model whose weights and target change between calls: every call's
    result and the state it updates in place equal those of the eager step (a stale input would differ)."""
    from fedaudit.algorithms.base import SGD
    from fedaudit.cuda_graph import GraphedStep

    torch.manual_seed(0)
    model = build_model(ModelSpec("convnet", (1, 28, 28), 10, width=16, depth=3)).cuda()
    runs = {}
    for mode in ("eager", "graphed"):
        x = torch.randn(8, 1, 28, 28, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        x.requires_grad_(True)
        opt = SGD([x], lr=0.1, momentum=0.5)

        def step(weights: dict, target: list, x=x, opt=opt) -> torch.Tensor:
            out = torch.func.functional_call(model, weights, (x,))
            loss = (out - target[0]).pow(2).mean()
            (x.grad,) = torch.autograd.grad(loss, [x])
            opt.step()
            return loss.detach()

        stepper = GraphedStep(step) if mode == "graphed" else step
        weights = {k: v.detach().clone() for k, v in model.named_parameters()}
        losses = []
        for i in range(8):
            if i % 3 == 0:  # new weights (a new dict) every third call, a new target every call
                weights = {k: v + 0.01 * i for k, v in weights.items()}
            target = [torch.full((8, 10), float(i), device="cuda")]
            losses.append(stepper(weights, target))
        runs[mode] = (torch.stack(losses), x.detach().clone())
        if mode == "graphed":
            assert stepper.replays == 8 - GraphedStep.warmup and not stepper.failed
    torch.testing.assert_close(runs["graphed"][0], runs["eager"][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(runs["graphed"][1], runs["eager"][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threaded", [False, True])
def test_a_fedlap_client_with_graphed_image_steps_equals_the_eager_one(monkeypatch, threaded):
    """FedLAP-DP's client update on CUDA replays its image steps as a graph; the synthetic set it sends equals that of
    the eager steps (FEDAUDIT_CUDA_GRAPHS=0) with the same client randomness. ``threaded``: the graphed client runs
    as the local engine runs clients at once, on a thread and a stream of its own, after 40 other streams were
    taken from the default-priority pool (which then wraps)."""
    from concurrent.futures import ThreadPoolExecutor

    import fedaudit.algorithms.fedlap as fedlap_module
    from fedaudit.algorithms.base import ClientData, RoundContext, get_algorithm
    from fedaudit.config import FederatedConfig, FedLAPConfig, PrivacyConfig, RunConfig
    from fedaudit.cuda_graph import GraphedStep
    from fedaudit.privacy.randomness import QueryDraws, SeededKeys

    steppers = []

    class Spy(fedlap_module.GraphedStep):
        def __init__(self, fn):
            super().__init__(fn)
            steppers.append(self)

    monkeypatch.setattr(fedlap_module, "GraphedStep", Spy)
    config = RunConfig(
        federated=FederatedConfig(algorithm="fedlap", rounds=1, batch_size=32),
        privacy=PrivacyConfig(dp=True, noise_multiplier=1.0),
        fedlap=FedLAPConfig(ipc=3, trajectories=1, max_loops=2, real_batches=2, image_steps=4, radius=50.0),
    ).resolved()
    torch.manual_seed(0)
    model = build_model(ModelSpec("convnet", (1, 28, 28), 10, width=16, depth=3)).cuda()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x = torch.randn(200, 1, 28, 28, generator=torch.Generator().manual_seed(2)).cuda()
    y = (torch.arange(200) % 2).cuda()

    def client() -> torch.Tensor:
        data = ClientData(0, x, y, draws=QueryDraws(SeededKeys(1, 0), 0, torch.device("cuda")))
        ctx = RoundContext(round=0, rounds=1, config=config, device=torch.device("cuda"))
        message = get_algorithm(config).client_update(model, params, data, ctx, torch.Generator("cuda").manual_seed(1))
        return message.payload["images"]

    def on_a_stream_of_its_own() -> torch.Tensor:
        taken = [torch.cuda.Stream() for _ in range(40)]
        taken[-1].wait_stream(torch.cuda.default_stream())
        with torch.cuda.stream(taken[-1]):
            result = client()
        taken[-1].synchronize()
        return result

    images = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("FEDAUDIT_CUDA_GRAPHS", mode)
        if threaded and mode == "1":
            with ThreadPoolExecutor(1) as pool:
                images[mode] = pool.submit(on_a_stream_of_its_own).result()
        else:
            images[mode] = client()
    assert len(steppers) == 1 and steppers[0].replays == 2 * 2 * 4 - GraphedStep.warmup and not steppers[0].failed
    torch.testing.assert_close(images["1"], images["0"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_on_the_gpu_takes_torch_optims_foreach_steps(momentum):
    """On CUDA fedaudit's SGD updates all parameters in one foreach launch each, as torch.optim.SGD does there."""
    from torch import nn

    from fedaudit.algorithms.base import SGD

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3)).cuda() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    ours = SGD(models[0].parameters(), lr=0.3, momentum=momentum)
    theirs = torch.optim.SGD(models[1].parameters(), lr=0.3, momentum=momentum, foreach=True)
    for step in range(5):
        x, y = torch.randn(11, 7, device="cuda"), torch.randint(0, 3, (11,), device="cuda")
        for model, optimizer in zip(models, (ours, theirs)):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            if step == 2:  # a parameter without a gradient this step keeps its value and its momentum
                model[2].bias.grad = None
            optimizer.step()
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            torch.testing.assert_close(a, b)


def test_no_client_stream_is_the_capture_stream():
    """PyTorch's streams come round robin from a pool of 32 per priority: after 40 default-priority streams (the
    clients'), none is the stream graphs are captured on."""
    from fedaudit.cuda_graph import capture_stream

    captures = capture_stream(torch.device("cuda"))
    assert captures == capture_stream(torch.device("cuda", torch.cuda.current_device()))
    clients = [torch.cuda.Stream() for _ in range(40)]
    assert len({s.cuda_stream for s in clients}) == 32  # the pool wraps: streams repeat
    assert all(s.cuda_stream != captures.cuda_stream for s in clients)


def test_the_captured_dp_query_equals_the_eager_one(monkeypatch):
    """FEDAUDIT_CUDA_GRAPHS=all: the DP query of a Poisson batch padded to padded_size(B), captured and replayed,
    gives the eager query's clipped sum and norms for batches of every size up to it; a batch with an overflowed
    example and one larger than the padded size take the eager query."""
    from fedaudit.privacy import primitive
    from fedaudit.privacy.primitive import dp_gradient, padded_size

    torch.manual_seed(0)
    model = build_model(ModelSpec("convnet", (1, 28, 28), 10, width=16, depth=3)).cuda()
    expected = 32.0
    sizes = [32, 17, 40, padded_size(expected), 1, 29, 33, 30]
    data = torch.randn(200, 1, 28, 28, device="cuda")
    labels = torch.randint(0, 10, (200,), device="cuda")
    data[150, 0, 0, 0] = float("inf")
    batches = [(data[:n], labels[:n]) for n in sizes]
    batches += [(data[140:160], labels[140:160]), (data[:120], labels[:120])]  # an overflow; beyond the padded size
    results = {}
    for mode in ("all", "0"):
        monkeypatch.setenv("FEDAUDIT_CUDA_GRAPHS", mode)
        results[mode] = []
        for x, y in batches:
            out = dp_gradient(
                model,
                x,
                y,
                noise_multiplier=0.0,
                max_grad_norm=0.5,
                expected_batch_size=expected,
                generator=torch.Generator("cuda"),
            )
            results[mode].append(({k: v.clone() for k, v in out.grads.items()}, out.per_sample_norms.clone()))
    steps = [s for s in primitive._CAPTURED[model].values() if s is not None]
    replayed = len(sizes) + 1 - steps[0].warmup  # the overflowed batch is replayed, then taken eagerly
    assert len(steps) == 1 and steps[0].replays == replayed and not steps[0].failed
    for (graphed, graphed_norms), (eager, eager_norms), (x, _) in zip(results["all"], results["0"], batches):
        assert graphed_norms.shape == eager_norms.shape == (len(x),)
        finite = torch.isfinite(eager_norms)
        torch.testing.assert_close(graphed_norms[finite], eager_norms[finite], rtol=1e-4, atol=1e-6)
        for name, value in eager.items():  # a relative norm error e moves a sum by up to e C B (over B here)
            assert float((graphed[name] - value).norm()) <= 1e-5 * 0.5 * len(x) / expected + 1e-7, name


def test_a_dp_run_with_captured_queries_passes_verify(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDAUDIT_CUDA_GRAPHS", "all")
    args = (*ON_GPU, "--dp", "--rounds", "2", "--local-epochs", "2")
    result = invoke("train", *args, "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    result = invoke("verify", tmp_path / "run")
    assert result.exit_code == 0, result.output


def test_clients_replaying_captured_queries_at_once_train_the_eager_queries_run(tmp_path, monkeypatch, fixed_secrets):
    """Five clients at once on their own streams, each replaying its thread's captured DP query, over three rounds (the
    next rounds' threads replay the graphs the first round captured): the eager queries' run up to float rounding.
    Each capture gets a cuBLAS workspace of its own (cuda_graph._clear_blas_workspaces); graphs sharing one would mix
    the products of clients replaying at the same time."""
    from safetensors.torch import load_file

    from fedaudit.privacy import primitive

    made = []

    class Spy(primitive.GraphedStep):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(primitive, "GraphedStep", Spy)
    args = (*ON_GPU, "--dp", "--rounds", "3", "--local-epochs", "2", "--parallel-clients", "5")
    models = {}
    for mode in ("all", "0"):
        monkeypatch.setenv("FEDAUDIT_CUDA_GRAPHS", mode)
        ok("train", *args, "--out", tmp_path / mode)
        models[mode] = load_file(str(tmp_path / mode / "model.safetensors"))
    assert 1 <= len(made) <= 5 and not any(step.failed for step in made)  # one capture a thread's copy, a run
    assert sum(step.replays for step in made) > 0
    for key, value in models["0"].items():
        torch.testing.assert_close(models["all"][key], value, rtol=1e-4, atol=1e-5)


FAILED_CAPTURE = """
import warnings
import torch
from fedaudit import cuda_graph
from fedaudit.cuda_graph import GraphedStep, capture_stream

device = torch.device("cuda")
x = torch.randn(64, device=device)
reads_back = GraphedStep(lambda g: g[0] * float(g[0].sum()))
stream = torch.cuda.Stream(device)
with torch.cuda.stream(stream):
    for _ in range(2):
        reads_back([x])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        out = reads_back([x])
    assert any("capture failed" in str(w.message) for w in said), [str(w.message) for w in said]
    assert torch.cuda.current_stream(device) == stream != capture_stream(device)
stream.synchronize()
torch.testing.assert_close(out, x * float(x.sum()))
assert reads_back.failed and reads_back.graph is None and cuda_graph._REFUSED
later = GraphedStep(lambda g: g[0] * 2)
for _ in range(4):
    torch.testing.assert_close(later([x]), x * 2)
assert later.failed and later.graph is None and later.replays == 0
torch.cuda.synchronize()
print("stream given back, eager from then on")
"""


def test_a_failed_capture_gives_the_caller_its_stream_back_and_the_process_stays_eager():
    """A step that reads a value back cannot be captured: GraphedStep warns, the caller's stream is current again
    (not the capture stream, on which its eager work would be recorded into another client's graph), the step runs
    eagerly, and no later step of the process is captured. In a process of its own: a failed capture may leave CUDA
    state that the other GPU tests of this worker should not inherit."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FAILED_CAPTURE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "stream given back" in done.stdout, done.stdout + done.stderr


def test_graphs_replayed_at_once_on_two_streams_each_have_their_own_cublas_workspace():
    """Two captured products with a long inner dimension (where cuBLAS splits it and uses its workspace), replayed at
    the same time on two streams, 50 times each: every result is its own eager product. Graphs that recorded one
    workspace (the capture stream's) would write it together."""
    from fedaudit.cuda_graph import GraphedStep

    torch.manual_seed(0)
    left = [torch.randn(256, 65536, device="cuda") for _ in range(2)]
    right = [torch.randn(65536, 256, device="cuda") for _ in range(2)]
    expected = [a @ b for a, b in zip(left, right)]
    steps = [GraphedStep(lambda group: group[0] @ group[1]) for _ in range(2)]
    for step, a, b in zip(steps, left, right):
        for _ in range(step.warmup + 1):
            step([a, b])
    streams = [torch.cuda.Stream() for _ in steps]
    torch.cuda.synchronize()
    results: list[list[torch.Tensor]] = [[], []]
    for _ in range(50):
        for i, (step, stream) in enumerate(zip(steps, streams)):
            with torch.cuda.stream(stream):
                results[i].append(step([left[i], right[i]]))
    torch.cuda.synchronize()
    assert all(step.replays == 51 and not step.failed for step in steps)
    for i in range(2):
        for out in results[i]:
            torch.testing.assert_close(out, expected[i], rtol=1e-4, atol=1e-2)


def test_client_level_dp_with_adaptive_clipping_on_the_gpu(tmp_path):
    """The server's noisy count of the updates under C is drawn from its source's device (a CUDA generator here)."""
    args = (*ON_GPU, "--dp", "--dp-level", "client", "--clipping", "adaptive", "--max-update-norm", "1")
    args = (*args, "--count-noise", "5", "--num-clients", "10")
    ok("train", *args, "--rounds", "2", "--client-fraction", "0.5", "--out", tmp_path / "run")
    ok("verify", tmp_path / "run")
