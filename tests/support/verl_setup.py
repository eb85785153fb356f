"""verl's real ``FSDPEngineWithLMHead`` on CPU, for the verl plug-in tests: a CPU platform, tiny models saved to disk,
engines built as verl's workers build them, and rollout batches in verl's no-padding layout.

verl has no CPU platform of its own; :class:`CPUPlatform` is registered with ``set_platform`` before any verl engine
module is imported (``transformer_impl`` reads the device name at import time). Collectives run on gloo.
"""

from __future__ import annotations

import contextlib
import os
from functools import partial

import torch

PLUGIN = "shared_prefix_logps.integrations.verl"


def use_cpu_platform() -> None:
    """Make verl see a CPU "device" (idempotent; must run before verl's engine modules are imported).

    verl >= 0.9 asks its platform registry (``verl.plugin.platform``), which has no CPU entry; verl 0.8 falls back to
    ``"cpu"`` by itself when no accelerator is present.
    """
    try:
        from verl.plugin.platform import platform_manager
    except ImportError:  # verl 0.8: no platform layer
        from verl.utils.device import get_device_name

        assert get_device_name() == "cpu", get_device_name()
        return
    if type(platform_manager._current_platform).__name__ == "CPUPlatform":
        return
    platform_manager.set_platform(_cpu_platform_class()())


def _cpu_platform_class():
    """verl's platform interface answered for the CPU: device ``cpu``, collectives on gloo, nothing to profile."""
    from verl.plugin.platform.platform_base import PlatformBase

    class CPUPlatform(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = torch.cpu

        def is_available(self):
            return True

        def is_platform_available(self, use_smi_check=False):
            return True

        def current_device(self):
            return "cpu"

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, device_index=0):
            return (None, None)

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CPU_VISIBLE_DEVICES"

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def cudart(self):
            return None

    return CPUPlatform


def init_single_process(port: int) -> None:
    """A one-process gloo group (verl's engine asks torch.distributed for its rank and builds a device mesh)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1"
    )
    dist.init_process_group("gloo")


def save_model(path, family: str = "qwen2", *, tied: bool | None = None, seed: int = 0) -> str:
    """A tiny random model of ``family`` (``support.tiny_models``), saved where verl's ``HFModelConfig`` loads it."""
    from support.tiny_models import build_model

    build_model(family, tied=tied, seed=seed).save_pretrained(str(path))
    return str(path)


def build_engine(
    model_path: str,
    *,
    plugin: bool = True,
    remove_padding: bool = True,
    lora_rank: int = 0,
    dynamic_bsz: bool = False,
    micro_batch_size: int = 4,
    max_token_len: int = 64,
    gradient_checkpointing: bool = False,
    lr: float = 0.1,
    optimizer: str = "SGD",
    model_kwargs: dict | None = None,
    **engine_kwargs,
):
    """An initialized ``FSDPEngineWithLMHead`` (FSDP2, float32), as verl's ``TrainingWorker`` builds it.

    ``plugin=True`` names the plug-in in ``HFModelConfig.external_lib`` (verl imports it there); the engine is built
    the same way either way, so with the plug-in installed an unpatched twin is made with ``unpatch_verl_engine``.
    The optimizer is SGD by default: a parameter step is then ``lr`` times the gradient, so comparing parameters
    after a step compares gradients (AdamW's first step is ``lr * g / (|g| + eps)``, which turns float noise in
    near-zero gradients into steps of order ``lr``).
    """
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    model_config = HFModelConfig(
        path=model_path,
        load_tokenizer=False,
        external_lib=PLUGIN if plugin else None,
        use_remove_padding=remove_padding,
        enable_gradient_checkpointing=gradient_checkpointing,
        lora_rank=lora_rank,
        lora_alpha=16,
        # verl defaults to flash_attention_2, which CPUs do not have
        override_config={"attn_implementation": "sdpa"},
        **(model_kwargs or {}),
    )
    settings = dict(
        strategy="fsdp2",
        model_dtype="fp32",
        mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        use_torch_compile=False,
        use_dynamic_bsz=dynamic_bsz,
        micro_batch_size_per_gpu=micro_batch_size,
        infer_micro_batch_size_per_gpu=micro_batch_size,
        max_token_len_per_gpu=max_token_len,
        infer_max_token_len_per_gpu=max_token_len,
        use_remove_padding=remove_padding,
    )
    settings.update(engine_kwargs)
    engine_config = FSDPEngineConfig(**settings)
    optimizer_config = FSDPOptimizerConfig(lr=lr, optimizer=optimizer, total_training_steps=10, weight_decay=0.0)
    engine = FSDPEngineWithLMHead(
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=optimizer_config,
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine


def rollout_batch(
    num_prompts: int = 3,
    generations: int = 4,
    prompt_len: int = 12,
    response_len: int = 6,
    *,
    seed: int = 0,
    shuffle: bool = False,
    vocab: int = 101,
    temperature=0.7,
    tool_tokens: bool = True,
    prompt_padding: str = "left",
    system_prompt: int = 0,
):
    """A rollout batch in the layout verl's trainer hands its workers (``left_right_2_no_padding`` applied).

    Prompts are left-padded with different true lengths (one of a single token), responses right-padded with
    lengths from 1 to ``response_len`` (the first row full, the second a single token); each prompt is repeated
    ``generations`` times (rows in groups, or shuffled). ``response_mask`` zeroes a token inside some responses, as
    multi-turn tool output does. Old and reference log-probs and advantages are random. ``prompt_padding="right"``
    pads prompts on the right instead (not a layout verl's rollout produces; verl's own step handles it).
    ``system_prompt > 0`` starts every prompt with the same ``system_prompt`` tokens (the prompts' widths grow by as
    much), as chat templates with one system message do.
    """
    from tensordict import TensorDict
    from verl.workers.utils.padding import left_right_2_no_padding

    gen = torch.Generator().manual_seed(seed)
    rows = num_prompts * generations
    prompt_lens = torch.randint(2, prompt_len + 1, (num_prompts,), generator=gen)
    prompt_lens[0] = prompt_len
    if num_prompts > 2:
        prompt_lens[2] = 1
    prompt_mask = torch.arange(prompt_len)[None, :] >= (prompt_len - prompt_lens)[:, None]
    prompts = torch.randint(1, vocab, (num_prompts, prompt_len), generator=gen).masked_fill(~prompt_mask, 0)
    if system_prompt:
        system = torch.randint(1, vocab, (system_prompt,), generator=gen)
        prompts, prompt_mask = left_aligned(
            torch.cat([system.expand(num_prompts, -1), prompts], dim=1),
            torch.cat([torch.ones(num_prompts, system_prompt, dtype=torch.bool), prompt_mask], dim=1),
        )
    if prompt_padding == "right":
        prompts, prompt_mask = right_aligned(prompts, prompt_mask)
    prompts, prompt_mask = prompts.repeat_interleave(generations, 0), prompt_mask.repeat_interleave(generations, 0)
    response_lens = torch.randint(1, response_len + 1, (rows,), generator=gen)
    response_lens[0], response_lens[1] = response_len, 1
    response_mask = torch.arange(response_len)[None, :] < response_lens[:, None]
    responses = torch.randint(1, vocab, (rows, response_len), generator=gen).masked_fill(~response_mask, 0)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    loss_mask = response_mask.long()
    if tool_tokens:
        loss_mask[3::4, 1] = 0  # a tool token: an input, not trained on
    order = torch.randperm(rows, generator=gen) if shuffle else torch.arange(rows)
    data = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
        "response_mask": loss_mask,
        "old_log_probs": -torch.rand((rows, response_len), generator=gen) * 5 * response_mask,
        "ref_log_prob": -torch.rand((rows, response_len), generator=gen) * 5 * response_mask,
        "advantages": torch.randn((rows, response_len), generator=gen) * response_mask,
    }
    if isinstance(temperature, torch.Tensor):
        data["temperature"] = temperature
    td = TensorDict({key: value[order] for key, value in data.items()}, batch_size=rows)
    td = left_right_2_no_padding(td)
    if not isinstance(temperature, torch.Tensor):
        from verl.utils import tensordict_utils as tu

        tu.assign_non_tensor(td, temperature=temperature)
    return td


def nested_layout(td):
    """The batch as verl's v1 trainer holds it: ``prompts`` and ``responses`` jagged (valid tokens only), no
    ``attention_mask``."""
    attention = td["attention_mask"].bool()
    width = td["responses"].shape[1]
    for key, mask in (("prompts", attention[:, :-width]), ("responses", attention[:, -width:])):
        rows = [ids[valid] for ids, valid in zip(td[key], mask)]
        td[key] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    del td["attention_mask"]
    return td


def left_aligned(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) rows with their valid tokens moved, in order, to the end of the row (left padding)."""
    order = torch.argsort(mask.to(torch.int8), dim=1, stable=True)  # padding first, then valid positions in order
    return ids.gather(1, order), mask.gather(1, order)


def right_aligned(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (B, P) rows moved to the start of the row (right padding)."""
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # valid positions first, in order
    return ids.gather(1, order), mask.gather(1, order)


def assign(td, **values):
    """``tu.assign_non_tensor`` (verl's way of passing options with a batch)."""
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(td, **values)
    return td


def batch_options(engine, td, *, calculate_entropy: bool = True, infer: bool = True):
    """The options verl's ``TrainingWorker`` and trainer attach to a batch before calling the engine."""
    config = engine.engine_config
    return assign(
        td,
        use_remove_padding=engine.use_remove_padding,
        use_dynamic_bsz=config.use_dynamic_bsz,
        max_token_len_per_gpu=config.infer_max_token_len_per_gpu if infer else config.max_token_len_per_gpu,
        micro_batch_size_per_gpu=config.infer_micro_batch_size_per_gpu if infer else config.micro_batch_size_per_gpu,
        use_fused_kernels=False,
        calculate_entropy=calculate_entropy,
        global_batch_size=len(td),
        compute_loss=not infer,
    )


def ppo_loss(**overrides):
    """verl's ``ppo_loss`` bound to an actor config, as ``ActorRolloutRefWorker`` binds it."""
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss as verl_ppo_loss

    settings = dict(strategy="fsdp2", rollout_n=4, ppo_micro_batch_size_per_gpu=4, clip_ratio=0.2)
    settings.update(overrides)
    return partial(verl_ppo_loss, config=FSDPActorConfig(**settings))


def full_parameters(engine) -> dict[str, torch.Tensor]:
    """Every parameter of the engine's model, unsharded (``DTensor.full_tensor()``), detached copies."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in engine.module.named_parameters():
        value = param.full_tensor() if isinstance(param, DTensor) else param
        out[name] = value.detach().clone()
    return out


def full_gradients(engine) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, unsharded, detached copies (zeros where None)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue
        grad = param.grad
        if grad is None:
            out[name] = torch.zeros(param.shape)
            continue
        out[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
    return out


def infer(engine, td):
    """``infer_batch`` in the engine's eval mode, as verl's workers compute old and reference log-probs."""
    with engine.eval_mode():
        return engine.infer_batch(td)


def forward_backward(engine, td, loss_fn):
    """One mini-batch's forward and backward (no optimizer step): verl's output (the loss per micro-batch, the
    metrics) and the full gradients, read before the train-mode context zeroes them."""
    with engine.train_mode():
        out = engine.forward_backward_batch(td, loss_function=loss_fn, forward_only=False)
        grads = full_gradients(engine)
    return out, grads


def gradient_error(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    """The largest ``max |ours - theirs|`` of a parameter's gradient relative to ``max |theirs|`` of that parameter.
    Every parameter of ``theirs`` must have a nonzero gradient (each takes part in the loss), or the relative error
    means nothing."""
    worst = 0.0
    for name, grad in theirs.items():
        scale = grad.abs().max().item()
        assert scale > 0, f"{name} got no gradient"
        worst = max(worst, (ours[name] - grad).abs().max().item() / scale)
    return worst


class TokenCounter:
    """Counts the token ids the model's input embedding receives (every forward, padding included)."""

    def __init__(self, engine):
        from shared_prefix_logps.model import unwrap_causal_lm

        embedding = unwrap_causal_lm(engine.module).get_input_embeddings()
        self.tokens = 0
        self.handle = embedding.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.tokens += int(args[0].numel())

    def close(self):
        self.handle.remove()


def metric_values(value) -> tuple[str, list[float]]:
    """A metric verl's step returned (a ``Metric``, a list of them or of numbers, a number) as ``(aggregation,
    values)``, so that two runs' metrics compare with a tolerance."""
    items = value if isinstance(value, list) else [value]
    aggregation, values = "", []
    for item in items:
        if hasattr(item, "values") and hasattr(item, "aggregation"):
            aggregation = str(item.aggregation)
            values.extend(float(v) for v in item.values)
        else:
            values.append(float(item))
    return aggregation, values


def assert_metrics_close(ours: dict, theirs: dict, *, rtol: float = 1e-5, atol: float = 1e-6) -> float:
    """Same metric names, aggregations and values within tolerance; returns the largest absolute difference."""
    assert set(ours) == set(theirs), (sorted(ours), sorted(theirs))
    worst = 0.0
    for key in theirs:
        (agg_a, a), (agg_b, b) = metric_values(ours[key]), metric_values(theirs[key])
        assert agg_a == agg_b and len(a) == len(b), key
        a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
        assert torch.allclose(a, b, rtol=rtol, atol=atol), (key, a, b)
        worst = max(worst, (a - b).abs().max().item() if a.numel() else 0.0)
    return worst


def assert_same_training_step(ours: dict, theirs: dict, rank: int) -> None:
    """Two processes' records of one training step (``loss``, ``metrics`` as :func:`metric_values` pairs, ``params``
    after the step) agree: loss within 1e-5 relative, same metric names and aggregations with values within
    rtol 1e-5 / atol 1e-6, parameters within 1e-6."""
    import pytest

    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    assert ours["metrics"].keys() == theirs["metrics"].keys()
    for key, (aggregation, values) in theirs["metrics"].items():
        assert ours["metrics"][key][0] == aggregation
        assert torch.allclose(torch.tensor(ours["metrics"][key][1]), torch.tensor(values), rtol=1e-5, atol=1e-6)
    worst = max((ours["params"][n] - theirs["params"][n]).abs().max().item() for n in theirs["params"])
    assert worst < 1e-6, (rank, worst)


def randomize_lora(engine, std: float = 0.2, seed: int = 0) -> None:
    """Give the LoRA matrices of an engine's (sharded) model the same values on every engine built alike: PEFT draws
    A at random when it builds the model and starts B at zero, which makes the adapter a no-op."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in engine.module.named_parameters():
            if "lora_A" not in name and "lora_B" not in name:
                continue
            value = torch.randn(param.shape, generator=generator) * std
            if isinstance(param, DTensor):
                value = distribute_tensor(value, param.device_mesh, param.placements)
            param.copy_(value)


# verl's engine modules read the platform's device name when they are imported, and importing the plug-in imports
# them: the CPU platform has to be in place before any test imports either.
use_cpu_platform()
