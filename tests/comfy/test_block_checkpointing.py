"""Gradient checkpointing that checkpoints blocks, and the memory plan's weight streaming, through the real trainer.

For every family ComfyUI trains, a tiny model of ComfyUI's own classes is built at two block counts
(``support.tiny_families.build_family_patcher``: the same widths, 2 and 4 blocks; UNets 1 and 2 res blocks per
level) and trained one step at a time by ``train_lora`` (CPU, fp32, a LoRA on every layer). A saved-tensor hook
around each step measures what the forward keeps for the backward pass (distinct storages, weights left out):

* without checkpointing it grows with every block's activations (and ComfyUI's patched weight copies);
* with every block its own checkpoint it grows with one hidden state per block (each checkpoint's inputs), so
  the two block counts keep nearly the same bytes;
* losses and every LoRA gradient are bit-identical with and without checkpointing, with the blocks' weights
  streamed through two slots (the CPU stands in for the device), and with the checkpoints' inputs kept in host
  memory: the same kernels run on the same values, only where they live changes.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from support.encoded import write_random_samples
from support.tiny_families import BLOCK_COUNTS, FAMILIES, Family, build_family_patcher

SETTINGS = {"steps": 2, "batch_size": 2, "learning_rate": 1e-3, "rank": 2, "optimizer": "AdamW", "seed": 3,
            "training_dtype": "fp32", "lora_dtype": "fp32", "prefetch_batches": 0, "memory": "no offload"}


def _module(pack: ModuleType, name: str) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.{name}")


@pytest.fixture(scope="module", params=list(FAMILIES), ids=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> Family:
    return FAMILIES[request.param]


@pytest.fixture(scope="module")
def dataset(pack: ModuleType, family: Family, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Two samples of the family's latent shape and conditionings (one bucket: every step a batch of two)."""
    return write_random_samples(pack, family, tmp_path_factory.mktemp(f"ckpt_{family.name}") / "cache")


@dataclasses.dataclass
class Run:
    losses: list[float]
    grads: list[list[torch.Tensor]]
    lora: dict[str, torch.Tensor]
    saved: int
    memory_plan: dict[str, Any]


def _saved_meter(training: ModuleType, monkeypatch: pytest.MonkeyPatch, out: list[int]) -> None:
    """Around each step's forward: the bytes of the distinct storages saved for backward (the parameters, which
    stay anyway, left out), counted until the backward starts. What a checkpoint's recompute saves inside the
    backward is left out: those storages come and go block by block, and counting them by address counted more or
    fewer as the allocator reused addresses (a flaky count). Unpacking checks each tensor's version as autograd
    would (saved-tensor hooks turn its own check off): a tensor modified after it was saved fails the run, as it
    does without hooks."""
    real = training.loop.StepLoop._fwd_bwd
    real_backward = torch.autograd.backward

    def fwd_bwd(self: Any, batch: Any, index: int) -> float:
        weights = {t.untyped_storage().data_ptr() for t in [*self.mp.model.parameters(), *self.mp.model.buffers()]}
        seen: dict[int, int] = {}
        forward = [True]

        def backward(*args: Any, **kwargs: Any) -> Any:
            forward[0] = False
            return real_backward(*args, **kwargs)

        def pack(t: torch.Tensor) -> tuple[torch.Tensor, int]:
            storage = t.untyped_storage()
            if forward[0] and storage.data_ptr() not in weights:
                seen[storage.data_ptr()] = storage.nbytes()
            return t, t._version

        def unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
            t, version = packed
            assert t._version == version, f"a {list(t.shape)} tensor was modified after it was saved for backward"
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack), monkeypatch.context() as patch:
            patch.setattr(torch.autograd, "backward", backward)
            loss = real(self, batch, index)
        assert not forward[0], "the step's backward did not go through torch.autograd.backward"
        out.append(sum(seen.values()))
        return loss

    monkeypatch.setattr(training.loop.StepLoop, "_fwd_bwd", fwd_bwd)


def train(pack: ModuleType, family: Family, blocks: int, dataset: Any, monkeypatch: pytest.MonkeyPatch,
          **options: Any) -> Run:
    training = _module(pack, "nodes.training")
    settings = training.TrainSettings(**{**SETTINGS, **options})
    saved: list[int] = []
    grads: list[list[torch.Tensor]] = []

    def hook(optimizer: Any, _args: Any, _kwargs: Any) -> None:
        grads.append([p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                      for g in optimizer.param_groups for p in g["params"]])

    model = build_family_patcher(family, blocks)
    reader, samples = dataset.open()
    with monkeypatch.context() as patch:
        _saved_meter(training, patch, saved)
        handle = register_optimizer_step_pre_hook(hook)
        try:
            with torch.inference_mode():
                result = training.train_lora(model, reader, samples, settings)
        finally:
            handle.remove()
            reader.close()
    del model
    gc.collect()
    return Run(result.losses, grads, result.lora, max(saved), result.memory_plan)


def _same(a: Run, b: Run) -> None:
    assert a.losses == b.losses
    assert len(a.grads) == len(b.grads) == SETTINGS["steps"]
    for step_a, step_b in zip(a.grads, b.grads):
        assert len(step_a) == len(step_b) and all(torch.equal(x, y) for x, y in zip(step_a, step_b))
    assert a.lora.keys() == b.lora.keys() and all(torch.equal(a.lora[k], b.lora[k]) for k in a.lora)


@pytest.fixture(scope="module")
def runs(pack: ModuleType, family: Family, dataset: Any) -> Iterator[dict[tuple[int, bool], Run]]:
    """Each block count, with and without checkpointing."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield {(n, ckpt): train(pack, family, n, dataset, monkeypatch, gradient_checkpointing=ckpt)
               for n in BLOCK_COUNTS[family.name] for ckpt in (False, True)}


def test_checkpointed_bytes_grow_with_a_hidden_state_per_block_not_with_its_activations(
        family: Family, runs: dict[tuple[int, bool], Run]) -> None:
    small, large = BLOCK_COUNTS[family.name]
    plain = runs[large, False].saved - runs[small, False].saved  # the added blocks' activations
    checkpointed = runs[large, True].saved - runs[small, True].saved  # their checkpoints' inputs
    assert plain > 0
    assert checkpointed < plain / 8, (family.name, {k: r.saved for k, r in runs.items()})
    assert runs[large, True].saved < 1.25 * runs[small, True].saved  # nearly the same bytes for twice the blocks
    plan = runs[large, True].memory_plan
    assert plan["checkpoint"] and plan["blocks"] >= 4 and plan["streamed_blocks"] == 0


def test_the_memory_probe_predicts_what_the_forward_keeps(family: Family, runs: dict[tuple[int, bool], Run]) -> None:
    """The plan's figures come from one forward on fake tensors before any weight moves: what it predicts a forward
    keeps (without and with checkpointing) is what the real steps kept, to within what it does not model (the
    adapters' own few saved tensors and the loss's: under 3% on every family; it never predicts more)."""
    for (_n, ckpt), run in runs.items():
        predicted = run.memory_plan["needs"]["held_checkpointed" if ckpt else "held"]
        assert 0.97 * run.saved <= predicted <= run.saved, (family.name, ckpt, predicted, run.saved)


def test_blocks_kept_whole_hold_what_the_probe_predicts_and_train_bit_identically(
        pack: ModuleType, family: Family, dataset: Any, runs: dict[tuple[int, bool], Run],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``memory`` auto + keep blocks whole (this batch of 2) with room for some blocks kept whole (a budget that
    leaves twice their bytes free): the forward keeps the checkpoints' inputs plus the kept blocks' saves, as the
    probe predicted: never under by more than the 3% above, and over by at most the kept blocks' inputs, counted in
    both (byte counts, the same on any machine: 0–2% on most families, 5% on Flux, whose blocks take copies of their
    inputs); and it trains bit for bit as every block checkpointed."""
    n = BLOCK_COUNTS[family.name][-1]
    lean = runs[n, True]
    plans = _module(pack, "dataset_cache.memory_plan")
    memory = _module(pack, "nodes.training.memory")
    needs = lean.memory_plan["needs"]
    low = lean.memory_plan["estimate_bytes"]
    budget = low + (needs["held"] - needs["held_checkpointed"])  # half of it: about half of what keeping all holds
    monkeypatch.setattr(memory, "device_budget", lambda _device, slots, _there: plans.Budget(budget, None, slots))
    run = train(pack, family, n, dataset, monkeypatch, memory="auto + keep blocks whole", gradient_checkpointing=True)
    plan = run.memory_plan
    assert 0 < plan["kept_blocks"] < plan["blocks"] and plan["fits"], (family.name, plan["description"])
    predicted = plan["needs"]["held_checkpointed"] + plan["needs"]["kept_saved"]
    assert 0.97 * run.saved <= predicted <= 1.10 * run.saved, (family.name, predicted, run.saved)
    assert lean.saved < run.saved < runs[n, False].saved
    _same(run, lean)


def test_block_checkpointing_trains_bit_identically(family: Family, runs: dict[tuple[int, bool], Run]) -> None:
    for n in BLOCK_COUNTS[family.name]:
        _same(runs[n, True], runs[n, False])


def test_streamed_weights_and_host_activations_train_bit_identically(
        pack: ModuleType, family: Family, dataset: Any, runs: dict[tuple[int, bool], Run],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block's weights streamed through two slots, the checkpoints' inputs in host memory (the CPU stands in
    for the device); then only some blocks streamed: the same losses, gradients and LoRA."""
    n = BLOCK_COUNTS[family.name][1]
    everything = train(pack, family, n, dataset, monkeypatch, memory="stream blocks + host activations",
                       stream_blocks=1000)
    plan = everything.memory_plan
    assert plan["streamed_blocks"] == plan["blocks"] and plan["host_activations"]
    assert plan["stream"]["misses"] == 1 and plan["stream"]["uploads"] > 0  # each block copied ahead of its use
    _same(everything, runs[n, True])
    some = train(pack, family, n, dataset, monkeypatch, memory="stream blocks", stream_blocks=2)
    assert some.memory_plan["streamed_blocks"] == 2 and not some.memory_plan["host_activations"]
    _same(some, runs[n, True])



FAST_FAMILIES = ("sd15", "flux")
"""The families whose "fast" checkpoints are compared (a UNet with a timestep embedding every res block reads, a
transformer with a modulation vector every block reads)."""


def test_fast_checkpoints_train_as_exact_ones_up_to_float_rounding(
        pack: ModuleType, family: Family, dataset: Any, runs: dict[tuple[int, bool], Run],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``checkpoint_mode`` "fast" (torch's reentrant checkpoint) against "exact". The first step's forward is the
    same computation: the same loss bit for bit. Its gradients are sums of the same fp32 terms, those of a tensor
    several blocks read associated per block first: within U·eps·sum|terms| (U: the uses, about two per block);
    compared per tensor against 1e-4 × its largest element, which allows sums whose terms cancel to 1/40 of their
    magnitudes (SD1.5: under 2e-6). From then on the weights differ by those roundings through AdamW, whose update
    is about ``learning_rate`` per element wherever a gradient is non-zero: the LoRAs must agree to 5% of one
    update (a wrong or missing gradient moves an element by a whole one; SD1.5: under 1%), and the later losses to
    1e-5 relative (the loss changes by ~15% from step to step here; SD1.5: 6e-8). What a step keeps for the
    backward pass (measured by hooks around forward *and* backward) is the same: the recompute inside the backward
    saves past outer hooks, and the memory probe's figures hold for both forms."""
    if family.name not in FAST_FAMILIES:
        pytest.skip("compared on SD1.5 and Flux")
    n = BLOCK_COUNTS[family.name][1]
    exact, fast = runs[n, True], train(pack, family, n, dataset, monkeypatch, checkpoint_mode="fast")
    assert fast.losses[0] == exact.losses[0]
    assert fast.losses[1:] == pytest.approx(exact.losses[1:], rel=1e-5, abs=0)
    first_exact, first_fast = exact.grads[0], fast.grads[0]
    assert len(first_exact) == len(first_fast) > 0
    assert any(bool(a.abs().max() > 0) for a in first_exact)  # (the LoRAs' up halves start at 0: their downs' too)
    for a, b in zip(first_exact, first_fast):
        assert float((a - b).abs().max()) <= 1e-4 * float(a.abs().max())
    lr, steps = SETTINGS["learning_rate"], SETTINGS["steps"]
    assert exact.lora.keys() == fast.lora.keys()
    assert all(torch.allclose(exact.lora[k], fast.lora[k], rtol=0, atol=0.05 * lr) for k in exact.lora)
    assert steps == len(exact.losses) == len(fast.losses)
    assert fast.saved == exact.saved
    predicted = fast.memory_plan["needs"]["held_checkpointed"]
    assert predicted == exact.memory_plan["needs"]["held_checkpointed"] and 0.97 * fast.saved <= predicted <= fast.saved


def test_an_unknown_checkpoint_mode_is_refused_by_name(pack: ModuleType) -> None:
    settings = _module(pack, "nodes.training").TrainSettings
    with pytest.raises(ValueError, match="checkpoint_mode 'quick'; use one of exact, fast"):
        settings(checkpoint_mode="quick").validate()
    settings(checkpoint_mode="fast").validate()
