"""Variant reports and clean: what each role of a dataset costs, and variants no dataset uses are reclaimed."""

from __future__ import annotations

import json

import torch

from dataset_cache import CacheWriter, Sample, clean, open_cache, preview_clean, summarize_variants
from dataset_cache.cli import main


def _latent(v: float) -> dict:
    return {"samples": torch.full((1, 4, 8, 8), float(v))}  # 1 KiB of float32


def _cond(v: float) -> list:
    return [[torch.full((1, 3, 16), float(v)), {}]]  # 192 B


def _mask() -> dict:
    return {"mask": torch.full((1, 1, 8, 8), 255, dtype=torch.uint8)}  # 64 B


def _build(root, samples_of: dict[str, list[Sample]]) -> None:
    with CacheWriter(root) as w:
        for i in range(3):
            w.add(f"lat{i}", _latent(i), kind="latent")
            w.add(f"mir{i}", _latent(-i), kind="latent")
            w.add(f"mask{i}", _mask(), kind="mask")
            w.add(f"cap{i}", _cond(i), kind="conditioning")
            w.add(f"shuf{i}", _cond(-i), kind="conditioning")
        w.add("empty", _cond(0.5), kind="conditioning")
        for name, samples in samples_of.items():
            w.set_dataset(name, samples, info={"settings": {"bucket": {"flip": "random", "step": 64},
                                                            "shuffle_variants": 2, "batch_size": 4}})


def _full(i: int) -> Sample:
    return Sample(f"lat{i}", (f"cap{i}", f"shuf{i}"), 1, f"{i}.png", mirror=f"mir{i}", mask=f"mask{i}",
                  empty_caption="empty")


def test_summary_counts_each_role_once_with_its_bytes(tmp_path):
    samples = [_full(0), _full(1), Sample("lat2", ("cap2",), empty_caption="empty")]
    _build(tmp_path, {"d": samples})
    with open_cache(tmp_path) as r:
        s = summarize_variants(r, r.dataset("d"), r.datasets()["d"].info)
    d = s.describe()
    assert {role: (d[role]["entries"], d[role]["bytes"]) for role in s.roles} == {
        "latents": (3, 3 * 1024), "mirrors": (2, 2 * 1024), "masks": (2, 2 * 64),
        "captions": (5, 5 * 192), "empty_caption": (1, 192), "references": (0, 0)}
    assert not any(line.startswith("references") for line in s.lines())  # a role without entries is not listed
    assert s.settings == {"flip": "random", "shuffle_variants": 2}  # variant settings only
    assert s.has_variants
    assert "mirrors: 2 entries, 2.0 KiB" in s.lines()
    assert s.lines()[0] == "variant settings: shuffle_variants 2, flip random"


def test_reference_images_count_as_their_own_role(tmp_path):
    """An edit pair's reference latents (and their mirrors) are a role of their own, even when a reference is
    another sample's image."""
    samples = [Sample("lat0", ("cap0",), mirror="mir0", reference="lat1", reference_mirror="mir1"),
               Sample("lat1", ("cap1",), reference="lat2"), Sample("lat2", ("cap2",))]
    _build(tmp_path, {"d": samples})
    with open_cache(tmp_path) as r:
        s = summarize_variants(r, r.dataset("d"), r.datasets()["d"].info)
    assert (s.roles["references"].entries, s.roles["references"].bytes) == (3, 3 * 1024)
    assert s.has_variants and "references: 3 entries, 3.0 KiB" in s.lines()


def test_summary_counts_missing_entries_without_failing():
    class Headers:
        def __contains__(self, key: object) -> bool:
            return key != "gone"

        def entry_nbytes(self, key: str) -> int:
            return 10

    s = summarize_variants(Headers(), [Sample("lat", ("cap",), mirror="gone")])
    assert (s.roles["mirrors"].entries, s.roles["mirrors"].missing, s.roles["mirrors"].bytes) == (1, 1, 0)
    assert "(1 not in the cache)" in s.lines()[1] and "variant settings" not in s.lines()[0]
    assert not summarize_variants(Headers(), [Sample("lat", ("cap",))]).has_variants


def test_clean_reclaims_variants_no_dataset_uses(tmp_path):
    """A dataset re-stored without mirrors, masks and shuffles (flip back to none, ...) leaves those entries to
    clean; entries another dataset still names are kept."""
    _build(tmp_path, {"a": [_full(0), _full(1)], "b": [_full(1)]})
    assert preview_clean(tmp_path).unreferenced == ("cap2", "lat2", "mask2", "mir2", "shuf2")
    with CacheWriter(tmp_path) as w:  # "a" re-encoded plainly: no mirror, mask, shuffle or empty caption
        w.set_dataset("a", [Sample("lat0", ("cap0",), 1, "0.png"), Sample("lat1", ("cap1",), 1, "1.png")])
    unreferenced = set(preview_clean(tmp_path).unreferenced)
    assert {"mir0", "mask0", "shuf0"} <= unreferenced  # only "a" used them
    assert not {"mir1", "mask1", "shuf1", "empty"} & unreferenced  # "b" still does
    report = clean(tmp_path, dry_run=False)
    assert report.preview.unreferenced
    with open_cache(tmp_path) as r:
        assert {"mir0", "mask0", "shuf0"}.isdisjoint(r.keys())
        assert {"lat0", "cap0", "mir1", "mask1", "shuf1", "empty"} <= set(r.keys())
        assert r.verify() == []


def test_cli_info_lists_each_datasets_variants(tmp_path, capsys):
    _build(tmp_path, {"d": [_full(0)]})
    assert main(["info", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["variants"]["d"]["mirrors"] == {"entries": 1, "bytes": 1024, "missing": 0}
    assert out["variants"]["d"]["empty_caption"]["entries"] == 1
