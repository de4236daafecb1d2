"""Sample images during training (``sample_count``), on the real ComfyUI with the tiny SD1.5 (CPU, fp32).

The check of the sampler is ComfyUI's own: a new LoRA adds nothing before its first step (ComfyUI starts every
up matrix at 0), so the samples taken before the first step must be what ComfyUI's KSampler makes of the base
model with the same caption, noise, sampler and schedule (Euler over "simple" by default, and others). The rest:
a run with samples trains the same LoRA bit for bit, later samples show the LoRA, guidance is KSampler's, every
sampler of ComfyUI's runs, and the output blocks its users when no samples were asked for.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from types import ModuleType
from typing import Any

import pytest
import torch
from support.encoded import key, write_comfy_encoded

CAPTION = "a photo of test pattern number {}"
SIZES = [(64, 64)] * 4 + [(64, 96)] * 2  # (height, width): the 64×64 bucket has the most sources
RUN = {  # the node's required inputs
    "batch_size": 2, "grad_accumulation_steps": 1, "steps": 2, "learning_rate": 1e-2, "rank": 4,
    "optimizer": "AdamW", "loss_function": "MSE", "seed": 7, "training_dtype": "fp32", "lora_dtype": "fp32",
    "algorithm": "LoRA", "gradient_checkpointing": False, "checkpoint_depth": 1, "offloading": False,
    "existing_lora": "[None]", "prefetch_batches": 2, "loader_threads": 0,
}


def _module(pack: ModuleType, name: str) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.{name}")


@pytest.fixture(scope="module")
def node(pack: ModuleType) -> type:
    return _module(pack, "nodes.train_lora").TrainLoRA


@pytest.fixture(scope="module")
def dataset(pack: ModuleType, comfy_nodes: ModuleType, models: tuple, handles: ModuleType,
            tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Dataset "train" (6 samples, 2 buckets, no empty caption) and "guided": the same samples, each with the last
    sample's caption as the caption guidance pushes away from (the empty caption's place)."""
    _, clip, vae = models
    root = tmp_path_factory.mktemp("train_samples") / "cache"

    def guided(_cls: Any, samples: list[Any]) -> list[Any]:
        return [dataclasses.replace(s, empty_caption=samples[-1].captions[0]) for s in samples]

    write_comfy_encoded(pack, comfy_nodes, clip, vae, root, SIZES, seed=0, caption=CAPTION,
                        extra={"guided": guided})
    return handles.StreamDatasetHandle(str(root), "train"), handles.StreamDatasetHandle(str(root), "guided")


def _train(node: type, model: Any, dataset: Any, **options: Any) -> Any:
    with torch.inference_mode():  # ComfyUI executes every node under inference mode
        return node.execute(model, dataset, **{**RUN, **options})


def _summary(out: Any) -> str:
    (text,) = out.ui["text"] if isinstance(out.ui, dict) else out.ui.as_dict()["text"]
    return text


def _sampled_sources(out: Any) -> list[str]:
    """The sources the summary says were sampled, in order ("img2.png, img0.png")."""
    match = re.search(r"sample images of \d+ caption\(s\) \(([^)]*)\)", _summary(out))
    assert match, _summary(out)
    return match.group(1).split(", ")


def _ksampler(comfy_nodes: ModuleType, models: tuple, sources: list[str], seed: int, steps: int, cfg: float,
              negative_index: int | None = None) -> torch.Tensor:
    """ComfyUI's KSampler's images of the base model: each source's caption (CLIPTextEncode, as the cache holds
    it), Euler over the "simple" schedule, the noise the pack draws for that image (``(seed, "sample", latent
    key)``); ``negative_index``: the caption of that sample as the negative."""
    import comfy.sample

    from support.pack import import_pack

    seeding = importlib.import_module(f"{import_pack().__name__}.dataset_cache.seeding")
    model, clip, _ = models
    out = []
    for source in sources:
        i = int(source.removeprefix("img").removesuffix(".png"))
        (positive,) = comfy_nodes.CLIPTextEncode().encode(clip, CAPTION.format(i))
        negative = positive
        if negative_index is not None:
            (negative,) = comfy_nodes.CLIPTextEncode().encode(clip, CAPTION.format(negative_index))
        h, w = SIZES[i]
        noise = torch.randn((1, 4, h // 8, w // 8), generator=seeding.seeded_generator(seed, "sample", key(
            f"latent{i}")), dtype=torch.float32)
        out.append(comfy.sample.sample(model, noise, steps, cfg, "euler", "simple", positive, negative,
                                       torch.zeros_like(noise), seed=seed))
    return torch.cat(out)


def _ksampler_of(models: tuple, positive: Any, negative: Any, noise_key: str, steps: int, cfg: float,
                 shape: tuple[int, ...] = (1, 4, 8, 8), sampler: str = "euler", scheduler: str = "simple",
                 seed: int = RUN["seed"]) -> torch.Tensor:
    """KSampler's image of the base model for these conditionings and the pack's noise of ``noise_key``, with
    the seed the pack gives a sampler that adds noise as it goes (``(seed, "sample", noise_key)``'s)."""
    import comfy.sample

    from support.pack import import_pack

    seeding = importlib.import_module(f"{import_pack().__name__}.dataset_cache.seeding")
    noise = torch.randn(shape, generator=seeding.seeded_generator(seed, "sample", noise_key), dtype=torch.float32)
    return comfy.sample.sample(models[0], noise, steps, cfg, sampler, scheduler, positive, negative,
                               torch.zeros_like(noise), seed=seeding.derive_seed(seed, "sample", noise_key))


@pytest.mark.parametrize(("sampler", "scheduler", "cfg"), [
    ("dpmpp_2m", "karras", 1.0),  # a multistep sampler over another schedule
    ("uni_pc", "normal", 1.0),  # KSampler drops its penultimate sigma
    ("euler_ancestral", "beta", 1.0),  # noise added as it goes, from the seed
    ("dpmpp_2m_sde", "exponential", 2.5),  # Brownian-tree noise from the seed, with guidance
    ("euler_cfg_pp", "simple", 1.0),  # the negative's prediction at cfg 1 (ComfyUI's post-CFG hook)
])
def test_samplers_and_schedulers_are_ksamplers(node: type, models: tuple, dataset: tuple,
                                               comfy_nodes: ModuleType, sampler: str, scheduler: str,
                                               cfg: float) -> None:
    """sample_sampler and sample_scheduler give KSampler's image of that sampler and scheduler (before the first
    step the LoRA adds nothing), with the negative's call whenever KSampler makes it. Tolerance as above: the same
    fp32 operations in another grouping, over 4 steps."""
    clip = models[1]
    (prompt,) = comfy_nodes.CLIPTextEncode().encode(clip, "a red square on a blue field")
    (negative,) = comfy_nodes.CLIPTextEncode().encode(clip, "blurry")
    with torch.inference_mode():
        out = _train(node, models[0], dataset[0], steps=1, sample_count=1, sample_steps=4, sample_cfg=cfg,
                     sample_prompt=prompt, sample_negative=negative, sample_sampler=sampler,
                     sample_scheduler=scheduler)
        expected = _ksampler_of(models, prompt, negative, "sample_prompt:0", 4, cfg, sampler=sampler,
                                scheduler=scheduler)
        plain = _ksampler_of(models, prompt, negative, "sample_prompt:0", 4, cfg)
    torch.testing.assert_close(out.result[3]["samples"][:1], expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(expected, plain, atol=1e-3)  # the choice changed the image
    assert f"4 {sampler} steps ({scheduler} schedule)" in _summary(out)


def test_the_models_guidance_hooks_apply_as_in_ksampler(node: type, models: tuple, dataset: tuple,
                                                        comfy_nodes: ModuleType) -> None:
    """A model patched by ComfyUI's RescaleCFG node (its sampler_cfg_function) samples what KSampler makes of it
    at cfg 4 (tolerance as above), which differs from the unpatched model's images."""
    import comfy_extras.nodes_model_advanced

    (patched,) = comfy_extras.nodes_model_advanced.RescaleCFG().patch(models[0], 0.7)
    clip = models[1]
    (prompt,) = comfy_nodes.CLIPTextEncode().encode(clip, "a red square on a blue field")
    (negative,) = comfy_nodes.CLIPTextEncode().encode(clip, "blurry")
    with torch.inference_mode():
        out = _train(node, patched, dataset[0], steps=1, sample_count=1, sample_steps=3, sample_cfg=4.0,
                     sample_prompt=prompt, sample_negative=negative)
        expected = _ksampler_of((patched, *models[1:]), prompt, negative, "sample_prompt:0", 3, 4.0)
        plain = _ksampler_of(models, prompt, negative, "sample_prompt:0", 3, 4.0)
    torch.testing.assert_close(out.result[3]["samples"][:1], expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(expected, plain, atol=1e-3)


def test_every_comfyui_sampler_and_scheduler_runs_through_the_run(node: type, models: tuple, dataset: tuple,
                                                                  pack: ModuleType) -> None:
    """Every sampler of this ComfyUI's list samples through the run's model call (each takes what it needs from
    the guider: the model sampling, the model patcher, the guidance hooks), and every scheduler's noise levels
    are KSampler's own for every sampler (the same ComfyUI function: equal)."""
    import comfy.samplers

    samples = _module(pack, "nodes.training.samples")
    model = models[0]
    for scheduler in comfy.samplers.KSampler.SCHEDULERS:
        for sampler in ("euler", "uni_pc"):  # one that keeps every level, one whose penultimate KSampler drops
            expected = comfy.samplers.KSampler(model, 5, "cpu", sampler, scheduler).sigmas
            got = samples.sample_sigmas(model.get_model_object("model_sampling"), sampler, scheduler, 5)
            assert torch.equal(got, expected), (sampler, scheduler)
    with torch.inference_mode():
        for sampler in comfy.samplers.KSampler.SAMPLERS:
            out = _train(node, model, dataset[0], steps=1, sample_count=1, sample_steps=2, sample_sampler=sampler)
            latents = out.result[3]["samples"]
            assert latents.shape == (2, 4, 8, 8) and torch.isfinite(latents).all(), sampler
            assert f"2 {sampler} steps" in _summary(out)


def test_a_sampler_that_reseeds_torch_leaves_the_training_s_random_numbers(node: type, models: tuple,
                                                                          dataset: tuple) -> None:
    """ComfyUI's "ddim" reseeds torch's global generator; a run sampling with it every step trains the same LoRA
    and leaves the global generator where a run without samples does (from the same state)."""
    torch.manual_seed(11)
    plain = _train(node, models[0], dataset[0])
    after_plain = torch.get_rng_state()
    torch.manual_seed(11)
    sampled = _train(node, models[0], dataset[0], sample_count=1, sample_every=1, sample_steps=2,
                     sample_sampler="ddim")
    assert torch.equal(torch.get_rng_state(), after_plain)
    assert plain.result[1] == sampled.result[1]
    for k, v in plain.result[0].items():
        assert torch.equal(v, sampled.result[0][k]), k


def test_a_sample_size_of_the_users_is_ksamplers_image_at_that_size(node: type, models: tuple, dataset: tuple,
                                                                    comfy_nodes: ModuleType, pack: ModuleType,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """sample_width 96 × sample_height 80: KSampler's images of the base model at that size (latent 10 × 12,
    tolerance as above); larger than every training bucket (8 × 8 and 8 × 12 latents), so one image per model call
    (the model sees no batch larger than a training row's forward)."""
    loop = _module(pack, "nodes.training.loop").StepLoop
    predict, rows = loop.predict, []

    def counted(self: Any, x: torch.Tensor, sigma: torch.Tensor, groups: Any) -> torch.Tensor:
        if not torch.is_grad_enabled():  # the samples' calls (the training steps have gradients)
            rows.append(tuple(x.shape))
        return predict(self, x, sigma, groups)

    monkeypatch.setattr(loop, "predict", counted)
    (prompt,) = comfy_nodes.CLIPTextEncode().encode(models[1], "a red square on a blue field")
    with torch.inference_mode():
        out = _train(node, models[0], dataset[0], steps=1, sample_count=2, sample_steps=3, sample_prompt=prompt,
                     sample_width=96, sample_height=80)
        expected = torch.cat([_ksampler_of(models, prompt, prompt, f"sample_prompt:{i}", 3, 1.0,
                                           shape=(1, 4, 10, 12)) for i in range(2)])
    torch.testing.assert_close(out.result[3]["samples"][:2], expected, rtol=1e-4, atol=1e-4)
    assert set(rows) == {(1, 4, 10, 12)}
    assert "3 euler steps (simple schedule), 96×80 px" in _summary(out)
    rows.clear()
    with torch.inference_mode():  # no larger than the largest bucket: the batch's rows in one call
        _train(node, models[0], dataset[0], steps=1, sample_count=2, sample_steps=2, sample_prompt=prompt,
               sample_width=96, sample_height=64)
    assert set(rows) == {(2, 4, 8, 12)}


@pytest.mark.parametrize(("size", "message"), [
    ({"sample_width": 96}, "sample_width 96 and sample_height 0: set both"),
    ({"sample_width": 100, "sample_height": 64}, "sample_width 100 is not a multiple of 8, this model's latent "
                                                 "downscale: use "),
    ({"sample_width": 32, "sample_height": 32}, "sample_width must be 0 (the size of the captions' bucket) or a "
                                                "whole number of pixels from 64 to 8192, got 32"),
])
def test_a_sample_size_that_cannot_be_is_refused_naming_the_input(node: type, models: tuple, dataset: tuple,
                                                                 size: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        _train(node, models[0], dataset[0], sample_count=1, **size)


def test_sample_seed_gives_runs_of_other_seeds_the_same_noise(node: type, models: tuple, dataset: tuple,
                                                              comfy_nodes: ModuleType) -> None:
    """sample_seed 5: the samples of runs with seed 7 and seed 8 start from the same noise (KSampler's images of
    the noise of ``(5, "sample", key)``, tolerance as above; an ancestral sampler's added noise too), and their
    later samples differ only by their LoRAs; with sample_seed -1 each run samples from its own seed's noise."""
    (prompt,) = comfy_nodes.CLIPTextEncode().encode(models[1], "a red square on a blue field")
    opts = {"steps": 1, "sample_count": 1, "sample_steps": 3, "sample_prompt": prompt,
            "sample_sampler": "euler_ancestral"}
    with torch.inference_mode():
        runs = [_train(node, models[0], dataset[0], seed=seed, sample_seed=5, **opts) for seed in (7, 8)]
        expected = _ksampler_of(models, prompt, prompt, "sample_prompt:0", 3, 1.0, sampler="euler_ancestral", seed=5)
        own = _train(node, models[0], dataset[0], seed=8, **opts)
    for out in runs:
        torch.testing.assert_close(out.result[3]["samples"][:1], expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(runs[0].result[3]["samples"][0], runs[1].result[3]["samples"][0])
    assert not torch.allclose(own.result[3]["samples"][0], runs[1].result[3]["samples"][0], atol=1e-3)
    with pytest.raises(ValueError, match=r"sample_seed must be -1 \(the run's seed\) or a seed from 0 to "):
        _train(node, models[0], dataset[0], sample_count=1, sample_seed=-2)


def test_an_unknown_sampler_or_scheduler_is_refused_naming_the_input(node: type, models: tuple,
                                                                    dataset: tuple) -> None:
    with pytest.raises(ValueError, match=r"unknown sample_sampler 'euler_a'; use one of ComfyUI's: euler, "):
        _train(node, models[0], dataset[0], sample_count=1, sample_sampler="euler_a")
    with pytest.raises(ValueError, match=r"unknown sample_scheduler 'Karras'; use one of ComfyUI's: simple, "):
        _train(node, models[0], dataset[0], sample_count=1, sample_scheduler="Karras")


def test_a_connected_prompt_is_sampled_with_a_noise_per_image(node: type, models: tuple, dataset: tuple,
                                                              comfy_nodes: ModuleType) -> None:
    """sample_prompt replaces the cached captions: sample_count images of it, image i from the noise of
    ``(seed, "sample", "sample_prompt:i")``, each KSampler's (tolerance as above), at the dataset's most common
    bucket (64×64); with sample_negative, guidance needs no empty caption in the cache."""
    clip = models[1]
    (prompt,) = comfy_nodes.CLIPTextEncode().encode(clip, "a red square on a blue field")
    (negative,) = comfy_nodes.CLIPTextEncode().encode(clip, "blurry")
    with torch.inference_mode():
        out = _train(node, models[0], dataset[0], steps=1, sample_count=2, sample_steps=3, sample_prompt=prompt)
        expected = torch.cat([_ksampler_of(models, prompt, prompt, f"sample_prompt:{i}", 3, 1.0) for i in range(2)])
    torch.testing.assert_close(out.result[3]["samples"][:2], expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(expected[0], expected[1])  # two noises
    assert ("sample images of the sample_prompt (2 noises) at steps 0, 1: 3 euler steps (simple schedule)"
            in _summary(out))
    with torch.inference_mode():
        guided = _train(node, models[0], dataset[0], steps=1, sample_count=1, sample_steps=3, sample_cfg=4.0,
                        sample_prompt=prompt, sample_negative=negative)
        expected = _ksampler_of(models, prompt, negative, "sample_prompt:0", 3, 4.0)
    torch.testing.assert_close(guided.result[3]["samples"][:1], expected, rtol=1e-4, atol=1e-4)
    assert "cfg 4 against the sample_negative" in _summary(guided)


def test_sample_texts_lines_are_encoded_with_sample_clip_and_sampled_each(node: type, models: tuple,
                                                                         dataset: tuple, comfy_nodes: ModuleType,
                                                                         pack: ModuleType) -> None:
    """sample_texts (blank lines, a # comment and a repeated line left out) with sample_clip: sample_count images of
    each line, after the sample_prompt's, each KSampler's image of CLIP Text Encode's conditioning of the line and
    the noise of ``(seed, "sample", "sample_text:<digest of the line>:i")`` (tolerance as above); the order of the
    lines changes no line's images."""
    import xxhash

    clip = models[1]
    (prompt,) = comfy_nodes.CLIPTextEncode().encode(clip, "a red square on a blue field")
    lines = ["a green circle", "a yellow triangle"]
    texts = f"# what the LoRA should keep\n{lines[0]}\n\n  {lines[1]}  \n{lines[0]}\n"
    with torch.inference_mode():
        out = _train(node, models[0], dataset[0], steps=1, sample_count=2, sample_steps=3, sample_prompt=prompt,
                     sample_clip=clip, sample_texts=texts)
        expected = [_ksampler_of(models, prompt, prompt, f"sample_prompt:{i}", 3, 1.0) for i in range(2)]
        for line in lines:
            (cond,) = comfy_nodes.CLIPTextEncode().encode(clip, line)
            digest = xxhash.xxh3_64_hexdigest(line.encode())
            expected += [_ksampler_of(models, cond, cond, f"sample_text:{digest}:{i}", 3, 1.0) for i in range(2)]
        swapped = _train(node, models[0], dataset[0], steps=1, sample_count=2, sample_steps=3, sample_clip=clip,
                         sample_texts="\n".join(reversed(lines)))
    latents = out.result[3]["samples"]
    assert latents.shape == (12, 4, 8, 8)  # 6 images before the first step and 6 after the last
    torch.testing.assert_close(latents[:6], torch.cat(expected), rtol=1e-4, atol=1e-4)
    first = swapped.result[3]["samples"][:4]
    torch.testing.assert_close(first, torch.cat([*expected[4:6], *expected[2:4]]), rtol=1e-4, atol=1e-4)
    assert ("sample images of the sample_prompt and 2 sample_texts line(s) ('a green circle', 'a yellow "
            "triangle'; 2 noise(s) each) at steps 0, 1" in _summary(out))


def test_a_sample_texts_lines_own_negative_guides_it(node: type, models: tuple, dataset: tuple,
                                                     comfy_nodes: ModuleType) -> None:
    """kohya's ``--n``: at cfg 3 the first line is guided against its own negative, the second (without one)
    against sample_negative, each KSampler's image (tolerance as above); the noise is the prompt's, whatever its
    negative. Every line with its own negative guides without sample_negative or an empty caption in the cache.
    An option kohya's prompt files have and this node does not is refused, naming the ones it has."""
    import xxhash

    clip = models[1]
    encode = comfy_nodes.CLIPTextEncode().encode
    (fallback,) = encode(clip, "blurry")
    texts = "a green circle --n a red square\na yellow triangle"
    with torch.inference_mode():
        out = _train(node, models[0], dataset[0], steps=1, sample_count=1, sample_steps=3, sample_cfg=3.0,
                     sample_clip=clip, sample_texts=texts, sample_negative=fallback)
        expected = []
        for line, negative in (("a green circle", encode(clip, "a red square")[0]), ("a yellow triangle", fallback)):
            key = f"sample_text:{xxhash.xxh3_64_hexdigest(line.encode())}:0"
            expected.append(_ksampler_of(models, encode(clip, line)[0], negative, key, 3, 3.0))
        own = _train(node, models[0], dataset[0], steps=1, sample_count=1, sample_steps=3, sample_cfg=3.0,
                     sample_clip=clip, sample_texts="a green circle --n a red square")
    torch.testing.assert_close(out.result[3]["samples"][:2], torch.cat(expected), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(own.result[3]["samples"][:1], expected[0], rtol=1e-4, atol=1e-4)
    assert "2 sample_texts line(s) ('a green circle', 'a yellow triangle'; 1 noise(s) each, 1 with its own --n " \
           "negative)" in _summary(out)
    assert "cfg 3 against the sample_negative (a line's own --n where it has one)" in _summary(out)
    assert "cfg 3 against each line's --n negative" in _summary(own)
    with pytest.raises(ValueError, match=r"sample_texts line 'a cat --f 17': --f is no option here \(these are: --n "
                                         r"the negative, --s steps, --l guidance scale, --d seed, --w and --h the "
                                         r"size\): take it out"):
        _train(node, models[0], dataset[0], sample_count=1, sample_clip=clip, sample_texts="a cat --f 17")


def test_a_lines_own_steps_guidance_seed_and_size_are_kohyas(node: type, models: tuple, dataset: tuple,
                                                             comfy_nodes: ModuleType, pack: ModuleType,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """kohya's ``--s``, ``--l``, ``--d``, ``--w``, ``--h``: the first line samples 2 steps at cfg 3 against its --n
    from the noise of seed 11, the second the node's 3 steps without guidance from the run's seed, both at the lines'
    96×80 px, each KSampler's image (tolerance as above); no model call mixes the two lines' settings."""
    import xxhash

    loop = _module(pack, "nodes.training.loop").StepLoop
    predict, rows = loop.predict, []

    def counted(self: Any, x: torch.Tensor, sigma: torch.Tensor, groups: Any) -> torch.Tensor:
        if not torch.is_grad_enabled():
            rows.append(x.shape[0])
        return predict(self, x, sigma, groups)

    monkeypatch.setattr(loop, "predict", counted)
    clip, encode = models[1], comfy_nodes.CLIPTextEncode().encode
    texts = "a green circle --s 2 --l 3 --d 11 --w 96 --h 80 --n a red square\na yellow triangle --w 96 --h 80"
    with torch.inference_mode():
        out = _train(node, models[0], dataset[0], steps=1, batch_size=2, sample_count=1, sample_steps=3,
                     sample_clip=clip, sample_texts=texts)
        keys = [f"sample_text:{xxhash.xxh3_64_hexdigest(line.encode())}:0"
                for line in ("a green circle", "a yellow triangle")]
        (green,), (square,), (yellow,) = (encode(clip, t) for t in ("a green circle", "a red square",
                                                                    "a yellow triangle"))
        expected = torch.cat([
            _ksampler_of(models, green, square, keys[0], 2, 3.0, shape=(1, 4, 10, 12), seed=11),
            _ksampler_of(models, yellow, yellow, keys[1], 3, 1.0, shape=(1, 4, 10, 12))])
    torch.testing.assert_close(out.result[3]["samples"][:2], expected, rtol=1e-4, atol=1e-4)
    assert set(rows) == {1}  # each line its own model calls: 2 × 2 (guided) + 3 per sampling
    assert "own settings 'a green circle': --s 2 --l 3 --d 11" in _summary(out) and "96×80 px" in _summary(out)


@pytest.mark.parametrize(("texts", "options", "message"), [
    ("a --w 96 --h 80\nb --w 64 --h 64", {}, "sample_texts lines ask for sizes 64×64, 96×80: a sampling's images "
                                            "leave as one LATENT batch"),
    ("a --w 96 --h 80\nb", {}, "sample_texts: some lines ask for 96×80 px with --w and --h, others for none"),
    ("a --w 96 --h 80", {"sample_width": 64, "sample_height": 64},
     "sample_texts lines ask for 96×80 px and sample_width × sample_height is 64×64"),
    ("a --w 96", {}, "sample_texts line 'a --w 96': give both --w and --h"),
    ("a --s 0", {}, "sample_texts line 'a --s 0': --s sets the line's steps, a whole number from 1 to 100; got '0'"),
    ("a --l 0.5", {}, "--l sets the line's guidance scale, a number from 1 to 30; got '0.5'"),
    ("a --l nan", {}, "--l sets the line's guidance scale, a number from 1 to 30; got 'nan'"),
    ("a --d x", {}, "--d sets the line's seed, a whole number from 0 to 18446744073709551615; got 'x'"),
    ("a --w 100 --h 64", {}, "sample_width 100 is not a multiple of 8"),
    ("a --l 3", {}, "a sample_texts line's --l guides each sample image against the empty caption, which this "
                    "dataset has not encoded"),
])
def test_a_lines_option_that_cannot_be_is_refused_naming_the_line(node: type, models: tuple, dataset: tuple,
                                                                  texts: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        _train(node, models[0], dataset[0], sample_count=1, sample_clip=models[1], sample_texts=texts, **options)


def test_sample_texts_need_a_clip_and_are_not_encoded_without_samples(node: type, models: tuple, dataset: tuple,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    clip = models[1]
    with pytest.raises(ValueError, match=r"sample_texts holds 1 prompt\(s\) but no CLIP is connected to "
                                         "sample_clip"):
        _train(node, models[0], dataset[0], sample_count=1, sample_texts="a cat")
    with pytest.raises(ValueError, match="sample_texts holds 17 prompts; at most 16"):
        _train(node, models[0], dataset[0], sample_count=1, sample_clip=clip,
               sample_texts="\n".join(f"prompt {i}" for i in range(17)))
    with pytest.raises(ValueError, match=r"sample_texts line 'xxxxxxxx.*\.\.\. has 2001 characters; at most 2000"):
        _train(node, models[0], dataset[0], sample_count=1, sample_clip=clip, sample_texts="x" * 2001)
    calls: list[str] = []
    tokenize = clip.tokenize
    monkeypatch.setattr(clip, "tokenize", lambda text, **kw: calls.append(text) or tokenize(text, **kw))
    out = _train(node, models[0], dataset[0], steps=1, sample_clip=clip, sample_texts="a cat")
    assert calls == [] and "sample images" not in _summary(out)


def test_a_prompt_one_model_call_cannot_take_is_refused_naming_the_input(node: type, models: tuple, dataset: tuple,
                                                                        comfy_nodes: ModuleType) -> None:
    (a,) = comfy_nodes.CLIPTextEncode().encode(models[1], "a")
    (b,) = comfy_nodes.CLIPTextEncode().encode(models[1], "b")
    (combined,) = comfy_nodes.ConditioningCombine().combine(a, b)
    with pytest.raises(ValueError, match=r"sample_prompt: connect one prompt's conditioning \(a CLIP Text Encode\); "
                                         r"this one holds 2 conditionings"):
        _train(node, models[0], dataset[0], sample_count=1, sample_prompt=combined)
    (area,) = comfy_nodes.ConditioningSetArea().append(a, 64, 64, 0, 0, 1.0)
    with pytest.raises(ValueError, match=r"sample_negative: the conditioning carries 'area', 'strength'"):
        _train(node, models[0], dataset[0], sample_count=1, sample_cfg=2.0, sample_negative=area)


def test_the_first_samples_are_comfyuis_ksampler_images_of_the_base_model(node: type, models: tuple, dataset: tuple,
                                                                         comfy_nodes: ModuleType) -> None:
    """Before the first step the LoRA adds nothing, so the samples are KSampler's. Tolerance: the same fp32
    operations on the same inputs; KSampler's model wrapper may group them otherwise (rounding only, 1e-6 of
    values of size ~1 per call), and 4 Euler steps carry that along: 1e-4 relative and absolute."""
    with torch.inference_mode():
        out = _train(node, models[0], dataset[0], sample_count=2, sample_steps=4)
    lora, _losses, _steps, samples = out.result
    latents = samples["samples"]
    assert latents.shape == (4, 4, 8, 8)  # 2 captions before the first step and after the last
    sources = _sampled_sources(out)
    assert len(sources) == 2 and all(SIZES[int(s[3:-4])] == (64, 64) for s in sources)
    with torch.inference_mode():
        expected = _ksampler(comfy_nodes, models, sources, RUN["seed"], 4, 1.0)
    torch.testing.assert_close(latents[:2], expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(latents[2:], latents[:2], atol=1e-3)  # after two steps: the LoRA's images
    assert "at steps 0, 2: 4 euler steps (simple schedule)" in _summary(out)


def test_sampling_changes_nothing_the_run_trains_and_repeats_itself(node: type, models: tuple,
                                                                    dataset: tuple) -> None:
    """The same LoRA and losses bit for bit with samples every step as without any (sampling draws from no
    generator of the training's); a second run samples the same images; every step's sampling is in the output,
    in order."""
    plain = _train(node, models[0], dataset[0])
    sampled = _train(node, models[0], dataset[0], sample_count=1, sample_every=1, sample_steps=2)
    again = _train(node, models[0], dataset[0], sample_count=1, sample_every=1, sample_steps=2)
    assert plain.result[1] == sampled.result[1]
    for k, v in plain.result[0].items():
        assert torch.equal(v, sampled.result[0][k]), k
    assert sampled.result[3]["samples"].shape == (3, 4, 8, 8)  # steps 0, 1 and 2
    assert torch.equal(sampled.result[3]["samples"], again.result[3]["samples"])
    assert "at steps 0, 1, 2:" in _summary(sampled)


def test_guidance_is_ksamplers_against_the_empty_caption(node: type, models: tuple, dataset: tuple,
                                                         comfy_nodes: ModuleType) -> None:
    """sample_cfg 3 with the "guided" dataset, whose empty caption is the last sample's caption: KSampler at cfg 3
    with that caption as the negative (tolerance as above). The dataset without an empty caption is refused before
    anything loads, naming both ways out."""
    with torch.inference_mode():
        out = _train(node, models[0], dataset[1], sample_count=1, sample_steps=3, sample_cfg=3.0, steps=1)
        expected = _ksampler(comfy_nodes, models, _sampled_sources(out), RUN["seed"], 3, 3.0,
                             negative_index=len(SIZES) - 1)
    torch.testing.assert_close(out.result[3]["samples"][:1], expected, rtol=1e-4, atol=1e-4)
    assert "3 euler steps (simple schedule), cfg 3 against the empty caption" in _summary(out)
    with pytest.raises(ValueError, match=r"sample_cfg 3 guides each sample image against the empty caption, which "
                                         r"this dataset has not encoded .*empty_caption on, connect a sample_negative, "
                                         r"or sample without guidance \(sample_cfg 1, no line's --l above 1\)"):
        _train(node, models[0], dataset[0], sample_count=1, sample_cfg=3.0)


def test_without_samples_the_output_blocks_its_users_with_a_message(node: type, models: tuple,
                                                                    dataset: tuple) -> None:
    from comfy_execution.graph_utils import ExecutionBlocker

    out = _train(node, models[0], dataset[0], steps=1)
    assert isinstance(out.result[3], ExecutionBlocker)
    assert out.result[3].message == "Train LoRA made no sample images: set its sample_count above 0"
    assert "sample images" not in _summary(out)


def test_each_sampling_is_previewed_on_the_node(node: type, models: tuple, dataset: tuple,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """With ComfyUI's previews on (its --preview-method, or the front end's setting), its progress hook gets a JPEG
    preview (Latent2RGB of the first image) at the run's progress for each sampling, as KSampler's previews reach
    the node; with them off (ComfyUI's default), none, as for KSampler."""
    import comfy.utils
    from comfy.cli_args import LatentPreviewMethod, args

    seen: list[tuple[int, int, Any]] = []

    def hook(value: int, total: int, preview: Any, node_id: Any = None) -> None:
        if preview is not None:
            seen.append((value, total, preview))

    monkeypatch.setattr(comfy.utils, "PROGRESS_BAR_HOOK", hook)
    monkeypatch.setattr(args, "preview_method", LatentPreviewMethod.NoPreviews)
    _train(node, models[0], dataset[0], sample_count=1, sample_steps=2, steps=1)
    assert seen == []
    monkeypatch.setattr(args, "preview_method", LatentPreviewMethod.Latent2RGB)
    _train(node, models[0], dataset[0], sample_count=1, sample_steps=2)
    assert [(value, total) for value, total, _ in seen] == [(0, 2), (2, 2)]
    for _, _, (fmt, image, _size) in seen:
        assert fmt == "JPEG" and image.size == (8, 8)
