import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dataset_cache.threads import available_cpus, resolve_threads

ROOT = Path(__file__).resolve().parents[2]


def test_available_cpus_matches_affinity():
    assert available_cpus() == len(os.sched_getaffinity(0))


def test_auto_is_at_least_one_and_at_most_cpus():
    n = resolve_threads(None, purpose="loader threads")
    assert 1 <= n <= available_cpus()
    assert resolve_threads(0, purpose="loader threads") == n


def test_over_request_is_clamped_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="dataset_cache.threads"):
        n = resolve_threads(10_000, purpose="encode threads")
    assert n == min(32, available_cpus())
    assert "encode threads: 10000 requested" in caplog.text


def test_per_cpu_allows_io_oversubscription():
    assert resolve_threads(2 * available_cpus(), purpose="io", per_cpu=2.0) == min(32, 2 * available_cpus())


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux affinity")
def test_one_cpu_affinity_gives_one_thread():
    code = (
        "import os, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        f"sys.path.insert(0, {str(ROOT)!r}); "
        "from dataset_cache.threads import resolve_threads; "
        "print(resolve_threads(None, purpose='x'), resolve_threads(8, purpose='x'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1", "1"]
