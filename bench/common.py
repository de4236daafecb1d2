"""What the benchmarks share: synthetic datasets, the lazy-branch baseline, and the measuring helpers.

Everything here measures or builds; nothing writes Markdown (that is :mod:`bench.report`). The library
(``dataset_cache``) is imported inside the functions, never at the top: :mod:`bench.ab_read_path` registers the
``dataset_cache`` of the source tree under test before anything imports it, and ``scripts/bench-comfy`` loads it
from the pack without putting the pack root on ``sys.path`` (see :mod:`bench.run_comfyui`).
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import os
import pickle
import platform
import random
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "PACK_ROOT", "DOC", "MIB", "Profile", "PROFILES", "Entries", "keys_of", "write_ours", "write_lazy", "LazyReader",
    "random_batches", "read_ours", "rss_mib", "open_footprint", "evict", "med", "Machine", "machine_info",
    "run_json_child",
]

PACK_ROOT = Path(__file__).resolve().parents[1]
DOC = PACK_ROOT / "docs" / "BENCHMARKS.md"
MIB = 1 << 20


# ------------------------------------------------------------------------------------------------ profiles
@dataclass(frozen=True)
class Profile:
    """The tensor shapes of one model family's sample (a latent and a conditioning with its pooled output)."""

    name: str
    latent: tuple[int, ...]
    cond: tuple[int, ...]
    pooled: tuple[int, ...]
    dtype: str  # "float16" | "bfloat16"
    batch: int  # batch size of the read benchmarks

    @property
    def sample_bytes(self) -> int:
        total = 0
        for shape in (self.latent, self.cond, self.pooled):
            n = 1
            for d in shape:
                n *= d
            total += 2 * n
        return total


PROFILES = {
    "sd15": Profile("SD1.5", (1, 4, 64, 64), (1, 77, 768), (1, 768), "float16", 4),
    "flux": Profile("Flux", (1, 16, 128, 128), (1, 512, 4096), (1, 768), "bfloat16", 2),
}


class Entries:
    """Distinct entries without generating N random tensors: a small random pool, stamped with the index."""

    def __init__(self, p: Profile) -> None:
        import torch

        g = torch.Generator().manual_seed(0)
        dt = getattr(torch, p.dtype)
        self.lat = [torch.randn(p.latent, generator=g).to(dt) for _ in range(4)]
        self.cond = [torch.randn(p.cond, generator=g).to(dt) for _ in range(4)]
        self.pool = [torch.randn(p.pooled, generator=g).to(dt) for _ in range(4)]

    def get(self, i: int) -> tuple[dict, list]:
        import torch

        lat = self.lat[i % 4].clone()
        lat.view(-1)[:2] = torch.tensor([i & 0xFFF, i >> 12], dtype=lat.dtype)
        cond = self.cond[i % 4].clone()
        cond.view(-1)[:2] = torch.tensor([i & 0xFFF, i >> 12], dtype=cond.dtype)
        return {"samples": lat}, [[cond, {"pooled_output": self.pool[i % 4].clone()}]]


def keys_of(i: int) -> tuple[str, str]:
    """Synthetic entry keys of sample ``i`` (xxh3-128 of the length-prefixed kind and number: stable across versions,
    so benchmarks of two source trees read one cache)."""
    import xxhash

    def key(kind: str) -> str:
        h = xxhash.xxh3_128()
        for part in (kind.encode(), str(i).encode()):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        return h.hexdigest()

    return key("latent"), key("cond")


# ------------------------------------------------------------------------------------------------ writers
def write_ours(root: Path, n: int, entries: Entries) -> float:
    """Write ``n`` samples into a cache at ``root`` (dataset ``"bench"``); returns the seconds it took."""
    from dataset_cache.dataset import Sample
    from dataset_cache.format import CacheWriter

    t = time.perf_counter()
    with CacheWriter(root) as w:
        samples = []
        for i in range(n):
            lk, ck = keys_of(i)
            lat, cond = entries.get(i)
            w.add(lk, lat, kind="latent", name="latent")
            w.add(ck, cond, kind="conditioning", name="conditioning")
            samples.append(Sample(lk, (ck,)))
        w.set_dataset("bench", samples)
    return time.perf_counter() - t


def write_lazy(root: Path, n: int, entries: Entries, shard_size: int = 1000) -> float:
    """The lazy-branch layout: shard_XXXX.safetensors (one tensor per sample tensor) + pickled skeletons."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    for s in range(0, n, shard_size):
        tensors, skels = {}, []
        for j, i in enumerate(range(s, min(n, s + shard_size))):
            lat, cond = entries.get(i)
            tensors[f"s{j}_lat_0"] = lat["samples"]
            tensors[f"s{j}_cond_1"] = cond[0][0]
            tensors[f"s{j}_cond_2"] = cond[0][1]["pooled_output"]
            skels.append(({"samples": {"__tref__": f"s{j}_lat_0"}},
                          [[{"__tref__": f"s{j}_cond_1"}, {"pooled_output": {"__tref__": f"s{j}_cond_2"}}]]))
        idx = s // shard_size
        save_file(tensors, str(root / f"shard_{idx:04d}.safetensors"))
        with open(root / f"shard_{idx:04d}.skeleton.pkl", "wb") as f:
            pickle.dump(skels, f, protocol=pickle.HIGHEST_PROTOCOL)
    (root / "metadata.json").write_text(json.dumps({"format_version": 2, "num_samples": n,
                                                    "num_shards": -(-n // shard_size), "shard_size": shard_size}))
    return time.perf_counter() - t


class LazyReader:
    """Opens like the lazy branch's ``_ShardReader`` (skeleton pickle + safetensors header per shard) and realizes
    a sample with one ``safe_open`` handle per shard, opened on first use and kept, one ``get_tensor`` per tensor."""

    def __init__(self, root: Path) -> None:
        from dataset_cache.safe_pickle import load_skeleton_pickle

        meta = json.loads((root / "metadata.json").read_text())
        self.shard_size = meta["shard_size"]
        self.shards: list[tuple[str, list, dict]] = []
        self.handles: dict[int, Any] = {}
        for idx in range(-(-meta["num_samples"] // self.shard_size)):
            path = root / f"shard_{idx:04d}.safetensors"
            skels = load_skeleton_pickle(root / f"shard_{idx:04d}.skeleton.pkl")  # restricted: no code runs
            with open(path, "rb") as f:
                (hn,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(hn))
            self.shards.append((str(path), skels, header))

    def __len__(self) -> int:
        return sum(len(s[1]) for s in self.shards)

    def realize(self, i: int) -> Any:
        from safetensors import safe_open

        s = i // self.shard_size
        h = self.handles.get(s)
        if h is None:
            h = self.handles[s] = safe_open(self.shards[s][0], "pt")
        return self.realize_with(i, lambda name: h.get_tensor(name).clone())  # clone: the bytes are really read

    def realize_with(self, i: int, tensor: Callable[[str], Any]) -> Any:
        """Sample ``i`` with each ``{"__tref__": name}`` of its skeleton replaced by ``tensor(name)``."""
        skels = self.shards[i // self.shard_size][1]

        def walk(v: Any) -> Any:
            if isinstance(v, dict) and "__tref__" in v:
                return tensor(v["__tref__"])
            if isinstance(v, dict):
                return {k: walk(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return type(v)(walk(x) for x in v)
            return v

        return walk(skels[i % self.shard_size])


# ------------------------------------------------------------------------------------------------ reads
def random_batches(n: int, batch: int, count: int, seed: int) -> list[list[int]]:
    """``count`` random batches of ``batch`` distinct sample numbers below ``n`` (seeded: both sides of an A/B
    read the same rows)."""
    rng = random.Random(seed)
    return [rng.sample(range(n), batch) for _ in range(count)]


def read_ours(root: Path, plan: list[list[int]]) -> float:
    """Seconds for ``CacheReader.read`` (checksums verified, one reused ``ReadBuffer``) of every batch of ``plan``."""
    from dataset_cache.format import ReadBuffer, open_cache

    batches = [[k for i in b for k in keys_of(i)] for b in plan]  # content keys: not part of reading
    with open_cache(root, verify=True) as r:
        buf = ReadBuffer()
        t = time.perf_counter()
        for keys in batches:
            r.read(keys, out=buf)
        return time.perf_counter() - t


# ------------------------------------------------------------------------------------------------ measuring
def rss_mib() -> tuple[float, float]:
    """(current RSS, peak RSS) of this process in MiB."""
    cur = peak = 0.0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
    return cur, peak


def open_footprint(open_: Callable[[], tuple[Any, int]]) -> dict[str, float]:
    """Wall time and RSS growth of opening a dataset in this process (L1 and C1 take theirs the same way, so their
    figures compare): ``open_`` returns what it keeps open (alive until the RSS is read, as a training run keeps
    it) and the samples it found."""
    gc.collect()
    r0, _ = rss_mib()
    t = time.perf_counter()
    kept, n = open_()
    dt = time.perf_counter() - t
    gc.collect()
    r1, peak = rss_mib()
    del kept
    return {"open_s": dt, "growth_mib": r1 - r0, "rss_mib": r1, "peak_mib": peak, "samples": n}


def evict(root: Path) -> None:
    """Drop the page cache of every file under ``root`` (posix_fadvise DONTNEED; no root rights needed)."""
    for p in Path(root).rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fdatasync(fd)  # dirty pages cannot be dropped: write them back first (no-op when clean)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def med(values: Sequence[float]) -> float:
    return statistics.median(values)


def run_json_child(module: str, args: Sequence[str], *, timeout: float | None = None,
                   env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``python -m <module> ARGS`` in a fresh interpreter from the pack root and return the last JSON object it
    printed (a measurement that must not share this process: RSS, cold imports). ``-m`` from the pack root makes
    ``bench`` and ``dataset_cache`` importable there without touching ``sys.path``."""
    return last_json_result([sys.executable, "-m", module, *args], timeout=timeout, env=env)


def last_json_result(command: Sequence[str], *, timeout: float | None = None,
                     env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``command`` from the pack root and return the last JSON object line it printed; a failure or no result
    raises ``RuntimeError`` with the end of its output."""
    proc = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout, cwd=str(PACK_ROOT), env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{' '.join(command)} printed no result:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def serial_reads(reader: Any, plans: Any, batches: int, buf: Any) -> list[float]:
    """Seconds of each of ``batches`` batch reads on this thread, no loader: ``reader.read`` of a plan's entries
    into ``buf`` plus the ``torch.cat`` of its latents (the reference the loader figures are measured against)."""
    import torch

    reads = []
    for _ in range(batches):
        p = next(plans)
        t = time.perf_counter()
        v = reader.read(list(dict.fromkeys(p.latent_keys + p.caption_keys)), out=buf)
        torch.cat([v[j]["samples"] for j in range(len(p.latent_keys))])
        reads.append(time.perf_counter() - t)
    return reads


# ------------------------------------------------------------------------------------------------ the machine
@dataclass(frozen=True)
class Machine:
    """Where and when figures were taken (shown above every measured section: a shared machine's load matters)."""

    date: str
    cpu: str
    cores: int | None
    usable: int
    load: float
    ram: str
    disk: str
    versions: dict[str, str] = field(default_factory=dict)
    os: str = ""


def _version(mod: str) -> str:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        try:
            return str(__import__(mod).__version__)
        except Exception:
            return "not installed"


def machine_info(extra_versions: dict[str, str] | None = None, root: Path | None = None) -> Machine:
    """CPU model, cores, load average now, RAM, the disk of the scratch folder ``root``, versions, date."""
    cpu = platform.processor() or "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = "?"
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                ram = f"{int(line.split()[1]) / 2**20:.1f} GiB"
                break
    except OSError:
        pass
    disk = "?"
    if root is not None:
        try:
            dev = subprocess.run(["df", "-hT", str(root)], capture_output=True, text=True).stdout.splitlines()[-1]
            parts = dev.split()
            disk = f"{parts[0]} ({parts[1]}, {parts[2]} total, {parts[4]} free) for {root}"
            name = os.path.basename(os.path.realpath(parts[0])).rstrip("0123456789")
            rot = Path(f"/sys/block/{name}/queue/rotational")
            if rot.exists():
                disk += ", rotational" if rot.read_text().strip() == "1" else ", non-rotational"
                disk = disk.replace("rotational", "rotational as the kernel reports it", 1)
        except Exception:
            pass
    versions = {"python": platform.python_version(), "torch": _version("torch"),
                "safetensors": _version("safetensors"), "xxhash": _version("xxhash"), "numpy": _version("numpy")}
    versions.update(extra_versions or {})
    return Machine(
        date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        cpu=cpu, cores=os.cpu_count(), usable=len(os.sched_getaffinity(0)), load=os.getloadavg()[0],
        ram=ram, disk=disk, versions=versions, os=platform.platform(),
    )
