"""The check that tells a bare Python error message from one written for a user (used by the e2e suite)."""

from __future__ import annotations

from support.messages import why_bare


def test_bare_python_messages_are_told_from_messages_for_users() -> None:
    assert why_bare("KeyError", "'dataset'")
    assert why_bare("", "'x'")
    assert why_bare("RuntimeError", "'NoneType' object has no attribute 'shape'")
    assert why_bare("ValueError", "list index out of range")
    assert why_bare("ValueError", "bad value")
    hooks = "conditioning[0]: hooks cannot be stored; remove the hook nodes before Make Training Dataset"
    assert why_bare("comfyui_streamcache.dataset_cache.errors.UnstorableValueError", hooks) is None
    assert why_bare("", "cache 'nope': unknown cache (no cache at /m/nope); available: a. Pick one of those") is None
