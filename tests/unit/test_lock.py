import subprocess
import sys
import textwrap
import time

import pytest

from dataset_cache.errors import CacheLockedError
from dataset_cache.lock import READ_LOCK, WRITE_LOCK, CacheLock


def _hold_in_subprocess(root, name, exclusive, seconds):
    code = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).resolve().parents[2])!r})
        from dataset_cache.lock import CacheLock
        with CacheLock({str(root)!r}, {name!r}, exclusive={exclusive}):
            print("held", flush=True)
            time.sleep({seconds})
        """
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_exclusive_lock_refuses_second_holder_with_clear_error(tmp_path):
    p = _hold_in_subprocess(tmp_path, WRITE_LOCK, True, 5)
    try:
        with pytest.raises(CacheLockedError, match="another process is using this cache"):
            CacheLock(tmp_path, WRITE_LOCK, timeout=0.2, purpose="encode").acquire()
    finally:
        p.kill()
        p.wait()
    # the OS released the dead holder's lock
    with CacheLock(tmp_path, WRITE_LOCK, timeout=1) as lock:
        assert lock.held


def test_shared_locks_coexist_but_block_exclusive(tmp_path):
    p = _hold_in_subprocess(tmp_path, READ_LOCK, False, 5)
    try:
        with CacheLock(tmp_path, READ_LOCK, exclusive=False, timeout=0.5) as shared:
            assert shared.held
        with pytest.raises(CacheLockedError, match="clean"):
            CacheLock(tmp_path, READ_LOCK, exclusive=True, timeout=0, purpose="clean").acquire()
    finally:
        p.kill()
        p.wait()


def test_waiter_gets_lock_when_holder_finishes(tmp_path):
    p = _hold_in_subprocess(tmp_path, WRITE_LOCK, True, 0.5)
    t0 = time.monotonic()
    with CacheLock(tmp_path, WRITE_LOCK, timeout=10) as lock:
        assert lock.held
    assert time.monotonic() - t0 < 10
    p.wait()


def test_release_is_idempotent(tmp_path):
    lock = CacheLock(tmp_path).acquire()
    lock.release()
    lock.release()
    assert not lock.held
