"""distributed/backward_driver.py: the per-chunk loss step both chunked entry points share, and the driver choice."""

import pytest
import torch
from support.tiny_models import build_model, make_batch
from support.trees import pad_rows, random_tree_rows

from shared_prefix_logps import chunked_backward, chunked_backward_tree
from shared_prefix_logps.distributed.backward_driver import (
    DDPBackward,
    PlainBackward,
    backward_chunk_loss,
    backward_driver,
)


class _RecordingDriver(PlainBackward):
    def __init__(self):
        self.calls = []

    def loss(self, loss):
        self.calls.append(float(loss.detach()))


def test_chunk_loss_with_grad_goes_to_the_driver():
    driver = _RecordingDriver()
    leaf = torch.tensor(2.0, requires_grad=True)
    ran = backward_chunk_loss(driver, leaf * 3, chunk_rows=torch.tensor([0]), has_valid=True, logps_need_grad=True)
    assert ran and driver.calls == [6.0]


def test_chunk_loss_without_grad_is_skipped_only_without_valid_tokens():
    driver = _RecordingDriver()
    rows = torch.arange(10)
    ran = backward_chunk_loss(driver, torch.tensor(0.0), chunk_rows=rows, has_valid=False, logps_need_grad=True)
    assert not ran and driver.calls == []
    with pytest.raises(RuntimeError, match=r"rows \[0, 1, 2, 3, 4, 5, 6, 7, \.\.\.\].*loss_fn detached it"):
        backward_chunk_loss(driver, torch.tensor(0.0), chunk_rows=rows, has_valid=True, logps_need_grad=True)
    with pytest.raises(RuntimeError, match="no parameter of the model requires grad"):
        backward_chunk_loss(driver, torch.tensor(0.0), chunk_rows=rows, has_valid=True, logps_need_grad=False)


@pytest.mark.parametrize("loss", [torch.zeros(2, requires_grad=True), 1.0], ids=["vector", "float"])
def test_chunk_loss_must_be_a_scalar_tensor(loss):
    with pytest.raises(TypeError, match="loss_fn must return a scalar tensor"):
        backward_chunk_loss(_RecordingDriver(), loss, chunk_rows=torch.arange(1), has_valid=True, logps_need_grad=True)


def test_both_chunked_entry_points_refuse_a_detached_loss_alike():
    """Both chunked entry points go through the same per-chunk step: same refusal, same words."""
    model = build_model("llama")
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=5, completion_len=3)
    detached = lambda out, rows: out.logps.sum().detach()  # noqa: E731
    with pytest.raises(RuntimeError, match=r"chunk of rows \[0, 2\] .* loss_fn detached it") as two_level:
        chunked_backward(
            model, prompts, comps, detached, generations_per_chunk=1, prompt_mask=pmask, completion_mask=cmask
        )
    ids, mask, score = pad_rows(random_tree_rows(4, depth=2, branching=2), 4)
    with pytest.raises(RuntimeError, match=r"chunk of rows \[\d+\] .* loss_fn detached it") as tree:
        chunked_backward_tree(model, ids, mask, score, detached, rows_per_chunk=1)
    assert str(two_level.value).split("]", 1)[1] == str(tree.value).split("]", 1)[1]


def test_driver_of_an_unwrapped_model_is_plain_autograd():
    model = build_model("llama")
    driver = backward_driver(model)
    assert type(driver) is PlainBackward and not isinstance(driver, DDPBackward)


@pytest.mark.parametrize("entry", ["chunked_backward", "chunked_backward_tree"])
def test_driver_refusals_name_the_entry_point_that_was_called(entry, monkeypatch):
    from types import SimpleNamespace

    from shared_prefix_logps.distributed import backward_driver as module

    static = SimpleNamespace(static_graph=True, require_backward_grad_sync=True)
    monkeypatch.setattr(module, "find_ddp", lambda model: static)
    with pytest.raises(ValueError, match=rf"^{entry} cannot serve a DistributedDataParallel model with static_graph"):
        backward_driver(torch.nn.Linear(2, 2), entry)
