"""Train LoRA's inputs, in the order saved workflows and API prompts rely on: the built-in node's (and the loader's),
then every optional input added since 0.1.0, appended in the order they were added (a new one goes at the end).

Kept apart from the node so the node's module holds what it does, not three hundred lines of declarations; the
schema test (``tests/comfy/test_train_lora.py``) pins the order and the advanced set.
"""

from __future__ import annotations

import comfy.samplers
from comfy.weight_adapter import adapter_maps
from comfy_api.latest import io

from ..dataset_cache.adapter_dropout import MAX_DROPOUT
from ..dataset_cache.constants import DEFAULT_PREFETCH_BATCHES
from ..dataset_cache.devices import AUTO as ALL_DEVICES
from ..dataset_cache.holdout import MAX_VAL_SPLIT
from ..dataset_cache.memory_plan import AUTO, MEMORY_MODES
from ..dataset_cache.sample_choice import MAX_SAMPLE_CFG, MAX_SAMPLE_COUNT, MAX_SAMPLE_SIZE, MAX_SAMPLE_STEPS
from .handles import StreamDataset
from .training import (
    CHECKPOINT_MODES,
    DEFAULT_SAVE_PREFIX,
    LOSS_FUNCTIONS,
    LOSS_TARGETS,
    LR_SCHEDULES,
    MAX_EMA_DECAY,
    MAX_GRAD_NORM,
    MAX_LORA_ALPHA,
    MAX_MIN_SNR_GAMMA,
    MAX_MULTIRES_ITERATIONS,
    MAX_NOISE_OFFSET,
    MAX_REG_RATIO,
    MAX_REG_WEIGHT,
    MAX_SEED,
    MAX_TIMESTEP,
    MAX_WARMUP_STEPS,
    OPTIMIZERS,
    TIMESTEP_SAMPLINGS,
)
from .training.lora_files import lora_choices
from .training.samples import SAMPLE_SAMPLER, SAMPLE_SCHEDULER

__all__ = ["train_lora_inputs"]


def train_lora_inputs() -> list[io.Input]:
    """Every input of Train LoRA, in order."""
    return [*_builtin_inputs(), *_step_inputs(), *_option_inputs()]


def _builtin_inputs() -> list[io.Input]:
    """The built-in Train LoRA's inputs (same names and defaults) and the loader's two."""
    algorithms = list(adapter_maps)
    return [
        io.Model.Input("model", tooltip="The model to train the LoRA on."),
        StreamDataset.Input("dataset", tooltip="The cached dataset to train on."),
        io.Int.Input("batch_size", default=1, min=1, max=10000,
                     tooltip="Images per batch. A batch holds images of one resolution bucket."),
        io.Int.Input("grad_accumulation_steps", default=1, min=1, max=1024,
                     tooltip="Batches whose gradients are summed before each optimizer step."),
        io.Int.Input("steps", default=16, min=1, max=100000, tooltip="Optimizer steps to train."),
        io.Float.Input("learning_rate", default=0.0005, min=0.0000001, max=1.0, step=0.0000001,
                       tooltip="The optimizer's learning rate."),
        io.Int.Input("rank", default=8, min=1, max=128, tooltip="Rank of the LoRA layers."),
        io.Combo.Input("optimizer", options=list(OPTIMIZERS), default="AdamW",
                       tooltip="The optimizer that updates the LoRA weights: ComfyUI's four, Prodigy (finds its "
                       "own step size: set learning_rate 1.0), Lion (one step size per weight: rates 3-10x "
                       "below AdamW's), Adafactor (kohya's and FluxGym's Flux optimizer, with their settings), "
                       "AdamW8bit (bitsandbytes' 8-bit AdamW, kohya's and ai-toolkit's default) or Lion8bit "
                       "(bitsandbytes' Lion with a one-byte moment); no package needed."),
        io.Combo.Input("loss_function", options=list(LOSS_FUNCTIONS), default="MSE",
                       tooltip="How the denoised prediction is compared with the clean latent."),
        io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF,
                     control_after_generate=io.ControlAfterGenerate.fixed,  # a re-queue reuses the LoRA
                     tooltip="Decides the batch order, caption variants, noise, timesteps and the LoRA's "
                     "initial weights: the same seed and inputs train the same LoRA."),
        io.Combo.Input("training_dtype", options=["bf16", "fp32", "none"], default="bf16",
                       tooltip="Compute dtype. 'none' keeps the model's own (fp16 models get a GradScaler)."),
        io.Combo.Input("lora_dtype", advanced=True, options=["bf16", "fp32"], default="bf16",
                       tooltip="dtype of the LoRA weights."),
        io.Combo.Input("algorithm", options=algorithms, default=algorithms[0],
                       tooltip="The adapter type to train."),
        io.Boolean.Input("gradient_checkpointing", default=True,
                         tooltip="Recompute activations in the backward pass, each block of the model its "
                         "own checkpoint: much less memory, about a quarter slower. Off: the memory plan "
                         "turns it on only when the run would not fit without it."),
        io.Int.Input("checkpoint_depth", advanced=True, default=0, min=0, max=5,
                     tooltip="No longer used (kept so saved workflows load): gradient checkpointing "
                     "checkpoints each block of the model, which gives the same results as any depth with "
                     "less memory."),
        io.Boolean.Input("offloading", advanced=True, default=False,
                         tooltip="Let ComfyUI manage the weights (its partial loading: weights kept in CPU "
                         "memory and copied in layer by layer). The memory plan then only checkpoints."),
        io.Combo.Input("existing_lora", options=lora_choices(), default="[None]",
                       tooltip="A LoRA to continue training, or [None] for a new one: from the loras "
                       "folders, or '[output]' for one saved in the output folder's loras/ (Save LoRA "
                       "Weights, save_every; newest first). A LoRA this node trained continues exactly "
                       "(optimizer state, step count and batch order come from the training state saved "
                       "beside it); another continues from the step count in its name, with a fresh "
                       "optimizer (the summary says so)."),
        io.Int.Input("prefetch_batches", advanced=True, default=DEFAULT_PREFETCH_BATCHES, min=0, max=64,
                     tooltip="Batches read ahead while the model trains (0: read in the training loop)."),
        io.Int.Input("loader_threads", advanced=True, default=0, min=0, max=32,
                     tooltip="Threads reading batches (0: automatic)."),
    ]


def _step_inputs() -> list[io.Input]:
    """Optional inputs added after 0.1.0 that change how a step runs: quantized and bypass training, masks,
    variety, regularization, the memory plan, devices and checkpointing."""
    return [
        io.Boolean.Input("quantized_backward", default=False, optional=True, advanced=True,
                         tooltip="For a quantized model (e.g. fp8 weights) trained with training_dtype "
                         "'none': the backward pass also uses the quantized matmul (less memory, coarser "
                         "gradients), as in ComfyUI's own Train LoRA. Off: the backward pass is computed "
                         "at full precision. No effect on models that are not quantized."),
        io.Boolean.Input("bypass_mode", default=False, optional=True, advanced=True,
                         tooltip="Apply the adapters as forward hooks instead of patching the model's "
                         "weights, as in ComfyUI's own Train LoRA: for quantized models, whose weights "
                         "cannot be patched. The saved LoRA is the same either way. Off: weights are "
                         "patched."),
        io.Boolean.Input("masked_loss", default=True, optional=True, advanced=True,
                         tooltip="Weigh each image's loss by its mask where the dataset has masks (Encode "
                         "Dataset's 'masks' input): areas a mask leaves out count unmasked_weight. No "
                         "effect on a dataset without masks. Off: masks are ignored."),
        io.Float.Input("unmasked_weight", default=0.1, min=0.0, max=1.0, step=0.01, optional=True,
                       advanced=True,
                       tooltip="Loss weight of the areas a mask leaves out (mask 0), between 0 (not "
                       "trained at all) and 1 (the mask has no effect); masked areas weigh 1."),
        # training-time variety (#16)
        io.Float.Input("caption_dropout", default=0.0, min=0.0, max=1.0, step=0.01, optional=True,
                       tooltip="Chance that an image trains with the empty caption instead of its own "
                       "(decided by the seed, so a continued run drops what an uninterrupted one would). "
                       "Needs a dataset encoded with Encode Dataset's empty_caption on. 0: never."),
        StreamDataset.Input("reg_dataset", optional=True,
                            tooltip="Regularization (class) images mixed into every epoch, as kohya's reg "
                            "folders or DreamBooth's prior preservation; from this cache or another one "
                            "(e.g. a reg cache shared by projects). Not connected: none."),
        io.Float.Input("reg_ratio", default=1.0, min=0.0, max=MAX_REG_RATIO, step=0.05, optional=True,
                       tooltip="Regularization images per image of dataset in each epoch (1: as many, "
                       "kohya's default); which ones changes from epoch to epoch. Only with reg_dataset."),
        io.Float.Input("reg_weight", default=1.0, min=0.0, max=MAX_REG_WEIGHT, step=0.05, optional=True,
                       tooltip="Loss weight of a regularization image (kohya's prior_loss_weight); an image "
                       "of dataset weighs 1. Only with reg_dataset."),
        # the memory plan (#25)
        io.Combo.Input("memory", options=list(MEMORY_MODES), default=AUTO, optional=True,
                       tooltip="How the run fits the device: 'auto' measures the model and the batch, reads "
                       "the memory free and picks the fastest plan that fits (every weight on the device, "
                       "at batch_size 1 with blocks kept whole, not recomputed, in up to half the memory left "
                       "free; else some blocks' weights streamed from CPU memory while the others compute; "
                       "else also the checkpointed activations in CPU memory), shown on the node before the "
                       "first step. 'auto + keep blocks whole': the same, blocks kept whole at any batch size "
                       "(faster, more memory). The others fix one plan ('no offload': every weight on the "
                       "device, every block checkpointed: the least memory without streaming). None changes "
                       "the results."),
        io.Int.Input("stream_blocks", default=0, min=0, max=1000, optional=True, advanced=True,
                     tooltip="With memory 'stream blocks...': how many blocks to stream (0: as many as "
                     "needed to fit)."),
        io.Boolean.Input("allow_fp8", default=False, optional=True, advanced=True,
                         tooltip="Let the memory plan store the model's block weights in fp8 when nothing "
                         "else fits ('auto'), or always (the stream modes): half the memory of bf16, the "
                         "LoRA trained against rounded weights. A model loaded in fp8 counts as fp8 "
                         "anyway."),
        io.String.Input("devices", default=ALL_DEVICES, optional=True,
                        tooltip="Where to train. 'auto': every visible GPU (one: as before). A list such as "
                        "'0,1' trains on those GPUs (it must include ComfyUI's own). Several GPUs train "
                        "data-parallel: each takes batch_size images per step (the global batch is "
                        "batch_size × GPUs), one worker process per extra GPU loads its own copy of the "
                        "model. '0,1 + 2 remote' adds 2 ranks joining from other machines (README: Several "
                        "machines). 'cpu:2' runs 2 CPU processes (for tests)."),
        # last: saved workflows keep their widget values in order
        io.Combo.Input("checkpoint_mode", options=list(CHECKPOINT_MODES), default="exact", optional=True,
                       advanced=True,
                       tooltip="How gradient checkpointing recomputes the blocks. 'exact': the same "
                       "gradients bit for bit as ComfyUI's own Train LoRA. 'fast': fewer ops and half the "
                       "Python calls per step (faster where the GPU waits for the host: small batches), "
                       "gradients equal up to float rounding."),
    ]


def _option_inputs() -> list[io.Input]:
    """Optional inputs added later: saves, the schedule, noise, validation, the step's options, sampling."""
    return [
        io.Int.Input("save_every", default=0, min=0, max=100000, optional=True, advanced=True,
                     tooltip="Save the LoRA trained so far every this many steps, and when the run is "
                     "cancelled or fails after a step, with its training state: continuing a save is "
                     "exactly the run that never stopped. Files go where Save LoRA Weights puts them "
                     "(<save_prefix>_<steps>_steps_<counter>_.safetensors in the output folder). 0: no "
                     "saves, a cancelled run keeps nothing (as ComfyUI's own Train LoRA)."),
        io.String.Input("save_prefix", default=DEFAULT_SAVE_PREFIX, optional=True, advanced=True,
                        tooltip="The name of the saves of save_every, in ComfyUI's output folder (a "
                        "subfolder may be given, as Save LoRA Weights' prefix)."),
        io.Combo.Input("lr_schedule", options=list(LR_SCHEDULES), default="constant", optional=True,
                       tooltip="How the learning rate changes over the training, after the warm-up. "
                       "'constant': learning_rate throughout (ComfyUI's own Train LoRA). 'cosine': from "
                       "learning_rate down to near 0 along half a cosine. 'linear': down to near 0 in a "
                       "straight line. The training counts the existing LoRA's steps and this run's: "
                       "continuing a save with the steps it had left sets the rates the run that never "
                       "stopped would have."),
        io.Int.Input("warmup_steps", default=0, min=0, max=MAX_WARMUP_STEPS, optional=True,
                     tooltip="Steps over which the learning rate rises in a straight line to learning_rate "
                     "(the first step at 1/warmup_steps of it), before lr_schedule applies. 0: none."),
        io.Combo.Input("timestep_sampling", options=list(TIMESTEP_SAMPLINGS), default="uniform",
                       optional=True, advanced=True,
                       tooltip="How each image's noise level is drawn. 'uniform': evenly over the model's "
                       "schedule (ComfyUI's own Train LoRA). 'logit-normal': more often at middle noise "
                       "levels, as the SD3 paper trains rectified-flow models (SD3, Flux, Qwen-Image, "
                       "Lumina 2, WAN)."),
        io.Float.Input("noise_offset", default=0.0, min=0.0, max=MAX_NOISE_OFFSET, step=0.01,
                       optional=True, advanced=True,
                       tooltip="Shift each image's noise, per channel, by this much times a random value "
                       "(kohya's noise_offset; 0.05-0.1 usual), so the LoRA can also learn images much "
                       "darker or lighter than average. 0: plain noise (ComfyUI's own Train LoRA)."),
        StreamDataset.Input("val_dataset", optional=True,
                            tooltip="Images held out of training whose loss is measured with the same noise "
                            "and timestep each time (before the first step, every val_every steps and "
                            "after the last): a curve that moves only with the LoRA, and rises again when "
                            "it overfits. Not connected: no validation."),
        io.Int.Input("val_every", default=0, min=0, max=100000, optional=True, advanced=True,
                     tooltip="With val_dataset: measure its loss every this many steps too. 0: before the "
                     "first step and after the last only."),
        io.Float.Input("max_grad_norm", default=0.0, min=0.0, max=MAX_GRAD_NORM, step=0.1, optional=True,
                       tooltip="Clip each step's gradients to this global norm, so one unusual batch cannot "
                       "undo what many steps learned (1.0: the default of kohya, OneTrainer and "
                       "ai-toolkit). 0: no clipping (ComfyUI's own Train LoRA). The live panel and the "
                       "summary show the norm either way, and how often it was clipped."),
        io.Float.Input("ema_decay", default=0.0, min=0.0, max=MAX_EMA_DECAY, step=0.001, optional=True,
                       advanced=True,
                       tooltip="Output the moving average of the LoRA's weights over the last steps instead "
                       "of the last step's (EMA, as OneTrainer, ai-toolkit and SimpleTuner offer): each step "
                       "weighs 1 - ema_decay (0.99 to 0.999 usual; the first steps weigh more). Saves and "
                       "the validation loss are of the average too, and continuing a save continues both "
                       "exactly. 0: no average (ComfyUI's own Train LoRA)."),
        io.Float.Input("min_snr_gamma", default=0.0, min=0.0, max=MAX_MIN_SNR_GAMMA, step=0.5,
                       optional=True, advanced=True,
                       tooltip="Weigh each image's loss by min(SNR, gamma) of its noise level (Min-SNR, "
                       "kohya's min_snr_gamma; 5 usual): nearly clean images weigh less, so the training "
                       "spends less on details the model already gets right. For SD1.5 and SDXL this is "
                       "kohya's objective exactly (with the MSE loss). 0: unweighted (ComfyUI's own Train "
                       "LoRA)."),
        io.String.Input("train_layers", default="", optional=True, advanced=True,
                        placeholder="every layer",
                        tooltip="Train only some layers: pieces of layer names, separated by commas; a layer "
                        "trains when its name holds one of them, and none of those written with a leading "
                        "'-'. E.g. 'attn' (attention only, SD1.5/SDXL), 'attn2' (cross-attention), "
                        "'double_blocks' (Flux), '-norm' (all but the norms). A smaller LoRA and a faster "
                        "step; the summary says how many layers trained, and a piece in no name is noted. "
                        "Empty: every layer (ComfyUI's own Train LoRA)."),
        io.Int.Input("min_timestep", default=0, min=0, max=MAX_TIMESTEP, optional=True, advanced=True,
                     tooltip="The least noisy timestep trained, of the model's 0-1000 (1000: pure noise; "
                     "kohya's and musubi-tuner's min_timestep). With max_timestep, a LoRA of WAN 2.2's "
                     "high-noise expert trains 875 to 1000, of its low-noise expert 0 to 875. 0 and 1000: "
                     "every timestep (ComfyUI's own Train LoRA)."),
        io.Int.Input("max_timestep", default=MAX_TIMESTEP, min=0, max=MAX_TIMESTEP, optional=True,
                     advanced=True,
                     tooltip="The noisiest timestep trained, of the model's 0-1000 (see min_timestep). The "
                     "timesteps are drawn as timestep_sampling says, within the range; the validation loss "
                     "is measured within it too."),
        io.Float.Input("lora_alpha", default=1.0, min=0.01, max=MAX_LORA_ALPHA, step=1.0, round=0.01,
                       optional=True, advanced=True,
                       tooltip="The new adapters' alpha (kohya's network_alpha): a LoRA, LoHa or LoKr adds "
                       "its difference times lora_alpha / rank. 1: ComfyUI's own Train LoRA (and kohya's "
                       "default); lora_alpha = rank: scale 1, with a learning rate to match. The LoRA file "
                       "holds it; a continued LoRA keeps its own."),
        io.Float.Input("val_split", default=0.0, min=0.0, max=MAX_VAL_SPLIT, step=0.05, round=0.01,
                       optional=True,
                       tooltip="Hold out this share of the dataset's images (or clips) for the validation "
                       "loss, instead of a val_dataset: each held out whole (all its resolutions and "
                       "windows), the same ones on every run (by their names), at least one. 0: none."),
        io.Combo.Input("loss_target", options=list(LOSS_TARGETS), default=LOSS_TARGETS[0], optional=True,
                       advanced=True,
                       tooltip="What the loss compares. clean latent: the predicted and the true clean "
                       "image, as ComfyUI's own Train LoRA. prediction: the model's output and its target "
                       "(the noise for SD1.5 and SDXL, v for v-prediction models, the velocity for SD3, "
                       "Flux, WAN, Qwen-Image, Lumina 2), as kohya, musubi-tuner, ai-toolkit and OneTrainer "
                       "train: nearly clean images weigh more, very noisy ones less. With min_snr_gamma the "
                       "two are the same (MSE)."),
        io.Int.Input("multires_noise_iterations", default=0, min=0, max=MAX_MULTIRES_ITERATIONS,
                     optional=True, advanced=True,
                     tooltip="Multi-resolution (pyramid) noise, kohya's multires_noise_iterations: add this "
                     "many levels of lower-resolution noise to each image's noise, so the LoRA also learns "
                     "coarse layout and colour (6-10 usual). 0: plain noise, as ComfyUI's own Train LoRA."),
        io.Float.Input("multires_noise_discount", default=0.3, min=0.0, max=1.0, step=0.05, round=0.01,
                       optional=True, advanced=True,
                       tooltip="Each coarser level of the multi-resolution noise weighs this times the one "
                       "before (kohya's multires_noise_discount; 0.3 its default, 0.1-0.8 usual). No effect "
                       "with multires_noise_iterations 0."),
        io.Int.Input("sample_count", default=0, min=0, max=MAX_SAMPLE_COUNT, optional=True,
                     tooltip="Sample images during training: generate this many of the cache's own captions "
                     "(of the validation set when there is one, else of the dataset; one resolution bucket) "
                     "before the first step, every sample_every steps and after the last, from the same "
                     "noise each time. They come out of the samples output as latents (connect VAE Decode "
                     "and Save Image); the node previews each. No text encoder or VAE is loaded while "
                     "training. 0: none."),
        io.Int.Input("sample_every", default=0, min=0, max=MAX_WARMUP_STEPS, optional=True, advanced=True,
                     tooltip="Sample images every this many steps too (0: only before the first step and "
                     "after the last). Each sampling costs sample_steps model calls per image (twice with "
                     "sample_cfg above 1)."),
        io.Int.Input("sample_steps", default=20, min=1, max=MAX_SAMPLE_STEPS, optional=True, advanced=True,
                     tooltip="Denoising steps per sample image (of sample_sampler over sample_scheduler)."),
        io.Float.Input("sample_cfg", default=1.0, min=1.0, max=MAX_SAMPLE_CFG, step=0.5, round=0.01,
                       optional=True, advanced=True,
                       tooltip="Classifier-free guidance of the sample images against the empty caption "
                       "(needs Encode Dataset's empty_caption on). 1: none, the right choice for Flux and "
                       "other guidance-distilled models; 5-7 for SD1.5 and SDXL."),
        io.Conditioning.Input("sample_prompt", optional=True,
                              tooltip="Sample this prompt instead of the cache's captions (a CLIP Text "
                              "Encode; ComfyUI encodes it before training): sample_count images of it, each "
                              "from its own noise. No effect with sample_count 0."),
        io.Conditioning.Input("sample_negative", optional=True,
                              tooltip="The negative prompt of the sample images' guidance (sample_cfg above "
                              "1), instead of the cache's empty caption."),
        io.Boolean.Input("debiased_estimation", default=False, optional=True, advanced=True,
                         tooltip="kohya's debiased estimation (debiased_estimation_loss): weigh each image's loss on "
                         "the prediction by 1/sqrt(SNR) of its noise level (1/(SNR+1) for v-prediction), for SD1.5, "
                         "SDXL and SD2. Needs loss_target prediction."),
        io.Combo.Input("sample_sampler", options=comfy.samplers.KSampler.SAMPLERS, default=SAMPLE_SAMPLER,
                       optional=True, advanced=True,
                       tooltip="The sampler of the sample images, as KSampler's sampler_name (any of ComfyUI's). "
                       "A sampler that adds noise as it goes (ancestral, SDE) draws it from the run's seed, so "
                       "every sampling of a run starts from the same noise."),
        io.Combo.Input("sample_scheduler", options=comfy.samplers.KSampler.SCHEDULERS, default=SAMPLE_SCHEDULER,
                       optional=True, advanced=True,
                       tooltip="The scheduler of the sample images, as KSampler's scheduler: the noise levels "
                       "the sample_steps go through."),
        io.Boolean.Input("scale_v_pred_loss", default=False, optional=True, advanced=True,
                         tooltip="kohya's scale_v_pred_loss_like_noise_pred: weigh a v-prediction model's loss "
                         "(SD2 768-v, v-pred SDXL) by SNR/(SNR+1) of each image's noise level, so its noise levels "
                         "weigh as a noise-prediction model's. Needs loss_target prediction."),
        io.Int.Input("sample_width", default=0, min=0, max=MAX_SAMPLE_SIZE, step=8, optional=True, advanced=True,
                     tooltip="The sample images' width in pixels (with sample_height; a multiple of the model's "
                     "latent downscale, 8 for SD and Flux). 0: the size of the bucket the captions come from."),
        io.Int.Input("sample_height", default=0, min=0, max=MAX_SAMPLE_SIZE, step=8, optional=True, advanced=True,
                     tooltip="The sample images' height in pixels (with sample_width). 0: the bucket's."),
        io.Clip.Input("sample_clip", optional=True,
                      tooltip="The text encoder that encodes sample_texts before training (the same CLIP a CLIP "
                      "Text Encode would take). Only used when sample_texts holds prompts and sample_count is "
                      "above 0."),
        io.String.Input("sample_texts", default="", multiline=True, optional=True, advanced=True,
                        tooltip="Prompts to sample, one per line (kohya's prompt file; blank lines and lines "
                        "starting with # are skipped; a line's own --n negative, --s, --l, --d, --w and --h as "
                        "kohya's): each gives sample_count images, encoded with sample_clip before training, "
                        "instead of the cache's captions. At most 16."),
        io.Int.Input("sample_seed", default=-1, min=-1, max=MAX_SEED, optional=True, advanced=True,
                     tooltip="The seed of the sample images' noise (kohya's --d): the same seed gives the same "
                     "noise in runs of other training seeds, so their LoRAs can be compared image by image. "
                     "-1: the run's seed."),
        io.Float.Input("network_dropout", default=0.0, min=0.0, max=MAX_DROPOUT, step=0.01, optional=True,
                       advanced=True,
                       tooltip="kohya's network_dropout: in each training step, each hidden unit of a LoRA (its "
                       "down projection's output) is zeroed with this probability, the rest scaled up. Needs "
                       "bypass_mode (only there does the LoRA run beside the layer). 0: none; 0.1 is usual."),
        io.Float.Input("rank_dropout", default=0.0, min=0.0, max=MAX_DROPOUT, step=0.01, optional=True,
                       advanced=True,
                       tooltip="kohya's rank_dropout: in each training step, each rank of a LoRA is dropped with "
                       "this probability (per image in bypass_mode, for the whole batch otherwise), the rest "
                       "scaled up. LoRA only. 0: none."),
        io.Float.Input("module_dropout", default=0.0, min=0.0, max=MAX_DROPOUT, step=0.01, optional=True,
                       advanced=True,
                       tooltip="kohya's module_dropout: in each training step, each layer's whole change is left "
                       "out with this probability. Any algorithm. 0: none."),
        io.String.Input("optimizer_args", default="", optional=True, advanced=True,
                        tooltip="The optimizer's own settings as kohya's optimizer_args: name=value separated by "
                        "spaces, e.g. 'weight_decay=0.1 betas=0.9,0.99' (AdamW), 'd_coef=0.8' (Prodigy). Empty: "
                        "its defaults (AdamW's weight decay 0.01, as ComfyUI's own)."),
        io.Float.Input("ip_noise_gamma", default=0.0, min=0.0, max=1.0, step=0.01, optional=True, advanced=True,
                       tooltip="kohya's ip_noise_gamma (input perturbation): each training image's noisy input gets "
                       "this times more noise than its target is made of, so training sees inputs as imperfect as "
                       "sampling gives. 0: none; 0.1 is kohya's."),
        io.Float.Input("v_pred_like_loss", default=0.0, min=0.0, max=1.0, step=0.01, optional=True, advanced=True,
                       tooltip="kohya's v_pred_like_loss: a noise-prediction model's (SD1.5, SDXL) loss plus this "
                       "times the v loss it implies, which weighs the noisiest levels up as training v would. Needs "
                       "loss_target prediction. 0: none; about 0.1 in kohya's guides."),
        io.Boolean.Input("noise_offset_random_strength", default=False, optional=True, advanced=True,
                         tooltip="kohya's noise_offset_random_strength: each training image's noise offset is "
                         "noise_offset times a random strength from 0 to 1, so training sees every offset up to the "
                         "one set. Needs noise_offset. Off: noise_offset as set."),
        io.Boolean.Input("ip_noise_gamma_random_strength", default=False, optional=True, advanced=True,
                         tooltip="kohya's ip_noise_gamma_random_strength: each training image's input perturbation "
                         "is ip_noise_gamma times a random strength from 0 to 1. Needs ip_noise_gamma. Off: "
                         "ip_noise_gamma as set."),
    ]
