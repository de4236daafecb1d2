"""The weight streamer and host-held activations on a CUDA device: pinned host copies, one side stream, events.

Skipped without CUDA. The model of ``test_weight_stream.py`` trains on the GPU with every weight resident, then
with its blocks streamed through two or three device slots (and with its checkpointed activations in host
memory): losses and gradients must be bit-identical, since the same kernels run on the same values in the same
order on the compute stream; only where the weights come from changes. A wrong event or a slot overwritten too
early shows up as different numbers.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import torch

from dataset_cache.block_runner import BlockRunners
from dataset_cache.host_activations import HostActivations
from dataset_cache.transfers import CudaTransfers
from dataset_cache.weight_stream import WeightStreamer, block_tensors

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

sys.path.insert(0, str(Path(__file__).parent))
import test_weight_stream as cpu  # noqa: E402  (the CPU suite's model)

DEVICE = torch.device("cuda")


def _register(t: torch.Tensor) -> bool:
    """Pin an ordinary host tensor in place, as ComfyUI's ``pin_memory`` does (``cudaHostRegister``)."""
    return bool(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0) == 0)


def _unregister(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def _train(streamed: tuple[int, ...] = (), slots: int = 2, host: bool = False, register: bool = False,
           steps: int = 3) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], Any]:
    model = cpu.Model(blocks=6).to(DEVICE)
    runners = BlockRunners(list(model.blocks), checkpoint=True)
    streamer = None
    if streamed:
        transfers = CudaTransfers(DEVICE, pin=_register if register else None,
                                  unpin=_unregister if register else None)
        streamer = WeightStreamer([(f"blocks.{i}", model.blocks[i]) for i in streamed], transfers, slots=slots)
        runners.streamer, runners.streamed = streamer, {i: k for k, i in enumerate(streamed)}
        for i in streamed:  # between uses the weights live in pinned host memory
            assert all(t.device.type == "cpu" and t.is_pinned() for _o, _n, t in block_tensors(model.blocks[i]))
    offload = HostActivations(CudaTransfers(DEVICE), min_bytes=0) if host else None
    optimizer = torch.optim.AdamW(model.adapters.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    losses, grads = [], []
    try:
        for _ in range(steps):
            x = torch.randn(4, 64, cpu.DIM, generator=gen).to(DEVICE).requires_grad_(True)
            context = torch.randn(4, 64, cpu.DIM, generator=gen).to(DEVICE)
            with offload.hooks() if offload is not None else ExitStack():
                loss = model(x, context).square().mean()
            loss.backward()
            losses.append(loss.detach().cpu())
            grads.append([p.grad.detach().cpu() for p in model.adapters.parameters()])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    finally:
        if streamer is not None:
            streamer.close()
        runners.remove()
    return losses, grads, streamer


@pytest.fixture(scope="module")
def resident() -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    losses, grads, _ = _train()
    return losses, grads


@pytest.mark.parametrize(("streamed", "slots", "host", "register"), [
    ((0, 1, 2, 3, 4, 5), 2, False, False),
    ((1, 3, 4), 2, False, False),
    ((0, 2, 3, 5), 3, False, False),
    ((0, 1, 2, 3, 4, 5), 2, False, True),
    ((), 2, True, False),
    ((1, 2, 5), 2, True, True),
], ids=["all", "some", "three-slots", "registered-pinning", "host-activations", "streamed+host"])
def test_streamed_training_is_bit_identical_on_cuda(resident: Any, streamed: tuple[int, ...], slots: int,
                                                     host: bool, register: bool) -> None:
    losses, grads, streamer = _train(streamed, slots, host, register)
    assert all(torch.equal(a, b) for a, b in zip(losses, resident[0]))
    for step, ref in zip(grads, resident[1]):
        assert all(torch.equal(a, b) for a, b in zip(step, ref))
    if streamer is not None:
        assert streamer.stats.misses == 1  # every later block was copied while an earlier one computed


def test_slots_are_device_memory_and_the_weights_come_back_to_pinned_host_memory() -> None:
    model = cpu.Model(blocks=3).to(DEVICE)
    before = {k: v.cpu() for k, v in model.blocks.state_dict().items()}
    streamer = WeightStreamer([(f"blocks.{i}", b) for i, b in enumerate(model.blocks)], CudaTransfers(DEVICE))
    assert [s.device.type for s in streamer.slot_buffers()] == ["cuda", "cuda"]
    allocated = torch.cuda.memory_allocated(DEVICE)
    streamer.enter(0, recompute=False)
    assert all(t.device.type == "cuda" for _o, _n, t in block_tensors(model.blocks[0]))
    assert torch.cuda.memory_allocated(DEVICE) == allocated  # views of a slot, nothing new
    streamer.leave(0, recompute=False)
    streamer.close()
    after = model.blocks.state_dict()
    assert all(after[k].device.type == "cpu" and torch.equal(after[k], before[k]) for k in before)
