"""dataset_cache.lion: the Lion optimizer, checked step by step against the ``lion-pytorch`` package (the one
kohya's and ai-toolkit's ``Lion`` is), and continued exactly from a training state.

Both compute each step with the same elementwise operations in the same order (the package per tensor, ours fused
over the tensors), so on the CPU the weights agree bit for bit in fp32 and bf16: a sign of a value that rounds to
zero could only differ if the arithmetic did.
"""

from __future__ import annotations

from typing import Any

import lion_pytorch
import pytest
import torch

from dataset_cache.lion import Lion
from dataset_cache.optimizer_state import TrainState, capture_optimizer, optimizer_state_dict


def _problem(dtype: torch.dtype) -> tuple[list[torch.Tensor], Any]:
    """Two LoRA-like factors (one zero, as lora_up starts) and a least-squares loss on random data."""
    g = torch.Generator().manual_seed(0)
    down = torch.randn(16, 8, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    up = torch.zeros(8, 4, dtype=dtype, requires_grad=True)
    x = torch.randn(32, 16, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(32, 4, generator=g, dtype=torch.float64).to(dtype)

    def loss() -> torch.Tensor:
        return ((x @ down @ up - y) ** 2).mean()
    return [down, up], loss


def _train(cls: type, dtype: torch.dtype, steps: int, **kw: Any) -> list[torch.Tensor]:
    params, loss = _problem(dtype)
    opt = cls(params, **kw)
    for _ in range(steps):
        opt.zero_grad()
        loss().backward()
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("settings", [{}, {"lr": 3e-3, "weight_decay": 0.1, "betas": (0.95, 0.98)}])
def test_each_step_is_the_packages_bit_for_bit(dtype: torch.dtype, settings: dict[str, Any]) -> None:
    ours = _train(Lion, dtype, 12, **settings)
    reference = _train(lion_pytorch.Lion, dtype, 12, **settings)
    for a, b in zip(ours, reference):
        assert torch.equal(a, b)
    assert not torch.equal(ours[1], torch.zeros_like(ours[1]))  # it trained


def test_every_weight_moves_by_the_rate_on_the_first_step() -> None:
    """The first step's moment is 0, so each weight with a nonzero gradient moves by exactly ±lr (without weight
    decay): Lion's steps have one size."""
    params, loss = _problem(torch.float64)
    start = [p.detach().clone() for p in params]
    opt = Lion(params, lr=0.01)
    loss().backward()
    grads = [p.grad.clone() for p in params]
    opt.step()
    for p, p0, g in zip(params, start, grads):
        moved = (p.detach() - p0)[g != 0]
        torch.testing.assert_close(moved.abs(), torch.full_like(moved, 0.01), rtol=1e-12, atol=0)
        assert torch.equal(torch.sign(moved), -torch.sign(g[g != 0]))


def test_continuing_from_a_training_state_is_the_uninterrupted_run_bit_for_bit() -> None:
    """6 steps == 3 steps, the state captured as Train LoRA saves it, a new optimizer given it, then 3 more."""
    whole = _train(Lion, torch.float32, 6, lr=1e-3)
    params, loss = _problem(torch.float32)
    names = ["down", "up"]
    opt = Lion(params, lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        loss().backward()
        opt.step()
    slots, groups = capture_optimizer(opt.state_dict(), names)
    assert {slot for per_param in slots.values() for slot in per_param} == {"exp_avg"}
    state = TrainState(lora_digest="0" * 32, optimizer="Lion", steps=3, batches=3, slots=slots, param_groups=groups)
    fresh = Lion(params, lr=1e-3)
    fresh.load_state_dict(optimizer_state_dict(state, names, fresh.state_dict()))
    for _ in range(3):
        fresh.zero_grad()
        loss().backward()
        fresh.step()
    assert all(torch.equal(a.detach(), b) for a, b in zip(params, whole))


@pytest.mark.parametrize(("kw", "message"), [({"lr": 0.0}, "lr must be above 0"),
                                             ({"betas": (0.9, 1.0)}, r"betas must be in \[0, 1\)"),
                                             ({"weight_decay": -0.1}, "weight_decay must be 0 or more")])
def test_bad_settings_are_refused_naming_them(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"Lion: {message}"):
        Lion(_problem(torch.float32)[0], **kw)
