"""Optimizers that keep fp32 state for bf16 parameters (Adafactor; bitsandbytes-style 8-bit AdamW) keep it fp32,
bit for bit, through ``state_dict`` / ``load_state_dict``, as a continued run needs."""

from __future__ import annotations

import torch

from dataset_cache.adafactor import Adafactor
from dataset_cache.fp32_state import fp32_copies


LR = 0.05
"""A step size bf16 weights of size 1 see (their resolution there is 2⁻⁸, 0.004)."""


def _made(param: torch.Tensor) -> Adafactor:
    return Adafactor([param], lr=LR, relative_step=False, scale_parameter=False, beta1=0.9)


def _stepped(param: torch.Tensor, grad: torch.Tensor) -> Adafactor:
    optimizer = _made(param)
    param.grad = grad.clone()
    optimizer.step()
    return optimizer


def test_fp32_moments_of_a_bf16_parameter_load_back_fp32_and_unchanged() -> None:
    g = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(16, 8, generator=g).to(torch.bfloat16))
    saved = _stepped(param, torch.randn(16, 8, generator=g).to(torch.bfloat16)).state_dict()
    assert {v.dtype for v in saved["state"][0].values()} == {torch.float32}
    other = torch.nn.Parameter(param.detach().clone())
    loaded = _made(other)
    loaded.load_state_dict(saved)
    for slot, value in saved["state"][0].items():
        assert loaded.state[other][slot].dtype == torch.float32
        assert torch.equal(loaded.state[other][slot], value)
        assert loaded.state[other][slot].data_ptr() != value.data_ptr()  # a copy: stepping leaves the dict alone
    assert loaded.param_groups[0]["step"] == 1


def test_a_continued_bf16_run_steps_as_the_one_that_never_stopped() -> None:
    g = torch.Generator().manual_seed(1)
    start = torch.randn(32, 4, generator=g).to(torch.bfloat16)
    grads = [torch.randn(32, 4, generator=g).to(torch.bfloat16) for _ in range(6)]
    whole = torch.nn.Parameter(start.clone())
    optimizer = _stepped(whole, grads[0])
    halted = torch.nn.Parameter(whole.detach().clone())
    resumed = _made(halted)
    resumed.load_state_dict(optimizer.state_dict())
    for grad in grads[1:]:
        for param, opt in ((whole, optimizer), (halted, resumed)):
            param.grad = grad.clone()
            opt.step()
    assert torch.equal(whole, halted)


def test_fp32_copies_are_each_tensors_fp32_value_and_leave_fp32_ones_themselves() -> None:
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(4, 3, generator=g).to(torch.bfloat16), torch.randn(5, generator=g),
               torch.randn(2, 2, 2, generator=g).to(torch.float16), torch.randn(1, generator=g).to(torch.bfloat16)]
    copies = fp32_copies(tensors)
    assert copies[1] is tensors[1]
    for t, c in zip(tensors, copies):
        assert c.dtype == torch.float32 and c.shape == t.shape
        assert torch.equal(c, t.float())
    copies[0].add_(1.0)  # a copy: writing it leaves the tensor alone, and its neighbours in the buffer
    assert torch.equal(tensors[0].float() + 1.0, copies[0])
    assert torch.equal(copies[2], tensors[2].float()) and torch.equal(copies[3], tensors[3].float())
    assert fp32_copies([tensors[1]])[0] is tensors[1]
    assert fp32_copies([]) == []


def test_the_copies_are_views_of_one_buffer() -> None:
    tensors = [torch.ones(3, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.bfloat16)]
    first, second = fp32_copies(tensors)
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()


def test_tensors_on_several_devices_are_copied_one_by_one() -> None:
    """One buffer lives on one device: a list that spans two is copied tensor by tensor, each on its own device."""
    tensors = [torch.ones(3, dtype=torch.bfloat16), torch.empty(2, dtype=torch.bfloat16, device="meta")]
    on_cpu, on_meta = fp32_copies(tensors)
    assert (on_cpu.device.type, on_meta.device.type) == ("cpu", "meta")
    assert on_cpu.dtype == on_meta.dtype == torch.float32 and torch.equal(on_cpu, torch.ones(3))
