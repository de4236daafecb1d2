"""dataset_cache.ema: the fp32 moving average of a LoRA's weights, its warm-up, and its swap into the parameters."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from dataset_cache.ema import MAX_EMA_DECAY, WeightAverage, check_ema_decay, ema_decay_at


def _params(dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return {f"m{i}.lora_up.weight": torch.nn.Parameter(torch.randn(s, generator=g).to(dtype))
            for i, s in enumerate([(6, 2), (2, 5), (), (300,)])}


def _move(params: dict[str, torch.nn.Parameter], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params.values():
            p.add_(torch.randn(p.shape, generator=g).to(p.device, p.dtype))


def test_the_decay_warms_up_then_holds() -> None:
    """diffusers' EMAModel warm-up: step 1 keeps 2/11 of the start, step 90 91/100, and never more than decay."""
    assert ema_decay_at(0.999, 1) == pytest.approx(2 / 11)
    assert ema_decay_at(0.999, 90) == pytest.approx(0.91)
    assert ema_decay_at(0.99, 10_000) == 0.99
    assert [ema_decay_at(0.5, t) for t in (1, 8, 9, 100)] == [2 / 11, 0.5, 0.5, 0.5]


def test_each_update_is_a_lerp_towards_the_weights_by_one_minus_the_decay() -> None:
    """Three steps: the average after each is ``lerp(average, weights, 1 - decay_t)``, the same op in the same
    dtype as computed here (bit for bit); the parameters are not touched."""
    params = _params()
    expected = {k: p.detach().clone() for k, p in params.items()}
    average = WeightAverage(params, 0.9)
    for step in (1, 2, 3):
        _move(params, step)
        before = {k: p.detach().clone() for k, p in params.items()}
        average.update(step)
        for k, p in params.items():
            expected[k] = torch.lerp(expected[k], p.detach(), 1.0 - ema_decay_at(0.9, step))
            assert torch.equal(p.detach(), before[k])
    assert all(torch.equal(average.weights()[k], expected[k]) for k in params)
    assert all(torch.equal(average.state()[k], expected[k]) for k in params)


def test_a_bf16_lora_is_averaged_in_fp32() -> None:
    """At decay 0.999 a step moves a bf16 average by less than its resolution: kept in fp32 it moves, and it is the
    fp32 lerp of the bf16 values; the LoRA output is rounded to bf16 once, at the end."""
    params = _params(torch.bfloat16)
    average = WeightAverage(params, 0.999)
    start = {k: p.detach().float() for k, p in params.items()}
    _move(params, 1)
    average.update(10_000)  # past the warm-up (9,000 steps at 0.999): the decay itself
    state = average.state()
    for k, p in params.items():
        assert state[k].dtype == torch.float32
        assert torch.equal(state[k], torch.lerp(start[k], p.detach().float(), 1.0 - 0.999))
        assert average.weights()[k].dtype == torch.bfloat16
    moved = state["m3.lora_up.weight"] - start["m3.lora_up.weight"]
    assert bool((moved != 0).any()) and float(moved.abs().max()) < 2.0 ** -8  # below bf16's resolution near 1


def test_a_saved_average_is_continued_and_missing_keys_start_at_the_weights() -> None:
    params = _params()
    saved = {"m0.lora_up.weight": torch.full((6, 2), 3.0)}
    average = WeightAverage(params, 0.9, saved)
    state = average.state()
    assert torch.equal(state["m0.lora_up.weight"], saved["m0.lora_up.weight"])
    assert torch.equal(state["m1.lora_up.weight"], params["m1.lora_up.weight"].detach())
    saved["m0.lora_up.weight"].add_(1.0)  # the average holds its own copy
    assert torch.equal(average.state()["m0.lora_up.weight"], torch.full((6, 2), 3.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_average_is_swapped_in_for_a_block_and_the_trained_weights_come_back_bit_for_bit(
        dtype: torch.dtype) -> None:
    params = _params(dtype)
    average = WeightAverage(params, 0.9)
    _move(params, 1)
    trained = {k: p.detach().clone() for k, p in params.items()}
    average.update(1)
    with average.swapped_in():
        for k, p in params.items():
            assert torch.equal(p.detach(), average.state()[k].to(dtype))
    assert all(torch.equal(p.detach(), trained[k]) for k, p in params.items())
    with pytest.raises(RuntimeError, match="inside"), average.swapped_in():
        raise RuntimeError("inside")  # an error in the block (a Cancel) still restores them
    assert all(torch.equal(p.detach(), trained[k]) for k, p in params.items())


def test_outputs_are_copies() -> None:
    params = _params()
    average = WeightAverage(params, 0.9)
    for out in (average.weights(), average.state()):
        out["m0.lora_up.weight"].add_(1.0)
    assert torch.equal(average.state()["m0.lora_up.weight"], params["m0.lora_up.weight"].detach())


@pytest.mark.parametrize("value", [0, 0.0, 0.5, 0.999, MAX_EMA_DECAY])
def test_ema_decay_accepts_zero_to_the_maximum(value: float) -> None:
    check_ema_decay(value)


@pytest.mark.parametrize("value", [-0.1, 1.0, 0.99995, math.nan, math.inf, True, "0.99", None])
def test_ema_decay_refuses_other_values_naming_the_field(value: object) -> None:
    with pytest.raises(ValueError, match=r"ema_decay must be a number from 0 \(no average\) to 0.9999, got"):
        check_ema_decay(value)


def _cuda_kernels(fn: Callable[[], object]) -> int:
    """CUDA kernels ``fn`` launches, as torch's profiler sees them."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_bf16_lora_is_averaged_by_fused_kernels_as_on_the_cpu() -> None:
    """300 bf16 tensors, made on the CPU with their average and then moved to the GPU (as ComfyUI moves a LoRA's
    adapters when it loads the model): the average follows them, one update launches a few fused kernels (the cast
    into the fp32 scratch and the lerp, ~100 tensors each), not one per tensor, and gives the CPU's average within
    the rounding of two lerps (the GPU may fuse their multiply-adds: 2 ulp of fp32, of the tensor's largest value
    where an element cancels)."""
    g = torch.Generator().manual_seed(0)
    cpu = {f"t{i}": torch.nn.Parameter(torch.randn(16, 8, generator=g).bfloat16()) for i in range(300)}
    gpu = {k: torch.nn.Parameter(p.detach().clone()) for k, p in cpu.items()}
    averages = [WeightAverage(params, 0.9) for params in (cpu, gpu)]
    for p in gpu.values():
        p.data = p.data.cuda()  # what nn.Module.to does to an adapter's parameters
    for params in (cpu, gpu):
        _move(params, 1)
    averages[0].update(5)
    averages[1].update(5)  # warm: the first launch of a kernel loads it
    averages[0].update(6)
    kernels = _cuda_kernels(lambda: averages[1].update(6))
    assert 2 <= kernels < 30, kernels
    assert all(a.is_cuda for a in averages[1].average)
    for k, value in averages[0].state().items():
        torch.testing.assert_close(averages[1].state()[k], value, rtol=2.0 ** -22,
                                   atol=2.0 ** -22 * float(value.abs().max()))  # an element that cancels to ~0
