"""The library section of docs/BENCHMARKS.md (L1–L6) and its chart, rendered from a measured run.

One function per section of the doc, each reading only the figures of :mod:`bench.library_figures`: the wording
and the goals stated in a table live here, next to the rows that show them, and the whole section can be
rendered from fixed figures (tests, checks of a refactor) without measuring anything.
"""

from __future__ import annotations

from typing import Any

from .common import PROFILES, med
from .library_figures import IncrementalFigures, LibraryRun, PrefetchFigures, PrefetchRow
from .report import growth, machine_lines, stat

__all__ = ["render", "plot_panels"]


def _open_series(run: LibraryRun, profile: str) -> dict[str, list[tuple[int, float]]]:
    """The warm L1 figures of one profile as plot/growth series over N."""
    series: dict[str, list[tuple[int, float]]] = {}
    for f in run.opens:
        if f.profile == profile and not f.cold:
            series.setdefault("ours open ms", []).append((f.n, med(f.ours["open_s"]) * 1e3))
            series.setdefault("lazy open ms", []).append((f.n, med(f.lazy["open_s"]) * 1e3))
            series.setdefault("ours RSS MiB", []).append((f.n, max(med(f.ours["growth_mib"]), 0.1)))
            series.setdefault("lazy RSS MiB", []).append((f.n, max(med(f.lazy["growth_mib"]), 0.1)))
    return series


def _profiles(run: LibraryRun) -> list[tuple[str, list[int]]]:
    return [(PROFILES["sd15"].name, run.sd15), (PROFILES["flux"].name, run.flux)]


def plot_panels(run: LibraryRun) -> list[dict[str, Any]]:
    """The panels of ``bench_open_library.png`` (open time and RSS growth vs N per profile with > 1 size)."""
    panels = []
    for pname, _ in _profiles(run):
        series = _open_series(run, pname)
        if series and len(next(iter(series.values()))) > 1:
            panels.append({"title": f"{pname}: open time (warm), ms", "xlabel": "N samples", "ylabel": "ms",
                           "series": {k: v for k, v in series.items() if k.endswith("ms")}})
            panels.append({"title": f"{pname}: RSS growth after open, MiB", "xlabel": "N samples",
                           "ylabel": "MiB", "series": {k: v for k, v in series.items() if k.endswith("MiB")}})
    return panels


def _head(run: LibraryRun, cmd: str) -> list[str]:
    """The section's title, how to regenerate it, what this run was, and the machine."""
    sd, fx = run.sd15, run.flux
    return [
        "## Library benchmarks (`python -m dataset_cache bench`)",
        "",
        f"Regenerate: `{cmd}` (this run: mode {run.mode}, {run.runs} runs per figure, "
        f"took {run.seconds / 60:.1f} min). "
        f"SD1.5 N = {', '.join(map(str, sd))}; Flux N = {', '.join(map(str, fx)) or 'none'}. "
        "Figures are `median (min–max)` over the runs.",
        "",
        *machine_lines(run.machine),
    ]


def _l1_open(run: LibraryRun) -> list[str]:
    """L1: open time and RSS of ours vs the lazy design, then the write speed of the synthetic caches."""
    open_rows, write_rows = [], []
    for w in run.writes:
        write_rows.append(f"| {w.profile} | {w.n} | {w.gb:.2f} | {w.gb / w.ours_s:.2f} ({w.ours_s:.1f} s) "
                          f"| {w.gb / w.lazy_s:.2f} ({w.lazy_s:.1f} s) |")
    for f in run.opens:
        o, l_ = f.ours, f.lazy
        ratio = med(l_["open_s"]) / med(o["open_s"])
        ok = med(o["open_s"]) <= med(l_["open_s"]) * 1.0
        open_rows.append(
            f"| {f.profile} | {f.n} | {'dropped' if f.cold else 'warm'} "
            f"| {stat(o['open_s'], 1e3)} | {stat(o['growth_mib'])} "
            f"| {stat(l_['open_s'], 1e3)} | {stat(l_['growth_mib'])} "
            f"| {ratio:.1f}× | {'met' if ok else 'NOT met'} |")
    return [
        "### L1. Open a dataset: ours vs the lazy-branch design",
        "",
        "Each open runs in a fresh interpreter (torch already imported before the baseline RSS is taken). "
        "*Ours*: `open_cache(root)` (manifest, journal, shard headers) + `reader.dataset(name)` (the sample list). "
        "*Lazy branch*: unpickle every shard's skeleton + parse every shard's safetensors header "
        "(KohakuBlueleaf/ComfyUI@streamabledataset, 1000 samples a shard). *Dropped*: the files' page cache was "
        "dropped with `posix_fadvise(DONTNEED)` before each run. The built-in `LoadTrainingDataset` is in the "
        "ComfyUI section below (Goal: no slower than the lazy design).",
        "",
        "| profile | N | page cache | ours open ms | ours RSS growth MiB | lazy open ms | lazy RSS growth MiB "
        "| lazy / ours time | goal: ours ≤ lazy |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
        *open_rows,
        "",
        "Writing the synthetic caches (single thread, includes the xxh3 checksums of ours):",
        "",
        "| profile | N | GB | ours GB/s | lazy-branch GB/s |",
        "|---|---:|---:|---:|---:|",
        *write_rows,
    ]


def _l3_reads(run: LibraryRun) -> list[str]:
    """L3: MB/s of each way of reading the same random batches, and the ratios the goals are stated in."""
    read_rows = []
    for r in run.reads:
        o, f_, h_, l_, r_ = r.ours, r.floor, r.floor_xxh3, r.safe_open, r.raw
        read_rows.append(
            f"| {r.profile} | {r.n} | {'dropped' if r.cold else 'warm'} | {r.batch} "
            f"| {stat(o, fmt='.0f')} | {stat(f_, fmt='.0f')} | {stat(h_, fmt='.0f')} "
            f"| {stat(l_, fmt='.0f')} | {stat(r_, fmt='.0f')} | {med(o) / med(r_):.0%} "
            f"| {med(f_) / med(r_):.0%} | {med(h_) / med(r_):.0%} | {med(o) / med(h_):.0%} "
            f"| {med(o) / med(l_):.1f}× |")
    return [
        "### L3. Batch read throughput (MB/s of tensor payload)",
        "",
        "Random batches (150 of 4 for SD1.5, 15 of 2 for Flux) at the largest N. *Ours*: `CacheReader.read` with "
        "a reused `ReadBuffer`, checksums verified. *Floor*: the same rows with nothing but one `preadv` per row "
        "into one buffer, files open and every offset computed before the clock starts (what this layout allows "
        "with zero Python work); *floor + xxh3*: the same plus the per-row checksum ours verifies. *safe_open*: "
        "the lazy-branch files, one `safe_open` handle per shard kept open "
        "(as that branch does), `get_tensor(...).clone()` per tensor (`get_tensor` returns a view of a memory "
        "map: the clone is what reads the bytes). *Raw*: sequential `readinto` (8 MiB) of the same number of "
        "bytes of our shard files, no parsing or checksums: the limit of the disk/page cache. Goals (issue #3): "
        "ours ≥ 70% of raw and ≥ 5× safe_open.",
        "",
        "| profile | N | page cache | batch | ours MB/s | floor MB/s | floor + xxh3 MB/s | safe_open MB/s "
        "| raw sequential MB/s | ours / raw | floor / raw | floor + xxh3 / raw | ours / (floor + xxh3) "
        "| ours / safe_open |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *read_rows,
    ]


def _prefetch_row(row: PrefetchRow, read_s: float) -> str:
    """One L4 row, with the goal that applies to its setting (none for the reference or a standalone run)."""
    kind, factor, step_s, depth, threads, hints = (row.kind, row.factor, row.step_s, row.depth, row.threads,
                                                   row.hints)
    per, waits, alone = row.per_batch_s, row.wait_s, row.standalone_s
    goal = ""
    wait_frac = [w / read_s for w in waits]
    rate = [alone / x for x in per]
    if depth >= 1 and factor >= 1.0:
        goal = "met" if med(wait_frac) < 0.05 else "NOT met"
    elif depth >= 1 and kind != "none":
        goal = "met" if med(rate) >= 0.90 else "NOT met"
    alone_row = kind == "none"
    length = "—" if alone_row else f"{factor:g}× " + ("standalone" if factor < 1 else "serial read")
    return (f"| {'none (standalone)' if alone_row else kind} | {length} "
            f"| {'—' if alone_row else f'{step_s * 1e3:.2f}'} | {depth if depth else 'off'} "
            f"| {threads if depth else '—'} | {('on' if hints else 'off') if depth else '—'} "
            f"| {stat(per, 1e3, '.2f')} "
            f"| {'—' if alone_row else stat(waits, 1e3, '.2f')} "
            f"| {'—' if alone_row else stat(wait_frac, 100) + '%'} "
            f"| {stat(rate, 100, '.0f') + '%' if factor == 0.5 else '—'} | {goal} |")


def _l4_prefetch(pf: PrefetchFigures) -> list[str]:
    """L4: the consumer's wait and throughput with each loader setting under each simulated step."""
    read_s = pf.serial_read_s
    return [
        "### L4. Prefetch overlap (the consumer's wait for data)",
        "",
        f"`PrefetchLoader` over a real SD1.5 cache of {pf.samples} samples, batches of {pf.batch}, "
        f"{pf.batches} batches a run, the "
        "cache's page cache dropped before every run (each read waits for the disk, as with a dataset larger than "
        f"RAM). *Serial read*: one thread reads a batch (`CacheReader.read` + `torch.cat` of the latents), no "
        f"loader: {read_s * 1e3:.2f} ms (median). *Standalone*: the loader with the same setting iterated with no "
        "step (its own best rate). The consumer then runs a simulated step of 1×/2× the serial read time, or of "
        "0.5× the standalone time of the same setting (reads slower than steps): a torch matmul loop on one thread "
        "(releases the GIL, competes for the CPU like a CPU training step) or a "
        "`time.sleep` (like a GPU step: the CPU is free). *Wait* = the consumer's time in `next()` per batch, "
        "first batch excluded. Goals (issue #5): with a step at least as long as a read (≥ 1×), the wait is under "
        "5% of the serial read time; with reads slower than steps (0.5× standalone), the throughput is at least "
        "90% of the "
        "loader's standalone rate. Prefetch off = the read runs inside `next()` (the reference). *Hints*: a "
        "worker starting a batch first asks the kernel for the next batch's rows (`CacheReader.announce`, "
        "`posix_fadvise(WILLNEED)` while reads come from the disk), so two batches are in flight on the disk; "
        "*off* = the same loader over a reader that cannot announce (the A/B). This machine has 2 CPUs, so a "
        "second loader thread competes with a matmul step for a core.",
        "",
        "| step | step length | step ms | prefetch | threads | hints | ms per batch | wait ms per batch "
        "| wait / serial read | throughput / standalone | goal |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|",
        *(_prefetch_row(row, read_s) for row in pf.rows),
    ]


def _incremental_lines(inc: IncrementalFigures | str | None) -> list[str]:
    """L5's incremental table, or why it was not measured (nothing when it was not asked for)."""
    if isinstance(inc, IncrementalFigures):
        total_after = inc.n + inc.added
        ours_calls = inc.images + inc.texts
        return [
            f"A folder of {inc.n} tiny PNGs with one caption each, encoded with no-op encoders that count their "
            f"inputs (`bench/bench_incremental.py`'s generator), then {inc.edited} captions edited (1%) and "
            f"{inc.added} images added (1%). The built-in `MakeTrainingDataset` + `SaveTrainingDataset` path "
            "re-encodes every image and every caption on every run (its `execute` loops `vae.encode` over all "
            "images and `clip.encode_from_tokens_scheduled` over all texts; see `scripts/bench-comfy` for a run "
            "with the real node).",
            "",
            "| images | edit | ours: VAE inputs | ours: text inputs | built-in: VAE | built-in: text "
            "| ours / built-in | ours wall s after the edit | first build wall s | goal: only changed items |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
            f"| {inc.n} | {inc.edited} captions + {inc.added} images | {inc.images} | {inc.texts} "
            f"| {total_after} | {total_after} | {ours_calls / (2 * total_after):.1%} | {inc.wall:.2f} "
            f"| {inc.build_wall:.2f} | "
            f"{'met' if inc.images == inc.added and inc.texts == inc.edited + inc.added else 'NOT met'} |",
            "",
            f"Re-planning the unchanged folder ({2 * inc.n} files): `validate_sources` {stat(inc.validate, 1e3)} ms, "
            f"whole `plan_encode` {stat(inc.plan, 1e3)} ms.",
            "",
        ]
    if inc is not None:
        return [f"Incremental encode: not measured ({inc}).", ""]
    return []


def _l5_incremental(run: LibraryRun) -> list[str]:
    """L5: encoder inputs after a small edit, then validating unchanged folders against the < 1 s/100k goal."""
    out = ["### L5. Incremental encode and validation", "", *_incremental_lines(run.incremental)]
    out += [
        "Validation of an unchanged folder (stat every file, compare with the stored record, hash nothing): "
        "`validate_sources` with the record already loaded. Goal: < 1 s per 100k files.",
        "",
        "| files | wall ms | CPU ms | µs per file | goal |",
        "|---:|---:|---:|---:|---|",
    ]
    for v in run.validation:
        # the goal is stated for 100k files; smaller folders carry fixed costs
        files, wall, cpu = v.files, v.wall, v.cpu
        goal = ("met" if med(wall) < 1.0 else "NOT met") + " (wall)" if files >= 100_000 else "— (stated at 100k)"
        out.append(f"| {files} | {stat(wall, 1e3)} | {stat(cpu, 1e3)} | {med(wall) / files * 1e6:.1f} | {goal} |")
    return out


def _l6_scaling(run: LibraryRun, plot_name: str | None) -> list[str]:
    """L6: growth of the warm L1 figures and of validation from the smallest to the largest size, and the chart."""
    scale_rows = []
    for pname, sizes in _profiles(run):
        series = _open_series(run, pname)
        if len(sizes) > 1:
            xs = [x for x, _ in series["ours open ms"]]
            for name, pts in series.items():
                scale_rows.append(f"| {pname} | {name} | {growth(xs, [y for _, y in pts])} |")
    if len(run.validation) > 1:
        scale_rows.append(f"| files | validate unchanged folder | "
                          f"{growth([v.files for v in run.validation], [med(v.wall) for v in run.validation])} |")
    out = [
        "### L6. Scaling with N",
        "",
        "Growth between the smallest and largest N (log-log slope < 0.25: flat; > 0.75: linear).",
        "",
        "| profile | figure | growth |",
        "|---|---|---|",
        *scale_rows,
    ]
    if plot_name:
        out += ["", f"![open time and RSS vs N]({plot_name})"]
    return out


def render(run: LibraryRun, cmd: str, plot_name: str | None = None) -> str:
    """The library section of docs/BENCHMARKS.md for ``run``; ``cmd`` is the command shown to regenerate it and
    ``plot_name`` the chart (beside the doc) to link, if one was drawn."""
    pf = run.prefetch
    assert pf is not None, "the prefetch figures are part of every run"
    sections = [_head(run, cmd), _l1_open(run), _l3_reads(run), _l4_prefetch(pf), _l5_incremental(run),
                _l6_scaling(run, plot_name)]
    out: list[str] = []
    for i, lines in enumerate(sections):
        out += ([""] if i else []) + lines
    return "\n".join(out) + "\n"
