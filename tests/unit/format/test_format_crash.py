"""kill -9 at random instants: the cache is always readable and is the state before or after a commit."""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch
from support.killing import fork_and_kill

from dataset_cache.dataset import Sample
from dataset_cache.format import CacheWriter, open_cache

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin", reason="needs fork()")
RUNS = 50


def value_for(key: str):
    i = int(key.split("-")[1])
    x = float(hash(key) % 1000)
    if i % 3 == 0:
        return [[torch.full((1, 5, 4), x, dtype=torch.float16), {"pooled_output": torch.full((1, 4), x), "i": i}]]
    return {"samples": torch.full((1, 2, 4, 4) if i % 2 else (1, 2, 2, 6), x, dtype=torch.bfloat16)}


def child(root, run: int, wfd: int) -> None:
    rng = random.Random(run)
    w = CacheWriter(root, shard_bytes=rng.choice([300, 600, 2000]))
    os.write(wfd, b"ready\n")
    added: list[str] = []
    i = 0
    while True:
        for _ in range(rng.randint(1, 4)):
            k = f"r{run:02d}-{i:04d}"
            w.add(k, value_for(k))
            added.append(k)
            i += 1
        op = rng.random()
        if op < 0.12:
            w.compact(min_fill=0.9)
        elif op < 0.3:
            w.set_dataset(f"ds{run % 3}", [Sample(k, (k,)) for k in added[-5:]])
        else:
            w.commit()
        os.write(wfd, f"{added[-1]}\n".encode())


def check(root, committed: set[str], attempted: set[str]) -> None:
    r = open_cache(root)
    assert r.verify() == []
    present = set(r.keys())
    assert committed <= present, f"lost committed entries: {sorted(committed - present)[:5]}"
    assert present <= attempted, "entries appeared that were never added"
    keys = sorted(present)
    for k, v in zip(keys, r.read(keys)):
        want = value_for(k)
        got_t = v[0][0] if isinstance(v, list) else v["samples"]
        want_t = want[0][0] if isinstance(want, list) else want["samples"]
        assert torch.equal(got_t, want_t) and got_t.dtype == want_t.dtype, k
    for name in r.datasets():
        assert all(s.latent in present for s in r.dataset(name))


def test_kill_9_at_random_points(tmp_path):
    root = tmp_path / "cache"
    rng = random.Random(1234)
    committed: set[str] = set()
    attempted: set[str] = set()
    commits_seen = 0
    for run in range(RUNS):
        lines = fork_and_kill(root, run, child, rng)
        attempted.update(f"r{run:02d}-{i:04d}" for i in range(2000))
        if lines:
            last = int(lines[-1].split("-")[1])
            committed.update(f"r{run:02d}-{i:04d}" for i in range(last + 1))
            commits_seen += len(lines)
        if (root / "manifest.json").exists():
            check(root, committed, attempted)
    assert commits_seen >= RUNS // 4  # the kills did land between and during commits, not only before the first
