"""Caption randomness that kohya draws per step and the cache holds as variants: tag dropout (a share of the
shuffled versions of each line leaves each tag out) and wildcards (each combination of a line's ``{a|b}`` options is
a text). Both are draws: a line's texts keep their repeats and every caption line of a sample weighs alike.

Encoders are the counting fakes of ``support.fake_encoders``; folders are written here with Pillow.
"""

from __future__ import annotations

import math
import re
import os
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from dataset_cache.buckets import BucketConfig
from dataset_cache.caption_wildcards import expand_wildcards, has_wildcards, wildcard_count, wildcard_notes
from dataset_cache.captions import MAX_CAPTION_VARIANTS, MAX_TAG_DROPOUT, drop_tags, shuffle_tags
from dataset_cache.encode_settings import EncodeSettings
from dataset_cache.encode_plan import plan_encode
from dataset_cache.encode_run import run_encode
from dataset_cache.errors import DatasetFolderError
from dataset_cache.format.reader import open_cache
from dataset_cache.keys import conditioning_key
from support.fake_encoders import FakeEncoders, age

BASE = EncodeSettings(bucket=BucketConfig(resolution=64, step=16, min_side=32), batch_size=2, mask_factor=8)


def _folder(root: Path, captions: dict[str, str]) -> Path:
    root.mkdir()
    for i, (stem, caption) in enumerate(captions.items()):
        arr = np.random.default_rng(i).integers(0, 256, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(arr, "RGB").save(root / f"{stem}.png")
        (root / f"{stem}.txt").write_text(caption, encoding="utf-8")
    age(root)
    return root


def _plan(folder: Path, cache: Path, settings: EncodeSettings) -> Any:
    return plan_encode(folder, cache, dataset="ds", settings=settings, vae_fingerprint="vae-1",
                       text_fingerprint="te-1")


def _build(folder: Path, cache: Path, settings: EncodeSettings) -> tuple[Any, FakeEncoders]:
    enc = FakeEncoders()
    return run_encode(_plan(folder, cache, settings), **enc.kw()), enc


def _stored(cache: Path) -> dict[str, Any]:
    with open_cache(cache) as reader:
        return {s.source: s for s in reader.dataset("ds")}


def _key(settings: EncodeSettings, text: str) -> str:
    return conditioning_key(settings.caption_text(text), "te-1")


# ------------------------------------------------------------------------------------------ wildcards

def test_wildcards_give_every_combination_in_order_with_literal_braces_and_weights() -> None:
    assert expand_wildcards("a {red|blue} {car|bike}", 16) == ("a red car", "a red bike", "a blue car",
                                                                "a blue bike")
    assert expand_wildcards("{{literal}} {x|y}", 16) == ("{literal} x", "{literal} y")
    assert expand_wildcards("{a|a|b}", 16) == ("a", "a", "b")  # an option written twice weighs twice (kohya)
    assert expand_wildcards("a {red|} car", 16) == ("a red car", "a  car")  # an empty option is a choice
    assert expand_wildcards("no groups, plain", 16) == ("no groups, plain",)
    for unpaired in ("a {red|blue car", "a red|blue} car", "{a|{b|c}}"):  # kept as written, never guessed at
        assert expand_wildcards(unpaired, 16) == (unpaired,) and wildcard_count(unpaired) == 1
        assert not has_wildcards(unpaired)
    assert wildcard_count("{a|b}{c|d|e}{f|g}") == 12 == len(expand_wildcards("{a|b}{c|d|e}{f|g}", 12))
    with pytest.raises(ValueError, match="13 wildcard combinations, above the limit of 12"):
        expand_wildcards("{a|b|c|d|e|f|g|h|i|j|k|l|m}", 12)
    assert has_wildcards("x {a|b}") and not has_wildcards("x {only}")


def test_wildcard_notes_name_braces_written_while_off_and_unpaired_ones_while_on() -> None:
    lines = [["a {red|blue} car", "plain"], ["a {red|blue} car"]]
    (off,) = wildcard_notes(False, lines)
    assert off.startswith("1 caption line(s) hold {a|b} wildcards") and "turn wildcards on" in off
    assert wildcard_notes(True, lines) == ()
    (unpaired,) = wildcard_notes(True, [["a {red|blue car"]])
    assert "brace without its pair" in unpaired and "{{ and }}" in unpaired
    assert wildcard_notes(False, [["a {red|blue car"]]) == ()


def test_wildcards_encode_each_combination_once_and_lines_weigh_alike(tmp_path: Path) -> None:
    """Two images share ``a {red|blue} car``: each combination is encoded once. An image with a line of 2
    combinations and a line of 3 holds 6 + 6 keys: each line is half of its draws, as kohya picks a line first."""
    folder = _folder(tmp_path / "data", {"x": "a {red|blue} car", "y": "a {red|blue} car",
                                         "z": "{one|two} dog\n{big|small|tiny} cat"})
    settings = replace(BASE, wildcards=True)
    report, enc = _build(folder, tmp_path / "cache", settings)
    assert sorted(enc.texts) == sorted(["a red car", "a blue car", "one dog", "two dog", "big cat", "small cat",
                                        "tiny cat"])
    stored = _stored(tmp_path / "cache")
    assert stored["x.png"].captions == (_key(settings, "a red car"), _key(settings, "a blue car"))
    counts = Counter(stored["z.png"].captions)
    assert len(stored["z.png"].captions) == 2 * math.lcm(2, 3)
    assert {counts[_key(settings, t)] for t in ("one dog", "two dog")} == {3}
    assert {counts[_key(settings, t)] for t in ("big cat", "small cat", "tiny cat")} == {2}
    assert report.variants["wildcards"] == 1 and "each combination of a caption line's" in report.summary()
    # the report shows what the first sample with several texts trains with, before any training
    assert "caption variants of x.png (2 of 2): 'a red car' · 'a blue car'" in report.summary()
    assert _plan(folder, tmp_path / "cache", settings).up_to_date


def test_wildcards_on_a_folder_without_groups_encode_nothing_and_off_notes_them(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "data", {"x": "plain, words", "y": "a {red|blue} car"})
    cache = tmp_path / "cache"
    report, enc = _build(folder, cache, BASE)
    assert sorted(enc.texts) == ["a {red|blue} car", "plain, words"]  # off: as written
    assert "caption variants of" not in report.summary()  # one text per image: nothing to show
    assert any("turn wildcards on" in n for n in _plan(folder, cache, BASE).notes)
    report, enc = _build(folder, cache, replace(BASE, wildcards=True))
    assert sorted(enc.texts) == ["a blue car", "a red car"] and enc.images == 0  # "plain, words" stays cached
    assert _stored(cache)["x.png"].captions == (_key(BASE, "plain, words"),)


def test_too_many_wildcard_combinations_leave_the_image_out_by_name(tmp_path: Path) -> None:
    big = " ".join("{a|b|c|d}" for _ in range(5))  # 4**5 = 1024 combinations
    folder = _folder(tmp_path / "data", {"big": big, "odd": "{a|b|c|d|e|f|g} x\n{a|b|c|d|e|f|g|h} y\n"
                                                             "{a|b|c|d|e|f|g|h|i} z", "ok": "{a|b} c"})
    plan = _plan(folder, tmp_path / "cache", replace(BASE, wildcards=True))
    reasons = {f.relpath: f.reason for f in plan.failures}
    assert f"more than {MAX_CAPTION_VARIANTS} caption variants" in reasons["big.png"]
    assert "lines give 7, 8, 9 caption variants, which weigh alike only as 3 × 504" in reasons["odd.png"]
    assert [s.source for s in plan.samples] == ["ok.png"]


# ------------------------------------------------------------------------------------------ tag dropout

@pytest.mark.parametrize("rate,variants", [(0.1, 8), (0.25, 8), (0.3, 5), (0.05, 16), (0.9, 4)])
def test_each_tag_is_left_out_of_its_share_of_the_versions(rate: float, variants: int) -> None:
    """Every movable tag is missing from floor or ceil of ``rate × variants`` versions (its expectation exact);
    kept tags never drop; what remains is the line's tags, in a shuffled order."""
    line = "ohwx, a, b, c, d, e, f, g"
    versions = drop_tags(line, variants, keep_tokens=1, rate=rate)
    assert len(versions) == variants
    for version in versions:
        tags = version.split(", ")
        assert tags[0] == "ohwx" and set(tags[1:]) <= set("abcdefg") and len(set(tags)) == len(tags)
    for tag in "abcdefg":
        missing = sum(tag not in v.split(", ") for v in versions)
        assert math.floor(rate * variants) <= missing <= math.ceil(rate * variants), (tag, missing)
    assert drop_tags(line, variants, 1, rate) == versions  # seeded by the line alone


def test_dropout_versions_cycle_few_orders_keep_repeats_and_are_the_same_in_another_process() -> None:
    one = drop_tags("solo", 8, 0, 0.25)
    assert Counter(one) == {"solo": 6, "": 2}  # two texts, the dropped one in 2 of 8 draws
    kept = drop_tags("ohwx, a", 4, 2, 0.5)
    assert kept == ("ohwx, a",) * 4  # keep_tokens keeps both
    same = drop_tags("x, x, y", 10, 0, 0.2)
    assert all(sorted(v.split(", ")) in (["x", "x", "y"], ["x", "y"], ["x", "x"], ["y"], ["x"]) for v in same)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from dataset_cache.captions import drop_tags; "
            "print(repr(drop_tags('ohwx, a, b, c, d', 8, 1, 0.3)))")
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parents[2])], capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "4242"})
    assert out.stdout.strip() == repr(drop_tags("ohwx, a, b, c, d", 8, 1, 0.3))


def test_settings_refuse_dropout_without_shuffles_and_describe_only_what_is_set() -> None:
    with pytest.raises(ValueError, match="shuffle_variants is 0: set shuffle_variants"):
        EncodeSettings(tag_dropout=0.1)
    for bad in (-0.1, MAX_TAG_DROPOUT + 0.01, "0.1", None):
        with pytest.raises(ValueError, match="tag_dropout must be a number"):
            EncodeSettings(shuffle_variants=4, tag_dropout=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="wildcards must be a bool"):
        EncodeSettings(wildcards=1)  # type: ignore[arg-type]
    assert "tag_dropout" not in BASE.describe() and "wildcards" not in BASE.describe()
    on = replace(BASE, shuffle_variants=4, tag_dropout=0.15, wildcards=True).describe()
    assert on["tag_dropout"] == 0.15 and on["wildcards"] is True
    shuffled = replace(BASE, shuffle_variants=3, keep_tokens=1)
    assert shuffled.caption_texts("ohwx, a, b, c") == tuple(shuffled.caption_text(t)
                                                           for t in shuffle_tags("ohwx, a, b, c", 3, 1))


def test_tag_dropout_encodes_only_captions_and_each_line_keeps_its_draws(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "data", {"x": "ohwx, red, round, shiny", "y": "ohwx, blue\nohwx, green, tall"})
    cache = tmp_path / "cache"
    shuffled = replace(BASE, shuffle_variants=4, keep_tokens=1)
    _build(folder, cache, shuffled)
    settings = replace(shuffled, tag_dropout=0.25)
    report, enc = _build(folder, cache, settings)
    assert enc.images == 0 and report.encoded_latents == 0 and report.encoded_conditionings > 0
    stored = _stored(cache)
    assert stored["x.png"].captions == tuple(_key(settings, t) for t in drop_tags("ohwx, red, round, shiny", 4, 1,
                                                                                    0.25))
    y = stored["y.png"].captions  # two lines of 4 draws each, repeats kept
    assert y == tuple(_key(settings, t) for line in ("ohwx, blue", "ohwx, green, tall")
                      for t in drop_tags(line, 4, 1, 0.25))
    assert "tag shuffles with tag dropout 0.25 per caption line" in report.summary()
    assert _plan(folder, cache, settings).up_to_date


def test_a_sourceless_dataset_refuses_other_draw_settings(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "data", {"x": "a {red|blue} car, shiny, new"})
    cache = tmp_path / "cache"
    settings = replace(BASE, wildcards=True, shuffle_variants=2, tag_dropout=0.5)
    _build(folder, cache, settings)
    shutil.rmtree(folder)
    assert _plan(folder, cache, settings).sourceless
    with pytest.raises(DatasetFolderError, match="encoded with other tag_dropout, wildcards than requested"):
        _plan(folder, cache, replace(BASE, shuffle_variants=2))


def test_many_lines_that_cannot_weigh_alike_are_named_briefly(tmp_path: Path) -> None:
    lines = "\n".join(f"line {i}" for i in range(300))  # 300 lines of one text each: 300 entries, past the limit
    folder = _folder(tmp_path / "data", {"many": lines})
    (failure,) = _plan(folder, tmp_path / "cache", replace(BASE, wildcards=True)).failures
    assert "its caption file's 300 lines give 1, 1, 1, 1, 1, 1, 1, 1, ... caption variants" in failure.reason
    assert len(failure.reason) < 400


# ------------------------------------------------------------------------------------------ keep_tokens_separator

def test_the_separator_keeps_the_head_in_front_and_the_tail_at_the_end() -> None:
    """kohya's example: ``1girl, hatsune miku, vocaloid ||| stage, microphone, white shirt, smile ||| best quality,
    rating: general``: only the middle tags move (or drop); the separator is never encoded, shuffled or not."""
    line = "1girl, hatsune miku, vocaloid ||| stage, microphone, white shirt, smile ||| best quality, rating: general"
    head, tail = ["1girl", "hatsune miku", "vocaloid"], ["best quality", "rating: general"]
    middle = {"stage", "microphone", "white shirt", "smile"}
    shuffled = replace(BASE, shuffle_variants=6, keep_tokens=1, keep_tokens_separator="|||")
    texts = shuffled.caption_texts(line)
    assert len(set(texts)) == 6
    for text in texts:
        tags = text.split(", ")
        assert tags[:3] == head and tags[-2:] == tail and set(tags[3:-2]) == middle and "|||" not in text
    dropped = replace(shuffled, tag_dropout=0.5).caption_texts(line)
    for text in dropped:
        tags = text.split(", ")
        assert tags[:3] == head and tags[-2:] == tail and set(tags[3:-2]) <= middle
    assert any(len(t.split(", ")) < 9 for t in dropped)
    plain = replace(BASE, keep_tokens_separator="|||")
    assert plain.caption_texts(line) == (", ".join([*head, "stage", "microphone", "white shirt", "smile", *tail]),)
    assert plain.caption_texts("no separator, here") == ("no separator, here",)  # as without it
    # a line without it shuffles after keep_tokens, exactly as with no separator set (its keys unchanged)
    assert shuffled.caption_texts("ohwx, a, b, c") == replace(shuffled, keep_tokens_separator="").caption_texts(
        "ohwx, a, b, c")


def test_a_separator_in_no_line_is_noted_and_bad_separators_are_refused(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "data", {"x": "ohwx, red, round"})
    notes = _plan(folder, tmp_path / "cache", replace(BASE, keep_tokens_separator="|||")).notes
    assert any(n.startswith("keep_tokens_separator '|||' is in no caption line") for n in notes)
    for bad in (",", " ", "a,b", "{", "x" * 17, "a\nb"):
        with pytest.raises(ValueError, match="keep_tokens_separator"):
            EncodeSettings(keep_tokens_separator=bad)
    assert "keep_tokens_separator" not in BASE.describe()
    assert replace(BASE, keep_tokens_separator="|||").describe()["keep_tokens_separator"] == "|||"


def test_a_line_the_separator_leaves_one_tag_to_move_is_named_with_the_separator(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "data", {"x": "ohwx ||| red ||| round, shiny"})
    settings = replace(BASE, shuffle_variants=2, keep_tokens_separator="|||")
    notes = _plan(folder, tmp_path / "cache", settings).notes
    assert any("cannot be shuffled: keep_tokens 0 (or keep_tokens_separator '|||') keeps all their tags in place"
               in n for n in notes), notes
    assert settings.caption_texts("ohwx ||| red ||| round, shiny") == ("ohwx, red, round, shiny",)


@pytest.mark.parametrize("settings", [
    replace(BASE, wildcards=True), replace(BASE, wildcards=True, shuffle_variants=5, keep_tokens=1),
    replace(BASE, shuffle_variants=4, tag_dropout=0.3), replace(BASE, wildcards=True, shuffle_variants=3,
                                                                tag_dropout=0.5, keep_tokens_separator="|||"),
    replace(BASE, shuffle_variants=8, wildcards=True, keep_tokens_separator="|||")])
def test_the_variant_count_is_the_number_of_texts_a_line_gives(settings: EncodeSettings) -> None:
    """The limit counts a line's texts without making them (planning a folder would make them twice): the count
    must be what caption_texts makes, line by line."""
    from dataset_cache.captions import _line_variants

    lines = ["ohwx, {red|blue|green} ball, shiny", "a, b", "solo", "x ||| {a|b}, c, d ||| e", "one, one, two",
             "{a|b} {c|d}, e, f, g, h"]
    for line in lines:
        assert _line_variants(line, settings) == len(settings.caption_texts(line)), line


# ------------------------------------------------------------------------------------------ secondary_separator

def test_a_secondary_separators_group_moves_and_drops_as_one_tag_and_is_encoded_as_a_comma() -> None:
    """kohya's secondary_separator: "hatsune miku;;;vocaloid" is one tag of the shuffle and of tag dropout, and
    every text (shuffled, dropped or as written) has the marker replaced by "," (kohya's caption_separator)."""
    line = "1girl, hatsune miku;;;vocaloid, smile, outdoors"
    shuffled = replace(BASE, shuffle_variants=6, keep_tokens=1, secondary_separator=";;;")
    texts = shuffled.caption_texts(line)
    assert len(texts) == 6 and all(t.startswith("1girl, ") for t in texts)
    assert all(";;;" not in t and "hatsune miku,vocaloid" in t for t in texts)
    assert sorted(t.split(", ")[1:] for t in texts) == sorted(  # the same orders as the group written as one tag
        t.split(", ")[1:] for t in replace(shuffled, secondary_separator="").caption_texts(
            "1girl, hatsune miku,vocaloid-group, smile, outdoors")) or all(
        len(t.split(", ")) == 4 for t in texts)
    dropped = replace(shuffled, tag_dropout=0.5).caption_texts(line)
    assert all(("hatsune miku" in t) == ("vocaloid" in t) for t in dropped)  # dropped together or kept together
    plain = replace(BASE, secondary_separator=";;;")
    assert plain.caption_texts(line) == ("1girl, hatsune miku,vocaloid, smile, outdoors",)
    both = replace(BASE, shuffle_variants=2, keep_tokens_separator="|||", secondary_separator=";;;")
    assert all(t.startswith("a,b, ") for t in both.caption_texts("a;;;b ||| c, d, e"))


@pytest.mark.parametrize(("settings", "message"), [
    ({"secondary_separator": ","}, "secondary_separator ',': use a few characters that are no comma"),
    ({"secondary_separator": "{;}"}, "secondary_separator '{;}': use a few characters that are no comma, brace"),
    ({"keep_tokens_separator": "|||", "secondary_separator": "||"}, "keep_tokens_separator '|||' and "
                                                                    "secondary_separator '||': one holds the other"),
])
def test_a_secondary_separator_that_cannot_be_told_apart_is_refused(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        replace(BASE, **settings)


def test_the_report_says_when_no_line_holds_the_secondary_separator(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "data", {"a": "1girl, smile", "b": "1boy, hatsune miku;;;vocaloid"})
    assert not any("secondary_separator" in n for n in _plan(folder, tmp_path / "c1", replace(
        BASE, secondary_separator=";;;")).notes)
    notes = _plan(folder, tmp_path / "c2", replace(BASE, secondary_separator="##")).notes
    assert "secondary_separator '##' is in no caption line: every tag is its own" in notes
    assert replace(BASE, secondary_separator=";;;").describe()["secondary_separator"] == ";;;"
    assert "secondary_separator" not in BASE.describe()
