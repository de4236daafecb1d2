"""The repository's benchmarks: one package, figures in docs/BENCHMARKS.md (not shipped: .comfyignore leaves
``bench/`` out of the registry archive).

Commands:

* ``python -m dataset_cache bench [--quick|--smoke]`` — the library benchmarks (:mod:`bench.library`; the CLI
  hands its arguments over), from the pack root under the project venv; rewrites the library section of
  docs/BENCHMARKS.md and ``docs/bench_open_library.png``.
* ``scripts/bench-comfy [--quick]`` — the benchmarks against the real ComfyUI (:mod:`bench.comfy_command`, started
  by :mod:`bench.run_comfyui` under ComfyUI's python); rewrites the ComfyUI section and ``docs/bench_comfy.png``.
* ``python -m bench.<name>`` from the pack root — the focused benchmarks that print their own tables:
  :mod:`bench.bench_format` (the cache format vs the lazy-branch design), :mod:`bench.bench_loader` (prefetch
  overlap and loader memory), :mod:`bench.bench_incremental` (incremental encode bookkeeping at scale),
  :mod:`bench.bench_validate` (validating an unchanged folder) and :mod:`bench.ab_read_path` (the read path of
  two source trees, A/B in one run).

Shared pieces: :mod:`bench.common` (synthetic datasets, the lazy-branch baseline, RSS/page-cache/machine helpers:
measuring only) and :mod:`bench.report` (number formatting, the doc's marked sections, PNG charts: reporting
only). Each benchmark measures into plain dataclasses first and renders Markdown from them afterwards.
"""
