"""C1 of ``scripts/bench-comfy``: the same SD1.5 samples written three ways, and one open timed in a child process.

Why apart from the driver: :func:`child_open` runs alone in a fresh interpreter (``run_comfyui.py --child open``),
so that each open starts from the same imports and RSS baseline; :func:`prep_open` runs once per N in the driver.
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Any

from .common import PROFILES, Entries, LazyReader, open_footprint, write_lazy, write_ours
from .comfyui import comfy_setup

__all__ = ["prep_open", "child_open"]


def prep_open(work: Path, n: int) -> dict[str, Any]:
    """Write the same N SD1.5 samples as the built-in (SaveTrainingDataset.execute), ours and lazy-branch."""
    import torch

    import comfy_extras.nodes_dataset as nd

    entries = Entries(PROFILES["sd15"])
    name = f"builtin-{n}"
    latents, conds = [], []
    for i in range(n):
        lat, cond = entries.get(i)
        latents.append(lat)
        conds.append(cond)
    t = time.perf_counter()
    with torch.inference_mode():
        nd.SaveTrainingDataset.execute(latents=latents, conditioning=conds, folder_name=[name], shard_size=[1000])
    t_save = time.perf_counter() - t
    del latents, conds
    gc.collect()
    ours, lazy = work / f"ours-{n}", work / f"lazy-{n}"
    write_ours(ours, n, entries)
    write_lazy(lazy, n, entries)
    import folder_paths

    return {"builtin": name, "builtin_dir": os.path.join(folder_paths.get_output_directory(), name),
            "ours": str(ours), "lazy": str(lazy), "save_s": t_save}


def child_open(kind: str, target: str, work: Path) -> dict[str, float]:
    """Open ``target`` as ``kind`` ("builtin" / "ours" / "lazy") in this fresh process: its wall time and RSS."""
    import torch  # noqa: F401

    if kind == "builtin":
        comfy_setup(work)
        import comfy_extras.nodes_dataset as nd
    from dataset_cache.format import open_cache  # every import before the clock and the baseline RSS

    def open_() -> tuple[Any, int]:
        if kind == "builtin":
            out = nd.LoadTrainingDataset.execute(target)  # measured while the node's output is alive
            return out, len(out.result[0]) if hasattr(out, "result") else len(out[0])
        if kind == "ours":
            reader = open_cache(target)
            return reader, len(reader.dataset("bench"))
        lazy = LazyReader(Path(target))
        return lazy, len(lazy)

    return open_footprint(open_)
