"""The weight streamer, the block runners and host-held activations, on the CPU with a stand-in device.

The stand-in is :class:`~dataset_cache.transfers.SyncTransfers` with a recording allocator and copy: "device"
buffers are CPU tensors the test knows, so it can check, inside every streamed block's compute (forward and
recompute), that each of the block's weights lies in one of the device slots, that no more slots exist than
asked, and what was copied when. Results must be bit-identical with and without checkpointing, streaming and
host activations: the same fp32 CPU kernels run on the same values (only where the values live changes).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
import torch
from torch import nn

from dataset_cache.block_runner import BlockRunners, out_of_place_assignments
from dataset_cache.host_activations import HostActivations
from dataset_cache.transfers import SyncTransfers
from dataset_cache.weight_stream import WeightStreamer, block_tensors, streamable

DIM = 16


class Adapter(nn.Module):
    """A trained low-rank delta, kept outside the block (as ComfyUI keeps its adapters in weight functions)."""

    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(2 * DIM, 2, generator=gen) * 0.1)
        self.down = nn.Parameter(torch.randn(2, DIM, generator=gen) * 0.1)


class Block(nn.Module):
    """A transformer-ish block: a patched weight, a norm, a buffer, and a value read from the options dict the model
    updates between blocks (as ComfyUI's ``transformer_options["block_index"]``)."""

    def __init__(self, gen: torch.Generator, adapter: Adapter) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.norm = nn.LayerNorm(2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)
        self.register_buffer("scale", torch.rand(DIM, generator=gen) + 0.5)
        for p in self.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        self.requires_grad_(False)
        object.__setattr__(self, "adapter", adapter)  # not a submodule: not streamed

    def forward(self, x: torch.Tensor, context: torch.Tensor, *, options: dict[str, Any]) -> torch.Tensor:
        weight = self.fc1.weight + self.adapter.up @ self.adapter.down
        h = torch.nn.functional.gelu(self.norm(torch.nn.functional.linear(x + context, weight, self.fc1.bias)))
        return x + self.fc2(h) * self.scale * (1.0 + 0.01 * options["block_index"])


class Model(nn.Module):
    def __init__(self, blocks: int = 6, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.adapters = nn.ModuleList([Adapter(gen) for _ in range(blocks)])
        self.blocks = nn.ModuleList([Block(gen, a) for a in self.adapters])
        self.head = nn.Linear(DIM, DIM).requires_grad_(False)
        with torch.no_grad():
            for p in self.head.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        options = {"block_index": 0}
        for i, block in enumerate(self.blocks):
            options["block_index"] = i
            x = block(x, context, options=options)
        return self.head(x)


class Recording(SyncTransfers):
    """The stand-in device: every buffer and copy recorded."""

    def __init__(self) -> None:
        super().__init__("cpu", alloc=self._record_alloc)
        self.device_buffers: list[torch.Tensor] = []
        self.uploads: list[int] = []
        self.marks = 0

    def _record_alloc(self, nbytes: int, where: str) -> torch.Tensor:
        buffer = torch.full((nbytes,), 0xAB, dtype=torch.uint8)  # garbage until a copy fills it
        if where == "device":
            self.device_buffers.append(buffer)
        return buffer

    def upload(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Any:
        self.uploads.append(src.numel())
        return super().upload(dst, src, after)

    def mark(self) -> Any:
        self.marks += 1
        return super().mark()

    def on_device(self, t: torch.Tensor) -> bool:
        start = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
        return any(b.data_ptr() <= start < b.data_ptr() + b.numel() for b in self.device_buffers)


@contextmanager
def setup(model: Model, *, checkpoint: bool, streamed: tuple[int, ...] = (), host: bool = False,
          transfers: Recording | None = None, slots: int = 2) -> Iterator[tuple[BlockRunners, Any]]:
    """The runners (and a streamer over ``streamed``, host activations) on ``model`` for the ``with`` body."""
    runners = BlockRunners(list(model.blocks), checkpoint=checkpoint)
    streamer = None
    if streamed:
        transfers = transfers or Recording()
        streamer = WeightStreamer([(f"blocks.{i}", model.blocks[i]) for i in streamed], transfers, slots=slots)
        runners.streamer, runners.streamed = streamer, {i: k for k, i in enumerate(streamed)}
    offload = HostActivations(SyncTransfers("cpu"), min_bytes=0) if host else None
    try:
        yield runners, offload
    finally:
        if streamer is not None:
            streamer.close()
        runners.remove()


def train(model: Model, steps: int = 3, **options: Any) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """``steps`` AdamW steps on the adapters; the losses and each step's gradients."""
    optimizer = torch.optim.AdamW(model.adapters.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    losses, grads = [], []
    with setup(model, **options) as (_runners, offload):
        for _ in range(steps):
            x = torch.randn(4, 8, DIM, generator=gen).requires_grad_(True)
            context = torch.randn(4, 8, DIM, generator=gen)
            with offload.hooks() if offload is not None else ExitStack():
                loss = model(x, context).square().mean()
            loss.backward()
            losses.append(loss.detach().clone())
            grads.append([p.grad.clone() for p in model.adapters.parameters()])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return losses, grads


def _same(a: tuple[list[torch.Tensor], list[list[torch.Tensor]]],
          b: tuple[list[torch.Tensor], list[list[torch.Tensor]]]) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0])), (a[0], b[0])
    for step_a, step_b in zip(a[1], b[1]):
        assert all(torch.equal(x, y) for x, y in zip(step_a, step_b))


# ---------------------------------------------------------------------------------------------- bit-identical
@pytest.mark.parametrize("options", [
    {"checkpoint": True},
    {"checkpoint": True, "streamed": (0, 1, 2, 3, 4, 5)},
    {"checkpoint": True, "streamed": (1, 3, 4)},
    {"checkpoint": True, "streamed": (0, 2, 3, 5), "slots": 3},
    {"checkpoint": True, "host": True},
    {"checkpoint": True, "streamed": (2, 5), "host": True},
], ids=["checkpointed", "all-streamed", "some-streamed", "three-slots", "host-activations", "streamed+host"])
def test_training_is_bit_identical_to_training_without_any_of_it(options: dict[str, Any]) -> None:
    reference = train(Model(), checkpoint=False)
    _same(train(Model(), **options), reference)


def test_a_recompute_sees_the_options_of_its_own_block() -> None:
    """The model updates ``options["block_index"]`` after each block; a recompute given the dict as it is at
    backward time would scale every block like the last one. The runner recomputes with this block's copy."""
    model = Model(blocks=3)
    with setup(model, checkpoint=True):
        x = torch.randn(2, 4, DIM, requires_grad=True)
        model(x, torch.zeros(2, 4, DIM)).sum().backward()
    grad = x.grad.clone()
    x.grad = None
    model(x, torch.zeros(2, 4, DIM)).sum().backward()
    assert torch.equal(x.grad, grad)


# -------------------------------------------------------------------------------------------------- schedule
def test_every_streamed_block_computes_from_a_device_slot_and_no_more_slots_exist() -> None:
    """Inside each streamed block's layers, in the forward and in the recompute, every weight and buffer of the
    block is a view of one of the device slots; resident blocks never are; two slots are all there is."""
    model = Model(blocks=6)
    transfers = Recording()
    streamed = (0, 2, 3, 5)
    seen: list[tuple[int, bool]] = []

    def check(index: int) -> Any:
        def hook(_module: nn.Module, _args: Any) -> None:
            tensors = [t for _o, _n, t in block_tensors(model.blocks[index])]
            on_device = [transfers.on_device(t) for t in tensors]
            assert all(on_device) if index in streamed else not any(on_device), index
            seen.append((index, torch.is_grad_enabled()))
        return hook

    handles = [layer.register_forward_pre_hook(check(i)) for i, b in enumerate(model.blocks)
               for layer in (b.norm, b.fc2)]
    try:
        train(model, steps=2, checkpoint=True, streamed=streamed, transfers=transfers)
    finally:
        for h in handles:
            h.remove()
    assert len(transfers.device_buffers) == 2
    runs = [i for k, (i, _) in enumerate(seen) if k == 0 or seen[k - 1][0] != i]  # consecutive layers: one run
    forward, recompute = [0, 1, 2, 3, 4, 5], [4, 3, 2, 1, 0]  # block 5's recompute follows its forward
    assert runs == forward + recompute + forward[1:] + recompute
    # between uses no streamed block points into a slot, except the one the backward computed last (held)
    assert [i for i in streamed if transfers.on_device(model.blocks[i].fc1.weight)] == []


def test_prefetching_copies_ahead_so_only_the_very_first_block_waits() -> None:
    """With two slots the next streamed block is copied while the current one computes, across passes: the last
    block of a forward is still in its slot for its recompute, the first recomputed for the next forward."""
    model = Model(blocks=6)
    transfers = Recording()
    streamed = (0, 1, 2, 3, 4, 5)
    with setup(model, checkpoint=True, streamed=streamed, transfers=transfers) as (runners, _):
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            model(torch.randn(2, 4, DIM, generator=gen).requires_grad_(True), torch.zeros(2, 4, DIM)).sum().backward()
        stats = runners.streamer.stats  # type: ignore[union-attr]
    assert stats.misses == 1 and stats.hits == 3 * 2 * 6 - 1
    assert stats.uploads == len(transfers.uploads) <= 3 * (2 * 6 - 2) + 1  # two uses per pass saved by the ring
    assert stats.slot_bytes == 2 * max(transfers.uploads)


def test_a_slot_is_overwritten_only_after_the_compute_that_used_it() -> None:
    """Every upload after the first two is ordered after a marker of compute (the slot's last use)."""
    model = Model(blocks=4)
    afters: list[Any] = []

    class Ordered(Recording):
        def mark(self) -> Any:
            super().mark()
            return object()

        def upload(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Any:
            afters.append(after)
            return super().upload(dst, src, after)

    train(model, steps=2, checkpoint=True, streamed=(0, 1, 2, 3), transfers=Ordered())
    assert afters[:2] == [None, None] and all(a is not None for a in afters[2:])


# -------------------------------------------------------------------------------------------- what it refuses
def test_blocks_that_cannot_stream_are_named() -> None:
    model = Model(blocks=2)
    model.blocks[0].fc1.weight.requires_grad_(True)
    assert streamable(model.blocks[0]) == "Linear.weight is trained"
    assert streamable(model.blocks[1]) == ""
    with pytest.raises(ValueError, match=r"block blocks\.0 cannot be streamed: Linear\.weight is trained"):
        WeightStreamer([("blocks.0", model.blocks[0])], Recording())
    with pytest.raises(ValueError, match="at least 2 slots"):
        WeightStreamer([("blocks.1", model.blocks[1])], Recording(), slots=1)


def test_close_leaves_every_weight_readable_in_host_memory() -> None:
    model = Model(blocks=3)
    before = {k: v.clone() for k, v in model.blocks.state_dict().items()}
    transfers = Recording()
    train(model, steps=1, checkpoint=True, streamed=(0, 1, 2), transfers=transfers)
    after = model.blocks.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not any(transfers.on_device(t) for b in model.blocks for _o, _n, t in block_tensors(b))
    assert all("forward" not in vars(b) for b in model.blocks)  # the runners are gone


def test_host_activations_move_what_the_checkpoints_keep_and_copy_a_shared_tensor_once() -> None:
    """Each block's checkpoint keeps its inputs (x and the shared context): the context is copied once."""
    model = Model(blocks=4)
    with setup(model, checkpoint=True, host=True) as (_runners, offload):
        x = torch.randn(2, 4, DIM, requires_grad=True)
        context = torch.randn(2, 4, DIM)
        with offload.hooks():
            loss = model(x, context).sum()
        moved = offload.offloaded_bytes
        loss.backward()
    one = x.numel() * x.element_size()
    assert 5 * one <= moved  # four blocks' x, the context once, and what the head saves
    assert offload.restored_bytes >= moved - one  # all comes back (the head's input may stay unused)


# ------------------------------------------------------------------------------- blocks that write in place
class InPlace(nn.Module):
    """Flux's double block: a norm saves its input for the backward pass, the residual is added into that input,
    and the block goes on (a second norm), so a recompute runs past the addition."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(4)
        self.fc = nn.Linear(DIM, DIM)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(DIM, DIM, generator=gen))
        self.fc.requires_grad_(False)
        self.trained = nn.Parameter(torch.randn(DIM, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(torch.nn.functional.layer_norm(x, (DIM,)) * self.trained)
        x += h  # overwrites what the first layer_norm saved
        return torch.nn.functional.layer_norm(x, (DIM,)) * self.trained


def _grad(block: InPlace, **runner: Any) -> torch.Tensor:
    runners = BlockRunners([block], checkpoint=runner.pop("checkpoint"))
    for name, value in runner.items():
        setattr(runners, name, value)
    try:
        x = torch.randn(3, DIM, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
        (block(x * 1.0).square().sum()).backward()  # the gradient reaches x through the layer norm
    finally:
        runners.remove()
    block.trained.grad = None
    return x.grad


def test_a_block_that_overwrites_what_it_saved_is_run_out_of_place() -> None:
    """Without checkpointing autograd refuses the overwritten tensor, and so does a checkpoint whose saved input
    is overwritten; handed a copy of its input, the checkpoint's recompute reads the overwritten tensor silently
    (a wrong gradient: what ComfyUI's own checkpointing computes on Flux). Run out of place, both give the true
    gradient, bit for bit."""
    block = InPlace()
    for checkpoint in (False, True):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            _grad(block, checkpoint=checkpoint)
    true = _grad(block, checkpoint=False, out_of_place={0})
    assert not torch.equal(_grad(block, checkpoint=True, copied={0: {0}}), true)
    assert torch.equal(_grad(block, checkpoint=True, out_of_place={0}), true)
    assert "__iadd__" not in torch.Tensor.__dict__  # the patch is gone after the block
    t = torch.ones(2, dtype=torch.bfloat16)
    with out_of_place_assignments():
        alias = t
        t += torch.ones(2, dtype=torch.float32)  # a new tensor, in t's own dtype
    assert t.dtype == torch.bfloat16 and t.tolist() == [2.0, 2.0] and alias.tolist() == [1.0, 1.0]


def test_inputs_a_block_writes_into_are_handed_as_copies() -> None:
    class AddsIntoItsInput(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.add_(1.0)

    block = AddsIntoItsInput()
    runners = BlockRunners([block], checkpoint=False)
    runners.copied = {0: {0}}
    try:
        x = torch.zeros(2)
        assert block(x).tolist() == [1.0, 1.0] and x.tolist() == [0.0, 0.0]
        runners.copied = None  # not known: every tensor input is copied
        assert block(x).tolist() == [1.0, 1.0] and x.tolist() == [0.0, 0.0]
    finally:
        runners.remove()
    assert block(x).tolist() == [1.0, 1.0] and x.tolist() == [1.0, 1.0]
