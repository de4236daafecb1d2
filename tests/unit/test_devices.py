"""parse_devices: the ``devices`` setting of Train LoRA read into one rank per device, rank 0 on the home device."""

from __future__ import annotations

import os

import pytest

from dataset_cache.devices import DevicePlan, parse_devices


def cuda(spec, home_index=0, count=4):
    return parse_devices(spec, home="cuda", home_index=home_index, cuda_count=count)


@pytest.mark.parametrize("spec", [None, "auto", "AUTO", " auto ", ""])
def test_auto_is_every_visible_gpu_with_the_home_one_first(spec):
    assert cuda(spec) == DevicePlan("cuda", (0, 1, 2, 3))
    assert cuda(spec, home_index=2) == DevicePlan("cuda", (2, 0, 1, 3))
    assert cuda(spec, count=1).size == 1


@pytest.mark.parametrize("home", ["cpu", "mps", "xpu"])
def test_auto_without_cuda_home_is_one_device_as_before(home):
    plan = parse_devices("auto", home=home, home_index=None, cuda_count=2)
    assert plan == DevicePlan(home, (0,)) and plan.size == 1


def test_a_list_of_gpus():
    assert cuda("0,1") == DevicePlan("cuda", (0, 1))
    assert cuda("cuda:2, cuda:0") == DevicePlan("cuda", (0, 2))  # rank 0 is ComfyUI's own device
    assert cuda([3, 1], home_index=1) == DevicePlan("cuda", (1, 3))
    assert cuda("0").size == 1
    assert cuda("0,1").describe() == "cuda:0, cuda:1"


@pytest.mark.parametrize("spec,message", [
    ("0,7", "no CUDA device 7 .*sees 4"),
    ("0,0", "listed twice"),
    ("1,2", "must include 0"),
    ("0,x", "'x' is not a CUDA device index"),
    ("0;1", "is not a CUDA device index"),
    ([0, True], "whole numbers"),
])
def test_bad_lists_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        cuda(spec)


def test_gpu_lists_on_a_cpu_comfyui_are_refused():
    with pytest.raises(ValueError, match="trains on cpu, not on CUDA devices"):
        parse_devices("0,1", home="cpu", home_index=None, cuda_count=0)


def test_cpu_ranks_for_tests():
    cpu = dict(home="cpu", home_index=None, cuda_count=0)
    assert parse_devices("cpu:2", **cpu) == DevicePlan("cpu", (0, 1))
    assert parse_devices("cpu", **cpu).size == 1
    assert parse_devices("cpu:2", **cpu).describe() == "2 CPU processes"
    with pytest.raises(ValueError, match="cpu:N needs 1 <= N"):
        parse_devices(f"cpu:{(os.cpu_count() or 1) + 1}", **cpu)
    with pytest.raises(ValueError, match="whole number"):
        parse_devices("cpu:two", **cpu)
    with pytest.raises(ValueError, match="for testing on a ComfyUI started with --cpu"):
        parse_devices("cpu:2", home="cuda", home_index=0, cuda_count=2)


def test_ranks_joining_from_other_machines_follow_the_local_ones():
    cpu = dict(home="cpu", home_index=None, cuda_count=0)
    assert cuda("0,1 + 2 remote") == DevicePlan("cuda", (0, 1), 2)
    assert cuda("auto+1 REMOTE", home_index=2) == DevicePlan("cuda", (2, 0, 1, 3), 1)
    assert cuda(" + 3 remote", count=1) == DevicePlan("cuda", (0,), 3)  # nothing before '+': auto
    plan = parse_devices("cpu:1 + 1 remote", **cpu)
    assert plan == DevicePlan("cpu", (0,), 1) and (plan.size, plan.local) == (2, 1)
    assert plan.describe() == "cpu:0 and 1 rank on other machines"
    assert parse_devices("cpu:2 + 2 remote", **cpu).describe() == "2 CPU processes and 2 ranks on other machines"
    assert cuda("0").remote == 0


@pytest.mark.parametrize("spec,message", [
    ("0 + remote", "'\\+ N remote' with N from 1 to 64"),
    ("0 + 0 remote", "with N from 1 to 64"),
    ("0 + 65 remote", "with N from 1 to 64"),
    ("0 + two remote", "with N from 1 to 64"),
    ("0 + 2", "after '\\+', write 'N remote'"),
    ("0 + 1 remote + 1 remote", "after '\\+', write 'N remote'"),
    ("0,9 + 1 remote", "no CUDA device 9"),
])
def test_bad_remote_counts_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        cuda(spec)


def test_remote_ranks_join_cuda_or_cpu_runs_only():
    with pytest.raises(ValueError, match="trains on mps; ranks on other machines join CUDA or CPU runs only"):
        parse_devices("auto + 1 remote", home="mps", home_index=None, cuda_count=0)
