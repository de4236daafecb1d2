"""The memory probe: one forward pass of the training model on *fake* tensors (``FakeTensorMode``: shapes and
dtypes, no memory, no compute) at the run's largest batch shape, measuring what each block and the rest save for
the backward pass. That is what the memory plan needs, for any family, before any weight moves to the device.

Measured by storage (a tensor saved twice, or several views of one, count once), parameters left out (they are
counted as weights). ComfyUI's ops copy each weight and add the adapter before using it when a model trains
(``cast_bias_weight`` with a weight function), and those copies are saved too; their wrappers are only attached
when ComfyUI loads the model, after the plan, so the probe adds them from the weights' sizes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import comfy.model_management

from ...dataset_cache.memory_plan import BlockCost, MemoryNeeds
from ...dataset_cache.refs import materialize
from ...dataset_cache.weight_stream import block_tensors, streamable
from .blocks import Block, BlockRunners
from .conditioning import Conditioner, ModelCall

__all__ = ["measure", "OPTIMIZER_STATES", "probe_inputs"]

log = logging.getLogger("streamcache.train")

OPTIMIZER_STATES = {"AdamW": 2, "Adam": 2, "RMSprop": 1, "SGD": 0}
"""Tensors the optimizer keeps per trained parameter (ComfyUI's optimizers with their default settings)."""
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _storage(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage._cdata, storage.nbytes()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Meter:
    """Attributes every saved tensor to the block computing (``-1``: outside the blocks) and notes each block's
    inputs; the :class:`~.blocks.BlockRunners` probe."""

    def __init__(self, params: set[int]) -> None:
        self.params = params
        self.current = -1
        self.saved: dict[int, dict[int, int]] = {}
        self.inputs: dict[int, dict[int, int]] = {}
        self._alive: list[torch.Tensor] = []  # inputs kept until the end: a freed storage's id could come back

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key, nbytes = _storage(t)
        if key not in self.params:
            self.saved.setdefault(self.current, {})[key] = nbytes
        return t

    def run(self, index: int, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        seen = self.inputs.setdefault(index, {})
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                key, nbytes = _storage(value)
                if key not in self.params:
                    seen[key] = nbytes
                    self._alive.append(value)
        outer, self.current = self.current, index
        try:
            return forward(*args, **kwargs)
        finally:
            self.current = outer


def probe_inputs(reader: Any, samples: Sequence[Any], buckets: Sequence[tuple[int, ...]], batch_size: int
                 ) -> tuple[tuple[int, ...], Any]:
    """The run's largest latent shape as a batch, and one conditioning of a sample of that shape."""
    index = max(range(len(buckets)), key=lambda i: (torch.Size(buckets[i]).numel(), -i))
    sample = samples[index]
    return (batch_size, *buckets[index]), materialize(reader.get(sample.captions[0]))


def _prepare(mp: Any, shape: tuple[int, ...], conditioning: Any, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[list[int], dict[str, Any]]]]:
    """The step loop's inputs for one batch of ``shape`` (zeros; real tensors: turning conditionings into the
    model's arguments looks at values, e.g. an attention mask's length), before the fake forward."""
    model = mp.model
    latents = model.process_latent_in(torch.zeros(shape, device=device))
    sigma = torch.full((shape[0],), float(model.model_sampling.percent_to_sigma(0.5)), device=device)
    noise = torch.zeros(shape, device=device)
    xt = model.model_sampling.noise_scaling(sigma, noise, latents, False)
    return xt, sigma, Conditioner(model, device)([conditioning] * shape[0], noise, latents, 0)


def _forward(mp: Any, model_options: dict[str, Any], dtype: torch.dtype, xt: torch.Tensor, sigma: torch.Tensor,
             groups: list[tuple[list[int], dict[str, Any]]]) -> None:
    """The step loop's model call (under the fake mode: its real inputs become fake tensors)."""
    xt, sigma = xt.requires_grad_(True), sigma.requires_grad_(True)
    autocast = contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(xt.device.type, dtype=dtype)
    with autocast:
        for rows, kwargs in groups:
            ModelCall(mp, model_options)(xt[rows], sigma[rows], kwargs)


def _costs(blocks: list[Block], meter: _Meter, order: Sequence[int], copy_size: int
           ) -> tuple[list[BlockCost], int]:
    """Each block's cost (in the order the forward ran them; blocks the probe never saw last, not streamable),
    and the bytes of ComfyUI's weight copies over all blocks."""
    owners: dict[int, int] = {}
    for index, block in enumerate(blocks):
        for _owner, _name, t in block_tensors(block.module):
            owners[id(t)] = -2 if owners.get(id(t), index) != index else index
    costs: list[BlockCost] = []
    copies = 0
    for index in [*order, *(i for i in range(len(blocks)) if i not in order)]:
        tensors = {id(t): t.data for _o, _n, t in block_tensors(blocks[index].module)}.values()
        weight = sum(_nbytes(t) for t in tensors)
        fp8 = sum(t.numel() if t.dtype in _FLOATS and t.ndim >= 2 else _nbytes(t) for t in tensors)
        copy = sum(t.numel() * copy_size for t in tensors if t.is_floating_point()) if copy_size else 0
        copies += copy
        shared = any(owners.get(id(t)) == -2 for _o, _n, t in block_tensors(blocks[index].module))
        costs.append(BlockCost(
            blocks[index].name, weight, sum(meter.saved.get(index, {}).values()) + copy,
            sum(meter.inputs.get(index, {}).values()), fp8 if fp8 < weight else None,
            streamable=index in order and not shared and not streamable(blocks[index].module) and weight > 0))
    return costs, copies


def measure(mp: Any, model_options: dict[str, Any], dtype: torch.dtype, blocks: list[Block], runners: BlockRunners,
            shape: tuple[int, ...], conditioning: Any, *, trainable_bytes: int, weight_copies: bool
            ) -> tuple[MemoryNeeds, list[int]]:
    """Measure a run's memory needs with one fake forward pass; also the order the blocks ran in (indices into
    ``blocks``). Raises whatever the forward raises (the caller falls back to an estimate from the weights)."""
    dm = mp.model.diffusion_model
    device = next((p.device for p in dm.parameters()), torch.device("cpu"))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    params = {_storage(mode.from_tensor(t))[0] for _o, _n, t in block_tensors(mp.model)}
    meter = _Meter(params)
    with torch.no_grad():
        xt, sigma, groups = _prepare(mp, shape, conditioning, device)
    training = comfy.model_management.in_training
    comfy.model_management.in_training = True  # ComfyUI picks its differentiable kernels then (rotary embeddings)
    runners.probe, runners.order[:] = meter, []
    try:
        with mode, torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t):
            _forward(mp, model_options, dtype, xt, sigma, groups)
    finally:
        runners.probe = None
        comfy.model_management.in_training = training
    order = [i for i in _first_seen(meter) if i >= 0]
    copy_size = torch.tensor([], dtype=dtype).element_size() if weight_copies else 0
    costs, copies = _costs(blocks, meter, order, copy_size)
    block_ids = {id(t) for b in blocks for _o, _n, t in block_tensors(b.module)}
    other = sum(_nbytes(t.data) for t in {id(t): t for _o, _n, t in block_tensors(dm)
                                          if id(t) not in block_ids}.values())
    everything: dict[int, int] = {}
    for per_block in meter.saved.values():
        everything.update(per_block)
    held_ckpt = dict(meter.saved.get(-1, {}))
    for per_block in meter.inputs.values():
        held_ckpt.update(per_block)
    largest = max((t.numel() * (copy_size or t.element_size()) for _o, _n, t in block_tensors(dm)), default=0)
    needs = MemoryNeeds(tuple(costs), other, trainable_bytes, sum(everything.values()) + copies,
                        sum(held_ckpt.values()), largest, measured="probe")
    return needs, order


def _first_seen(meter: _Meter) -> list[int]:
    return list(meter.inputs)
