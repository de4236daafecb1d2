"""Benchmarks that need the real ComfyUI (``scripts/bench-comfy``); rewrites the ComfyUI section of docs/BENCHMARKS.md.

Runs under ComfyUI's python and calls ComfyUI's own functions in-process (CPU, ``args.cpu = True``):

* **C1. Open a dataset**: the same SD1.5-sized samples written by the built-in ``SaveTrainingDataset.execute``,
  by our ``CacheWriter`` and in the lazy-branch layout; then, each in a fresh interpreter, the built-in
  ``LoadTrainingDataset.execute`` vs ``open_cache`` + the sample list vs the lazy-branch open: wall time and RSS.
* **C2. Training**: time to the first training step, steady steps/s and peak RSS of our trainer
  (``nodes/training.train_lora``, what ``StreamCache_TrainLoRA`` runs) vs the built-in ``LoadTrainingDataset``
  → ``ResolutionBucket`` → ``TrainLoraNode(bucket_mode=True)``, same batch size, steps and options, with the tiny
  SD1.5-shaped model; and the upper bound: our loop with every batch already in (CPU) device memory.
* **C5. Built-in re-encode**: ComfyUI's ``MakeTrainingDataset`` with the tiny VAE and CLIP on a small folder,
  before and after editing 1% of the captions and adding 1% images, counting its encoder calls.

    scripts/bench-comfy            # defaults (see --help), ~6-8 min on 2 cores
    scripts/bench-comfy --quick    # small N, for iteration

How it runs: ``scripts/bench-comfy`` starts :mod:`bench.run_comfyui` by path with ComfyUI's python, which loads
``support`` (tests/support), ``dataset_cache`` and this package from their folders and calls :func:`main` (the
pack root must stay off ``sys.path``: its ``nodes/`` would shadow ComfyUI's ``nodes.py``). Each fresh-interpreter
measurement starts the same runner with ``--child``. :func:`measure` returns a :class:`ComfyRun` of plain
figures; :func:`render` and :func:`plot_panels` turn it into the doc's section and chart.
"""

from __future__ import annotations

import argparse
import ast
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .common import (
    DOC, PROFILES, Entries, LazyReader, Machine, keys_of, last_json_result, machine_info, med, rss_mib, write_lazy,
    write_ours,
)
from .report import growth, line_plot, machine_lines, stat, update_doc

__all__ = ["main", "measure", "render", "plot_panels", "ComfyRun", "comfy_version"]

PROG = "scripts/bench-comfy"
RUNNER = Path(__file__).resolve().parent / "run_comfyui.py"

TRAIN_LATENT = (1, 4, 16, 16)  # 128 px: the tiny UNet's step stays well under a second on a CPU core
TRAIN_OPTS = {"batch_size": 4, "grad_accumulation_steps": 1, "learning_rate": 1e-4, "rank": 4,
              "optimizer": "AdamW", "loss_function": "MSE", "seed": 7, "training_dtype": "fp32",
              "lora_dtype": "fp32", "algorithm": "LoRA", "gradient_checkpointing": False, "checkpoint_depth": 1,
              "offloading": False, "existing_lora": "[None]"}


# ------------------------------------------------------------------------------------------------ comfy setup
def comfy_setup(work: Path, cpu: bool = True) -> Any:
    """ComfyUI importable in-process (on the CPU unless ``cpu`` is False: ``scripts/bench-gpu``), its folders private
    to ``work``; returns the install."""
    from support.comfy_env import find_comfyui, skip_reason

    install = find_comfyui()
    if install is None:
        raise SystemExit(skip_reason())
    if str(install.path) not in sys.path:  # ComfyUI's own tree, as its main.py runs with it: never the pack root
        sys.path.insert(0, str(install.path))
    from comfy.cli_args import args

    args.cpu = cpu
    import folder_paths

    for sub in ("output", "input", "temp"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    folder_paths.set_output_directory(str(work / "output"))
    folder_paths.set_input_directory(str(work / "input"))
    folder_paths.set_temp_directory(str(work / "temp"))
    return install


def comfy_version(path: Path) -> str:
    """ComfyUI's version from ``<path>/comfyui_version.py``, read without running the file ("?" if unreadable).

    The file is generated as ``__version__ = "x.y.z"``; it is parsed, never executed.
    """
    try:
        tree = ast.parse((path / "comfyui_version.py").read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return "?"
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if (any(isinstance(t, ast.Name) and t.id == "__version__" for t in targets)
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
                return node.value.value
    return "?"


def rss_now() -> float:
    return rss_mib()[0]


# ------------------------------------------------------------------------------------------------ C1 prep + child
def prep_open(work: Path, n: int) -> dict[str, str]:
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
    import torch  # noqa: F401

    if kind == "builtin":
        comfy_setup(work)
        import comfy_extras.nodes_dataset as nd
    from dataset_cache.format import open_cache  # every import before the clock and the baseline RSS

    gc.collect()
    r0 = rss_now()
    t = time.perf_counter()
    if kind == "builtin":
        out = nd.LoadTrainingDataset.execute(target)
        n = len(out.result[0]) if hasattr(out, "result") else len(out[0])
        keep = out  # noqa: F841 - measured while the node's output is alive
    elif kind == "ours":
        reader = open_cache(target)
        n = len(reader.dataset("bench"))
    else:
        reader = LazyReader(Path(target))
        n = len(reader)
    dt = time.perf_counter() - t
    gc.collect()
    r1, peak = rss_mib()
    return {"open_s": dt, "growth_mib": r1 - r0, "rss_mib": r1, "peak_mib": peak, "samples": n}


# ------------------------------------------------------------------------------------------------ C2 prep + child
def prep_train(work: Path, n: int, clip_cond: Any) -> dict[str, str]:
    """N samples of a 16x16 latent + a CLIP-L conditioning (77x768 + pooled 768, fp16: ~120 KB a sample), written
    by the built-in SaveTrainingDataset and by our CacheWriter."""
    import torch

    import comfy_extras.nodes_dataset as nd
    from dataset_cache.dataset import Sample
    from dataset_cache.format import CacheWriter

    g = torch.Generator().manual_seed(1)
    base_c, base_p = clip_cond
    name = f"train-builtin-{n}"
    ours = work / f"train-ours-{n}"
    lats, conds, samples = [], [], []
    with CacheWriter(ours) as w:
        for i in range(n):
            lat = {"samples": torch.randn(TRAIN_LATENT, generator=g)}
            c = base_c.clone()
            c.view(-1)[:2] = torch.tensor([i & 0xFFF, i >> 12], dtype=c.dtype) * 1e-3
            cond = [[c, {"pooled_output": base_p.clone()}]]
            lk, ck = keys_of(i)
            w.add(lk, lat, kind="latent")
            w.add(ck, cond, kind="conditioning")
            samples.append(Sample(lk, (ck,)))
            lats.append(lat)
            conds.append(cond)
        w.set_dataset("train", samples)
    with torch.inference_mode():
        nd.SaveTrainingDataset.execute(latents=lats, conditioning=conds, folder_name=[name], shard_size=[1000])
    return {"builtin": name, "ours": str(ours)}


def child_train(kind: str, target: str, steps: int, work: Path, models: str) -> dict[str, Any]:
    comfy_setup(work)
    import torch

    import folder_paths
    import nodes as comfy_nodes

    for sub in ("checkpoints", "diffusion_models", "text_encoders", "vae"):
        folder_paths.add_model_folder_path(sub, str(Path(models) / sub), is_default=True)
    torch.manual_seed(0)
    (model,) = comfy_nodes.UNETLoader().load_unet("tiny_sd15_unet.safetensors", "default")
    ends: list[float] = []
    import comfy_extras.nodes_train as nt

    gc.collect()
    r0 = rss_now()
    t0 = time.perf_counter()
    with torch.inference_mode():
        if kind == "builtin":
            import comfy_extras.nodes_dataset as nd

            orig = nt.TrainSampler.fwd_bwd

            def fwd_bwd(self: Any, *a: Any, **k: Any) -> Any:
                out = orig(self, *a, **k)
                ends.append(time.perf_counter())
                return out

            nt.TrainSampler.fwd_bwd = fwd_bwd
            lat, cond = nd.LoadTrainingDataset.execute(target).result
            blat, bcond = nd.ResolutionBucket.execute(lat, cond).result
            opts = {k: [v] for k, v in TRAIN_OPTS.items()}
            opts["existing_lora"] = ["[None]"]
            nt.TrainLoraNode.execute(
                [model], blat, bcond, steps=[steps], quantized_backward=[False], bucket_mode=[True],
                bypass_mode=[False], **opts)
        else:
            from support.pack import import_pack

            pack = import_pack()
            import importlib

            lt = importlib.import_module(f"{pack.__name__}.nodes.training")
            handles = importlib.import_module(f"{pack.__name__}.nodes.handles")
            if kind == "bound":
                real_loader = lt.run.PrefetchLoader

                class InMemory:
                    """Every batch the run will use, read before the loop starts (the upper bound)."""

                    def __init__(self, reader: Any, sampler: Any, **kw: Any) -> None:
                        kw["prefetch_batches"] = 0
                        with real_loader(reader, sampler, **kw) as loader:
                            it = iter(loader)
                            self.batches = [next(it) for _ in range(steps)]

                    def __iter__(self) -> Any:
                        return iter(self.batches)

                    def close(self) -> None:
                        self.batches = []

                lt.run.PrefetchLoader = InMemory
            reader, samples = handles.StreamDatasetHandle(target, "train").open()
            try:
                settings = lt.TrainSettings(steps=steps, prefetch_batches=2, loader_threads=0, **TRAIN_OPTS)
                # the trainer's public per-step callback marks the end of each step (one batch a step here)
                lt.train_lora(model, reader, samples, settings,
                              on_step=lambda _report: ends.append(time.perf_counter()))
            finally:
                reader.close()
    wall = time.perf_counter() - t0
    gc.collect()
    r1, peak = rss_mib()
    steps_dt = [b - a for a, b in zip(ends, ends[1:])]
    return {"first_s": ends[0] - t0 if ends else None, "steps": len(ends), "step_s": steps_dt[2:],
            "wall_s": wall, "peak_mib": peak, "r0_mib": r0, "rss_end_mib": r1}


# ------------------------------------------------------------------------------------------------ C5
def builtin_reencode(work: Path, models: str, n: int) -> dict[str, int]:
    """Run the real MakeTrainingDataset twice (before and after a 1% edit) and count its encoder calls."""
    import torch

    import comfy_extras.nodes_dataset as nd
    import folder_paths
    import nodes as comfy_nodes

    for sub in ("checkpoints", "diffusion_models", "text_encoders", "vae"):
        folder_paths.add_model_folder_path(sub, str(Path(models) / sub), is_default=True)
    (clip,) = comfy_nodes.CLIPLoader().load_clip("tiny_clip_l.safetensors", "stable_diffusion")
    (vae,) = comfy_nodes.VAELoader().load_vae("tiny_taesd.safetensors")
    counts = {"vae": 0, "clip": 0}
    ov, oc = vae.encode, clip.encode_from_tokens_scheduled

    def venc(*a: Any, **k: Any) -> Any:
        counts["vae"] += 1
        return ov(*a, **k)

    def cenc(*a: Any, **k: Any) -> Any:
        counts["clip"] += 1
        return oc(*a, **k)

    vae.encode, clip.encode_from_tokens_scheduled = venc, cenc
    g = torch.Generator().manual_seed(0)
    images = [torch.rand(1, 64, 64, 3, generator=g) for _ in range(n)]
    texts = [f"a photo of item {i}" for i in range(n)]
    out = {}
    with torch.inference_mode():
        t = time.perf_counter()
        nd.MakeTrainingDataset.execute(images, [vae], [clip], texts)
        out["first_s"] = time.perf_counter() - t
        out["first_vae"], out["first_clip"] = counts["vae"], counts["clip"]
        k = max(1, n // 100)
        for j in range(k):
            texts[j * (n // k)] = f"an edited caption {j}"
        images += [torch.rand(1, 64, 64, 3, generator=g) for _ in range(k)]
        texts += [f"a new image {j}" for j in range(k)]
        counts.update(vae=0, clip=0)
        t = time.perf_counter()
        nd.MakeTrainingDataset.execute(images, [vae], [clip], texts)
        out["edit_s"] = time.perf_counter() - t
        out["edit_vae"], out["edit_clip"], out["edited"], out["added"] = counts["vae"], counts["clip"], k, k
    out["n"] = n
    return out


def clip_template(models: str) -> Any:
    """One real CLIP-L conditioning from the tiny text encoder (fp16), the template of every training sample."""
    import torch

    import folder_paths
    import nodes as comfy_nodes

    for sub in ("checkpoints", "diffusion_models", "text_encoders", "vae"):
        folder_paths.add_model_folder_path(sub, str(Path(models) / sub), is_default=True)
    (clip,) = comfy_nodes.CLIPLoader().load_clip("tiny_clip_l.safetensors", "stable_diffusion")
    with torch.inference_mode():
        (cond,) = comfy_nodes.CLIPTextEncode().encode(clip, "a photo of a test pattern")
    c, extra = cond[0]
    return c.detach().to(torch.float16).clone(), extra["pooled_output"].detach().to(torch.float16).clone()


# ------------------------------------------------------------------------------------------------ figures
@dataclass
class ComfyRun:
    """Everything one run measured, plus what the report says about the run itself."""

    mode: str
    runs: int
    steps: int
    machine: Machine
    open: dict[int, dict[str, dict[str, list[float]]]] = field(default_factory=dict)
    """C1: N → "builtin" / "ours" / "lazy" → "open_s" / "growth_mib" / "rss_mib" → one value per run."""
    save_s: dict[int, float] = field(default_factory=dict)
    """C1: N → seconds of the built-in ``SaveTrainingDataset`` writing the samples."""
    train: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    """C2: ("ours" / "bound" / "builtin", N) → :func:`child_train`'s figures, or ``{"error": text}``."""
    reencode: dict[str, Any] = field(default_factory=dict)
    """C5: :func:`builtin_reencode`'s counts and times (empty when not run)."""
    seconds: float = 0.0


@dataclass(frozen=True)
class Settings:
    """What one run measures, resolved from the options."""

    mode: str
    runs: int
    steps: int
    open_sizes: list[int]
    train_sizes: list[int]
    builtin_train_sizes: list[int]
    bound_sizes: list[int]
    reencode_n: int
    sections: frozenset[str]


# ------------------------------------------------------------------------------------------------ orchestration
def _child(args_list: list[str], timeout: float = 900) -> dict[str, Any]:
    """One measurement in a fresh interpreter (the runner again, with ``--child``): its last JSON line."""
    return last_json_result([sys.executable, str(RUNNER), *args_list], timeout=timeout)


def measure(s: Settings, work: Path, models: str, machine: Machine, say: Callable[[str], None]) -> ComfyRun:
    """Run the ComfyUI benchmarks in the scratch folder ``work`` (ComfyUI set up, tiny models in ``models``) and
    return the figures (no Markdown here)."""
    run = ComfyRun(mode=s.mode, runs=s.runs, steps=s.steps, machine=machine)
    open_sizes = s.open_sizes if "c1" in s.sections else []
    train_sizes, btrain, bound_sizes = s.train_sizes, s.builtin_train_sizes, s.bound_sizes
    if "c2" not in s.sections:
        train_sizes, btrain, bound_sizes = [], [], []
    for n in open_sizes:
        say(f"C1 N={n}: writing built-in / ours / lazy")
        paths = prep_open(work, n)
        run.save_s[n] = paths["save_s"]
        res: dict[str, dict[str, list[float]]] = {}
        for _ in range(s.runs):  # interleaved: machine noise hits all three alike
            for kind in ("builtin", "ours", "lazy"):
                r = _child(["--child", "open", kind, paths[kind], str(work)])
                d = res.setdefault(kind, {"open_s": [], "growth_mib": [], "rss_mib": []})
                for k in d:
                    d[k].append(r[k])
        run.open[n] = res
        say(f"C1 N={n}: built-in {med(res['builtin']['open_s']):.2f}s, ours {med(res['ours']['open_s']):.4f}s")
        shutil.rmtree(paths["builtin_dir"], ignore_errors=True)
        shutil.rmtree(paths["ours"], ignore_errors=True)
        shutil.rmtree(paths["lazy"], ignore_errors=True)

    if "c5" in s.sections:
        say("C5: built-in MakeTrainingDataset re-encode")
        run.reencode = builtin_reencode(work, models, s.reencode_n)
    template = clip_template(models) if train_sizes or btrain else None
    for n in sorted(set(train_sizes) | set(btrain)):
        say(f"C2 N={n}: writing training datasets")
        paths = prep_train(work, n, template)
        kinds = (["ours"] if n in train_sizes else []) + (["bound"] if n in bound_sizes else []) \
            + (["builtin"] if n in btrain else [])
        for kind in kinds:
            say(f"C2 N={n}: {kind}")
            target = paths["builtin"] if kind == "builtin" else paths["ours"]
            try:
                run.train[(kind, n)] = _child(["--child", "train", kind, target, str(s.steps), models, str(work)])
            except Exception as exc:  # report, keep the other figures
                run.train[(kind, n)] = {"error": str(exc)[-600:]}
                say(f"  failed: {str(exc)[-300:]}")
    return run


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small N for iteration")
    ap.add_argument("--open-sizes", default=None, help="SD1.5 N for C1 (default 1000,5000; --quick 1000)")
    ap.add_argument("--train-sizes", default=None, help="N for C2, ours (default 1000,5000; --quick 500,2000)")
    ap.add_argument("--builtin-train-sizes", default=None,
                    help="N for C2, built-in (default 1000; --quick 500)")
    ap.add_argument("--bound-sizes", default=None,
                    help="N for C2, the in-memory bound (default: the first of --train-sizes)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (default 20; --quick 12)")
    ap.add_argument("--runs", type=int, default=5, help="fresh-process runs per open figure (>= 5)")
    ap.add_argument("--reencode-n", type=int, default=None, help="images for C5 (default 100; --quick 20)")
    ap.add_argument("--sections", default="c1,c2,c5", help="which sections to run (default: %(default)s)")
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder (default: temporary, deleted)")
    ap.add_argument("--doc", type=Path, default=DOC, help="markdown file to update (default: %(default)s)")
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    return ap


def settings_from(a: argparse.Namespace) -> Settings:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    train_sizes = ints(a.train_sizes) if a.train_sizes else ([500, 2000] if a.quick else [1000, 5000])
    return Settings(
        mode="--quick" if a.quick else "default",
        runs=max(5, a.runs),
        steps=a.steps or (12 if a.quick else 20),
        open_sizes=ints(a.open_sizes) if a.open_sizes else ([1000] if a.quick else [1000, 5000]),
        train_sizes=train_sizes,
        builtin_train_sizes=ints(a.builtin_train_sizes) if a.builtin_train_sizes else ([500] if a.quick else [1000]),
        bound_sizes=ints(a.bound_sizes) if a.bound_sizes else train_sizes[:1],
        reencode_n=a.reencode_n or (20 if a.quick else 100),
        sections=frozenset(a.sections.lower().split(",")),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print the Markdown section, and rewrite it (and its chart) in the doc unless ``--no-doc``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(argv)
    if a.child:
        work = Path(a.child[-1])
        if a.child[0] == "open":
            print(json.dumps(child_open(a.child[1], a.child[2], work)))
        elif a.child[0] == "train":
            print(json.dumps(child_train(a.child[1], a.child[2], int(a.child[3]), work, a.child[4])))
        return 0

    t_start = time.perf_counter()
    s = settings_from(a)
    own = a.dir is None
    work = Path(tempfile.mkdtemp(prefix="streamcache-bench-comfy-")) if own else a.dir
    work.mkdir(parents=True, exist_ok=True)
    say = lambda m: sys.stderr.write(f"[bench-comfy {time.perf_counter() - t_start:6.1f}s] {m}\n")  # noqa: E731
    try:
        install = comfy_setup(work)
        from support.tiny_models import ensure_tiny_models

        models = str(ensure_tiny_models(install.path, install.python).root)
        machine = machine_info({"ComfyUI": f"{comfy_version(install.path)} ({install.path})"},
                               root=Path(tempfile.gettempdir()))
        run = measure(s, work, models, machine, say)
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    run.seconds = time.perf_counter() - t_start

    cmd = " ".join([PROG, *(x for x in argv if x != "--no-doc")])  # as typed, to regenerate
    plot_name = None
    panels = [] if a.no_doc else plot_panels(run)
    if panels:
        plot = a.doc.parent / "bench_comfy.png"
        line_plot(plot, panels, "ComfyUI: built-in vs StreamCache (log-log unless noted)")
        plot_name = plot.name
    out = render(run, cmd, plot_name)
    sys.stdout.write(out)
    if not a.no_doc:
        update_doc(a.doc, "comfy", out)
    return 0


# ------------------------------------------------------------------------------------------------ render
def _open_series(run: ComfyRun) -> tuple[dict[str, list], dict[str, list]]:
    """C1 medians over N per design: open ms, RSS growth MiB (floored at 0.01 for the log scale)."""
    plot_t: dict[str, list] = {}
    plot_m: dict[str, list] = {}
    for n, res in run.open.items():
        for name, kind in (("built-in", "builtin"), ("ours", "ours"), ("lazy", "lazy")):
            d = res[kind]
            plot_t.setdefault(name, []).append((n, med(d["open_s"]) * 1e3))
            plot_m.setdefault(name, []).append((n, max(med(d["growth_mib"]), 0.01)))
    return plot_t, plot_m


_TRAINERS = ["ours", "bound", "builtin"]
_LABELS = {"ours": "ours (StreamCache)", "bound": "bound (in memory)", "builtin": "built-in TrainLoraNode"}


def _train_order(run: ComfyRun) -> list[tuple[str, int]]:
    return sorted(run.train, key=lambda k: (k[1], _TRAINERS.index(k[0])))


def _peaks(run: ComfyRun) -> dict[str, list]:
    """C2 peak RSS over N per trainer ("ours", "bound", "built-in"), failed runs left out."""
    peaks: dict[str, list] = {}
    for (kind, n) in _train_order(run):
        r = run.train[(kind, n)]
        if "error" not in r:
            label = _LABELS[kind]
            peaks.setdefault(label.split(" (")[0] if kind != "builtin" else "built-in", []).append((n, r["peak_mib"]))
    return peaks


def plot_panels(run: ComfyRun) -> list[dict[str, Any]]:
    """The panels of ``bench_comfy.png``: C1 over N (with > 1 open size) and C2 peak RSS over N; none when C5 did
    not run (the section then ends before the chart) or when nothing has more than one N."""
    peaks = _peaks(run)
    if not run.reencode or not (len(run.open) > 1 or len(peaks.get("ours", [])) > 1):
        return []
    plot_t, plot_m = _open_series(run)
    panels: list[dict[str, Any]] = []
    if len(run.open) > 1:
        panels += [{"title": "Open a dataset (SD1.5), ms", "xlabel": "N samples", "ylabel": "ms",
                    "series": plot_t},
                   {"title": "RSS growth after open, MiB", "xlabel": "N samples", "ylabel": "MiB",
                    "series": plot_m}]
    if any(len(v) > 1 for v in peaks.values()):
        panels.append({"title": "Training peak RSS, MiB", "xlabel": "N samples", "ylabel": "MiB",
                       "series": peaks, "logy": False})
    return panels


def render(run: ComfyRun, cmd: str, plot_name: str | None = None) -> str:
    """The ComfyUI section of docs/BENCHMARKS.md for ``run``; ``cmd`` is the command shown to regenerate it and
    ``plot_name`` the chart (beside the doc) to link, if one was drawn."""
    open_res, save_s, train_res, steps, reenc = run.open, run.save_s, run.train, run.steps, run.reencode
    o: list[str] = [
        "## ComfyUI benchmarks (`scripts/bench-comfy`)",
        "",
        f"Regenerate: `{cmd}` (this run: mode {run.mode}, took {run.seconds / 60:.1f} min). "
        "Runs under ComfyUI's python and "
        "calls ComfyUI's own node functions in-process on the CPU (`args.cpu = True`).",
        "",
        *machine_lines(run.machine),
        "",
        "### C1. Open a dataset: ours vs the built-in `LoadTrainingDataset` vs the lazy-branch design",
        "",
        "The same SD1.5-sized samples (latent 4×64×64 fp16, conditioning 77×768 fp16 + pooled 768; ≈150 KB) "
        "written by the built-in `SaveTrainingDataset.execute` (shard_size 1000), by our `CacheWriter` and in the "
        f"lazy-branch layout. Each open in a fresh interpreter, {run.runs} runs interleaved, page cache warm. "
        "*Built-in*: `LoadTrainingDataset.execute(folder)` (this ComfyUI version `torch.load`s every shard: every "
        "tensor is read into RAM). *Ours*: `open_cache` + the dataset's sample list. *Lazy*: skeleton pickles + "
        "safetensors headers. RSS growth = RSS after opening (output alive) − RSS before, after imports. "
        "Goals at 5k: ≥ 100× faster and ≥ 20× less memory than the built-in; no slower than lazy.",
        "",
        "| N | built-in save s | built-in open ms | built-in RSS growth MiB | ours open ms | ours RSS growth MiB "
        "| lazy open ms | lazy RSS growth MiB | built-in / ours time | built-in / ours memory | goals |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    plot_t, plot_m = _open_series(run)
    for n, res in open_res.items():
        b, u, lz = res["builtin"], res["ours"], res["lazy"]
        tr = med(b["open_s"]) / med(u["open_s"])
        mr = med(b["growth_mib"]) / max(med(u["growth_mib"]), 0.01)
        goals = []
        goals.append(f"time ≥100×: {'met' if tr >= 100 else 'NOT met'}")
        goals.append(f"memory ≥20×: {'met' if mr >= 20 else 'NOT met'}")
        goals.append(f"≤ lazy: {'met' if med(u['open_s']) <= med(lz['open_s']) else 'NOT met'}")
        mem_note = f"{mr:.0f}×" if med(u["growth_mib"]) >= 0.01 else f"> {mr:.0f}× (ours < 0.01 MiB)"
        o.append(f"| {n} | {save_s[n]:.1f} | {stat(b['open_s'], 1e3, '.0f')} | {stat(b['growth_mib'], fmt='.0f')} "
                 f"| {stat(u['open_s'], 1e3, '.2f')} | {stat(u['growth_mib'], fmt='.2f')} "
                 f"| {stat(lz['open_s'], 1e3, '.2f')} | {stat(lz['growth_mib'], fmt='.2f')} | {tr:.0f}× | {mem_note} "
                 f"| {'; '.join(goals)} |")
    ns = list(open_res)
    if len(ns) > 1:
        o += ["", "Growth with N (first to last N): " + "; ".join(
            f"{name} time {growth(ns, [y for _, y in pts])}" for name, pts in plot_t.items()) + "; " + "; ".join(
            f"{name} memory {growth(ns, [y for _, y in pts])}" for name, pts in plot_m.items()) + "."]

    o += [
        "",
        "### C2. Training: time to first step, steady steps/s, peak RSS",
        "",
        f"Tiny SD1.5-shaped UNet (13.6M params), CPU, fp32, LoRA rank 4, AdamW, batch {TRAIN_OPTS['batch_size']}, "
        f"{steps} steps, one resolution bucket. Samples: latent {'×'.join(map(str, TRAIN_LATENT[1:]))} fp32 (kept "
        "small so a CPU step stays short) + a real CLIP-L conditioning from the tiny text encoder (77×768 + pooled "
        "768, fp16): ≈120 KB a sample. Each run in a fresh interpreter (ComfyUI imported, model loaded, then the "
        "clock starts). *Ours*: `train_lora` (what `StreamCache_TrainLoRA` runs), prefetch 2, from the cache. "
        "*Built-in*: `LoadTrainingDataset` → `ResolutionBucket` → `TrainLoraNode(bucket_mode=True)`, same options. "
        "*Bound*: our loop with every batch read into (CPU) device memory before the clock of the first step. "
        "First step = clock start → end of the first step (includes opening/loading the dataset; ours: "
        "`train_lora`'s `on_step` after the optimizer step, built-in: the end of its forward/backward). "
        "Steady step = time between consecutive step ends, steps 3.. (median (min–max)). "
        "Peak RSS = the process's VmHWM (includes ComfyUI, torch and the model). "
        "Goals: ours' steady steps/s within 5% of the bound; ours' peak RSS flat in N.",
        "",
        "| N | trainer | first step s | steady step ms | steps/s | vs bound | peak RSS MiB | goal |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for (kind, n) in _train_order(run):
        r = train_res[(kind, n)]
        label = _LABELS[kind]
        if "error" in r:
            o.append(f"| {n} | {label} | failed | | | | | {r['error'][-200:].replace('|', '/').splitlines()[-1]} |")
            continue
        sps = 1 / med(r["step_s"]) if r["step_s"] else 0
        bound = train_res.get(("bound", n), {})
        vs, goal = "", ""
        if bound and "error" not in bound and bound.get("step_s"):
            ratio = sps * med(bound["step_s"])
            vs = f"{ratio:.1%}"
            if kind == "ours":
                goal = "within 5%: " + ("met" if ratio >= 0.95 else "NOT met")
        o.append(f"| {n} | {label} | {r['first_s']:.2f} | {stat(r['step_s'], 1e3, '.0f')} | {sps:.2f} | {vs} "
                 f"| {r['peak_mib']:.0f} | {goal} |")
    peaks = _peaks(run)
    if peaks.get("ours") and len(peaks["ours"]) > 1:
        xs = [x for x, _ in peaks["ours"]]
        o += ["", "Peak RSS growth with N: " + "; ".join(
            f"{k} {growth([x for x, _ in v], [y for _, y in v])}" for k, v in peaks.items() if len(v) > 1)
            + f" (goal for ours: flat — "
              f"{'met' if growth(xs, [y for _, y in peaks['ours']]).startswith('flat') else 'NOT met'})."]

    if not reenc:
        return "\n".join(o) + "\n"
    o += [
        "",
        "### C5. Built-in re-encode after a 1% edit (real `MakeTrainingDataset`, tiny VAE + CLIP)",
        "",
        f"{reenc['n']} images of 64×64 with one caption each; then {reenc['edited']} captions edited and "
        f"{reenc['added']} images added. The built-in node has no cache: every run encodes every image and caption. "
        "Ours on the same edit: see L5 above (only the edited captions and the new images are encoded).",
        "",
        "| run | images | VAE encode calls | CLIP encode calls | wall s |",
        "|---|---:|---:|---:|---:|",
        f"| first | {reenc['n']} | {reenc['first_vae']} | {reenc['first_clip']} | {reenc['first_s']:.2f} |",
        f"| after the edit | {reenc['n'] + reenc['added']} | {reenc['edit_vae']} | {reenc['edit_clip']} "
        f"| {reenc['edit_s']:.2f} |",
    ]
    if plot_name:
        o += ["", f"![open and training memory vs N]({plot_name})"]
    return "\n".join(o) + "\n"


if __name__ == "__main__":
    raise SystemExit("run it with scripts/bench-comfy (bench/run_comfyui.py under ComfyUI's python)")
