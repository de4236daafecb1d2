"""dataset_cache.grad_clip: the global gradient norm and clipping to it, as torch's ``clip_grad_norm_`` clips, with
the norm of bf16 gradients summed in fp32."""

from __future__ import annotations

import math

import pytest
import torch

from dataset_cache.grad_clip import CLIP_EPSILON, MAX_GRAD_NORM, check_max_grad_norm, clip_gradients, gradient_norm

SHAPES = ((8, 4), (3,), (16, 16), (1000,))


def _params(dtype: torch.dtype = torch.float32, scale: float = 3.0, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * scale).to(dtype)
    return params


def _copies(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    out = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, out):
        assert p.grad is not None
        q.grad = p.grad.clone()
    return out


def _grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def _norm64(grads: list[torch.Tensor]) -> float:
    return float(torch.cat([g.double().flatten() for g in grads]).norm())


@pytest.mark.parametrize("max_norm", [1.0, 1e3])
def test_fp32_gradients_are_clipped_as_torchs_clip_grad_norm_clips_them(max_norm: float) -> None:
    """The same kernels in the same order as ``clip_grad_norm_``: the norm and every gradient equal bit for bit,
    clipped (1.0: the norm is about 58) or not (1e3)."""
    ours, theirs = _params(), _params()
    norm = clip_gradients(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert norm.dtype == torch.float32 and norm.shape == ()
    assert torch.equal(norm, expected)
    assert all(torch.equal(a, b) for a, b in zip(_grads(ours), _grads(theirs)))


def test_clipped_gradients_have_the_limit_as_their_norm_and_keep_their_direction() -> None:
    params = _params()
    before = [g.clone() for g in _grads(params)]
    norm = float(clip_gradients(params, 0.5))
    assert norm == pytest.approx(_norm64(before), rel=1e-5)  # fp32 sums of 1,280 squares: well within 1e-5
    scale = 0.5 / (norm + CLIP_EPSILON)
    # each element is one fp32 product of the old value and the scale (rounded once, plus the scale's own rounding)
    for old, new in zip(before, _grads(params)):
        torch.testing.assert_close(new.double(), old.double() * scale, rtol=4 * 2.0 ** -24, atol=0.0)
    assert _norm64(_grads(params)) == pytest.approx(0.5, rel=1e-5)


@pytest.mark.parametrize("max_norm", [0.0, 1e3])
def test_gradients_under_the_limit_or_without_one_stay_bit_for_bit(max_norm: float) -> None:
    """Below the limit the gradients are multiplied by exactly 1 (no read of the norm to decide): unchanged; with
    ``max_norm`` 0 they are not touched at all. The norm is returned either way, for the report."""
    params = _params()
    before = [g.clone() for g in _grads(params)]
    norm = clip_gradients(params, max_norm)
    assert all(torch.equal(a, b) for a, b in zip(before, _grads(params)))
    assert float(norm) == pytest.approx(_norm64(before), rel=1e-5)


def test_the_norm_of_bf16_gradients_is_summed_in_fp32() -> None:
    """bf16 values square exactly in fp32 (8 significant bits → 16): the only error is the fp32 sums', under 1e-4
    for these 1,280 squares (n·2^-24 = 8e-5 at worst), where bf16 sums would be off by up to 2^-8 = 0.4%."""
    params = _params(torch.bfloat16)
    norm = gradient_norm(_grads(params))
    assert norm.dtype == torch.float32
    assert float(norm) == pytest.approx(_norm64(_grads(params)), rel=1e-4)
    clip_gradients(params, 1.0)
    assert all(g.dtype == torch.bfloat16 for g in _grads(params))
    assert _norm64(_grads(params)) == pytest.approx(1.0, rel=2 * 2.0 ** -8)  # each element rounded to bf16 once


def test_parameters_without_a_gradient_are_skipped_and_none_gives_zero() -> None:
    params = _params()
    params[1].grad = None
    kept = [g.clone() for g in _grads(params)]
    assert float(clip_gradients(params, 1e3)) == pytest.approx(_norm64(kept), rel=1e-5)
    assert float(clip_gradients([torch.nn.Parameter(torch.ones(3))], 1.0)) == 0.0
    assert float(gradient_norm([])) == 0.0


def test_a_zero_gradient_stays_zero() -> None:
    """The epsilon keeps the scale finite: 0 / (0 + 1e-6) clamps to 1, never NaN."""
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.zeros(4)
    assert float(clip_gradients([p], 1.0)) == 0.0
    assert torch.equal(p.grad, torch.zeros(4))


def test_an_infinite_gradient_reports_an_infinite_norm() -> None:
    """What an fp16 step the gradient scaler skips looks like: the norm says so (the summary counts such steps)."""
    params = _copies(_params())
    assert params[0].grad is not None
    params[0].grad[0, 0] = math.inf
    assert math.isinf(float(clip_gradients(params, 1.0)))


@pytest.mark.parametrize("value", [0, 0.0, 1.0, 2, MAX_GRAD_NORM])
def test_max_grad_norm_accepts_zero_to_the_maximum(value: float) -> None:
    check_max_grad_norm(value)


@pytest.mark.parametrize("value", [-0.1, math.nan, math.inf, MAX_GRAD_NORM * 2, True, "1.0", None])
def test_max_grad_norm_refuses_other_values_naming_the_field(value: object) -> None:
    with pytest.raises(ValueError, match=r"max_grad_norm must be a number from 0 \(no clipping\) to 10000, got"):
        check_max_grad_norm(value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gradients_on_two_devices_have_one_global_norm_on_the_first_ones_device() -> None:
    """An offloaded LoRA can hold gradients on the CPU and the GPU: one norm over both, one scale for both."""
    params = _params()
    on_cpu = _copies(params)
    for p in params[2:]:
        assert p.grad is not None
        p.grad = p.grad.cuda()
    norm = clip_gradients(params, 1.0)
    expected = clip_gradients(on_cpu, 1.0)
    assert norm.device.type == "cpu"
    assert float(norm) == pytest.approx(float(expected), rel=1e-5)  # per-device fp32 sums, summed in another order
    for a, b in zip(_grads(params), _grads(on_cpu)):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=0.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_norm_and_the_clipping_launch_a_few_fused_kernels_not_one_per_tensor() -> None:
    """300 bf16 gradients on the GPU: the fp32 norm and the scaling launch a few kernels (one per ~100 tensors and
    a handful of scalar ones), and give the CPU's norm within fp32 sums (1e-5)."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(0)
    cpu = [torch.nn.Parameter(torch.randn(16, 8, generator=g).bfloat16()) for _ in range(300)]
    for p in cpu:
        p.grad = torch.randn(p.shape, generator=g).bfloat16()
    gpu = _copies(cpu)
    for p in gpu:
        p.data, p.grad = p.data.cuda(), p.grad.cuda()  # type: ignore[union-attr]
    clip_gradients(_copies(gpu), 1.0)  # warm: the first launch of a kernel loads it
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        norm = clip_gradients(gpu, 1.0)
        torch.cuda.synchronize()
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    assert kernels < 30, kernels
    assert float(norm) == pytest.approx(float(gradient_norm(_grads(cpu))), rel=1e-5)
