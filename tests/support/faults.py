"""Injecting ``OSError`` into the file operations the library makes under one folder.

:class:`FaultInjector` wraps the ``os`` calls the library uses for files (and ``open`` in its modules) so that a
test can make the N-th operation on a path under ``root`` fail with a chosen errno, as a full disk, a
permission change, an exhausted descriptor table or a failing drive would. Calls on other paths (Python's own
imports, pytest, torch) pass through untouched. Errors are raised as the real calls raise them: with the file
name for path calls (``os.open``), without it for descriptor calls (``os.write``, ``os.fsync``), so a test can
check that the library's own message names the file.
"""

from __future__ import annotations

import builtins
import errno as errno_mod
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

__all__ = ["FaultInjector", "PATH_CALLS", "FD_CALLS", "ERRNOS"]

PATH_CALLS = ("open", "replace", "rename", "unlink", "mkdir", "scandir")
FD_CALLS = ("read", "pread", "preadv", "write", "fsync", "fdatasync", "ftruncate")
ERRNOS = (errno_mod.EACCES, errno_mod.EMFILE, errno_mod.EIO, errno_mod.ENOSPC)


def _fd_path(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


class FaultInjector:
    """Counts, and on request fails, file operations on paths under ``root``.

    Args:
        root: only operations on paths under this folder are counted or failed.
        monkeypatch: pytest's fixture (undone at the end of the test).
        modules: library modules whose module-level ``open`` is wrapped too (buffered file writes).
    """

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch, modules: Sequence[Any] = ()) -> None:
        self.root = os.path.realpath(root)
        self.calls: list[tuple[str, str]] = []
        self.fail_at: int | None = None
        self.fail_errno = errno_mod.EIO
        self.rule: Callable[[str, str], int | None] | None = None
        self.failed: tuple[str, str] | None = None
        self._lock = threading.Lock()
        self._active = False
        real_open = builtins.open
        for name in PATH_CALLS:
            monkeypatch.setattr(os, name, self._wrap_path(name, getattr(os, name)))
        for name in FD_CALLS:
            if hasattr(os, name):
                monkeypatch.setattr(os, name, self._wrap_fd(name, getattr(os, name)))
        for module in modules:
            monkeypatch.setattr(module, "open", self._wrap_path("open", real_open), raising=False)

    @contextmanager
    def active(self, fail_at: int | None = None, errno: int = errno_mod.EIO,
               rule: Callable[[str, str], int | None] | None = None) -> Iterator[FaultInjector]:
        """Count operations under ``root`` inside the block; fail the ``fail_at``-th (0-based) with ``errno``, and
        every one for which ``rule(op, path)`` returns an errno."""
        self.calls, self.fail_at, self.fail_errno, self.failed = [], fail_at, errno, None
        self.rule = rule
        self._active = True
        try:
            yield self
        finally:
            self._active = False

    def _under(self, path: Any) -> str | None:
        try:
            p = os.fsdecode(path) if not isinstance(path, int) else _fd_path(path)
        except TypeError:
            return None
        if p is None:
            return None
        p = os.path.abspath(p)
        return p if p == self.root or p.startswith(self.root + os.sep) else None

    def _check(self, op: str, path: str) -> int | None:
        """The errno to fail this call with, or None."""
        with self._lock:
            i = len(self.calls)
            self.calls.append((op, path))
            if self.fail_at is not None and i == self.fail_at:
                self.failed = (op, path)
                return self.fail_errno
        err = self.rule(op, path) if self.rule is not None else None
        if err is not None:
            self.failed = (op, path)
        return err

    def _wrap_path(self, op: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._active and args:
                path = self._under(args[0])
                err = self._check(op, path) if path is not None else None
                if err is not None:
                    raise OSError(err, os.strerror(err), os.fsdecode(args[0]))
            return real(*args, **kwargs)
        return call

    def _wrap_fd(self, op: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._active and args and isinstance(args[0], int) and sys.platform.startswith("linux"):
                path = self._under(args[0])
                err = self._check(op, path) if path is not None else None
                if err is not None:
                    raise OSError(err, os.strerror(err))  # descriptor calls name no file
            return real(*args, **kwargs)
        return call
