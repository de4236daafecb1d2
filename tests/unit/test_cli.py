"""Tests of ``python -m dataset_cache`` (dataset_cache.cli): info, verify, convert, exit codes and messages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dataset_cache.cli import main
from dataset_cache.format import open_cache

REPO = Path(__file__).resolve().parents[2]


def save_comfy_pickle(folder: Path, n: int, shard_size: int = 2) -> Path:
    """A small upstream-layout SaveTrainingDataset folder (torch.save shards + metadata.json)."""
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    latents = [{"samples": torch.randn(1, 4, 8, 8, generator=g)} for _ in range(n)]
    conds = [[[torch.randn(1, 7, 16, generator=g), {"pooled_output": torch.randn(1, 16, generator=g)}]]
             for _ in range(n)]
    num_shards = (n + shard_size - 1) // shard_size
    for k in range(num_shards):
        with open(folder / f"shard_{k:04d}.pkl", "wb") as f:
            torch.save({"latents": latents[k * shard_size:(k + 1) * shard_size],
                        "conditioning": conds[k * shard_size:(k + 1) * shard_size]}, f)
    (folder / "metadata.json").write_text(json.dumps(
        {"num_samples": n, "num_shards": num_shards, "shard_size": shard_size}, indent=2))
    return folder


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    src = save_comfy_pickle(tmp_path / "src", 5)
    assert main(["convert", str(src), str(tmp_path / "cache"), "--shard-mb", "1"]) == 0
    return tmp_path / "cache"


def test_convert_prints_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = save_comfy_pickle(tmp_path / "src", 3)
    assert main(["convert", str(src), str(tmp_path / "cache"), "--name", "faces"]) == 0
    out = capsys.readouterr().out
    assert "converted 3 comfy-pickle sample(s)" in out and "dataset 'faces'" in out and "6 new entries" in out
    with open_cache(tmp_path / "cache") as reader:
        assert len(reader.dataset("faces")) == 3


def test_info_on_cache_prints_stats_json(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["info", str(cache)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["type"] == "streamcache" and info["version"] == 1
    assert info["entries"] == 10 and info["datasets"] == {"default": 5}
    assert info["shards"] >= 1 and info["bytes"] > 0


def test_info_on_comfy_folder_says_what_it_is(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = save_comfy_pickle(tmp_path / "src", 3)
    assert main(["info", str(src)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["type"] == "comfy-pickle" and info["samples"] == 3 and info["shards"] == 2
    assert "convert" in info["description"] and info["metadata"]["shard_size"] == 2


def test_verify_ok(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["verify", str(cache)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: 10 entries in ") and out.count("\n") == 1


def test_verify_names_each_bad_entry_and_its_shard(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with open_cache(cache) as reader:
        samples = reader.dataset("default")
    shards = sorted((cache / "shards").iterdir())
    shard = max(shards, key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # the last bytes are tensor data, past the header
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["verify", str(cache)]) == 1
    captured = capsys.readouterr()
    bad = [ln for ln in captured.out.splitlines() if ln.startswith("BAD ")]
    assert bad and all(shard.name in ln for ln in bad)
    keys = {k for s in samples for k in (s.latent, *s.captions)}
    assert any(ln.split()[2] in keys for ln in bad), bad
    assert "checksum mismatch" in captured.out and "verify failed" in captured.err
    assert "Traceback" not in captured.err


def test_verify_on_comfy_folder_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = save_comfy_pickle(tmp_path / "src", 1)
    assert main(["verify", str(src)]) == 2
    assert "has no checksums to verify" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["info", "{tmp}/missing"], "manifest.json is missing"),
    (["verify", "{tmp}/missing"], "manifest.json is missing"),
    (["convert", "{tmp}/missing", "{tmp}/cache"], "no such directory"),
    (["convert", "{tmp}", "{tmp}/cache"], "not a ComfyUI dataset folder"),
    (["convert", "{tmp}", "{tmp}/cache", "--shard-mb", "0"], "--shard-mb must be at least 1"),
])
def test_expected_errors_exit_2_without_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  argv: list[str], message: str) -> None:
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_convert_of_damaged_source_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = save_comfy_pickle(tmp_path / "src", 3)
    (src / "shard_0001.pkl").write_bytes(b"garbage")
    assert main(["convert", str(src), str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err
    assert "shard_0001.pkl" in err and "Traceback" not in err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["clean", "x"]) == 2  # reserved for later, not registered
    assert main(["bench", "--runs", "x"]) == 2  # registered now: a bad option, not the whole benchmark
    assert "invalid" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "convert" in capsys.readouterr().out


def test_verbose_logs_progress(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = save_comfy_pickle(tmp_path / "src", 3)
    assert main(["-v", "convert", str(src), str(tmp_path / "cache")]) == 0
    assert "converted shard_0001.pkl" in capsys.readouterr().err


def test_python_m_dataset_cache_info_subprocess(cache: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "dataset_cache", "info", str(cache)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["datasets"] == {"default": 5}


def test_verify_reports_damaged_headers_and_manifest(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shard = sorted((cache / "shards").iterdir())[0]
    shard.write_bytes(shard.read_bytes()[:40])  # truncated inside the header
    capsys.readouterr()
    assert main(["verify", str(cache)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("BAD ") and shard.name in out
    (cache / "manifest.json").write_text("{broken")
    assert main(["verify", str(cache)]) == 1
    assert "manifest.json" in capsys.readouterr().out
    assert main(["info", str(cache)]) == 2  # info cannot describe it: bad input, not a verify finding
