"""``python -m dataset_cache``: inspect, verify and convert caches from the command line.

Subcommands:

* ``info PATH`` — JSON summary of a cache (format version, entries, shards, bytes, datasets and each dataset's
  variants: entries and bytes per role, :mod:`.variants`), or of a ComfyUI
  ``SaveTrainingDataset`` folder (which layout it is, how many samples and shards).
* ``verify PATH`` — reads every stored tensor and checks every checksum; exit 1 naming each bad entry and its
  shard file, exit 0 with a one-line summary when the cache is healthy.
* ``convert SRC DST [--name N]`` — converts a ComfyUI dataset folder into a cache (see :mod:`.interop`).
* ``push CACHE URL`` — publishes a local cache to object storage (``s3://``, ``gs://``, ``az://``): shards and
  dataset files under content-addressed names, never overwritten, the manifest last (:mod:`.remote.publish`).
* ``pull URL CACHE [--dataset NAME ...]`` — copies a remote cache's datasets (all, or those named) into a local
  cache, every row verified.
* ``info`` and ``verify`` take a cache URL as well as a folder (reading a URL needs the remote extra).
* ``clean PATH [--dry-run]`` — removes entries no dataset references, compacts underfull shards and deletes
  orphan files (:mod:`.clean`); refuses (exit 2) while another process encodes into or reads the cache.
  ``--dry-run`` only prints what would be removed.
* ``bench [--quick|--smoke] [--sd15 N,N] [--flux N,N] [--runs R] [--no-doc]`` — library benchmarks on synthetic
  SD1.5- and Flux-sized caches (open vs the lazy-branch design, batch reads vs safe_open and raw reads, prefetch
  overlap, incremental encode, validation, scaling); prints markdown tables and rewrites the library section of
  ``docs/BENCHMARKS.md``. The benchmarks are the repository's ``bench`` package (``bench/library.py``), not part
  of the library: this command only hands its arguments over, from the pack root of a git checkout (an install
  from the registry has no ``bench/``: exit 2). Figures that need ComfyUI come from ``scripts/bench-comfy``.

Exit codes: 0 success; 1 ``verify`` found damage; 2 bad usage or input (missing path, not a cache, damaged
source). Expected errors print one ``error: ...`` line on stderr, never a traceback; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .constants import DEFAULT_SHARD_BYTES
from .errors import CacheCorruptError, CacheError, CacheNotFoundError
from .units import format_bytes

__all__ = ["main", "build_parser"]

log = logging.getLogger("dataset_cache.cli")

EXIT_OK = 0
EXIT_VERIFY_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time (tests and callers may swap it)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ assigns it
        pass


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser (separate so docs and tests can render ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m dataset_cache",
        description="Inspect, verify, convert and publish ComfyUI-StreamCache dataset caches.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("info", help="print a JSON summary of a cache or a ComfyUI dataset folder")
    p.add_argument("path", help="cache directory or URL, or ComfyUI SaveTrainingDataset folder")
    p.set_defaults(run=_cmd_info)

    p = sub.add_parser("verify", help="read every entry and check every checksum (exit 1 on damage)")
    p.add_argument("path", help="cache directory or URL")
    p.set_defaults(run=_cmd_verify)

    p = sub.add_parser("push", help="publish a cache to object storage (content-addressed, the manifest last)")
    p.add_argument("cache", type=Path, help="local cache directory")
    p.add_argument("url", help="where to publish it: s3://bucket/prefix, gs://..., az://container/prefix")
    p.set_defaults(run=_cmd_push)

    p = sub.add_parser("pull", help="copy the datasets of a cache in object storage into a local cache")
    p.add_argument("url", help="the remote cache: s3://..., gs://..., az://..., https://...")
    p.add_argument("cache", type=Path, help="local cache directory (created if missing; entries it has are kept)")
    p.add_argument("--dataset", action="append", metavar="NAME",
                   help="copy only this dataset (repeat for several; default: every dataset)")
    p.set_defaults(run=_cmd_pull)

    p = sub.add_parser("convert", help="convert a ComfyUI SaveTrainingDataset folder into a cache")
    p.add_argument("src", type=Path, help="ComfyUI dataset folder (shard_*.pkl or shard_*.safetensors)")
    p.add_argument("dst", type=Path, help="cache directory (created if missing; existing entries are reused)")
    p.add_argument("--name", default="default",
                   help="name of the dataset written into the cache (default: %(default)s)")
    p.add_argument("--shard-mb", type=int, default=DEFAULT_SHARD_BYTES >> 20, metavar="MB",
                   help="target size of new cache shards in MiB (default: %(default)s)")
    p.set_defaults(run=_cmd_convert)

    p = sub.add_parser("clean", help="remove entries no dataset references and orphan files; compact shards")
    p.add_argument("path", type=Path, help="cache directory")
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    p.add_argument("--repair", action="store_true",
                   help="also verify every shard and take damaged ones out of the cache, moving their files to "
                        "damaged/ (never deleted); without it damaged shards are only reported")
    p.set_defaults(run=_cmd_clean)

    # Every argument after ``bench`` goes to the benchmark's own parser (its options and --help live there, in the
    # repository's bench/ package): no prefix character is one, so argparse takes them all as bench_args.
    p = sub.add_parser("bench", help="run the library benchmarks and update docs/BENCHMARKS.md "
                                     "(from a git checkout; `bench --help` for its options)",
                       add_help=False, prefix_chars="\0")
    p.add_argument("bench_args", nargs="*", metavar="ARGS")
    p.set_defaults(run=_cmd_bench)
    return parser


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def _cmd_info(args: argparse.Namespace) -> int:
    from .comfy_folders import detect_comfy_dataset, inspect_comfy_dataset
    from .remote.urls import is_remote_url

    if not is_remote_url(args.path) and detect_comfy_dataset(Path(args.path)):
        info = inspect_comfy_dataset(Path(args.path))
        _print_json({
            "type": info.layout,
            "description": "ComfyUI SaveTrainingDataset folder (not a StreamCache cache); convert it with "
                           f"`python -m dataset_cache convert {args.path} <cache>`",
            "samples": info.num_samples,
            "shards": len(info.shards),
            "bytes": info.bytes,
            "metadata": info.metadata,
        })
        return EXIT_OK
    from .variants import summarize_datasets

    try:
        reader = _open_arg(args.path, verify=False)
    except CacheNotFoundError as exc:
        if is_remote_url(args.path):
            raise
        raise CacheNotFoundError(f"{exc} (nor is it a ComfyUI SaveTrainingDataset folder)") from None
    with reader:
        variants = {name: {"error": str(v)} if isinstance(v, CacheError) else v.describe()
                    for name, v in summarize_datasets(reader).items()}
        _print_json({"type": "streamcache", **reader.stats(), "variants": variants})
    return EXIT_OK


def _open_arg(path: str, **kwargs: Any) -> Any:
    """Open the cache a command names (a folder or a URL); a bad URL is a usage error."""
    from .format.reader import open_cache

    try:
        return open_cache(path, **kwargs)
    except ValueError as exc:
        if isinstance(exc, CacheError):
            raise
        raise CacheError(str(exc)) from None


def _cmd_verify(args: argparse.Namespace) -> int:
    from .comfy_folders import detect_comfy_dataset
    from .remote.urls import is_remote_url

    layout = None if is_remote_url(args.path) else detect_comfy_dataset(Path(args.path))
    if layout:
        raise CacheError(f"{args.path}: a ComfyUI dataset folder ({layout}) has no checksums to verify; "
                         f"convert it with `python -m dataset_cache convert {args.path} <cache>`")
    start = time.perf_counter()
    try:
        reader = _open_arg(args.path, verify=True, strict=False)
    except CacheCorruptError as exc:  # the manifest or journal itself: a verify finding, not a usage error
        _report_bad([exc])
        return EXIT_VERIFY_FAILED
    with reader:
        problems = reader.verify()
        stats = reader.stats()
    if problems:
        _report_bad(problems)
        return EXIT_VERIFY_FAILED
    sys.stdout.write(
        f"OK: {stats['entries']} entries in {stats['shards']} shards ({format_bytes(stats['bytes'])}), "
        f"{len(stats['datasets'])} dataset(s), every checksum matches ({time.perf_counter() - start:.2f}s)\n"
    )
    return EXIT_OK


def _report_bad(problems: Sequence[CacheError]) -> None:
    entries: set[str] = set()
    for exc in problems:  # CacheCorruptError or CacheUnreadableError: both name a path, a reason and the entry
        entry = getattr(exc, "entry", None)
        where = f"entry {entry}" if entry else "(no entry)"
        sys.stdout.write(f"BAD {where} in {getattr(exc, 'path', '?')}: {getattr(exc, 'reason', exc)}\n")
        if entry:
            entries.add(entry)
    sys.stderr.write(f"verify failed: {len(problems)} problem(s), {len(entries)} bad entr"
                     f"{'y' if len(entries) == 1 else 'ies'}; re-encode them or rebuild the cache\n")


def _cmd_convert(args: argparse.Namespace) -> int:
    from .interop import convert_comfy_dataset

    if args.shard_mb < 1:
        raise CacheError(f"--shard-mb must be at least 1, got {args.shard_mb}")
    rep = convert_comfy_dataset(args.src, args.dst, name=args.name, shard_bytes=args.shard_mb << 20)
    sys.stdout.write(
        f"converted {rep.source_samples} {rep.layout} sample(s) from {rep.source} into dataset {rep.dataset!r} "
        f"of {rep.dest}: {rep.samples} sample(s), {rep.new_entries} new entries, {rep.reused_entries} reused "
        f"({rep.seconds:.2f}s)\n"
    )
    return EXIT_OK


def _cmd_push(args: argparse.Namespace) -> int:
    from .remote.publish import push

    try:
        report = push(args.cache, args.url, on_file=lambda name: log.info("uploading %s", name))
    except ValueError as exc:  # a bad URL (CacheError subclasses keep their own message)
        if isinstance(exc, CacheError):
            raise
        raise CacheError(str(exc)) from None
    sys.stdout.write(report.summary() + "\n")
    return EXIT_OK


def _cmd_pull(args: argparse.Namespace) -> int:
    from .remote.publish import pull

    try:
        results = pull(args.url, args.cache, datasets=args.dataset,
                       on_dataset=lambda name: log.info("copying dataset %r", name))
    except KeyError as exc:  # a --dataset the remote cache does not have
        raise CacheError(str(exc.args[0])) from None
    except ValueError as exc:
        if isinstance(exc, CacheError):
            raise
        raise CacheError(str(exc)) from None
    for name, result in results.items():
        sys.stdout.write(f"dataset {name!r}: {result.samples} sample(s), {result.added} new entries in "
                         f"{args.cache}\n")
    return EXIT_OK


def _cmd_clean(args: argparse.Namespace) -> int:
    from .clean import clean

    report = clean(args.path, dry_run=args.dry_run, repair=args.repair)
    sys.stdout.write(report.summary() + "\n")
    return EXIT_OK


def _cmd_bench(args: argparse.Namespace) -> int:
    """Hand over to ``bench.library.main`` (imported only here: the library does not depend on its benchmarks)."""
    import importlib

    try:
        bench = importlib.import_module("bench.library")
    except ModuleNotFoundError as exc:
        if exc.name not in ("bench", "bench.library"):
            raise  # a dependency of the benchmarks is missing: its own error says which
        raise CacheError(
            "the benchmarks are not here: `python -m dataset_cache bench` runs the repository's bench/ package, "
            "which an installed pack does not have (the registry archive leaves it out); run it from the root "
            "folder of a git checkout of ComfyUI-StreamCache") from None
    try:
        return int(bench.main(args.bench_args))
    except SystemExit as exc:  # the benchmark's parser printed usage (code 2) or help (code 0)
        if isinstance(exc.code, str):
            sys.stderr.write(f"error: {exc.code}\n")
            return EXIT_USAGE
        return int(exc.code or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line and return the exit code (never raises for expected errors).

    Args:
        argv: arguments without the program name; ``None`` reads ``sys.argv[1:]``.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed usage (code 2) or help (code 0)
        return int(exc.code or 0)
    handler = _CurrentStderr()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("dataset_cache")
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO if args.verbose else logging.WARNING)
    try:
        return args.run(args)
    except (CacheError, OSError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return EXIT_INTERRUPTED
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
