"""The package's public surface: every exported name exists, and nothing exported shadows a builtin."""

import builtins

import dataset_cache


def test_every_exported_name_resolves():
    missing = [n for n in dataset_cache.__all__ if not hasattr(dataset_cache, n)]
    assert missing == []


def test_exports_do_not_shadow_builtins():
    assert [n for n in dataset_cache.__all__ if hasattr(builtins, n)] == []


def test_library_errors_share_one_base_and_builtin_parents():
    assert issubclass(dataset_cache.CacheCorruptError, (dataset_cache.CacheError, ValueError))
    assert issubclass(dataset_cache.CacheNotFoundError, FileNotFoundError)
    assert issubclass(dataset_cache.UnstorableValueError, TypeError)
