"""The GPU session's release probe (``tests/support/release_probe.py``) run on the CPU, where its findings are known:
the failed pass's tensors are held by C++ alone until the release, and nothing is left at the end."""

from __future__ import annotations

import pytest
import torch

from support.failed_backward import engine_error, python_error
from support.release_probe import probe


@pytest.mark.parametrize("hook", [python_error, engine_error], ids=["python-error", "engine-error"])
def test_the_probe_finds_what_only_autograd_holds_and_that_the_release_frees_it(hook: object) -> None:
    report = probe(hook, "none", torch.device("cpu"), rows=64)  # type: ignore[arg-type]
    head, dropped, end = report.splitlines()
    assert head.startswith(f"none/{hook.__name__}: failed 0.0;")  # type: ignore[attr-defined]
    assert "saved activation alive at the end: False" in head
    if dropped.endswith(": none"):
        pytest.skip(f"torch {torch.__version__} frees a failed backward pass's graph by itself")
    # once the error is dropped, the failed graph's activations are still there, with nothing in Python holding them
    assert dropped.count("(64, 256) float32 <- nothing in Python") >= 2
    assert end == "    reachable at the end: none"
