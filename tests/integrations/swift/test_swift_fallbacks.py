"""What the ms-swift plug-in does not serve goes to ms-swift's own method, with one warning naming the reason and a
count per call; and what it serves beyond the plain call (``dynamic_num_samples`` chunks, entropies) matches ms-swift's.

The trainer and its micro-batches come from one real ``swift rlhf`` step (ms-swift's own entry point, unpatched); each
test then patches that trainer (:func:`patch_trainer`), puts it in the setting under test and calls its log-prob
method as ms-swift does, comparing with ms-swift's own method on the same call.
"""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("swift", reason="ms-swift is not installed (make test-swift)")

import torch  # noqa: E402
from support import swift_setup as ss  # noqa: E402

from shared_prefix_logps.integrations.swift import patch_trainer, unpatch_trainer  # noqa: E402
from shared_prefix_logps.integrations.swift.patch import (  # noqa: E402
    REASON_LIGER,
    REASON_MULTIMODAL,
    REASON_PADDING_FREE,
    REASON_SEQUENCE_PARALLEL,
)


@pytest.fixture(scope="module")
def step(tiny_root, tmp_path_factory):
    """``(trainer, model_inputs, grpo_batch)`` of the grad pass of one unpatched ``swift rlhf`` step."""
    model_dir, dataset = ss.build_tiny(tiny_root)
    argv = ss.grpo_arguments(model_dir, dataset, tmp_path_factory.mktemp("swift_fallbacks"))
    with pytest.MonkeyPatch.context() as monkeypatch:
        record = ss.run_grpo(monkeypatch, argv)
    model_inputs, grpo_batch = record.batches[-1]
    return record.trainer, model_inputs, grpo_batch


def _own(trainer, *args, **kwargs):
    """ms-swift's own log-prob method of ``trainer`` (the class's, whatever the instance holds)."""
    from swift.rlhf_trainers.grpo_trainer import GRPOTrainer

    return GRPOTrainer._get_per_token_logps_and_entropies(trainer, *args, **kwargs)


def _patched_calls(trainer, calls: int, *args, **kwargs):
    """Patch ``trainer``, call its log-prob method ``calls`` times with the arguments, unpatch; returns the last
    result, the patch and the warnings raised."""
    patch = patch_trainer(trainer, self_check=False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(calls):
                result = trainer._get_per_token_logps_and_entropies(*args, **kwargs)
    finally:
        unpatch_trainer(trainer)
    return result, patch, [str(w.message) for w in caught if "shared_prefix_logps" in str(w.message)]


def _assert_fell_back(patch, messages, reason_start: str, calls: int):
    assert patch.stats.shared_calls == 0
    assert patch.stats.fallback_calls == calls
    assert [reason for reason in patch.stats.fallback_reasons if reason.startswith(reason_start)] == list(
        patch.stats.fallback_reasons
    )
    assert sum(patch.stats.fallback_reasons.values()) == calls
    assert len(messages) == 1 and reason_start in messages[0], messages


def test_sequence_parallel_falls_back(step, monkeypatch):
    """``sequence_parallel_size > 1``: ms-swift's own sequence-parallel path runs (spied: it needs several
    processes, so the spy computes what it returns with ms-swift's local forward), one warning for two calls."""
    trainer, model_inputs, grpo_batch = step
    ran = []

    def via_sp(model, inputs, batch, logits_to_keep, input_ids, compute_entropy=False):
        ran.append(logits_to_keep)
        return trainer._get_logps_via_local_forward(model, inputs, logits_to_keep, input_ids, compute_entropy)

    monkeypatch.setattr(trainer.template, "sequence_parallel_size", 2)
    monkeypatch.setattr(trainer, "_get_logps_via_sp", via_sp, raising=False)
    with torch.no_grad():
        (ours, _), patch, messages = _patched_calls(trainer, 2, trainer.model, dict(model_inputs), grpo_batch)
        theirs, _ = _own(trainer, trainer.model, dict(model_inputs), grpo_batch)
    assert len(ran) == 3  # both patched calls and the reference call took ms-swift's sequence-parallel path
    assert torch.equal(ours, theirs)
    _assert_fell_back(patch, messages, REASON_SEQUENCE_PARALLEL, 2)


def test_padding_free_falls_back(step, monkeypatch):
    """``--padding_free`` (rows packed into one sequence, position ids restarting per row; ms-swift allows it only with
    flash attention, which does not run on CPU, so the packed batch is built here from the step's rows with ms-swift's
    own frame function and transformers' packed-sequence masking serves the forward): ms-swift's own method runs and
    returns its frame (rows right-aligned, -1e10 padding), one warning for two calls."""
    from swift.rl_core.data import GRPOBatch
    from swift.rlhf_trainers.utils import build_completion_mask_and_seq_lengths

    trainer, model_inputs, grpo_batch = step
    ids, mask, completion = model_inputs["input_ids"], model_inputs["attention_mask"].bool(), grpo_batch.completion_mask
    labels = torch.full_like(ids, -100)
    labels[:, -completion.shape[1] :] = torch.where(completion, ids[:, -completion.shape[1] :], -100)
    packed_ids, packed_labels = ids[mask][None], labels[mask][None]
    position_ids = torch.cat([torch.arange(int(n)) for n in mask.sum(1)])[None]
    keep = int(packed_labels.shape[1] - (packed_labels[0] != -100).int().argmax())
    inputs = {"input_ids": packed_ids, "position_ids": position_ids}
    frame_mask, seq_lengths, _ = build_completion_mask_and_seq_lengths(
        packed_labels, ids.shape[0], padding_free=True, encoded_batch=inputs, logits_to_keep=keep
    )
    batch = GRPOBatch(
        completion_mask=frame_mask,
        truncated_mask=grpo_batch.truncated_mask,
        seq_lengths=seq_lengths,
        logits_to_keep=keep,
    )
    monkeypatch.setattr(trainer.template, "padding_free", True)
    with torch.no_grad():
        (ours, _), patch, messages = _patched_calls(trainer, 2, trainer.model, dict(inputs), batch)
        theirs, _ = _own(trainer, trainer.model, dict(inputs), batch)
    assert ours.shape == (ids.shape[0], keep) and bool((ours == -1e10).any())  # ms-swift's padding-free frame
    assert torch.equal(ours, theirs)
    _assert_fell_back(patch, messages, REASON_PADDING_FREE, 2)


def test_multimodal_inputs_fall_back(step, monkeypatch):
    """A multimodal model (ms-swift's ``is_multimodal``): ms-swift's own method runs, one warning for two calls. Inputs
    carrying images are refused by name before any forward."""
    trainer, model_inputs, grpo_batch = step
    monkeypatch.setattr(trainer, "is_multimodal", True)
    with torch.no_grad():
        (ours, _), patch, messages = _patched_calls(trainer, 2, trainer.model, dict(model_inputs), grpo_batch)
        theirs, _ = _own(trainer, trainer.model, dict(model_inputs), grpo_batch)
    assert torch.equal(ours, theirs)
    _assert_fell_back(patch, messages, REASON_MULTIMODAL, 2)

    monkeypatch.setattr(trainer, "is_multimodal", False)
    patch = patch_trainer(trainer, self_check=False)
    try:
        images = {**model_inputs, "pixel_values": torch.zeros(1, 3, 4, 4), "image_grid_thw": torch.ones(1, 3)}
        assert patch.call_reason(trainer.model, images) == f"{REASON_MULTIMODAL} (image_grid_thw, pixel_values)"
        assert patch.call_reason(trainer.model, model_inputs) is None
    finally:
        unpatch_trainer(trainer)


def test_liger_gradient_path_falls_back(step, monkeypatch):
    """``--use_liger_kernel``: the policy's loss is Liger's fused GRPO loss over full rows (``compute_liger_loss``);
    it runs as ms-swift's own, gives ms-swift's loss and gradients, and is counted and warned about once."""
    pytest.importorskip("liger_kernel", reason="liger-kernel is not installed")
    trainer, model_inputs, grpo_batch = step
    monkeypatch.setattr(trainer.args, "use_liger_kernel", True)
    trainer._prepare_liger_loss()  # what ms-swift's constructor does with the flag set
    monkeypatch.setattr(trainer, "use_liger_loss", True)
    model = trainer.model

    def loss_and_grads(compute):
        model.zero_grad()
        loss = compute()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    inputs = {"model_inputs": dict(model_inputs), "grpo_batch": grpo_batch}
    theirs = loss_and_grads(lambda: trainer.compute_loss(model, inputs))
    patch = patch_trainer(trainer, self_check=False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours = loss_and_grads(lambda: trainer.compute_loss(model, inputs))
            loss_and_grads(lambda: trainer.compute_loss(model, inputs))
    finally:
        unpatch_trainer(trainer)
        model.zero_grad()
    messages = [str(w.message) for w in caught if "shared_prefix_logps" in str(w.message)]
    assert torch.equal(ours[0], theirs[0]) and ours[1].keys() == theirs[1].keys()
    assert all(torch.equal(ours[1][name], grad) for name, grad in theirs[1].items())
    assert patch.stats.fallback_reasons == {REASON_LIGER: 2} and patch.stats.shared_calls == 0
    assert len(messages) == 1 and REASON_LIGER in messages[0], messages


def test_dynamic_num_samples_chunks_are_served(step, monkeypatch):
    """``dynamic_num_samples`` with more rows than the batch size: ms-swift's own method splits the micro-batch (its
    chunk count agreed across processes) and the plug-in serves every chunk; log-probs and entropies within 1e-5 of
    ms-swift's own split at every completion token, ms-swift's shape and dtype."""
    trainer, model_inputs, grpo_batch = step
    monkeypatch.setattr(trainer, "dynamic_num_samples", True)
    monkeypatch.setattr(trainer.args, "per_device_train_batch_size", 3)  # 8 rows: 3 chunks
    with torch.no_grad():
        (ours, ours_entropy), patch, messages = _patched_calls(
            trainer, 1, trainer.model, dict(model_inputs), grpo_batch, compute_entropy=True
        )
        theirs, theirs_entropy = _own(trainer, trainer.model, dict(model_inputs), grpo_batch, compute_entropy=True)
    valid = grpo_batch.completion_mask
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype and ours_entropy.shape == theirs_entropy.shape
    torch.testing.assert_close(ours[valid], theirs[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_entropy[valid], theirs_entropy[valid], atol=1e-5, rtol=0)
    assert patch.stats.shared_calls == 3 and patch.stats.fallback_calls == 0 and not messages
