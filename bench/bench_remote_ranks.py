"""Benchmark: what N ranks reading one bucket through one fetch cache fetch, with and without claims.

The ranks of a run on several devices read their shares of every global batch of the same cache, each in its own
process, into the one fetch cache of the run. A block one rank fetched is read from the disk by the others; a block
two ranks want at the same moment is fetched once when the fetch cache's claims make the second wait for it
(``claim_wait_s`` 60 s, the default), twice when they do not (``claim_wait_s`` 0: every claim counts as stale).

The dataset of ``bench_remote`` (``--n`` SD1.5-sized samples in ``--shard-mb`` shards) is published to moto's S3
server with ``--latency-ms`` per request; each configuration starts ``N`` processes that open the bucket with an
empty shared fetch cache, wait at a common start, then read their shares of one epoch (``RowShardSampler``, batch
``--batch`` per rank) through the loader with a ``--step-ms`` step. Reported, median (min-max) over ``--runs``: the
GETs and MiB fetched by all ranks together, and each rank's data wait in the epoch.

    .venv/bin/python -m bench.bench_remote_ranks                  # from the pack root (needs obstore + moto)
    .venv/bin/python -m bench.bench_remote_ranks --ranks 2 --runs 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dataset_cache.constants import DEFAULT_PREFETCH_BATCHES
from dataset_cache.format.reader import open_cache
from dataset_cache.latent_buckets import buckets_from_reader
from dataset_cache.loader import PrefetchLoader
from dataset_cache.sharding import RowShardSampler

from .bench_remote import BUCKET, _start_servers, _stat, _write
from .common import PACK_ROOT

__all__ = ["main", "measure", "parse_args"]

CLAIMS = {"claims": 60.0, "no claims": 0.0}
"""Each configuration's ``claim_wait_s``."""


def _rank(args: argparse.Namespace) -> dict[str, float]:
    """Child process: one rank's epoch; returns its GETs, bytes fetched and data wait."""
    from dataset_cache.remote import RemoteOptions

    options = RemoteOptions(fetch_dir=Path(args.fetch_dir), claim_wait_s=args.claim_wait_s)
    with open_cache(f"s3://{BUCKET}/cache", remote=options) as reader:
        samples = reader.dataset("bench")
        sampler = RowShardSampler(samples, buckets_from_reader(reader, samples), args.batch, seed=3,
                                  rank=args.rank, world_size=args.world)
        files = reader.files  # type: ignore[attr-defined]
        requests, fetched = files.requests, files.fetched_bytes  # the headers read on open are not counted
        start = Path(args.start)
        Path(f"{start}.ready{args.rank}").touch()
        while not start.exists():  # every rank opened: start together
            time.sleep(0.005)
        wait = 0.0
        with PrefetchLoader(reader, sampler, prefetch_batches=DEFAULT_PREFETCH_BATCHES, epochs=1) as loader:
            it = iter(loader)
            while True:
                t = time.perf_counter()
                try:
                    next(it)
                except StopIteration:
                    break
                wait += time.perf_counter() - t
                time.sleep(args.step_ms / 1e3)
        return {"gets": files.requests - requests, "bytes": files.fetched_bytes - fetched, "wait": wait}


def _epoch(args: argparse.Namespace, work: Path, world: int, claim_wait_s: float, run: int) -> list[dict[str, float]]:
    """``world`` rank processes over one empty fetch cache, started together; each one's result."""
    fetch_dir, start = work / f"fetched-{world}-{claim_wait_s:g}-{run}", work / f"start-{world}-{claim_wait_s:g}-{run}"
    procs = [subprocess.Popen([sys.executable, "-m", "bench.bench_remote_ranks", "--as-rank", str(r),
                               "--world", str(world), "--fetch-dir", str(fetch_dir), "--start", str(start),
                               "--claim-wait-s", str(claim_wait_s), "--batch", str(args.batch),
                               "--step-ms", str(args.step_ms)],
                              cwd=PACK_ROOT, stdout=subprocess.PIPE, text=True) for r in range(world)]
    while not all(Path(f"{start}.ready{r}").exists() for r in range(world)):  # every rank opened the cache
        if any(proc.poll() is not None for proc in procs):
            raise SystemExit("a rank ended before the start")
        time.sleep(0.01)
    start.touch()
    out = []
    for proc in procs:
        stdout, _ = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"a rank failed (exit {proc.returncode})")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The benchmark's arguments (for :func:`measure`)."""
    return _parser().parse_args(argv)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=512, help="samples in the dataset (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=2, help="rows per rank per step (default: %(default)s)")
    ap.add_argument("--step-ms", type=float, default=50.0, help="simulated training step (default: %(default)s)")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="latency added to every request (default: 20)")
    ap.add_argument("--shard-mb", type=int, default=8, help="shard size (default: %(default)s; see bench_remote)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="rank counts (default: 2 4)")
    ap.add_argument("--runs", type=int, default=3, help="runs per configuration (default: %(default)s)")
    for hidden in ("--as-rank", "--world"):
        ap.add_argument(hidden, type=int, default=None, help=argparse.SUPPRESS)
    for hidden in ("--fetch-dir", "--start"):
        ap.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--claim-wait-s", type=float, default=60.0, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Publish the dataset, run every configuration, print the table."""
    args = _parser().parse_args(argv)
    if args.as_rank is not None:
        args.rank = args.as_rank
        print(json.dumps(_rank(args)), flush=True)
        return 0
    size, results = measure(args)
    _print_table(args, size, results)
    return 0


def measure(args: argparse.Namespace) -> tuple[int, dict[tuple[int, str], list[list[dict[str, float]]]]]:
    """The cache's size, and per (ranks, claims label) each run's per-rank results."""
    from dataset_cache.remote.publish import push

    work = Path(tempfile.mkdtemp(prefix="bench_remote_ranks_"))
    local = work / "local"
    _write(local, args.n, args.shard_mb << 20)
    size = sum(sh.size for sh in open_cache(local).shards)
    servers = _start_servers([args.latency_ms])
    results: dict[tuple[int, str], list[list[dict[str, float]]]] = {}
    try:
        os.environ["AWS_ENDPOINT_URL"] = next(iter(servers.values()))[1]
        push(local, f"s3://{BUCKET}/cache")
        for run in range(args.runs):
            for world in args.ranks:
                for label, wait_s in CLAIMS.items():  # alternated, so the machine's load falls on both alike
                    results.setdefault((world, label), []).append(_epoch(args, work, world, wait_s, run))
    finally:
        for proc, _ in servers.values():
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    return size, results


def _print_table(args: argparse.Namespace, size: int,
                 results: dict[tuple[int, str], list[list[dict[str, float]]]]) -> None:
    print(f"\n{args.n} SD1.5-sized samples ({size / 2**20:.0f} MiB in {args.shard_mb} MiB shards, 4 MiB blocks), "
          f"{args.latency_ms:g} ms per request, batch {args.batch} per rank, step {args.step_ms:g} ms, one epoch; "
          f"{args.runs} runs, median (min–max)\n")
    print("| ranks | fetch cache | GETs, all ranks | MiB fetched, all ranks | × the cache | data wait per rank, s |")
    print("|---|---|---|---|---|---|")
    for (world, label), runs in results.items():
        gets = [sum(r["gets"] for r in ranks) for ranks in runs]
        mib = [sum(r["bytes"] for r in ranks) / 2**20 for ranks in runs]
        waits = [r["wait"] for ranks in runs for r in ranks]
        print(f"| {world} | {label} | {_stat(gets, fmt='.0f')} | {_stat(mib, fmt='.0f')} | "
              f"{statistics.median(mib) / (size / 2**20):.2f} | {_stat(waits)} |")


if __name__ == "__main__":
    raise SystemExit(main())
