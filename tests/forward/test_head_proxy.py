"""The lm_head proxy leaves the model picklable: a model used by the library survives ``torch.save``/``torch.load``,
``pickle`` and being sent to another process (multiprocessing, Ray arguments), and the loaded model runs plain
forwards and shared-prefix calls exactly."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
import torch.multiprocessing as mp
from support.exactness import compare_with_dense
from support.tiny_models import VOCAB, build_model, make_batch

from shared_prefix_logps import compute_logps

#: Llama runs sdpa (its name stays in the config); Gemma2 runs eager, which the library renames in the config.
FAMILIES = ("llama", "gemma2")


def _used_model(family):
    """A model after one shared-prefix call, with its plain logits on ``ids`` from before that call."""
    model = build_model(family)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=6, completion_len=4)
    compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)
    return model, ids, logits


def _assert_works(model, ids, logits):
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, logits, rtol=0, atol=0)
    prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=7, completion_len=5, seed=1)
    logps_err, _, grad_err = compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)
    assert logps_err <= 1e-5 and grad_err <= 1e-4, (logps_err, grad_err)


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_save_and_load_after_use(family):
    model, ids, logits = _used_model(family)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    _assert_works(loaded, ids, logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_pickle_after_use(family):
    model, ids, logits = _used_model(family)
    _assert_works(pickle.loads(pickle.dumps(model)), ids, logits)
    _assert_works(model, ids, logits)  # the original is untouched


def _plain_forward_then_score(model, ids, queue):
    """In a fresh process that never prepared a model: a plain forward first (its config may name the shared-prefix
    attention), then a shared-prefix call."""
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=7, completion_len=5, seed=1)
        logps = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask).logps
    queue.put((logits.tolist(), logps.tolist()))


def test_sent_to_a_fresh_process_after_use():
    model, ids, logits = _used_model("gemma2")  # eager: the config names the shared-prefix attention
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    process = context.Process(target=_plain_forward_then_score, args=(model, ids, queue))
    process.start()
    process.join(timeout=240)
    assert process.exitcode == 0, process.exitcode
    remote_logits, remote_logps = queue.get()
    torch.testing.assert_close(torch.tensor(remote_logits), logits, rtol=0, atol=1e-6)
    prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=7, completion_len=5, seed=1)
    with torch.no_grad():
        dense = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, backend="dense")
    assert (torch.tensor(remote_logps) - dense.logps).abs().max() <= 1e-5
