"""The head never holds more than one chunk of (tokens x vocabulary) logits, in forward or backward."""

import torch
from support.tiny_models import VOCAB, build_model, make_batch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shared_prefix_logps import compute_logps
from shared_prefix_logps.forward import head_proxy

CHUNK = 8


class VocabSizedAllocations(TorchDispatchMode):
    """Records the row count of every newly allocated tensor whose last axis is the vocabulary."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr() for t in inputs}
        for t in tree_flatten(out)[0]:
            # Views and in-place results share an input's storage: they allocate nothing.
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == VOCAB:
                if t.untyped_storage().data_ptr() not in storages:
                    self.rows.append(t.numel() // VOCAB)
        return out


def _run(backend, monkeypatch):
    monkeypatch.setattr(head_proxy, "HEAD_CHUNK_ROWS", CHUNK)
    model = build_model("qwen3")  # untied: no (V, H) embedding gradient with a last axis of V either
    prompts, pmask, comps, cmask = make_batch(2, 4, prompt_len=7, completion_len=9, seed=2)
    assert cmask.sum() > 4 * CHUNK  # enough tokens that full logits would be several chunks
    tracker = VocabSizedAllocations()
    with tracker:
        out = compute_logps(
            model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_entropy=True, backend=backend
        )
        (out.logps.sum() + out.entropy.sum()).backward()
    return tracker.rows, int(cmask.sum())


def test_shared_path_allocates_at_most_one_chunk_of_logits(monkeypatch):
    rows, tokens = _run("auto", monkeypatch)
    assert rows, "the head allocated no vocabulary-sized tensor at all: the tracker is not seeing it"
    assert max(rows) <= CHUNK < tokens
    assert CHUNK in rows  # full chunks do occur, so the bound is what limits them


def test_tracker_catches_full_logits_of_the_dense_path(monkeypatch):
    rows, tokens = _run("dense", monkeypatch)
    assert max(rows) >= tokens
