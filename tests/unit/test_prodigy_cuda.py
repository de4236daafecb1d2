"""dataset_cache.prodigy on a CUDA device: one synchronization per step, whatever the number of tensors (the
``prodigyopt`` package's loop makes two per tensor), and the CPU's training within fp32 rounding.

Skipped without CUDA. Synchronizations are counted with torch's sync debug mode, which warns at each operation that
makes the host wait for the device.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from dataset_cache.prodigy import Prodigy

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TENSORS = 64


def _lora(device: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``TENSORS`` LoRA-like factors (half zero, as lora_up starts) and a fixed gradient for each."""
    g = torch.Generator().manual_seed(0)
    params, grads = [], []
    for i in range(TENSORS):
        shape = (64, 8) if i % 2 == 0 else (8, 64)
        value = torch.randn(shape, generator=g) * 0.01 if i % 2 == 0 else torch.zeros(shape)
        params.append(value.to(device).requires_grad_())
        grads.append(torch.randn(shape, generator=g).to(device))
    return params, grads


def _step(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[torch.Tensor], scale: float) -> None:
    for p, grad in zip(params, grads):
        p.grad = grad * scale
    opt.step()


def _synchronizations(cls: type) -> int:
    params, grads = _lora("cuda")
    opt = cls(params, weight_decay=0.01)
    _step(opt, params, grads, 1.0)  # the first step makes the state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step(opt, params, grads, 0.5)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def test_a_step_synchronizes_once_whatever_the_number_of_tensors() -> None:
    assert _synchronizations(Prodigy) == 1


def test_the_reference_package_synchronizes_per_tensor() -> None:
    prodigyopt = pytest.importorskip("prodigyopt", reason="the reference (scripts/device-prep carries its wheel)")
    assert _synchronizations(prodigyopt.Prodigy) >= 2 * TENSORS


def test_the_device_trains_what_the_cpu_trains() -> None:
    """Other kernels add the same values in another order: each per-tensor sum (512 values) may differ by up to
    512 · ε = 3e-5 relative, and ``d``, a ratio of such sums accumulated over 5 steps, by about 5 × 2 × 3e-5 = 3e-4.
    The weights move by ``d × lr`` times Adam's direction, so they agree to 3e-4 of the distance they moved (plus
    fp32 rounding of the values themselves)."""
    results = []
    start, _ = _lora("cpu")
    for device in ("cpu", "cuda"):
        params, grads = _lora(device)
        opt = Prodigy(params, weight_decay=0.01)
        for i in range(5):
            _step(opt, params, grads, 1.0 / (1 + i))
        results.append((opt.param_groups[0]["d"], [p.detach().cpu() for p in params]))
    (d_cpu, cpu), (d_cuda, cuda) = results
    assert d_cpu > 1e-5 and d_cuda == pytest.approx(d_cpu, rel=3e-4)  # the step size grew from 1e-6
    for a, b, s in zip(cuda, cpu, start):
        moved = float((b - s.detach()).abs().max())
        assert moved > 0
        torch.testing.assert_close(a, b, rtol=1e-6, atol=3e-4 * moved)
