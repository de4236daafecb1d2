"""Optimizers that keep fp32 state for bf16 parameters (Adafactor; bitsandbytes-style 8-bit AdamW) keep it fp32,
bit for bit, through ``state_dict`` / ``load_state_dict``, as a continued run needs."""

from __future__ import annotations

import torch

from dataset_cache.adafactor import Adafactor


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
