"""ComfyUI's model folders set for a test and restored after it (run under ComfyUI's python only)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["only_folder"]


@contextmanager
def only_folder(kind: str, folder: Path) -> Iterator[Path]:
    """ComfyUI lists ``folder`` alone for ``kind`` (e.g. ``"loras"``) inside the block, then what it listed
    before."""
    import folder_paths

    saved = folder_paths.folder_names_and_paths.get(kind)
    folder_paths.folder_names_and_paths[kind] = ([str(folder)], set(folder_paths.supported_pt_extensions))
    try:
        yield folder
    finally:
        if saved is None:
            del folder_paths.folder_names_and_paths[kind]
        else:
            folder_paths.folder_names_and_paths[kind] = saved
