"""Loading the pickles of ComfyUI's dataset folders so that nothing in them can run code.

A pickle can call any importable function while it loads, and ComfyUI's dataset folders are shared between users,
so every pickle the library reads goes through this module and nowhere else: a ``shard_*.skeleton.pkl`` through
:func:`load_skeleton_pickle`, which refuses every global outside a tiny allowlist before anything is constructed,
and a ``torch.save`` shard through :func:`load_pickle_shard`, which uses ``torch.load(weights_only=True)``. Kept
apart from :mod:`.comfy_folders` so the whole boundary can be audited on one screen.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from .errors import CacheCorruptError, CacheFormatError

__all__ = ["load_skeleton_pickle", "load_pickle_shard"]

_ALLOWED_GLOBALS = frozenset({("builtins", "set"), ("builtins", "frozenset")})
"""The only globals a skeleton pickle may name. Plain containers, strings and numbers have their own pickle
opcodes and need none; ``set``/``frozenset`` are listed only because protocols < 4 build them by calling the
type. Both constructors merely copy an iterable, so nothing a hostile file names can run code."""


class _RefusedGlobal(pickle.UnpicklingError):
    def __init__(self, module: str, name: str) -> None:
        self.qualname = f"{module}.{name}"
        super().__init__(self.qualname)


class _RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that can build plain containers only.

    Every code path by which a pickle calls code (``GLOBAL``/``STACK_GLOBAL``/``INST``, and ``REDUCE``/``OBJ``/
    ``NEWOBJ``, which need a callable from one of those; ``EXT*`` from the copyreg registry) goes through
    :meth:`find_class`, so refusing there stops a hostile file before anything runs.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return {"set": set, "frozenset": frozenset}[name]
        raise _RefusedGlobal(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed")


def load_skeleton_pickle(path: str | Path) -> Any:
    """Unpickle a ``shard_*.skeleton.pkl`` file, refusing anything but plain containers.

    Raises:
        CacheFormatError: the pickle names a global outside the allowlist (``os.system``, ``builtins.eval``, a
            torch class, a ComfyUI hook object, ...); nothing it names is imported or called.
        CacheCorruptError: the file is truncated or not a pickle.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return _RestrictedUnpickler(f).load()
    except _RefusedGlobal as e:
        raise CacheFormatError(
            f"{path}: refused to unpickle global {e.qualname!r}. Skeleton pickles may only hold plain containers "
            "(dict, list, tuple, str, int, float, bool, None) and tensor references; a pickle that names other "
            "objects can run arbitrary code when loaded. If the dataset is yours and stores objects such as "
            "hooks, those samples cannot be converted: re-encode them without."
        ) from None
    except OSError:
        raise
    except Exception as e:
        raise CacheCorruptError(str(path), f"not a readable pickle ({type(e).__name__}: {e})") from e


def load_pickle_shard(path: Path) -> tuple[list[Any], list[Any]]:
    """Load one ``shard_*.pkl`` with ``torch.load(weights_only=True)`` (memory-mapped when possible)."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:
        text = str(e)
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", text)
        if refused:
            raise CacheFormatError(
                f"{path}: torch.load(weights_only=True) refused global {refused.group(1)!r}. The shard holds "
                "objects other than tensors and plain containers (e.g. hooks); it cannot be read safely. "
                "Re-save the dataset without them."
            ) from None
        detail = text.split("WeightsUnpickler error:", 1)[-1].split("Check the documentation", 1)[0]
        raise CacheCorruptError(str(path), f"not a readable torch.save file ({' '.join(detail.split())})") from None
    except OSError:
        raise
    except Exception as e:
        raise CacheCorruptError(str(path), f"not a readable torch.save file ({type(e).__name__}: {e})") from e
    if not (isinstance(data, dict) and isinstance(data.get("latents"), list)
            and isinstance(data.get("conditioning"), list)):
        raise CacheFormatError(f"{path}: expected a dict with lists 'latents' and 'conditioning'")
    if len(data["latents"]) != len(data["conditioning"]):
        raise CacheCorruptError(str(path), f"{len(data['latents'])} latents but "
                                f"{len(data['conditioning'])} conditionings")
    return data["latents"], data["conditioning"]
