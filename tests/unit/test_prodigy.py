"""dataset_cache.prodigy: the Prodigy optimizer, checked step by step against the ``prodigyopt`` package (the
reference LoRA trainers use), and continued exactly from a training state.

The reference sums each tensor's ``grad · (p0 - p)`` and ``|s|`` in the tensor's dtype, then adds the sums in
Python floats; ours adds the same per-tensor sums in one fp64 tensor. In fp64 the two differ only by the order of
those few additions (about 1e-16 relative per step), so after a dozen steps the weights agree to 1e-12 relative;
in fp32 each per-tensor sum is computed the same way, so the same bound holds for the step size and the weights
agree to fp32 rounding.
"""

from __future__ import annotations

import math
from typing import Any

import prodigyopt
import pytest
import torch

from dataset_cache.optimizer_state import TrainState, capture_optimizer, optimizer_state_dict
from dataset_cache.prodigy import GROUP_STATE, Prodigy


def _problem(dtype: torch.dtype) -> tuple[list[torch.Tensor], Any]:
    """Two LoRA-like factors (one zero, as lora_up starts) and a least-squares loss on random data."""
    g = torch.Generator().manual_seed(0)
    down = torch.randn(16, 8, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    up = torch.zeros(8, 4, dtype=dtype, requires_grad=True)
    x = torch.randn(32, 16, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(32, 4, generator=g, dtype=torch.float64).to(dtype)

    def loss() -> torch.Tensor:
        return ((x @ down @ up - y) ** 2).mean() + 0.1 * (down ** 2).mean()
    return [down, up], loss


def _train(cls: type, dtype: torch.dtype, steps: int, rates: list[float] | None = None,
           **kw: Any) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    params, loss = _problem(dtype)
    opt = cls(params, **kw)
    for i in range(steps):
        opt.zero_grad()
        loss().backward()
        if rates is not None:
            for group in opt.param_groups:
                group["lr"] = rates[i]
        opt.step()
    return [p.detach() for p in params], opt


SETTINGS = [{}, {"weight_decay": 0.01}, {"use_bias_correction": True, "safeguard_warmup": True},
            {"d_coef": 2.0, "growth_rate": 1.02}, {"betas": (0.9, 0.99), "weight_decay": 0.01,
                                                   "use_bias_correction": True}]


@pytest.mark.parametrize("kw", SETTINGS)
def test_steps_match_the_reference_package_in_fp64(kw: dict[str, Any]) -> None:
    rates = [0.1 + 0.9 * i / 11 for i in range(12)]  # a warm-up on the rate, as lr_schedule sets it
    ours, opt = _train(Prodigy, torch.float64, 12, rates, **kw)
    ref, ref_opt = _train(prodigyopt.Prodigy, torch.float64, 12, rates, **kw)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    assert b.abs().min() > 0  # it trained: every element of the zero factor moved
    for key in GROUP_STATE:
        assert opt.param_groups[0][key] == pytest.approx(ref_opt.param_groups[0][key], rel=1e-12), key


def test_steps_match_the_reference_package_in_fp32() -> None:
    """In fp32 the reference's ``s.abs().sum()`` and our fused L1 norms add the same ~100 values in another order:
    each sum may differ by up to n·ε ≈ 160 × 6e-8 ≈ 1e-5 relative, and so may ``d``. A step moves the weights by
    ``d × lr`` times a bounded Adam direction, so over 12 steps the weights may differ by about 12 × 1e-5 of the
    distance they moved (bounded by their largest value: the zero factor started at 0)."""
    ours, opt = _train(Prodigy, torch.float32, 12, weight_decay=0.01)
    ref, ref_opt = _train(prodigyopt.Prodigy, torch.float32, 12, weight_decay=0.01)
    assert opt.param_groups[0]["d"] == pytest.approx(ref_opt.param_groups[0]["d"], rel=1e-5)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1.2e-4 * float(b.abs().max()))


def test_bf16_tensors_train_with_sums_in_fp32() -> None:
    ours, opt = _train(Prodigy, torch.bfloat16, 6)
    ref, _ = _train(Prodigy, torch.float32, 6)
    assert all(p.dtype == torch.bfloat16 and torch.isfinite(p).all() for p in ours)
    assert opt.param_groups[0]["d"] > 1e-6  # the estimate moved: the bf16 sums did not vanish
    for a, b in zip(ours, ref):  # bf16 has 8 bits of mantissa: the same training within its resolution
        torch.testing.assert_close(a.float(), b, rtol=0.05, atol=0.01)


def test_no_gradient_no_step_and_a_zero_rate_changes_nothing() -> None:
    params, _loss = _problem(torch.float64)
    opt = Prodigy(params)
    before = [p.detach().clone() for p in params]
    opt.step()  # no gradients at all
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()  # zero gradients: nothing to estimate from
    assert all(torch.equal(a, b) for a, b in zip(params, before)) and opt.param_groups[0]["k"] == 0
    ours, opt = _train(Prodigy, torch.float64, 3, rates=[1.0, 0.0, 0.0])  # a rate of 0: no step, as the reference
    ref, ref_opt = _train(prodigyopt.Prodigy, torch.float64, 3, rates=[1.0, 0.0, 0.0])
    one, _ = _train(Prodigy, torch.float64, 1)
    assert all(torch.equal(a, b) for a, b in zip(ours, one)) and opt.param_groups[0]["k"] == 1
    assert ref_opt.param_groups[0]["k"] == 1 and all(torch.allclose(a, b, rtol=1e-12) for a, b in zip(ours, ref))


@pytest.mark.parametrize("bad", [{"lr": -1.0}, {"d0": 0.0}, {"eps": 0.0}, {"betas": (1.0, 0.999)},
                                 {"betas": (0.9, 1.0)}, {"weight_decay": -0.1}, {"growth_rate": 0.5},
                                 {"d_coef": math.nan}])
def test_bad_settings_are_refused_by_name(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=f"Prodigy: invalid {next(iter(bad))}"):
        Prodigy([torch.zeros(2, requires_grad=True)], **bad)


def test_continuing_from_a_training_state_is_the_uninterrupted_run_bit_for_bit() -> None:
    """6 steps == 3 steps, the state captured as Train LoRA saves it (per-tensor slots by name, the groups as
    JSON), a new optimizer given it with the group state carried, then 3 more steps."""
    whole, _ = _train(Prodigy, torch.float32, 6, weight_decay=0.01, use_bias_correction=True)
    params, loss = _problem(torch.float32)
    names = ["down", "up"]
    opt = Prodigy(params, weight_decay=0.01, use_bias_correction=True)
    for _ in range(3):
        opt.zero_grad()
        loss().backward()
        opt.step()
    slots, groups = capture_optimizer(opt.state_dict(), names)
    state = TrainState(lora_digest="0" * 32, optimizer="Prodigy", steps=3, batches=3, slots=slots,
                       param_groups=groups)
    fresh = Prodigy(params, weight_decay=0.01, use_bias_correction=True)
    fresh.load_state_dict(optimizer_state_dict(state, names, fresh.state_dict(), GROUP_STATE))
    assert fresh.param_groups[0]["d"] == opt.param_groups[0]["d"] and fresh.param_groups[0]["k"] == 3
    for _ in range(3):
        fresh.zero_grad()
        loss().backward()
        fresh.step()
    assert all(torch.equal(a.detach(), b) for a, b in zip(params, whole))


def test_carried_group_values_are_checked() -> None:
    params, _ = _problem(torch.float32)
    opt = Prodigy(params)
    names = ["down", "up"]
    base = {"params": names, "d": 0.1, "d_max": 0.1, "d_numerator": 0.5, "k": 2}
    for groups, message in ((({**base, "d": "a lot"},), "d are not finite numbers"),
                            (({**base, "k": math.inf},), "k are not finite numbers"),
                            (({k: v for k, v in base.items() if k != "d_max"},), "lack d_max"),
                            ((base, base), "2 parameter groups, this run 1")):
        state = TrainState(lora_digest="0" * 32, optimizer="Prodigy", steps=2, batches=2, slots={},
                           param_groups=groups)
        with pytest.raises(ValueError, match=message):
            optimizer_state_dict(state, names, opt.state_dict(), GROUP_STATE)


def test_the_sums_are_fp64_except_on_a_device_without_it() -> None:
    """Apple's MPS has no fp64: the step size's sums are fp32 there (a Mac would fail in the first step)."""
    from types import SimpleNamespace

    from dataset_cache.prodigy import _sum_dtype

    assert _sum_dtype([torch.zeros(2)]) == torch.float64
    mps = SimpleNamespace(device=torch.device("mps"))
    assert _sum_dtype([torch.zeros(2), mps]) == torch.float32  # type: ignore[list-item]
