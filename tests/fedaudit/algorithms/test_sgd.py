"""fedaudit's SGD takes torch.optim.SGD's steps bit for bit, and a process that trains never imports TorchDynamo."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from fedaudit.algorithms.base import SGD


@pytest.mark.parametrize("together", [False, True])
@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_the_steps_are_torch_optims_bit_for_bit(momentum, set_to_none, together):
    """``together``: the foreach step that a GPU takes, here on the CPU (where foreach falls back to the same
    per-tensor arithmetic)."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    ours = SGD(models[0].parameters(), lr=0.3, momentum=momentum)
    theirs = torch.optim.SGD(models[1].parameters(), lr=0.3, momentum=momentum)
    for step in range(6):
        x, y = torch.randn(11, 7), torch.randint(0, 3, (11,))
        for model, optimizer in zip(models, (ours, theirs)):
            optimizer.zero_grad(set_to_none=set_to_none)
            nn.functional.cross_entropy(model(x), y).backward()
            if step == 3:  # a parameter without a gradient this step keeps its value and its momentum
                model[2].bias.grad = None
            if together and optimizer is ours:
                ours._step_together([i for i, p in enumerate(ours.params) if p.grad is not None])
            else:
                optimizer.step()
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(a, b), step
            assert (a.grad is None) == (b.grad is None)


def test_a_training_process_does_not_import_torchdynamo(tmp_path):
    """torch.optim's step imports torch._dynamo (1.7 s of every process on this project's 2-core machine)."""
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from fedaudit.cli import main\n"
        "args = 'train --dataset digits --model mlp --width 8 --depth 1 --rounds 1 --dp --device cpu --no-progress'\n"
        f"result = CliRunner().invoke(main, [*args.split(), '--out', {str(tmp_path / 'run')!r}])\n"
        "assert result.exit_code == 0, result.output\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
