"""Loader runs shared by the CUDA tests and their CPU stand-in: every branch the trainer takes on a device.

Each :class:`Case` builds a reader and a sampler the same way for the CPU reference and for the target, and
:func:`run` iterates a loader to the end, keeping a CPU snapshot of every batch. :func:`assert_same` then compares a
target's snapshots with the reference's BIT FOR BIT (the bytes of every tensor, every plain value, the structure):
the delivery only copies bytes and looks mask bytes up in one table, so nothing may differ, not even in the last bit.

``target`` is ``"cpu"`` (the reference), ``"cuda"``, or ``"standin"``: the CUDA delivery's own steps (grouping by
storage, the pinned check, one copy per storage, staging, device views, mask widening) run on the CPU, with a
stand-in for pinned memory (see :func:`pretend_pinning`). The stand-in runs in the CPU suite, so the CUDA tests'
comparisons are exercised on every run, not only where a GPU is.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from dataset_cache.batch_assembly import map_tensors
from dataset_cache.cuda_delivery import CudaDelivery
from dataset_cache.dataset import Sample
from dataset_cache.dataset_mix import DatasetPart, Regularization, mix_datasets
from dataset_cache.format.reader import ReadBuffer, open_cache
from dataset_cache.format.writer import CacheWriter
from dataset_cache.latent_buckets import buckets_from_reader
from dataset_cache.loader import LoaderStats, PrefetchLoader
from dataset_cache.multi_reader import MultiCacheReader
from dataset_cache.sampler import BatchPlan, BucketSampler

sys.path.insert(0, str(Path(__file__).parent))
import test_loader as cpu
import test_loader_masks as masks
import test_multi_reader as multi


# ------------------------------------------------------------------------------------------- the stand-in
def pretend_pinning(monkeypatch: pytest.MonkeyPatch) -> dict[int, torch.Tensor]:
    """Make ``ReadBuffer(pin_memory=True)`` behave on a CPU-only machine as it does where CUDA is: the flag stays
    set (so a ``MultiCacheReader``'s per-group buffers follow the loader's), and every allocation it makes is
    recorded as pinned. Returns the record (address -> the tensor, kept so no address is reused meanwhile)."""
    pinned: dict[int, torch.Tensor] = {}

    def init(self: ReadBuffer, nbytes: int = 0, *, pin_memory: bool = False) -> None:
        self.pin_memory = bool(pin_memory)
        self.tensor = self._alloc(nbytes)

    def alloc(self: ReadBuffer, n: int) -> torch.Tensor:
        t = torch.empty(n, dtype=torch.uint8)
        if self.pin_memory and n:
            pinned[t.untyped_storage().data_ptr()] = t
        return t

    monkeypatch.setattr(ReadBuffer, "__init__", init)
    monkeypatch.setattr(ReadBuffer, "_alloc", alloc)
    return pinned


def standin(loader: PrefetchLoader, pinned: dict[int, torch.Tensor]) -> PrefetchLoader:
    """Give a CPU loader the CUDA target's steps (pinned slots, the delivery), with ``pinned`` as the pinned check."""
    ctx = loader._ctx
    ctx.cuda = CudaDelivery(torch.device("cpu"), is_pinned=lambda storage: storage.data_ptr() in pinned)
    ctx.pool, ctx.pin = None, True
    return loader


# ------------------------------------------------------------------------------------------- the cases
@dataclass
class Case:
    """A reader, a fresh sampler per run, and the loader's other arguments.

    Attributes:
        pageable: tensors of the reads that are not views of the read buffer (``LoaderStats.pageable_copies``
            of a CUDA run; ``None``: more than 0, the exact number depending on the batches).
    """

    reader: Any
    sampler: Callable[[], BucketSampler]
    kwargs: dict[str, Any] = field(default_factory=dict)
    pageable: int | None = 0
    close: Callable[[], None] = lambda: None


def _write(root: Path, entries: dict[str, Any]) -> Any:
    with CacheWriter(root) as w:
        for key, value in entries.items():
            w.add(key, value, kind="conditioning" if isinstance(value, list) else "latent")
    return open_cache(root)


def image(tmp: Path) -> Case:
    """Image latents ``[B, C, H, W]`` of two buckets, conditionings with ``pooled_output``, ``noise_mask`` extras."""
    _, _, reader, sampler = cpu.make(n=30)
    return Case(reader, lambda: cpu.make(n=30)[3], {"prefetch_batches": 2, "threads": 2})


def video(tmp: Path) -> Case:
    """Video latents ``[B, C, T, H, W]``: one-frame images and 3-frame clips."""
    samples, entries = cpu.make_dataset(12, shapes=((16, 1, 8, 8), (16, 3, 8, 8)))
    reader = cpu.FakeReader(entries)
    return Case(reader, lambda: BucketSampler(samples, buckets_from_reader(reader, samples), 3, 1, tail="wrap"),
                {"prefetch_batches": 2, "threads": 1})


def conditioning_extras(tmp: Path) -> Case:
    """The real ``CacheReader``: conditionings with every extra the families carry (pooled output, guidance, a
    list of reference latents, an attention mask), of mixed dtypes in one read (bf16 latents, fp16 and int64)."""
    g = torch.Generator().manual_seed(7)
    entries: dict[str, Any] = {}
    samples = []
    for i in range(10):
        entries[f"l{i}"] = {"samples": torch.randn(1, 16, 6, 4, generator=g).bfloat16()}
        entries[f"c{i}"] = [[torch.randn(1, 5, 32, generator=g).half(), {
            "pooled_output": torch.randn(1, 8, generator=g).half(),
            "guidance": 3.5,
            "reference_latents": [torch.randn(1, 16, 6, 4, generator=g), torch.randn(1, 16, 3, 2, generator=g)],
            "attention_mask": torch.randint(0, 2, (1, 5), generator=g, dtype=torch.int64),
        }]]
        samples.append(Sample(f"l{i}", (f"c{i}",)))
    reader = _write(tmp / "extras", entries)
    return Case(reader, lambda: BucketSampler(samples, buckets_from_reader(reader, samples), 3, 2, tail="wrap"),
                {"prefetch_batches": 3, "threads": 2, "epochs": 2}, close=reader.close)


def references(tmp: Path) -> Case:
    """The real ``CacheReader``: samples with reference images (an edit model's), mirrored with their reference's
    mirror, some without one; one reference is another sample's latent (one entry in two roles of a batch)."""
    g = torch.Generator().manual_seed(9)
    entries: dict[str, Any] = {"c": [[torch.randn(1, 5, 32, generator=g).half(), {"guidance": 2.5}]]}
    samples = []
    for i in range(10):
        entries[f"l{i}"] = {"samples": torch.randn(1, 16, 6, 4, generator=g).bfloat16()}
        entries[f"m{i}"] = {"samples": torch.randn(1, 16, 6, 4, generator=g).bfloat16()}
        if i % 3:
            entries[f"r{i}"] = {"samples": torch.randn(1, 16, 6, 4, generator=g).bfloat16()}
            entries[f"rm{i}"] = {"samples": torch.randn(1, 16, 6, 4, generator=g).bfloat16()}
        ref = None if i % 3 == 0 else ("l0" if i == 1 else f"r{i}")
        samples.append(Sample(f"l{i}", ("c",), mirror=f"m{i}", reference=ref,
                              reference_mirror=None if ref is None else f"rm{i}"))
    reader = _write(tmp / "references", entries)
    return Case(reader, lambda: BucketSampler(samples, buckets_from_reader(reader, samples), 3, 4, tail="wrap"),
                {"prefetch_batches": 2, "threads": 2, "epochs": 2}, close=reader.close)


def masks_and_mirrors(tmp: Path) -> Case:
    """Loss masks (``uint8``, widened on the target), mirrored rows (their masks flipped), rows without a mask."""
    samples, entries = masks.dataset(12)
    reader = cpu.FakeReader(entries)
    return Case(reader, lambda: BucketSampler(samples, buckets_from_reader(reader, samples), 4, seed=3, tail="wrap"),
                {"prefetch_batches": 3, "threads": 2, "epochs": 2})


def two_caches(tmp: Path) -> Case:
    """A real ``MultiCacheReader`` over two real caches: main datasets in one, a regularization set (row weights
    0.25) of the same bucket in the other, so batches span both (latents stacked, each cache's group in its own
    buffer); caption dropout, mirrors and masks too."""
    main, main_entries = multi._variety("p", 5, 4, 4, seed=1)
    extra, extra_entries = multi._variety("s", 2, 4, 4, seed=2)
    reg, reg_entries = multi._variety("r", 4, 4, 4, seed=3)
    a = _write(tmp / "a", {**main_entries, **extra_entries})
    b = _write(tmp / "b", reg_entries)
    reader = MultiCacheReader([a, b])

    def sampler() -> BucketSampler:
        mix = mix_datasets([DatasetPart("main", main, 2), DatasetPart("extra", extra, 1)])
        regularization = Regularization(reg, buckets_from_reader(reader, reg), 0.5, 0.25, name="reg")
        return BucketSampler(mix, buckets_from_reader(reader, mix.samples), 3, seed=5, tail="wrap",
                             caption_dropout=0.3, reg=regularization)

    return Case(reader, sampler, {"prefetch_batches": 2, "threads": 2, "epochs": 3}, close=reader.close)


def noise(_number: int, plan: BatchPlan, shape: torch.Size) -> dict[str, torch.Tensor]:
    """A trainer-like ``per_batch`` hook: sigmas and noise from a generator seeded by the batch alone."""
    g = torch.Generator().manual_seed(1000 * plan.epoch + plan.index)
    return {"sigmas": torch.rand(shape[0], generator=g), "noise": torch.randn(shape, generator=g),
            "weights": torch.tensor(plan.weights or (1.0,) * shape[0], dtype=torch.float32)}


def per_batch(tmp: Path) -> Case:
    """The ``per_batch`` hook: its CPU tensors reach the target as ``Batch.extras`` (pageable: staged, not counted)."""
    case = image(tmp)
    case.kwargs["per_batch"] = noise
    return case


class DetachedReader(cpu.FakeReader):
    """A reader whose conditionings' ``pooled_output`` is a fresh tensor, not a view of the read buffer."""

    def read(self, keys: Any, *, pin_memory: bool = False, out: Any = None) -> list[Any]:
        values = super().read(keys, pin_memory=pin_memory, out=out)
        for v in values:
            if isinstance(v, list):
                v[0][1]["pooled_output"] = v[0][1]["pooled_output"].clone()
        return values


def detached(tmp: Path) -> Case:
    """A reader value outside the read buffer: copied from pinned staging, counted and warned about."""
    samples, entries = cpu.make_dataset(20)
    reader = DetachedReader(entries)
    return Case(reader, lambda: BucketSampler(samples, buckets_from_reader(reader, samples), 3, 1, tail="wrap"),
                {"prefetch_batches": 2, "threads": 1}, pageable=None)


CASES: dict[str, Callable[[Path], Case]] = {
    "image": image, "video": video, "conditioning extras (real reader)": conditioning_extras,
    "masks and mirrors": masks_and_mirrors, "reference images (real reader)": references,
    "two caches, regularization rows": two_caches,
    "per_batch extras": per_batch, "a value outside the read buffer": detached,
}


# ------------------------------------------------------------------------------------------- running, comparing
@dataclass
class Run:
    """A loader run: each batch as ``(plan, CPU snapshot, device types of its tensors)``, and the loader's stats."""

    batches: list[tuple[BatchPlan, dict[str, Any], set[str]]]
    stats: LoaderStats


def snapshot(batch: Any) -> tuple[dict[str, Any], set[str]]:
    """A batch's values as CPU copies (a later reuse of its memory cannot change them) and its tensors' devices."""
    devices: set[str] = set()

    def to_cpu(t: torch.Tensor) -> torch.Tensor:
        devices.add(t.device.type)
        return t.to("cpu", copy=True)

    parts = {"latents": batch.latents, "conditioning": batch.conditioning, "latent_extras": batch.latent_extras,
             "masks": batch.masks, "extras": batch.extras}
    return map_tensors(parts, to_cpu), devices


def run(case: Case, target: str, pinned: dict[int, torch.Tensor] | None = None) -> Run:
    """Iterate ``case`` to the end on ``target`` (``"cpu"``, ``"cuda"`` or ``"standin"``, which needs ``pinned``).

    A batch is snapshot as it is delivered, with no synchronization: on CUDA the copy to the host is queued on the
    consumer's stream, so it sees the batch only if that stream waits for the side stream's copies."""
    device = "cuda" if target == "cuda" else "cpu"
    loader = PrefetchLoader(case.reader, case.sampler(), device=device, **case.kwargs)
    if target == "standin":
        assert pinned is not None
        standin(loader, pinned)
    out = []
    with loader:
        for batch in loader:
            values, devices = snapshot(batch)
            out.append((batch.plan, values, devices))
        stats = loader.stats
    return Run(out, stats)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (``torch.equal`` alone would call 0.0 and -0.0 equal)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))


def same(a: Any, b: Any) -> bool:
    """``a`` and ``b`` alike in structure, plain values and every tensor's dtype, shape and bytes."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and same_bits(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def assert_same(got: Run, ref: Run, device: str) -> None:
    """Every batch of ``got`` on ``device`` and equal, bit for bit, to ``ref``'s batch of the same plan."""
    assert [p for p, _, _ in got.batches] == [p for p, _, _ in ref.batches]
    assert len(got.batches) > 2
    for (plan, values, devices), (_, want, _) in zip(got.batches, ref.batches):
        assert devices == {device}, (plan, devices)
        for part in want:
            assert same(values[part], want[part]), (plan, part)
