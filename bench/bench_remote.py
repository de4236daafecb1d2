"""Benchmark: the training loop's wait for data when the cache is in a bucket, first and second epoch.

An SD1.5-sized dataset (``--n`` samples: a ``[1, 4, 64, 64]`` float16 latent and a ``[1, 77, 768]`` float16
conditioning each) is published with ``push`` to moto's S3 server (``tests/support/s3server.py``), run in a child
process that adds a fixed latency to every request (``--latency-ms``, default 20 and 100: a nearby and a distant
region; 0 shows moto's own cost per request, which grows with the object: shards of ``--shard-mb`` 8 MiB keep it
near 20 ms). The consumer is a training loop stand-in: the loader at the default prefetch depth
(``DEFAULT_PREFETCH_BATCHES``) and a step of ``--step-ms`` (a sleep: GPU work releases the GIL). Two epochs per run,
with a fresh reader and an empty fetch cache; epoch 2 reads what epoch 1 fetched from the local disk. The same
loop over the local cache (warm page cache) is the baseline, run alternately with the remote ones.

Reported per configuration, median (min-max) over ``--runs``: the consumer's wait for data per epoch (seconds
and % of the epoch's wall time), the first batch's wait, and the GETs of shard bytes sent in each epoch.

    .venv/bin/python -m bench.bench_remote                      # from the pack root (needs obstore + moto)
    .venv/bin/python -m bench.bench_remote --n 256 --runs 2 --latency-ms 20
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dataset_cache.constants import DEFAULT_PREFETCH_BATCHES
from dataset_cache.dataset import Sample
from dataset_cache.format.reader import open_cache
from dataset_cache.format.writer import CacheWriter
from dataset_cache.latent_buckets import buckets_from_reader
from dataset_cache.loader import PrefetchLoader
from dataset_cache.sampler import BucketSampler

from .common import PACK_ROOT

__all__ = ["main"]

BUCKET = "bench"


def _serve(latency_ms: float) -> None:
    """Child process: moto's S3 with ``latency_ms`` per request; prints its endpoint, runs until stdin closes."""
    spec = importlib.util.spec_from_file_location("streamcache_s3server", PACK_ROOT / "tests/support/s3server.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    server = module.S3Server()
    server.latency_s = latency_ms / 1e3
    server.boto3().create_bucket(Bucket=BUCKET)
    print(server.endpoint, flush=True)
    sys.stdin.read()
    server.stop()


def _write(root: Path, n: int, shard_bytes: int) -> None:
    g = torch.Generator().manual_seed(0)
    lat = [torch.randn(1, 4, 64, 64, generator=g).half() for _ in range(4)]
    cond = [torch.randn(1, 77, 768, generator=g).half() for _ in range(4)]
    with CacheWriter(root, shard_bytes=shard_bytes) as w:
        samples = []
        for i in range(n):
            lk, ck = f"{i:08x}l", f"{i:08x}c"
            latent = lat[i % 4].clone()
            latent.view(-1)[0] = i
            caption = cond[i % 4].clone()
            caption.view(-1)[0] = i
            w.add(lk, {"samples": latent}, kind="latent")
            w.add(ck, [[caption, {}]], kind="conditioning")
            samples.append(Sample(lk, (ck,)))
        w.set_dataset("bench", samples)


def _two_epochs(reader: Any, batch: int, step_s: float) -> dict[str, list[float]]:
    """Wait per epoch, first-batch wait and wall per epoch of a loop over two epochs; GETs per epoch."""
    samples = reader.dataset("bench")
    sampler = BucketSampler(samples, buckets_from_reader(reader, samples), batch, seed=3)
    files = getattr(reader, "files", None)
    wait = [0.0, 0.0]
    wall = [0.0, 0.0]
    gets = [0, 0]
    first = 0.0
    with PrefetchLoader(reader, sampler, prefetch_batches=DEFAULT_PREFETCH_BATCHES, epochs=2) as loader:
        it = iter(loader)
        epoch_start = time.perf_counter()
        current, requests_before = 0, files.requests if files else 0
        while True:
            t = time.perf_counter()
            try:
                b = next(it)
            except StopIteration:
                break
            waited = time.perf_counter() - t
            if b.plan.epoch != current:  # the first batch of epoch 2
                wall[current] = t - epoch_start
                gets[current] = (files.requests if files else 0) - requests_before
                current, epoch_start = b.plan.epoch, t
                requests_before = files.requests if files else 0
            if b.plan.epoch == 0 and b.plan.index == 0:
                first = waited
            wait[current] += waited
            time.sleep(step_s)
        wall[current] = time.perf_counter() - epoch_start
        gets[current] = (files.requests if files else 0) - requests_before
    return {"wait": wait, "wall": wall, "first": [first], "gets": [float(g) for g in gets]}


def _stat(values: list[float], scale: float = 1.0, fmt: str = ".2f") -> str:
    v = [x * scale for x in values]
    return f"{statistics.median(v):{fmt}} ({min(v):{fmt}}–{max(v):{fmt}})"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=512, help="samples in the dataset (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=4, help="batch size (default: %(default)s)")
    ap.add_argument("--step-ms", type=float, default=50.0, help="simulated training step (default: %(default)s)")
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 20.0, 100.0],
                    help="latency added to every request, one server each (default: 0 20 100; 0 is moto's own cost)")
    ap.add_argument("--shard-mb", type=int, default=8,
                    help="shard size (default: %(default)s; moto copies the whole object for every request, so its "
                         "own cost per request grows with the shard: ~20 ms at 8 MiB, ~160 ms at 74 MiB)")
    ap.add_argument("--runs", type=int, default=3, help="runs per configuration (default: %(default)s)")
    ap.add_argument("--serve", type=float, default=None, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Publish the dataset to one S3 server per latency, run every configuration, print the table."""
    args = _parser().parse_args(argv)
    if args.serve is not None:
        _serve(args.serve)
        return 0
    import dataset_cache.remote.publish  # noqa: F401 - needs the remote extra: fail before writing anything

    work = Path(tempfile.mkdtemp(prefix="bench_remote_"))
    local = work / "local"
    _write(local, args.n, args.shard_mb << 20)
    size = sum(sh.size for sh in open_cache(local).shards)
    servers = _start_servers(args.latency_ms)
    try:
        results = _measure(args, work, local, servers)
    finally:
        for proc, _ in servers.values():
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(timeout=30)
    _print_table(args, size, results)
    return 0


def _start_servers(latencies: list[float]) -> dict[float, tuple[subprocess.Popen[str], str]]:
    """One S3 server child per latency: latency → (its process, its endpoint); the AWS settings for them set."""
    servers = {}
    for lat in latencies:
        proc = subprocess.Popen([sys.executable, "-m", "bench.bench_remote", "--serve", str(lat)], cwd=PACK_ROOT,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        servers[lat] = (proc, proc.stdout.readline().strip())
    env = {"AWS_ALLOW_HTTP": "true", "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_REGION": "us-east-1"}
    os.environ.update(env)
    return servers


def _measure(args: argparse.Namespace, work: Path, local: Path,
             servers: dict[float, tuple[subprocess.Popen[str], str]]) -> dict[str, list[dict[str, list[float]]]]:
    """The cache pushed to every server, then per run the local disk and each bucket alternately: label → runs."""
    from dataset_cache.remote import RemoteOptions
    from dataset_cache.remote.publish import push

    results: dict[str, list[dict[str, list[float]]]] = {}
    for _proc, endpoint in servers.values():
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        push(local, f"s3://{BUCKET}/cache")
    step_s = args.step_ms / 1e3
    for run in range(args.runs):
        with open_cache(local) as reader:
            results.setdefault("local disk", []).append(_two_epochs(reader, args.batch, step_s))
        for lat, (_proc, endpoint) in servers.items():
            os.environ["AWS_ENDPOINT_URL"] = endpoint
            opts = RemoteOptions(fetch_dir=work / f"fetched-{lat:g}-{run}")
            with open_cache(f"s3://{BUCKET}/cache", remote=opts) as reader:
                results.setdefault(f"bucket, {lat:g} ms per request", []).append(
                    _two_epochs(reader, args.batch, step_s))
    return results


def _print_table(args: argparse.Namespace, size: int, results: dict[str, list[dict[str, list[float]]]]) -> None:
    """The configuration, then one row per cache: each epoch's data wait, the first batch's wait, the GETs."""
    batches = -(-args.n // args.batch)
    print(f"\n{args.n} SD1.5-sized samples ({size / 2**20:.0f} MiB in {args.shard_mb} MiB shards), batch "
          f"{args.batch}, step {args.step_ms:g} ms, prefetch {DEFAULT_PREFETCH_BATCHES}, {batches} batches per epoch, "
          f"{args.runs} runs; median (min–max)\n")
    print("| cache | epoch 1: data wait s (% of epoch) | epoch 2: data wait s (% of epoch) | first batch's wait ms "
          "| GETs epoch 1 / 2 |")
    print("|---|---|---|---|---|")
    for label, runs in results.items():
        cells = []
        for e in (0, 1):
            waits = [r["wait"][e] for r in runs]
            pct = [100 * r["wait"][e] / r["wall"][e] for r in runs]
            cells.append(f"{_stat(waits)} ({statistics.median(pct):.1f}%)")
        first = _stat([r["first"][0] for r in runs], 1e3, ".0f")
        gets = f"{statistics.median([r['gets'][0] for r in runs]):.0f} / " \
               f"{statistics.median([r['gets'][1] for r in runs]):.0f}"
        print(f"| {label} | {cells[0]} | {cells[1]} | {first} | {gets} |")

if __name__ == "__main__":
    raise SystemExit(main())
