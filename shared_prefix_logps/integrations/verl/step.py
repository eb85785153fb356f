"""The replacement for verl's ``FSDPEngineWithLMHead.forward_step`` (verl >= 0.8); :mod:`.install` installs it.

Every log-prob verl computes on its FSDP engine (old policy, reference model, and the policy with gradient in
``update_actor``) goes through ``forward_step(micro_batch, loss_function, forward_only)``: build the model inputs, run
the model once over every ``[prompt | response]`` sequence, turn the logits into jagged ``log_probs``/``entropy``, call
``loss_function``. The patched step rebuilds the rows, runs :func:`~shared_prefix_logps.compute_logps_concatenated`
(each distinct prompt of the micro-batch forwarded once, whatever the row order), lays the results out as verl's
step does (:mod:`.outputs`), and calls verl's own ``loss_function`` on them under verl's autocast. The micro-batching,
the backward (``loss.backward()`` in ``forward_backward_batch``), gradient sync and the optimizer stay verl's.

Under FSDP with more than one process every forward is a collective: the processes fall back together and join their
no-grad forwards (:class:`Lockstep`), as the TRL plug-in does.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
import torch.distributed as dist

from ...api import compute_logps_concatenated
from ...errors import UnsupportedModelError
from ..common.lockstep import Lockstep
from ..common.modules import dropout_active, eval_mode
from ..common.self_check import SelfCheckError, compare, default_tolerance
from ..common.stats import PatchStats, WarnOnce
from .batch import VerlRows, option_problem, read_rows, temperature_groups
from .options import VerlOptions
from .outputs import from_sequences, scatter_rows, to_sequences

logger = logging.getLogger("shared_prefix_logps.verl")

# where install() keeps verl's own forward_step on the function it puts in its place
ORIGINAL_ATTRIBUTE = "_shared_prefix_logps_original"


def engine_class():
    """verl's ``FSDPEngineWithLMHead`` (ImportError if verl or its FSDP engine is missing)."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    return FSDPEngineWithLMHead


def verl_forward_step():
    """verl's own ``FSDPEngineWithLMHead.forward_step`` function, whether or not the class is patched."""
    current = engine_class().__dict__["forward_step"]
    return getattr(current, ORIGINAL_ATTRIBUTE, current)


def serves_log_probs(engine) -> bool:
    """Whether ``engine`` turns its model's logits into log-probs as ``FSDPEngineWithLMHead`` does (a value-head or
    critic engine overrides ``prepare_model_outputs`` and is none of the plug-in's business)."""
    return type(engine).prepare_model_outputs is engine_class().prepare_model_outputs


class VerlPatch:
    """The shared-prefix ``forward_step`` of one engine; ``stats`` shows what it did.

    Attributes:
        engine: the ``FSDPEngineWithLMHead``.
        options: :class:`~.options.VerlOptions`.
        stats: calls, fallbacks per reason, rows, distinct prompts, tokens forwarded vs verl's, self-checks.
        lockstep: under FSDP with several processes, keeps their model calls in step; else None.
    """

    def __init__(self, engine, options: VerlOptions):
        self.engine = engine
        self.options = options
        self.original = functools.partial(verl_forward_step(), engine)
        self.stats = PatchStats()
        self.warn = WarnOnce()
        self.checked: set[str] = set()
        self.replaced: list = []  # instance attributes replaced by patch_verl_engine
        self._dtypes: tuple[torch.dtype, torch.dtype] | None = None
        multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.lockstep = Lockstep(_device(engine)) if multi else None

    # -- the step ---------------------------------------------------------------------------------------------------

    def forward_step(self, micro_batch, loss_function, forward_only):
        """What verl's ``forward_step`` returns: ``(loss, {"model_output", "loss", "metrics"})``."""
        engine = self.engine
        micro_batch = micro_batch.to(_device(engine))
        rows, reason = None, self._engine_problem()
        if reason is None:
            reason = option_problem(engine, micro_batch)
        if reason is None:
            rows, reason = read_rows(micro_batch)
        if self.lockstep is not None:
            reason = self._agreed_reason(reason, rows)
        if reason is not None:
            return self.fallback(reason, micro_batch, loss_function, forward_only)
        calculate_entropy = _flag(micro_batch, "calculate_entropy")
        # No-grad forwards are joined with the other processes' (their number depends on the rows); a grad call agrees
        # on its number of node calls in the core (its own lockstep).
        join = self._joined() if not torch.is_grad_enabled() else contextlib.nullcontext()
        try:
            with join:
                logps, entropy = self.compute(rows, calculate_entropy)
        except UnsupportedModelError as error:
            return self.fallback(f"unsupported model ({error})", micro_batch, loss_function, forward_only)
        logps_dtype, entropy_dtype = self.output_dtypes()
        with _autocast(engine):
            model_output = {"log_probs": to_sequences(logps.to(logps_dtype), rows)}
            if calculate_entropy:
                model_output["entropy"] = to_sequences(entropy.to(entropy_dtype), rows)
            if loss_function is not None:
                loss, metrics = loss_function(
                    model_output=model_output, data=micro_batch, dp_group=engine.get_data_parallel_group()
                )
            else:
                assert forward_only, "forward_only must be True when loss_function is None"
                loss, metrics = torch.tensor(1.0, device=_device_name()), {}
        self.stats.shared_calls += 1
        self.stats.record_batch(rows.input_ids, rows.attention_mask, rows.response_width)
        key = "grad" if torch.is_grad_enabled() else "no grad"
        if self.options.self_check and key not in self.checked:
            self.self_check(key, micro_batch, loss_function, rows, logps, entropy, loss)
            self.log()
        self.log_periodically()
        output = {"model_output": _detach(model_output), "loss": loss.detach().item(), "metrics": metrics}
        return loss, output

    def compute(self, rows: VerlRows, calculate_entropy: bool):
        """(N, R) float32 log-probs and entropies (or None) of the rows, under verl's autocast."""
        logps = entropy = None
        count = rows.input_ids.shape[0]
        with _autocast(self.engine):
            for temperature, indices in temperature_groups(rows):
                ids, mask = rows.input_ids, rows.attention_mask
                if indices is not None:
                    ids, mask = ids[indices], mask[indices]
                out = compute_logps_concatenated(
                    self.engine.module,
                    ids,
                    mask,
                    rows.response_width,
                    temperature=temperature,
                    return_entropy=calculate_entropy,
                    backend=self.options.backend,
                    token_budget=self.options.token_budget,
                )
                logps = scatter_rows(logps, out.logps, indices, count)
                if calculate_entropy:
                    entropy = scatter_rows(entropy, out.entropy, indices, count)
        return logps, entropy

    def output_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """The dtypes of verl's own ``log_probs`` and ``entropy`` on this engine (found once, on a 2 x 4 tensor).

        verl computes them from logits in its autocast dtype with its own helpers, and their dtype depends on the
        platform (flash-attn's cross entropy gives float32 log-probs from bf16 logits, the torch path bf16). The
        shared path's float32 results are cast to them: verl concatenates the micro-batches' outputs into one nested
        tensor, which fails when a fallback micro-batch's dtype differs, and its losses then see what they always see.
        """
        if self._dtypes is None:
            import verl.utils.torch_functional as verl_F

            dtype = getattr(self.engine, "_autocast_dtype", torch.bfloat16)
            logits = torch.zeros((2, 4), dtype=dtype, device=_device(self.engine))
            labels = torch.zeros(2, dtype=torch.long, device=logits.device)
            with torch.no_grad(), _autocast(self.engine):
                logps = verl_F.logprobs_from_logits(logits, labels)
                entropy = verl_F.entropy_from_logits(logits)
            self._dtypes = (logps.dtype, entropy.dtype)
        return self._dtypes

    def fallback(self, reason, micro_batch, loss_function, forward_only):
        """verl's own step, with one warning per reason and a count."""
        self.stats.count_fallback(reason)
        self.warn(f"shared_prefix_logps: falling back to verl's own forward_step: {reason}")
        self.log_periodically()
        return self.original(micro_batch, loss_function=loss_function, forward_only=forward_only)

    def log(self) -> None:
        """The statistics, to the ``shared_prefix_logps.verl`` logger (INFO), tagged with the process's rank."""
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        logger.info("shared_prefix_logps (rank %d, %s):\n%s", rank, type(self.engine).__name__, self.stats.summary())

    def log_periodically(self) -> None:
        every = self.options.log_every
        if every and (self.stats.shared_calls + self.stats.fallback_calls) % every == 0:
            self.log()

    # -- checks -----------------------------------------------------------------------------------------------------

    def _engine_problem(self) -> str | None:
        engine = self.engine
        if type(engine) is not engine_class():
            return f"engine class {type(engine).__name__} (only FSDPEngineWithLMHead itself is served)"
        return None

    def _agreed_reason(self, reason, rows):
        """Several processes: all fall back if any has a reason to."""
        if reason is None and torch.is_grad_enabled() and len(temperature_groups(rows)) > 1:
            reason = "several temperatures in one micro-batch (FSDP: one shared-path call per micro-batch)"
        if self.lockstep.any(reason is not None) and reason is None:
            reason = "another process falls back (FSDP: all processes fall back together)"
        return reason

    def _joined(self):
        return contextlib.nullcontext() if self.lockstep is None else self.lockstep.forwards(self.engine.module)

    def self_check(self, key, micro_batch, loss_function, rows, logps, entropy, loss):
        """Compare with verl's own step on this micro-batch (no grad); raise :class:`SelfCheckError` on mismatch.

        verl's step runs with the same ``loss_function``, so its loss is compared too. With dropout active both sides
        are recomputed in eval mode.
        """
        valid = rows.response_mask
        anything = bool(valid.any())
        if self.lockstep is not None:
            anything = self.lockstep.any(anything)
        if not anything:
            self.stats.count_trivial_check(f"{key} (no valid token)")
            return
        self.checked.add(key)
        calculate_entropy = entropy is not None
        module = self.engine.module
        dropout = dropout_active(module)
        detail = "(dropout active: compared in eval mode, loss not compared)" if dropout else ""
        with torch.no_grad(), self._joined(), eval_mode(module) if dropout else contextlib.nullcontext():
            if dropout:  # the step's own forward drew dropout masks that verl's forward would not reproduce
                logps, entropy = self.compute(rows, calculate_entropy)
            _, ref_output = self.original(micro_batch, loss_function=loss_function, forward_only=True)
        reference = ref_output["model_output"]
        ref_logps = from_sequences(reference["log_probs"], rows)
        ref_entropy = from_sequences(reference["entropy"], rows) if calculate_entropy else None
        tolerance = self.tolerance()
        check = compare(f"log-probs ({key})", logps, ref_logps, valid, tolerance, entropy, ref_entropy, detail)
        loss_diff = 0.0
        if not dropout:
            ours_loss, verl_loss = float(loss.detach()), float(ref_output["loss"])
            loss_diff = abs(ours_loss - verl_loss) / max(1.0, abs(verl_loss))
            check.detail = f"{check.detail} loss {ours_loss:.6g} vs verl's {verl_loss:.6g}".strip()
            check.passed = bool(check.passed and loss_diff <= tolerance[0])
        self.stats.self_checks.append(check)
        if not check.passed:
            raise SelfCheckError(
                f"shared_prefix_logps self-check failed ({key}): max |log-prob diff| {check.max_abs:.3g}, mean "
                f"{check.mean_abs:.3g}, max |entropy diff| {check.max_abs_entropy}, relative loss diff "
                f"{loss_diff:.3g}, "
                f"tolerance {tolerance}. The patched engine would optimize other numbers than verl's; set "
                "SHARED_PREFIX_LOGPS_MODE=off (or call unpatch_verl_engine) and report the model and config."
            )

    def tolerance(self) -> tuple[float, float]:
        if self.options.tolerance is not None:
            return tuple(self.options.tolerance)
        return default_tolerance(getattr(self.engine, "_autocast_dtype", torch.bfloat16))


def _flag(micro_batch, key: str) -> bool:
    from verl.utils import tensordict_utils as tu

    return bool(tu.get_non_tensor_data(data=micro_batch, key=key, default=False))


def _device(engine):
    from verl.utils.device import get_device_id

    return get_device_id()


def _device_name() -> str:
    from verl.utils.device import get_device_name

    return get_device_name()


def _autocast(engine):
    """verl's autocast around the forward: none when its mixed-precision dtype is float32."""
    dtype = getattr(engine, "_autocast_dtype", torch.bfloat16)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=_device_name(), dtype=dtype)


def _detach(tree):
    from verl.workers.engine.utils import detach_tree

    return detach_tree(tree)
