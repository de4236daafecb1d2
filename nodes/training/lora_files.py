"""The LoRAs ``existing_lora`` offers: the ``loras`` model folders, and the LoRAs saved in ComfyUI's output folder.

Save LoRA Weights and ``save_every`` write to ``output/loras``, which is no model folder: without this, continuing a
save after Cancel meant copying the file to ``models/loras`` first. Files of ``output/loras`` are offered with
ComfyUI's own ``" [output]"`` annotation (as its image pickers name output files), newest first, and never through a
symbolic link: a link under the output folder may point anywhere.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

import folder_paths

__all__ = ["NONE", "OUTPUT_SUFFIX", "OUTPUT_SUBFOLDER", "lora_choices", "lora_path"]

NONE = "[None]"
OUTPUT_SUFFIX = " [output]"
"""ComfyUI's annotation of a file name relative to the output folder (``folder_paths.annotated_filepath``)."""
OUTPUT_SUBFOLDER = "loras"
"""Where in the output folder Save LoRA Weights and ``save_every`` write by default."""
_MAX_LISTED = 1000
"""Output LoRAs offered at most (newest first): a picker of thousands of entries helps nobody."""
_EXTENSION = ".safetensors"


def lora_choices() -> list[str]:
    """``existing_lora``'s options: the ``loras`` folders' files, then the output folder's LoRAs newest first (those
    a ``loras`` folder already lists left out), then ``[None]``."""
    try:
        models = folder_paths.get_filename_list("loras")
    except Exception:  # a ComfyUI without a loras folder entry
        models = []
    return [*models, *output_loras(), NONE]


def output_loras() -> list[str]:
    """The ``.safetensors`` files under ``<output>/loras`` as ``"loras/<name> [output]"``, newest first; links, and
    folders a ``loras`` model folder already covers (README's extra_model_paths recipe), are skipped."""
    base = Path(folder_paths.get_output_directory())
    covered = _model_folders()
    found: list[tuple[int, str]] = []
    pending = [base / OUTPUT_SUBFOLDER]
    while pending and len(found) < 10 * _MAX_LISTED:
        folder = pending.pop()
        if os.path.abspath(folder) in covered:
            continue
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(Path(entry.path))
                    elif entry.name.endswith(_EXTENSION) and entry.is_file(follow_symlinks=False):
                        name = Path(entry.path).relative_to(base).as_posix()
                        found.append((entry.stat(follow_symlinks=False).st_mtime_ns, name))
        except OSError:  # missing, unreadable or a link: nothing to offer from it
            continue
    found.sort(key=lambda item: (-item[0], item[1]))
    return [name + OUTPUT_SUFFIX for _, name in found[:_MAX_LISTED]]


def lora_path(name: str) -> str:
    """The file of an ``existing_lora`` choice.

    Raises:
        ValueError: naming ``existing_lora`` and what to pick instead: the file is not in a ``loras`` folder, an
            output name leaves the output folder's ``loras`` subfolder, passes through a link, or is missing.
    """
    if name.endswith(OUTPUT_SUFFIX):
        return _output_path(name)
    path = folder_paths.get_full_path("loras", name)
    if path is None:
        raise ValueError(f"existing_lora {name!r:.200} is not in the loras folder; pick one from the list or {NONE}")
    return path


def _output_path(name: str) -> str:
    relative = name[: -len(OUTPUT_SUFFIX)]
    parts = PurePosixPath(relative.replace("\\", "/")).parts
    if (len(parts) < 2 or parts[0] != OUTPUT_SUBFOLDER or any(p in ("", ".", "..") for p in parts)
            or os.path.isabs(relative) or not relative.endswith(_EXTENSION)):
        raise ValueError(f"existing_lora {name!r:.200} is not a .safetensors file under the output folder's "
                         f"{OUTPUT_SUBFOLDER}/ ('{OUTPUT_SUBFOLDER}/<name>.safetensors{OUTPUT_SUFFIX}'); pick one from "
                         "the list")
    path = Path(folder_paths.get_output_directory())
    for part in parts:  # never through a link: one under the output folder may point anywhere
        path = path / part
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            raise ValueError(f"existing_lora {name!r:.200}: {path} does not exist (moved or deleted?); refresh the "
                             "list (R) and pick another") from None
        if stat.S_ISLNK(mode):
            raise ValueError(f"existing_lora {name!r:.200}: {path} is a symbolic link, which is never followed out "
                             "of the output folder; copy the LoRA into models/loras instead")
    if not stat.S_ISREG(mode):
        raise ValueError(f"existing_lora {name!r:.200}: {path} is not a regular file")
    return str(path)


def _model_folders() -> set[str]:
    try:
        return {os.path.abspath(p) for p in folder_paths.get_folder_paths("loras")}
    except Exception:
        return set()
