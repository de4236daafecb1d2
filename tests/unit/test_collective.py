"""The library side of training on several devices, without ComfyUI: rank 0 in this process, one worker process
started by ``WorkerPool`` (gloo on the CPU, as ``devices="cpu:2"``).

What is checked: gradients averaged (and kept absent where no rank has one), the loss averaged, a stop agreed by
every rank, rank 0's initial weights given to every rank; a worker that fails, dies or never starts becomes an
error naming its rank and how it ended, at once, in rank 0's collective; no worker outlives the pool or rank 0.
Values are small integers and halves, exact in fp32, so the comparisons are exact.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dataset_cache.collective import Collective, RunStopped, host_store
from support.processes import PROC_READABLE, alive
from dataset_cache.workers import WorkerFailedError, WorkerPool, describe_exit

ROOT = Path(__file__).resolve().parents[2]

WORKER = textwrap.dedent(f"""
    import os, pickle, signal, sys, time
    sys.path.insert(0, {str(ROOT)!r})
    if os.environ.get("SCENARIO") == "crash-at-start":
        sys.exit(5)
    import torch
    from dataset_cache.collective import Collective, RunStopped, join_store
    from dataset_cache.workers import connect

    link = connect()
    job = pickle.loads(link.receive())
    link.watch_parent()
    c = Collective(1, 2, torch.device("cpu"), "gloo")
    link.send("ready")
    c.start(join_store(job["port"], 2), 60)
    scenario = job["scenario"]
    try:
        if scenario == "exchange":
            a, b, none = (torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True),
                          torch.zeros(1, requires_grad=True))
            a.grad = torch.tensor([3.0, 5.0, -1.0])
            b.grad = torch.tensor([4.0, 2.0])  # rank 0 has no gradient for b
            c.reduce_gradients([a, b, none])
            assert a.grad.tolist() == [2.0, 3.0, 0.0] and b.grad.tolist() == [2.0, 1.0] and none.grad is None
            assert c.agree(3.0) == 2.0
            weights = [torch.full((2,), 9.0), torch.full((1,), 9.0, dtype=torch.float64),
                       torch.full((2,), 9.0, dtype=torch.bfloat16)]
            assert c.broadcast_(weights) == 3 and weights[0].tolist() == [1.0, 1.0] and weights[1].tolist() == [2.0]
            assert weights[2].dtype == torch.bfloat16 and weights[2].tolist() == [0.5, -3.0]
            assert c.sum_ints([1, 2]) == [11, 22]
            assert c.extremes([3.0, 0.5]) == ([1.0, 0.5], [3.0, 2.0])
            c.agree(0.0)  # rank 0 asks to stop here
            raise AssertionError("the agreed stop did not stop rank 1")
        elif scenario == "error":
            raise ValueError("boom in the worker")
        elif scenario == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        elif scenario == "hang":
            print(os.getpid(), flush=True)
            c.agree(0.0)  # rank 0 never comes: only the end of the control connection ends this process
    except RunStopped:
        link.send("stopped")
        sys.exit(0)
    except BaseException as exc:
        import traceback
        link.send("error", f"{{type(exc).__name__}}: {{exc}}", traceback.format_exc())
        sys.exit(1)
    link.send("done")
""")


@pytest.fixture
def entry(tmp_path: Path) -> Path:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return script


@pytest.fixture
def group(entry: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[WorkerPool, Collective, object]]:
    """Rank 0 (this process) and a worker running ``SCENARIO`` (set by the test before starting)."""
    store = host_store(2, timeout_s=60)
    pool = WorkerPool(entry, [1], lambda rank: {"SCENARIO": os.environ.get("TEST_SCENARIO", "")})
    stop = {"asked": False}
    c = Collective(0, 2, torch.device("cpu"), "gloo", check=pool.check, stop_requested=lambda: stop["asked"])
    try:
        yield pool, c, (store, stop)
    finally:
        pool.close()
        c.close()
        assert all(not alive(pid) for pid in pool.pids.values())  # no worker outlives the pool


def start(pool: WorkerPool, c: Collective, extra: object, scenario: str, monkeypatch: pytest.MonkeyPatch) -> dict:
    store, stop = extra  # type: ignore[misc]
    monkeypatch.setenv("TEST_SCENARIO", scenario)
    pool.start(lambda rank: [pickle.dumps({"port": store.port, "scenario": scenario})])
    pool.wait_ready(lambda: False, lambda: None, timeout_s=120)
    c.start(store, 60)
    return stop


@pytest.mark.skipif(not PROC_READABLE, reason="reads /proc (Linux)")
def test_gradients_losses_weights_and_an_agreed_stop(group, monkeypatch):
    pool, c, extra = group
    stop = start(pool, c, extra, "exchange", monkeypatch)
    a, b, none = (torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True),
                  torch.zeros(1, requires_grad=True))
    a.grad = torch.tensor([1.0, 1.0, 1.0])
    c.reduce_gradients([a, b, none])
    assert a.grad.tolist() == [2.0, 3.0, 0.0]  # (1 + 3) / 2, (1 + 5) / 2, (1 - 1) / 2
    assert b.grad is not None and b.grad.tolist() == [2.0, 1.0]  # one rank had it: the other counts zeros
    assert none.grad is None  # no rank had one: the optimizer skips it, as on one rank
    assert c.agree(1.0) == 2.0  # (1 + 3) / 2
    assert c.broadcast_([torch.ones(2), torch.full((1,), 2.0, dtype=torch.float64),
                         torch.tensor([0.5, -3.0], dtype=torch.bfloat16)]) == 0
    assert c.sum_ints([10, 20]) == [11, 22]
    assert c.extremes([1.0, 2.0]) == ([1.0, 0.5], [3.0, 2.0])  # how rank 0 sees that the ranks' starts differ
    stop["asked"] = True
    with pytest.raises(RunStopped):
        c.agree(0.0)
    pool.finish(timeout_s=60)  # the worker's own checks passed and it reported that it stopped


@pytest.mark.skipif(not PROC_READABLE, reason="reads /proc (Linux)")
def test_a_worker_error_reaches_rank_0_with_its_rank_and_traceback(group, monkeypatch):
    pool, c, extra = group
    start(pool, c, extra, "error", monkeypatch)
    with pytest.raises(WorkerFailedError, match="failed on rank 1: ValueError: boom in the worker") as caught:
        c.agree(1.0)
    assert caught.value.rank == 1 and 'raise ValueError("boom in the worker")' in caught.value.details


@pytest.mark.skipif(not PROC_READABLE, reason="reads /proc (Linux)")
def test_a_killed_worker_fails_rank_0_at_once_naming_the_signal(group, monkeypatch):
    pool, c, extra = group
    start(pool, c, extra, "die", monkeypatch)
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError, match=r"rank 1: the worker \(pid \d+\) was killed by SIGKILL"):
        c.agree(1.0)
    assert time.monotonic() - t0 < 30  # not the collective's timeout (60 s here, 30 min by default)


@pytest.mark.skipif(not PROC_READABLE, reason="reads /proc (Linux)")
def test_a_worker_stuck_in_a_collective_ends_with_its_control_connection(group, monkeypatch):
    pool, c, extra = group
    start(pool, c, extra, "hang", monkeypatch)
    (pid,) = pool.pids.values()
    time.sleep(0.5)
    t0 = time.monotonic()
    pool.close()
    assert not alive(pid) and time.monotonic() - t0 < 9  # it exited by itself, before any terminate


@pytest.mark.skipif(not PROC_READABLE, reason="reads /proc (Linux)")
def test_a_worker_that_dies_before_connecting_is_named(group, monkeypatch):
    pool, c, extra = group
    monkeypatch.setenv("TEST_SCENARIO", "crash-at-start")
    pool.start(lambda rank: [b""])
    with pytest.raises(WorkerFailedError, match="rank 1: the worker .* exited with code 5 before it connected"):
        pool.wait_ready(lambda: False, lambda: None, timeout_s=120)


def test_cancel_while_the_workers_start(group, monkeypatch):
    pool, c, extra = group
    monkeypatch.setenv("TEST_SCENARIO", "hang")
    pool.start(lambda rank: [b""])

    def cancelled() -> None:
        raise KeyboardInterrupt("cancelled")
    with pytest.raises(KeyboardInterrupt):
        pool.wait_ready(lambda: True, cancelled)


@pytest.mark.skipif(not PROC_READABLE, reason="reads /proc (Linux)")
def test_workers_end_when_rank_0_dies(entry: Path, tmp_path: Path):
    """Rank 0 killed outright (ComfyUI crashed): its connections end, and so does the worker, stuck or not."""
    parent = tmp_path / "parent.py"
    parent.write_text(textwrap.dedent(f"""
        import os, pickle, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        import torch
        from dataset_cache.collective import Collective, host_store
        from dataset_cache.workers import WorkerPool
        store = host_store(2, timeout_s=60)
        pool = WorkerPool({str(entry)!r}, [1], lambda rank: {{"SCENARIO": "hang"}})
        pool.start(lambda rank: [pickle.dumps({{"port": store.port, "scenario": "hang"}})])
        pool.wait_ready(lambda: False, lambda: None, timeout_s=120)
        Collective(0, 2, torch.device("cpu"), "gloo").start(store, 60)
        print(pool.pids[1], flush=True)
        time.sleep(1)
        os._exit(0)
    """))
    done = subprocess.run([sys.executable, str(parent)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 30
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid)


def test_exits_are_described_by_name():
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-signal.SIGSEGV) == "was killed by SIGSEGV"
    assert "ran out of memory" in describe_exit(-signal.SIGKILL)
    assert describe_exit(None) == "is still running"
