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
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import comfy.model_management

from ...dataset_cache.batch_assembly import with_references
from ...dataset_cache.memory_plan import BlockCost, MemoryNeeds
from ...dataset_cache.refs import materialize
from ...dataset_cache.weight_stream import block_tensors, streamable
from ...dataset_cache.block_runner import BlockRunners, out_of_place_assignments
from .blocks import Block
from .conditioning import Conditioner, ModelCall
from .probe_cache import ProbeCache, Uncacheable, structure_digest, value_digest

__all__ = ["OPTIMIZER_STATES", "PROBES", "ProbeResult", "clear_probe_cache", "fp8_able", "measure", "probe_inputs"]

log = logging.getLogger("streamcache.train")

OPTIMIZER_STATES = {"AdamW": 2, "Adam": 2, "RMSprop": 1, "SGD": 0, "Prodigy": 4, "AdamW8bit": 1,
                    "Lion8bit": 1}
"""Tensors the optimizer keeps per trained parameter (ComfyUI's optimizers with their default settings; Prodigy:
its two moments, its gradient sum and the starting weights; AdamW8bit: two bytes per weight, a bf16 LoRA's size,
besides a step's fp32 scratch of at most about 100 MB, :data:`~dataset_cache.blockwise8bit.CHUNK`; Lion8bit: one
byte per weight, counted as AdamW8bit's for its scratch)."""
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _storage(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage._cdata, storage.nbytes()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Meter:
    """Attributes every saved tensor to the block computing (``-1``: outside the blocks), notes each block's inputs,
    and which blocks modify their inputs or what they saved (``fix``: blocks run out of place); the
    :class:`~dataset_cache.block_runner.BlockRunners` probe."""

    def __init__(self, params: set[int], fix: set[int]) -> None:
        self.params = params
        self.fix = fix
        self.current = -1
        self.saved: dict[int, dict[int, int]] = {}
        self.saves: dict[int, int] = {}  # tensors saved (parameters too): what a recompute replays
        self.inputs: dict[int, dict[int, int]] = {}
        self._alive: list[torch.Tensor] = []  # inputs kept until the end: a freed storage's id could come back
        self._kept: list[tuple[torch.Tensor, int]] = []  # the current block's saved tensors and their versions
        self.mutated: dict[int, set[Any]] = {}
        self.overwrites: set[int] = set()

    def pack(self, t: torch.Tensor) -> None:
        """Count ``t``, keep it alive here until the pass ends (a freed storage's id could come back and be
        counted as the same storage), and put nothing in the graph: the probe never runs backward, and a saved
        tensor packed as itself would be held by its own ``grad_fn`` when it is that op's output (``exp``,
        ``softmax``...), a cycle through C++ that Python's collector cannot see, which kept the model's weights
        alive for good."""
        self._alive.append(t)
        self.saves[self.current] = self.saves.get(self.current, 0) + 1
        key, nbytes = _storage(t)
        if key not in self.params:
            self.saved.setdefault(self.current, {})[key] = nbytes
            if self.current >= 0:
                self._kept.append((t, t._version))

    def run(self, index: int, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        seen = self.inputs.setdefault(index, {})
        places = [*enumerate(args), *kwargs.items()]
        versions = {}
        for place, value in places:
            if isinstance(value, torch.Tensor):
                versions[place] = value._version
                key, nbytes = _storage(value)
                if key not in self.params:
                    seen[key] = nbytes
                    self._alive.append(value)
        outer, self.current, kept = self.current, index, len(self._kept)
        try:
            with out_of_place_assignments() if index in self.fix else contextlib.nullcontext():
                return forward(*args, **kwargs)
        finally:
            self.current = outer
            self.mutated.setdefault(index, set()).update(
                p for p, v in places if p in versions and v._version != versions[p])
            if any(t._version != v for t, v in self._kept[kept:]):
                self.overwrites.add(index)
            del self._kept[kept:]

    def drop_tensors(self) -> None:
        """Forget the fake tensors kept during the pass. They must not outlive it: their autograd graphs hold the
        real weights they were computed from and, through each saved tensor's hooks, this meter's ``pack`` — a
        cycle through C++ objects Python's collector cannot see, which would keep the model alive for good."""
        self._alive.clear()
        self._kept.clear()


def _never_unpacked(_packed: None) -> torch.Tensor:
    raise RuntimeError("the memory probe's graph is never run backward")


def probe_inputs(reader: Any, samples: Sequence[Any], buckets: Sequence[tuple[int, ...]], batch_size: int
                 ) -> tuple[tuple[int, ...], Any]:
    """The run's largest latent shape as a batch, and one conditioning of a sample of that shape (with its
    reference image, which an edit model reads as more tokens)."""
    index = max(range(len(buckets)), key=lambda i: (torch.Size(buckets[i]).numel(), -i))
    sample = samples[index]
    conditioning = materialize(reader.get(sample.captions[0]))
    if sample.reference is not None:
        reference = materialize(reader.get(sample.reference))["samples"]
        (conditioning,) = with_references([conditioning], [reference])
    return (batch_size, *buckets[index]), conditioning


def _prepare(mp: Any, shape: tuple[int, ...], conditioning: Any, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[list[int], dict[str, Any]]]]:
    """The step loop's inputs for one batch of ``shape`` (zeros; real tensors: turning conditionings into the
    model's arguments looks at values, e.g. an attention mask's length), before the fake forward."""
    model, sampling = mp.model, mp.get_model_object("model_sampling")  # a Model Sampling node's patch included
    latents = model.process_latent_in(torch.zeros(shape, device=device))
    sigma = torch.full((shape[0],), float(sampling.percent_to_sigma(0.5)), device=device)
    noise = torch.zeros(shape, device=device)
    xt = sampling.noise_scaling(sigma, noise, latents, False)
    return xt, sigma, Conditioner(model, device)([conditioning] * shape[0], noise, latents, 0)


def _forward(mp: Any, model_options: dict[str, Any], dtype: torch.dtype, xt: torch.Tensor, sigma: torch.Tensor,
             groups: list[tuple[list[int], dict[str, Any]]]) -> None:
    """The step loop's model call (under the fake mode: its real inputs become fake tensors)."""
    xt, sigma = xt.requires_grad_(True), sigma.requires_grad_(True)
    autocast = contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(xt.device.type, dtype=dtype)
    with autocast:
        for rows, kwargs in groups:
            ModelCall(mp, model_options)(xt[rows], sigma[rows], kwargs)


def adapted(module: torch.nn.Module) -> list[torch.Tensor]:
    """The weights and biases ComfyUI's trainer adapts in ``module`` (those of its ops, which have a
    ``weight_function``: ``_setup_lora_adapters`` wraps exactly these); each op copies them on use."""
    out = []
    for m in module.modules():
        if hasattr(m, "weight_function"):
            out += [t for t in (getattr(m, "weight", None), getattr(m, "bias", None))
                    if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return out


def fp8_able(module: torch.nn.Module) -> list[torch.Tensor]:
    """The matrices fp8 storage would convert: those of ComfyUI's ops, whose cast upcasts them on use."""
    out = []
    for m in module.modules():
        weight = getattr(m, "weight", None)
        if hasattr(m, "comfy_cast_weights") and isinstance(weight, torch.Tensor) and weight.dtype in _FLOATS \
                and weight.ndim >= 2:
            out.append(weight)
    return out


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
        fp8 = weight - sum(_nbytes(w) - w.numel() for w in fp8_able(blocks[index].module))
        copy = sum(t.numel() * copy_size for t in adapted(blocks[index].module))
        copies += copy
        shared = any(owners.get(id(t)) == -2 for _o, _n, t in block_tensors(blocks[index].module))
        costs.append(BlockCost(
            blocks[index].name, weight, sum(meter.saved.get(index, {}).values()) + copy,
            sum(meter.inputs.get(index, {}).values()), fp8 if fp8 < weight else None,
            streamable=index in order and not shared and not streamable(blocks[index].module) and weight > 0,
            saves=meter.saves.get(index, 0)))
    return costs, copies


@dataclass
class ProbeResult:
    """What the probe found: the run's needs, the order the blocks ran in (indices into the blocks), the inputs
    each block modifies in place (to hand it copies), the blocks that overwrite what they saved (run out of place)
    and the names of those still doing so out of place (their gradients through those tensors cannot be right)."""

    needs: MemoryNeeds
    order: list[int]
    copied: dict[int, set[Any]]
    out_of_place: set[int]
    unfixed: list[str]


def _pass(mp: Any, model_options: dict[str, Any], dtype: torch.dtype, runners: BlockRunners,
          inputs: tuple[Any, ...], fix: set[int]) -> _Meter:
    """One fake forward through the meter, the weights the trainer adapts marked as trained: the adapters are not
    attached yet (ComfyUI's load does that), and an adapted layer saves its input for the adapter's gradient as a
    trained weight would (a layer on a path without gradients, e.g. a text embedding, saves nothing otherwise)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    weights = [p for p in {id(t): t for t in adapted(mp.model)}.values() if not p.requires_grad]
    meter = _Meter({_storage(mode.from_tensor(t))[0] for _o, _n, t in block_tensors(mp.model)}, fix)
    training = comfy.model_management.in_training
    comfy.model_management.in_training = True  # ComfyUI picks its differentiable kernels then (rotary embeddings)
    for p in weights:
        p.requires_grad_(True)
    try:
        runners.probe = meter
        with mode, torch.autograd.graph.saved_tensors_hooks(meter.pack, _never_unpacked):
            _forward(mp, model_options, dtype, *inputs)
    finally:
        runners.probe = None
        meter.drop_tensors()
        for p in weights:
            p.requires_grad_(False)
        comfy.model_management.in_training = training
    return meter


PROBES = ProbeCache()
"""This process's probe results (:mod:`.probe_cache`): a re-run on the same model and shapes skips the fake pass."""


def clear_probe_cache() -> None:
    """Forget every remembered probe result (the next run of each model probes again)."""
    PROBES.clear()


def probe_key(mp: Any, model_options: dict[str, Any], dtype: torch.dtype, blocks: list[Block], runners: BlockRunners,
              shape: tuple[int, ...], conditioning: Any, trainable_bytes: int, weight_copies: bool) -> str | None:
    """The key of a probe's result: everything it depends on (:mod:`.probe_cache`), or ``None`` when something
    cannot be described as plain data (the run is then probed and nothing is remembered). ``runners.reentrant``
    (``checkpoint_mode``) is left out: the probe runs the blocks itself (``probe.run``), never through either
    checkpoint, and both forms keep the same tensors (each block's inputs) for the backward pass."""
    try:
        return value_digest(structure_digest(mp.model), [b.name for b in blocks], runners.checkpoint, str(dtype),
                            tuple(shape), conditioning, model_options, trainable_bytes, weight_copies)
    except Uncacheable as exc:
        log.debug("Train LoRA: the memory probe's result is not remembered (%s)", exc)
        return None


def measure(mp: Any, model_options: dict[str, Any], dtype: torch.dtype, blocks: list[Block], runners: BlockRunners,
            shape: tuple[int, ...], conditioning: Any, *, trainable_bytes: int, weight_copies: bool
            ) -> ProbeResult:
    """Measure a run's memory needs with a fake forward pass (a second one when some block modifies what it
    saved, run out of place), or hand out what an earlier run with the same key measured. Raises whatever the
    forward raises (the caller falls back to the weights)."""
    key = probe_key(mp, model_options, dtype, blocks, runners, shape, conditioning, trainable_bytes, weight_copies)
    found = PROBES.get(key) if key is not None else None
    if found is not None:
        log.info("Train LoRA: the memory probe's figures come from an earlier run of this model at these shapes")
        return found
    result = _measure(mp, model_options, dtype, blocks, runners, shape, conditioning,
                      trainable_bytes=trainable_bytes, weight_copies=weight_copies)
    return PROBES.put(key, result) if key is not None else result


def _measure(mp: Any, model_options: dict[str, Any], dtype: torch.dtype, blocks: list[Block], runners: BlockRunners,
             shape: tuple[int, ...], conditioning: Any, *, trainable_bytes: int, weight_copies: bool
             ) -> ProbeResult:
    dm = mp.model.diffusion_model
    device = next((p.device for p in dm.parameters()), torch.device("cpu"))
    with torch.no_grad():
        inputs = _prepare(mp, shape, conditioning, device)
    meter = _pass(mp, model_options, dtype, runners, inputs, set())
    fix = set(meter.overwrites) | {i for i, m in meter.mutated.items() if m}
    if fix:
        meter = _pass(mp, model_options, dtype, runners, inputs, fix)
    order = [i for i in _first_seen(meter) if i >= 0]
    copy_size = torch.tensor([], dtype=dtype).element_size() if weight_copies else 0
    costs, copies = _costs(blocks, meter, order, copy_size)
    block_ids = {id(t) for b in blocks for _o, _n, t in block_tensors(b.module)}
    outside = {id(t): t.data for _o, _n, t in block_tensors(dm) if id(t) not in block_ids}.values()
    other = sum(_nbytes(t) for t in outside)
    other_copies = sum(t.numel() * copy_size for t in adapted(dm) if id(t) not in block_ids)  # saved either way
    everything: dict[int, int] = {}
    for per_block in meter.saved.values():
        everything.update(per_block)
    held_ckpt = dict(meter.saved.get(-1, {}))
    for per_block in meter.inputs.values():
        held_ckpt.update(per_block)
    largest = max((t.numel() * (copy_size or t.element_size()) for _o, _n, t in block_tensors(dm)), default=0)
    needs = MemoryNeeds(tuple(costs), other, trainable_bytes, sum(everything.values()) + copies + other_copies,
                        sum(held_ckpt.values()) + other_copies, largest, measured="probe")
    return ProbeResult(needs, order, {i: m for i, m in meter.mutated.items() if m}, fix,
                       [blocks[i].name for i in sorted(meter.overwrites)])


def _first_seen(meter: _Meter) -> list[int]:
    return list(meter.inputs)
