"""The folder of training states (:mod:`.optimizer_state`): one ``<digest>.safetensors`` file per LoRA, written
atomically, kept bounded in count and bytes, and nothing else in the folder ever touched.

Kept apart from the file format because it is about a folder the user owns (ComfyUI's output folder): what may be
removed there, and when, is a rule of its own.
"""

from __future__ import annotations

import os
import re
import stat
import time
from pathlib import Path

from .optimizer_state import TrainState, write_train_state

__all__ = ["MAX_STATE_FILES", "MAX_STATE_FOLDER_BYTES", "TrainStateStore"]

MAX_STATE_FILES = 32
"""State files the folder keeps (the least recently written or used beyond this are removed)."""
MAX_STATE_FOLDER_BYTES = 16 << 30
"""Bytes the folder keeps: an AdamW state is twice its LoRA (two moments), so a rank-64 Flux LoRA's is ~1.2 GB."""
_ORPHAN_SECONDS = 3600.0
"""A temp file of an interrupted write older than this is an orphan (a write takes seconds)."""
_NAME = re.compile(r"[0-9a-f]{32}\.safetensors")
_TEMP = re.compile(r"\.[0-9a-f]{32}\.safetensors\.[0-9a-f]{16}\.tmp")


class TrainStateStore:
    """The folder of training states: ``<digest>.safetensors`` files, written atomically, bounded in count and bytes.

    Nothing else in the folder is ever touched: only regular files of that exact name pattern (and temp files of an
    interrupted write of one, once they are an hour old) are counted and removed, never through a link (a linked
    folder is neither written nor pruned, a linked file never removed).
    """

    def __init__(self, folder: str | os.PathLike[str], *, max_files: int = MAX_STATE_FILES,
                 max_bytes: int = MAX_STATE_FOLDER_BYTES) -> None:
        self.folder = Path(os.path.abspath(folder))
        self.max_files = max_files
        self.max_bytes = max_bytes

    def path_for(self, digest: str) -> Path:
        """Where the state of the LoRA of ``digest`` is (or would be) kept."""
        if not re.fullmatch(r"[0-9a-f]{32}", digest):
            raise ValueError(f"not a LoRA digest: {digest!r:.40}")
        return self.folder / f"{digest}.safetensors"

    def find(self, digest: str) -> Path | None:
        """The state file of the LoRA of ``digest``, or ``None`` when there is none (a link counts as none)."""
        path = self.path_for(digest)
        try:
            return path if stat.S_ISREG(os.lstat(path).st_mode) else None
        except OSError:
            return None

    def touch(self, path: Path) -> None:
        """Mark a state as just used, so pruning keeps it longest (best effort)."""
        try:
            os.utime(path)
        except OSError:
            pass

    def save(self, state: TrainState) -> tuple[Path, list[str]]:
        """Write ``state`` as its LoRA's state file; return the path and the names of the files pruned.

        Raises:
            OSError: the folder is a link, cannot be created, or the file cannot be written (naming it).
        """
        if os.path.islink(self.folder):
            raise OSError(None, "the training state folder is a symbolic link; it is not written through",
                          str(self.folder))
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path_for(state.lora_digest)
        write_train_state(path, state)
        return path, self.prune(keep=path)

    def prune(self, *, keep: Path | None = None) -> list[str]:
        """Remove the least recently written or used states beyond :attr:`max_files` or :attr:`max_bytes`
        (``keep`` stays whatever its size), and temp files of interrupted writes older than an hour; return the
        names removed. A folder that is a link is left alone: what it points to is not the store's."""
        if os.path.islink(self.folder):
            return []
        try:
            entries = list(os.scandir(self.folder))
        except OSError:
            return []
        states, removed = [], []
        now = time.time()
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(info.st_mode):
                continue
            if _NAME.fullmatch(entry.name):
                states.append((info.st_mtime, entry.name, info.st_size))
            elif _TEMP.fullmatch(entry.name) and now - info.st_mtime > _ORPHAN_SECONDS and self._remove(entry.name):
                removed.append(entry.name)
        states.sort(reverse=True)
        kept, total = 0, 0
        for _mtime, name, size in states:
            if keep is not None and name == keep.name:
                kept, total = kept + 1, total + size
                continue
            if kept + 1 > self.max_files or total + size > self.max_bytes:
                if self._remove(name):
                    removed.append(name)
                continue
            kept, total = kept + 1, total + size
        return removed

    def remove(self, path: Path) -> bool:
        """Remove the state file ``path`` of this folder (a regular file named as a state; anything else is left
        alone, and nothing when the folder is a link): for a state its writer has superseded. Whether it was
        removed."""
        if path.parent != self.folder or not _NAME.fullmatch(path.name) or os.path.islink(self.folder):
            return False
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                return False
        except OSError:
            return False
        return self._remove(path.name)

    def _remove(self, name: str) -> bool:
        try:
            os.unlink(self.folder / name)
            return True
        except OSError:
            return False
