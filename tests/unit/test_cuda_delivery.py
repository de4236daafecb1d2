"""The CUDA delivery's steps on the CPU (#24): what a CPU can show of the device path.

* Masks are widened through one float32 table (``MASK_LUT``): exactly the CPU division the loader did before, for
  every byte; CUDA's own division by a CPU scalar multiplies by the reciprocal, which is why the table exists.
* The delivery itself (grouping a batch's host tensors by storage, checking each storage ONCE for pinned memory,
  one copy per pinned storage, staging the rest, device views at the same offsets, masks gathered, flipped and
  widened on the target) runs on a CPU stand-in of pinned memory (``loader_cases.pretend_pinning``) for every
  branch the trainer takes, and gives the CPU batches bit for bit; a reader's tensor that is not in pinned memory
  is counted in ``LoaderStats.pageable_copies`` and warned about once.
* The ``per_batch`` hook: called on the worker after the read with the latents' shape; its tensors reach the
  consumer as ``Batch.extras`` (the very tensors on the CPU); anything else than CPU tensors by name is named.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from dataset_cache.batch_assembly import MASK_LUT, mask_bytes, widen_masks
from dataset_cache.cuda_delivery import CudaDelivery
from dataset_cache.format.reader import ReadBuffer
from dataset_cache.loader import LoaderWorkerError, PrefetchLoader
from dataset_cache.sampler import BatchPlan

sys.path.insert(0, str(Path(__file__).parent))
import loader_cases as cases
import test_loader as cpu


# ---------------------------------------------------------------------------------------------- mask widening
def test_the_mask_table_widens_every_byte_exactly_as_the_cpu_division_did():
    every = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(4, 1, 8, 8)
    widened = widen_masks(every, MASK_LUT)
    assert widened.dtype == torch.float32 and widened.shape == every.shape
    # the loader's widening before the table, and the CPU tests' expectation: the same bits, every byte
    assert cases.same_bits(widened, every.to(torch.float32).div_(255.0))
    assert cases.same_bits(widened, every.float() / 255)
    # and the correctly rounded quotient (float64 division rounded once more to float32 is exact for a quotient
    # of two floats: 53 >= 2 x 24 + 2 bits), so this holds on any CPU, whatever its division kernel
    assert cases.same_bits(widened, (every.double() / 255).float())


def test_cudas_division_by_a_cpu_scalar_would_not_give_the_cpus_masks():
    """Why masks differed on the GPU (#24): CUDA's true division by a CPU scalar computes ``a * (1 / b)`` in
    float32 (``div_true_kernel_cuda``). The same float32 operations on the CPU (IEEE, exact on any x86-64) differ
    from the division in the last bit for about half of the 256 bytes; the table makes the device look up the
    CPU's quotients instead of computing its own."""
    every = torch.arange(256, dtype=torch.float32)
    reciprocal = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(255.0, dtype=torch.float32)
    cuda_formula = every * reciprocal
    differ = int((cuda_formula != MASK_LUT).sum())
    assert 0 < differ < 256 and torch.equal(MASK_LUT, every / 255)
    assert float((cuda_formula - MASK_LUT).abs().max()) <= 2 ** -24  # one ulp below 1.0 at most


def test_mask_bytes_are_flipped_for_mirrored_rows_and_full_weight_without_a_mask():
    g = torch.Generator().manual_seed(0)
    stored = [torch.randint(0, 256, (1, 1, 3, 5), generator=g, dtype=torch.uint8) for _ in range(3)]
    plan = BatchPlan(0, 0, (0, 1, 2, 3), ("a", "b", "c", "d"), ("e",) * 4, mirrored=(False, True, False, True),
                     mask_keys=("ka", "kb", None, "kd"))
    got = mask_bytes(plan, [stored[0], stored[1], None, stored[2]], (3, 5), torch.device("cpu"))
    want = torch.stack([stored[0][0], stored[1][0].flip(-1), torch.full((1, 3, 5), 255, dtype=torch.uint8),
                        stored[2][0].flip(-1)])
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------- the stand-in
@pytest.mark.parametrize("name", list(cases.CASES))
def test_the_cuda_steps_on_a_cpu_standin_give_the_cpu_batches_bit_for_bit(name, tmp_path, monkeypatch, caplog):
    pinned = cases.pretend_pinning(monkeypatch)
    case = cases.CASES[name](tmp_path)
    try:
        ref = cases.run(case, "cpu")
        with caplog.at_level("WARNING", logger="dataset_cache.loader"):
            got = cases.run(case, "standin", pinned)
    finally:
        case.close()
    cases.assert_same(got, ref, "cpu")
    warnings = [r for r in caplog.records if "pinned host memory" in r.getMessage()]
    if case.pageable == 0:
        assert got.stats.pageable_copies == 0 and warnings == []
    else:  # one detached pooled_output per caption entry of each batch
        assert got.stats.pageable_copies == sum(len(set(p.caption_keys)) for p, _, _ in got.batches)
        assert len(warnings) == 1 and "LoaderStats.pageable_copies" in warnings[0].getMessage()
    assert ref.stats.pageable_copies == 0  # the CPU target copies nothing to a device


def _pinned_read(pinned: dict[int, torch.Tensor], entries: dict[str, Any], keys: list[str]) -> list[Any]:
    buf = ReadBuffer(pin_memory=True)
    return cpu.FakeReader(entries).read(keys, out=buf)


def test_one_copy_per_pinned_storage_and_views_at_the_same_offsets(monkeypatch):
    """A batch read into one pinned buffer moves in ONE copy; every tensor is a view of that one block."""
    pinned = cases.pretend_pinning(monkeypatch)
    samples, entries = cpu.make_dataset(6)
    rows_of = (1, 3, 5)  # one bucket, no noise_mask: the reader lays their latents back to back
    plan = BatchPlan(0, 0, rows_of, tuple(samples[i].latent for i in rows_of),
                     tuple(samples[i].captions[0] for i in rows_of))
    keys = list(dict.fromkeys(plan.latent_keys + plan.caption_keys))
    values = dict(zip(keys, _pinned_read(pinned, entries, keys)))
    rows = [values[k]["samples"] for k in plan.latent_keys]
    delivery = CudaDelivery(torch.device("cpu"), is_pinned=lambda s: s.data_ptr() in pinned)
    staging = ReadBuffer(pin_memory=True)
    done = delivery.deliver(plan, values, rows, {}, staging)
    assert len(done.allocations) == 1 and done.pageable == 0
    block = done.allocations[0].untyped_storage().data_ptr()
    batch = done.batch
    leaves = [batch.latents, *[t for c in batch.conditioning for t in (c[0][0], c[0][1]["pooled_output"])]]
    assert all(t.untyped_storage().data_ptr() == block for t in leaves)
    assert block not in pinned  # a copy, not the read buffer itself
    lat, cond = cpu.expected_batch(entries, plan)
    assert torch.equal(batch.latents, lat)
    assert all(torch.equal(g[0][0], w[0][0]) for g, w in zip(batch.conditioning, cond))
    assert batch.latent_extras is None
    assert staging.tensor.numel() == 0  # nothing needed staging


@pytest.mark.parametrize("sparse", [False, True], ids=["one block", "a few views of a large buffer"])
def test_odd_tensors_keep_their_values(monkeypatch, sparse):
    """An empty tensor, a transposed view, a uint8 tensor at an odd offset before a float one (device views of any
    alignment), in one pinned buffer (one copy), or as a few small views of a large one (copied one by one, not the
    whole span), keep their values."""
    pinned = cases.pretend_pinning(monkeypatch)
    buf = ReadBuffer(pin_memory=True).ensure((8 << 20) if sparse else 256)
    buf.zero_()
    buf[1:7].copy_(torch.arange(1, 7, dtype=torch.uint8))
    lat = buf[64:64 + 48].view(torch.float32).view(1, 3, 4)
    lat.copy_(torch.arange(12, dtype=torch.float32).view(1, 3, 4))
    at = (6 << 20) if sparse else 128
    far = buf[at:at + 16].view(torch.float32)
    far.copy_(torch.tensor([1.5, -2.0, 3.25, -0.0]))
    values: dict[str, Any] = {
        "l": {"samples": lat},
        "c": [[lat[0].t(), {"bytes": buf[1:7], "empty": buf[:0].view(torch.float32).view(0, 3), "far": far}]],
    }
    plan = BatchPlan(0, 0, (0,), ("l",), ("c",))
    delivery = CudaDelivery(torch.device("cpu"), is_pinned=lambda s: s.data_ptr() in pinned)
    done = delivery.deliver(plan, values, [lat], {}, ReadBuffer(pin_memory=True))
    assert cases.same(done.batch.latents, lat.clone()) and done.pageable == 0
    assert cases.same(done.batch.conditioning[0], [[lat[0].t().clone(), {
        "bytes": buf[1:7].clone(), "empty": torch.empty(0, 3), "far": far.clone()}]])
    assert not done.batch.conditioning[0][0][0].is_contiguous()  # the transposed view stays a view
    if sparse:  # latents, their transposed view, the bytes and the far floats: four small copies
        assert len(done.allocations) == 4 and sum(a.numel() * a.element_size() for a in done.allocations) < 1024
    else:
        assert len(done.allocations) == 1


def test_a_pageable_value_is_staged_and_counted_with_its_entry(monkeypatch):
    pinned = cases.pretend_pinning(monkeypatch)
    samples, entries = cpu.make_dataset(4)
    plan = BatchPlan(0, 0, (0, 2), (samples[0].latent, samples[2].latent), (samples[0].captions[0],) * 2)
    keys = list(dict.fromkeys(plan.latent_keys + plan.caption_keys))
    values = dict(zip(keys, _pinned_read(pinned, entries, keys)))
    cond = values[plan.caption_keys[0]]
    cond[0][0] = cond[0][0].clone()  # not a view of the read buffer: pageable
    rows = [values[k]["samples"] for k in plan.latent_keys]
    noise = torch.randn(2, 4, 8, 8)
    staging = ReadBuffer(pin_memory=True)
    done = CudaDelivery(torch.device("cpu"), is_pinned=lambda s: s.data_ptr() in pinned).deliver(
        plan, values, rows, {"noise": noise}, staging)
    assert done.pageable == 1 and done.pageable_entry == plan.caption_keys[0]  # the hook's noise is not counted
    assert torch.equal(done.batch.conditioning[0][0][0], entries[plan.caption_keys[0]][0][0])
    assert cases.same(done.batch.extras["noise"], noise)
    assert done.batch.conditioning[0] is done.batch.conditioning[1]  # rows of one caption share its objects
    assert staging.tensor.numel() >= noise.numel() * 4 + cond[0][0].numel() * 4


# ---------------------------------------------------------------------------------------------- the hook
def test_per_batch_runs_on_the_worker_after_the_read_with_the_latents_shape():
    _, _, reader, sampler = cpu.make(n=20)
    calls: list[tuple[BatchPlan, torch.Size, threading.Thread, bool, int]] = []
    returned: dict[int, dict[str, torch.Tensor]] = {}

    def hook(number: int, plan: BatchPlan, shape: torch.Size) -> dict[str, torch.Tensor]:
        read = tuple(dict.fromkeys(plan.latent_keys + plan.caption_keys)) in reader.reads
        calls.append((plan, shape, threading.current_thread(), read, number))
        out = cases.noise(number, plan, shape)
        returned[plan.index] = out
        return out

    with PrefetchLoader(reader, sampler, prefetch_batches=2, threads=1, per_batch=hook) as loader:
        batches = list(loader)
    assert sorted(c[0].index for c in calls) == [b.plan.index for b in batches]
    for i, b in enumerate(batches):
        plan, shape, thread, read, number = next(c for c in calls if c[0] == b.plan)
        assert shape == b.latents.shape and read and thread is not threading.main_thread()
        assert number == i  # the batch's place in the iteration, whichever worker called the hook
        assert b.extras.keys() == {"sigmas", "noise", "weights"}
        assert all(b.extras[k] is returned[plan.index][k] for k in b.extras)  # the CPU target: the very tensors
        assert cases.same(b.extras["noise"], cases.noise(i, plan, shape)["noise"])  # seeded by the batch alone


def test_no_hook_no_extras():
    _, _, reader, sampler = cpu.make(n=6)
    with PrefetchLoader(reader, sampler, prefetch_batches=0) as loader:
        assert all(b.extras == {} for b in loader)


@pytest.mark.parametrize("bad,named", [
    (lambda n, p, s: [torch.zeros(1)], "returned list"),
    (lambda n, p, s: {"noise": 1.0}, "returned float for 'noise'"),
    (lambda n, p, s: {"noise": torch.zeros(1, device="meta")}, "returned a tensor on meta for 'noise'"),
])
def test_a_bad_per_batch_result_is_named(bad, named):
    _, _, reader, sampler = cpu.make(n=6)
    with PrefetchLoader(reader, sampler, prefetch_batches=1, per_batch=bad) as loader:
        with pytest.raises(LoaderWorkerError, match="per_batch hook " + named):
            list(loader)
