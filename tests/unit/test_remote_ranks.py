"""Ranks that join from other machines (``WorkerPool(remote=...)``), without ComfyUI: rank 0's listener at an
address with the user's key, join processes started apart from it (here on the same machine, over the loopback).

What is checked: a joiner gets the next free remote rank and its payload, beside a local worker that keeps its own
rank; a process without the key is refused and the listener goes on waiting for the right one; a rank beyond the
count is turned away; a remote rank's error or silent end fails rank 0 naming the rank and its machine; ranks that
never join fail the wait naming how many and the port; closing the pool ends a joined process.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dataset_cache.workers import WorkerFailedError, WorkerPool
from support.processes import PROC_READABLE

ROOT = Path(__file__).resolve().parents[2]
KEY = b"the key of this test, 32 bytes!!"

JOINER = textwrap.dedent(f"""
    import os, pickle, sys, time
    sys.path.insert(0, {str(ROOT)!r})
    from dataset_cache.workers import join

    try:
        link = join("127.0.0.1", int(sys.argv[1]), sys.argv[2].encode(), sys.argv[3])
    except PermissionError as exc:
        print(exc, file=sys.stderr)
        sys.exit(7)
    try:
        job = pickle.loads(link.receive())
    except EOFError:
        print("turned away", file=sys.stderr)
        sys.exit(8)
    print("rank", job["rank"], flush=True)
    link.watch_parent(exit_code=3)
    link.send("ready", {{"torch": "9.9", "machine": sys.argv[3]}})
    scenario = sys.argv[4]
    if scenario == "done":
        link.send("done")
    elif scenario == "error":
        link.send("error", "ValueError: no such model here", "Traceback: ...")
    elif scenario == "vanish":
        os._exit(0)
    elif scenario == "stay":
        time.sleep(120)
        sys.exit(9)
""")

LOCAL = textwrap.dedent(f"""
    import pickle, sys
    sys.path.insert(0, {str(ROOT)!r})
    from dataset_cache.workers import connect

    link = connect()
    job = pickle.loads(link.receive())
    print("rank", job["rank"], flush=True)
    link.send("ready")
    link.send("done")
""")


@pytest.fixture
def scripts(tmp_path: Path) -> tuple[Path, Path]:
    joiner, local = tmp_path / "joiner.py", tmp_path / "local.py"
    joiner.write_text(JOINER)
    local.write_text(LOCAL)
    return joiner, local


@pytest.fixture
def pool_of(scripts: tuple[Path, Path]) -> Iterator[object]:
    pools: list[WorkerPool] = []

    def make(local: list[int], remote: list[int]) -> WorkerPool:
        pool = WorkerPool(scripts[1], local, lambda rank: {}, remote=remote, address=("127.0.0.1", 0), key=KEY)
        pool.start(lambda rank: [pickle.dumps({"rank": rank})])
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


def joiner(scripts: tuple[Path, Path], pool: WorkerPool, machine: str, scenario: str,
           key: bytes = KEY) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(scripts[0]), str(pool.address[1]), key.decode(), machine, scenario],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_ready(pool: WorkerPool, timeout_s: float = 60.0) -> None:
    pool.wait_ready(lambda: False, lambda: None, timeout_s=timeout_s)


def test_a_joiner_takes_the_remote_rank_beside_a_local_worker(scripts, pool_of):
    pool = pool_of([1], [2])
    assert set(pool.pids) == {1}  # the remote rank is not started here
    remote = joiner(scripts, pool, "box-b", "done")
    _wait_ready(pool)
    assert pool.machines == {2: "box-b at 127.0.0.1"}  # as it said, and where it connected from
    assert pool.about == {2: {"torch": "9.9", "machine": "box-b"}}  # what it reported with ready
    pool.finish(timeout_s=60)
    out, _ = remote.communicate(timeout=60)
    assert out.split() == ["rank", "2"] and remote.returncode == 0


def test_a_process_without_the_key_is_refused_and_the_listener_waits_on(scripts, pool_of):
    pool = pool_of([], [1])
    stranger = joiner(scripts, pool, "stranger", "done", key=b"a wrong key of this test, 32 b!!")
    _, err = stranger.communicate(timeout=60)
    assert stranger.returncode == 7 and "different keys (STREAMCACHE_JOIN_KEY)" in err
    friend = joiner(scripts, pool, "box-b", "done")
    _wait_ready(pool)
    pool.finish(timeout_s=60)
    assert friend.communicate(timeout=60)[0].split() == ["rank", "1"]


def test_a_rank_beyond_the_count_is_turned_away(scripts, pool_of):
    pool = pool_of([], [1])
    first = joiner(scripts, pool, "box-b", "stay")
    _wait_ready(pool)
    second = joiner(scripts, pool, "box-c", "done")
    _, err = second.communicate(timeout=60)
    assert second.returncode == 8 and "turned away" in err
    pool.close()  # ends the joined process there, as it ends a local worker
    first.communicate(timeout=60)
    assert first.returncode == 3


@pytest.mark.parametrize("scenario,reason", [
    ("error", "failed on rank 1: ValueError: no such model here"),
    ("vanish", "failed on rank 1: the rank on box-b at 127.0.0.1 ended its connection"),
])
def test_a_remote_rank_that_fails_is_named_with_its_machine(scripts, pool_of, scenario, reason):
    pool = pool_of([], [1])
    remote = joiner(scripts, pool, "box-b", scenario)
    with pytest.raises(WorkerFailedError, match=reason) as failed:
        _wait_ready(pool)
        pool.finish(timeout_s=60)
    assert failed.value.rank == 1
    remote.communicate(timeout=60)


def test_ranks_that_never_join_fail_the_wait_naming_the_port(pool_of):
    pool = pool_of([], [1, 2])
    port = pool.address[1]
    started = time.monotonic()
    with pytest.raises(WorkerFailedError, match=f"2 of 2 ranks from other machines did not join within 1 s.*"
                       f"--main <this machine>:{port}.*port {port}"):
        _wait_ready(pool, timeout_s=1.0)
    assert time.monotonic() - started < 30


@pytest.mark.skipif(not PROC_READABLE, reason="reads /proc (Linux)")
def test_a_port_in_use_is_named(pool_of):
    pool = pool_of([], [1])
    other = WorkerPool(Path(os.devnull), [], lambda rank: {}, remote=[1], address=("127.0.0.1", pool.address[1]),
                       key=KEY)
    with pytest.raises(RuntimeError, match=f"cannot listen for the training's ranks at 127.0.0.1:{pool.address[1]}"):
        other.start(lambda rank: [])
    other.close()


@pytest.mark.parametrize("args,env,code,message", [
    (["--main", "10.0.0.5"], {"STREAMCACHE_JOIN_KEY": "k" * 16}, 2, "--main '10.0.0.5': write HOST:PORT"),
    (["--main", "10.0.0.5:29440"], {}, 2, "set STREAMCACHE_JOIN_KEY to the key of rank 0's ComfyUI"),
    (["--main", "10.0.0.5:29440", "--comfyui", str(ROOT), "--repeat"], {"STREAMCACHE_JOIN_KEY": "k" * 16}, 2,
     f"{re.escape(str(ROOT))} is not a ComfyUI folder \\(no folder_paths.py\\): give --comfyui"),
])
def test_the_join_command_names_what_is_missing_before_it_connects(args, env, code, message):
    clean = {k: v for k, v in os.environ.items() if k != "STREAMCACHE_JOIN_KEY"}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "join-training"), *args], env={**clean, **env},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == code and re.search(message, done.stderr), done.stderr


def test_a_pool_listening_on_every_interface_serves_local_and_remote_ranks_and_closes(scripts):
    pool = WorkerPool(scripts[1], [1], lambda rank: {}, remote=[2], address=("0.0.0.0", 0), key=KEY)
    try:
        pool.start(lambda rank: [pickle.dumps({"rank": rank})])
        remote = joiner(scripts, pool, "box-b", "stay")  # over the loopback, as another machine over the network
        _wait_ready(pool)
    finally:
        started = time.monotonic()
        pool.close()  # wakes the listener's accept (bound to 0.0.0.0) and ends the joined process
    assert time.monotonic() - started < 15
    remote.communicate(timeout=60)
    assert remote.returncode == 3


def test_a_job_rank_0_cannot_make_fails_the_wait_naming_it(scripts):
    pool = WorkerPool(scripts[1], [], lambda rank: {}, remote=[1], address=("127.0.0.1", 0), key=KEY)

    def payloads(rank: int) -> list[bytes]:
        raise TypeError("cannot pickle 'generator' object")

    try:
        pool.start(payloads)
        remote = joiner(scripts, pool, "box-b", "done")
        with pytest.raises(WorkerFailedError, match="rank 1: rank 0 could not make its job \\(TypeError: cannot "
                           "pickle 'generator' object\\)"):
            _wait_ready(pool)
    finally:
        pool.close()
    _, err = remote.communicate(timeout=60)
    assert remote.returncode == 8 and "turned away" in err  # its connection closed before any payload
