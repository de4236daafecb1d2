"""Train LoRA on CUDA trains the LoRA the CPU trains (#24 item 1), through the real ComfyUI.

This suite's ComfyUI runs on the CPU, so the runs happen in child processes (``support.device_training``,
``support.train_child``): one ComfyUI on the CPU and one on CUDA each train every case of
:data:`~support.device_training.CASES` for 3 steps through the pack's Train LoRA node, from the same tiny model files
and caches, in fp32 (weights loaded in fp32, TF32 off on CUDA for matmuls and cuDNN). Each case takes branches of
the trainer on the device: image and video latents, conditionings with their extras (SDXL's pooled output, Flux's
guidance, Flux Kontext's reference latents, Lumina 2's attention masks and its rows run as separate model calls),
loss masks with mirrored rows, regularization rows with their loss weight, batches holding rows of two caches, AdamW
(the node's default optimizer), Prodigy with adapters of another alpha, and a LoRA the node creates itself. The
children record the LoRA, every LoRA parameter before the first step, every gradient the optimizer saw, the losses
(the validation's too) and each batch's plan and devices.

Without a GPU the CUDA test skips; the same harness then runs with both children on the CPU, where the computation is
the same and everything must be equal bit for bit, and against runs with a slightly different weighting, which the
comparison must reject: so the harness and the tolerances are proven on every run of the suite.

Tolerances (fp32 on both devices; u = 2⁻²⁴ ≈ 6e-8, the unit roundoff):

* The devices differ only in the order of their sums (cuBLAS/cuDNN against MKL/oneDNN tilings, reductions). A
  dot product of length K summed in two orders differs by at most γ_K = K·u times the sum of its terms' magnitudes,
  and typically by √K·u of it (independent roundings): K is at most 9216 here (Lumina 2's feed-forward; SDXL's 3×3
  convolutions of 640 channels: 5760), so √K·u ≈ 6e-6. A gradient passes through L ≲ 20 such products forward and
  backward, whose errors add: ≈ 1e-4 of the size of the terms. Hence:
* **losses**, the steps' and the validation's, agree to ``LOSS_RTOL`` = 1e-3 relative: the loss is a mean of
  squared errors of O(1) (latents and predictions are O(1)), so its relative error is about twice the
  prediction's, ≈ 2e-4.
* **gradients**, element by element, agree to ``GRAD_RTOL`` = 1e-3 of the largest gradient of their tensor, plus
  ``GRAD_FLOOR`` = 1e-4 of the largest gradient of the whole LoRA at that step. The first is the 1e-4 above with a
  margin of 10 (an element's error scales with the magnitudes of its tensor's terms, not with its own value, which
  can cancel to ~0). The second is for tensors whose gradient is itself a cancellation down to rounding noise:
  ComfyUI trains each LoRA's ``alpha`` (a scalar whose gradient sums every output of its layer) and norm and bias
  deltas; their largest gradient can be 1e-6 of the LoRA's largest, so their error is relative to the terms that
  cancelled, not to what is left. A CPU stand-in for "other kernels" (oneDNN convolutions off, 2 threads instead
  of 1) gave at most 3e-6 of a tensor's largest gradient for LoRA matrices and 1e-3 (but 1e-6 of the LoRA's
  largest) for an ``alpha``.
* **SGD's update** ``Δ = −lr Σ_t g_t`` (the final LoRA minus the initial one) agrees to ``lr`` times the sum of the
  steps' gradient tolerances, plus one rounding of ``p − lr·g`` per step (2⁻²³·|p|: the devices' kernels may round
  it differently; ``alpha``'s update is below its own ulp and is nothing but that rounding). After step 1 the
  parameters differ by those amounts only, so later gradients differ by the gradient tolerance again: every step's
  gradients are compared.
* **AdamW's update** is another matter: it divides each gradient by its own running size, so step 1 moves every
  element by ``lr·sign(g)`` whatever the gradient's size, and an element whose gradient is within rounding of 0
  moves by ``±lr`` with a sign that rounding decides. With gradients agreeing to a fraction ρ of their spread σ, a
  fraction ≈ 2ρ/√(2π) ≈ 0.8ρ of the elements can flip, each moving 2·lr the other way, so the updates differ by
  ≈ 2√(0.8ρ)·lr·√n in L2 norm for n elements, against an update of ≈ lr·√n per step: ≈ √ρ relative over 3 steps
  (3e-3 at ρ = 1e-5, 1e-2 at ρ = 1e-4; the CPU stand-in above gave 1.4e-5). The bound is ``ADAM_L2`` = 2e-2 of the
  CPU update's L2 norm; a step size off by 10% gives 1e-1, a gradient off by 1% anywhere ≈ 2√(0.8·0.01) ≈ 0.2. A
  flipped element changes the next gradients by more than rounding, so for AdamW only step 1's gradients are
  compared element by element (the parameters are equal then). Prodigy's update is Adam's times its step size, the
  same on both devices to the precision of two fp64 sums of those gradients: the same bound holds.

The initial LoRA must be equal bit for bit (a LoRA file, or drawn by the node from the seed), and so must the batches
(the sampler, noise and timesteps are drawn on the CPU whatever the device), including a LoRA the node creates on a
model ComfyUI loaded onto the GPU before training (``--highvram``): the trainer draws it again from the CPU's
generator (``comfy_parts.draw_new_adapters_on_cpu``), since ComfyUI's ``create_train`` draws on the weight's device.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from support.comfy_env import ComfyInstall
from support.device_training import CASES, Case, Run, load_run, prepare, run_children, variant

LOSS_RTOL = 1e-3
GRAD_RTOL = 1e-3
GRAD_FLOOR = 1e-4
ADAM_L2 = 2e-2
STEP_ROUNDING = 2.0 ** -23  # one rounding of p − lr·u, relative to |p|

TWIN = ("sd15_adamw", "sd15_fresh_lora", "sd15_masks_mirrors", "sd15_reg_two_caches", "flux_kontext_reference")
"""The cases the CPU twin trains (cheap ones: 2 cores are shared)."""
MUTANTS = {  # a twin case trained with a slightly different weighting: what a device bug would look like
    "sd15_masks_mirrors": {"unmasked_weight": 0.11},
    "sd15_reg_two_caches": {"reg_weight": 0.55},
    "sd15_adamw": {"learning_rate": 1.1e-4},
}
BY_NAME = {case.name: case for case in CASES}


# ------------------------------------------------------------------------------------------------ comparison
def _close(what: str, ref: Mapping[str, torch.Tensor], other: Mapping[str, torch.Tensor],
           atol: Mapping[str, float]) -> list[str]:
    """Every tensor of ``other`` within ``atol[key]`` of ``ref``'s, element by element."""
    if list(ref) != list(other):
        return [f"{what}: the keys differ ({sorted(set(ref) ^ set(other))[:4]})"]
    problems = []
    for key, value in ref.items():
        diff = float((other[key] - value).abs().max()) if value.numel() else 0.0
        if not diff <= atol[key]:  # NaN fails too
            problems.append(f"{what} of {key}: max |difference| {diff:.3e} > {atol[key]:.3e} "
                            f"(its largest value {float(value.abs().max()):.3e})")
    return problems


def _grad_atol(grads: Mapping[str, torch.Tensor]) -> dict[str, float]:
    largest = max(float(g.abs().max()) for g in grads.values())
    return {k: GRAD_RTOL * float(g.abs().max()) + GRAD_FLOOR * largest for k, g in grads.items()}


def _largest(tensors: Mapping[str, torch.Tensor], key: str) -> float:
    return float(tensors[key].abs().max()) if tensors[key].numel() else 0.0


def compare(case: Case, ref: Run, other: Run) -> list[str]:
    """What differs between two runs of ``case`` beyond the tolerances (see the module docstring); [] if nothing."""
    settings = case.settings()
    lr, steps, adam = settings["learning_rate"], settings["steps"], settings["optimizer"] != "SGD"
    problems = [f"initial LoRA: {key} differs" for key in ref.initial
                if key not in other.initial or not torch.equal(ref.initial[key], other.initial[key])]
    if ref.report["no_grad"] != other.report["no_grad"]:
        problems.append(f"parameters without a gradient differ: {ref.report['no_grad']} vs {other.report['no_grad']}")
    for step, (a, b) in enumerate(zip(ref.report["losses"], other.report["losses"], strict=True), 1):
        if not abs(a - b) <= LOSS_RTOL * abs(a):
            problems.append(f"loss of step {step}: {b!r} vs {a!r} (relative {abs(a - b) / abs(a):.2e})")
    if [s for s, _ in ref.report["val_losses"]] != [s for s, _ in other.report["val_losses"]]:
        problems.append(f"validation steps: {other.report['val_losses']} vs {ref.report['val_losses']}")
    for (step, a), (_, b) in zip(ref.report["val_losses"], other.report["val_losses"]):  # a loss, as the steps'
        if not abs(a - b) <= LOSS_RTOL * abs(a):
            problems.append(f"validation loss at step {step}: {b!r} vs {a!r} (relative {abs(a - b) / abs(a):.2e})")
    for step in range(1 if adam else steps):
        problems += _close(f"gradient of step {step + 1}", ref.grads[step], other.grads[step],
                           _grad_atol(ref.grads[step]))
    delta = {k: ref.lora[k] - ref.initial[k] for k in ref.lora}
    other_delta = {k: other.lora[k] - other.initial[k] for k in other.lora if k in other.initial}
    if adam:
        norm = math.sqrt(sum(float((d ** 2).sum()) for d in delta.values()))
        dist = math.sqrt(sum(float(((other_delta[k] - d) ** 2).sum()) for k, d in delta.items() if k in other_delta))
        if not dist <= ADAM_L2 * norm or set(other_delta) != set(delta):
            problems.append(f"AdamW update: L2 distance {dist:.3e} > {ADAM_L2} × the update's L2 norm {norm:.3e}")
        return problems
    tolerances = [_grad_atol(grads) for grads in ref.grads]
    atol = {k: lr * sum(t[k] for t in tolerances)
            + steps * STEP_ROUNDING * max(_largest(ref.initial, k), _largest(ref.lora, k)) * 2 for k in delta}
    return problems + _close("SGD update", delta, other_delta, atol)


# ------------------------------------------------------------------------------------------------ what ran
def _plans(run: Run) -> list[dict[str, Any]]:
    return [{k: v for k, v in batch.items() if k != "devices"} for batch in run.report["batches"]]


def _assert_on(run: Run, device: str) -> None:
    """Every batch of ``run`` reached the trainer on ``device``: latents, every conditioning tensor, masks."""
    for batch in run.report["batches"]:
        where = batch["devices"]
        assert where["latents"] == device and where["conditioning"] == [device], batch
        assert where["masks"] in (None, device), batch


def _assert_covers(case: Case, planned: dict[str, Any], run: Run) -> None:
    """The batches took the branches the case is for."""
    batches = run.report["batches"]
    assert len(run.report["losses"]) == case.settings()["steps"] and batches
    for what in case.expect:
        if what == "saved":
            assert "saved the LoRA at step 2 (" in run.report["summary"], run.report["summary"]
        elif what == "sampled":
            assert "sample images of 1 caption(s)" in run.report["summary"], run.report["summary"]
        elif what == "validated":
            steps = case.settings()["steps"]
            assert [s for s, _ in run.report["val_losses"]] == [0, steps], run.report["val_losses"]
        elif what == "mirrored_mask":
            assert any(b["mirrored"] and b["mask_keys"] and b["mirrored"][i] and b["mask_keys"][i] is not None
                       for b in batches for i in range(len(b["latent_keys"]))), "no mirrored row with a mask"
            assert any(b["mask_keys"] and None in b["mask_keys"] for b in batches), "no row without a mask beside one"
        elif what == "reg_rows":
            assert any(w != 1.0 for b in batches for w in b["weights"]), "no regularization row was trained"
        elif what == "two_caches":
            first, second = (set(keys) for keys in planned["cache_keys"])
            assert any(first & set(b["latent_keys"]) and second & set(b["latent_keys"]) for b in batches), \
                "no batch held rows of both caches"
        elif what == "groups":
            assert any(b["model_calls"] > 1 for b in batches), "no batch ran as several model calls"
        elif what == "video":
            assert all(len(b["latents"]) == 5 and b["latents"][2] > 1 for b in batches), "not clip latents"
        else:
            option = what.removeprefix("option:")
            assert all(option in b["options"] for b in batches), f"a batch without {option}"


def _load(outs: dict[str, Path], label: str, name: str) -> Run:
    run = load_run(outs[label], name)
    assert "error" not in run.report, f"{label} child, case {name}:\n{run.report['error']}"
    return run


# ------------------------------------------------------------------------------------------------ CUDA
@pytest.fixture(scope="module")
def cuda_runs(comfy_install: ComfyInstall, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[dict[str, Path], dict[str, dict[str, Any]]]:
    """Every case trained by a CPU child and a CUDA child at once (the CPU child takes the cores)."""
    folder = tmp_path_factory.mktemp("train_cuda")
    planned = prepare(CASES, folder / "data")
    cores = len(os.sched_getaffinity(0))
    outs = run_children(comfy_install.path, comfy_install.python, folder / "runs",
                        {"cpu": ("cpu", planned), "cuda": ("cuda", planned)},
                        {"cpu": max(1, cores - 2), "cuda": 2})
    return outs, {p["name"]: p for p in planned}


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_train_lora_on_cuda_trains_the_lora_the_cpu_trains(
        case: Case, cuda_runs: tuple[dict[str, Path], dict[str, dict[str, Any]]]) -> None:
    outs, planned = cuda_runs
    cpu, cuda = _load(outs, "cpu", case.name), _load(outs, "cuda", case.name)
    assert cuda.device["matmul_tf32"] is False and cuda.device["cudnn_tf32"] is False, cuda.device
    _assert_on(cpu, "cpu")
    _assert_on(cuda, "cuda")
    _assert_covers(case, planned[case.name], cpu)
    assert _plans(cuda) == _plans(cpu)
    apart = [k for k, v in cpu.initial.items() if k not in cuda.initial or not torch.equal(v, cuda.initial[k])]
    assert not apart, (f"{case.name}: the initial LoRA differs (adapters made on {cuda.report['adapters_on']}): "
                       f"{apart[:5]}")
    problems = compare(case, cpu, cuda)
    assert not problems, f"{case.name} on {cuda.device['name']}:\n" + "\n".join(problems[:20])


# ------------------------------------------------------------------------------------------------ the CPU twin
@pytest.fixture(scope="module")
def twin_runs(comfy_install: ComfyInstall, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[dict[str, Path], dict[str, dict[str, Any]]]:
    """The twin cases trained by two CPU children at once (one thread each); the second also trains the mutants."""
    folder = tmp_path_factory.mktemp("train_twin")
    planned = prepare(tuple(BY_NAME[name] for name in TWIN), folder / "data")
    by_name = {p["name"]: p for p in planned}
    mutants = [variant(by_name[name], f"{name}~mutant", **options) for name, options in MUTANTS.items()]
    outs = run_children(comfy_install.path, comfy_install.python, folder / "runs",
                        {"a": ("cpu", planned), "b": ("cpu", planned + mutants)}, {"cpu": 1, "cuda": 1})
    return outs, by_name


@pytest.mark.parametrize("name", TWIN)
def test_the_harness_trains_bit_identical_loras_in_two_cpu_children(
        name: str, twin_runs: tuple[dict[str, Path], dict[str, dict[str, Any]]]) -> None:
    """The same computation twice: every recorded tensor, loss and plan is equal, and the comparison agrees."""
    outs, planned = twin_runs
    case = BY_NAME[name]
    a, b = _load(outs, "a", name), _load(outs, "b", name)
    _assert_on(a, "cpu")
    _assert_covers(case, planned[name], a)
    timing = ("summary", "seconds")  # the node's summary says how fast it trained
    assert {k: v for k, v in a.report.items() if k not in timing} == \
        {k: v for k, v in b.report.items() if k not in timing}
    for what in ("initial", "lora"):
        ours, theirs = getattr(a, what), getattr(b, what)
        assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours), what
    assert len(a.grads) == case.settings()["steps"]
    for step, (ours, theirs) in enumerate(zip(a.grads, b.grads), 1):
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), f"gradients of step {step}"
    assert any(float(g.abs().max()) > 0 for g in a.grads[0].values())
    assert compare(case, a, b) == []


@pytest.mark.parametrize("name", list(MUTANTS))
def test_the_comparison_rejects_a_run_weighted_slightly_differently(
        name: str, twin_runs: tuple[dict[str, Path], dict[str, dict[str, Any]]]) -> None:
    """What a device bug would do (a mask weight, a row weight or the step size off by 10%) is beyond the
    tolerances: the comparison is sharp enough to catch it, and names what differs."""
    outs, _ = twin_runs
    case = BY_NAME[name]
    problems = compare(case, _load(outs, "a", name), _load(outs, "b", f"{name}~mutant"))
    kinds = {p.split(":")[0].split(" of ")[0] for p in problems}
    if "learning_rate" in MUTANTS[name]:  # the step size: the first step's gradients are equal, the update is not
        assert "AdamW update" in kinds and "gradient" not in kinds, problems
    else:
        assert {"loss", "gradient", "SGD update"} <= kinds, problems
