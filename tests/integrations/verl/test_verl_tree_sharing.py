"""The verl plug-in shares a system prompt common to different prompts, with no configuration change: through verl's
real ``FSDPEngineWithLMHead`` (FSDP2, gloo, CPU), a micro-batch whose distinct prompts start with the same system
prompt is scored as a prefix tree (the system prompt embedded once per micro-batch, not once per prompt), and its
log-probs, entropies, losses and gradients are the unpatched engine's. Prompts that share too little take the
two-level path, as exactly; under FSDP with two processes the searched trie serves no-grad calls only."""

from __future__ import annotations

import faulthandler

import pytest

pytest.importorskip("verl")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from support import verl_setup as vs  # noqa: E402
from support.distributed import free_port, set_rank_environment  # noqa: E402
from support.trees import spy_searched_plans, spy_tree_calls  # noqa: E402

SYSTEM = (
    70  # tokens of the shared system prompt: one repeat of it saves more than the searched trie's 64-token threshold
)
SHORT_SYSTEM = 8  # a shared start too short for the searched trie to pay
MICRO_BATCH = 6  # rows per micro-batch: the 12 shuffled rows make 2 micro-batches, each with 2 or 3 distinct prompts


def system_batch(engine, *, system_prompt=SYSTEM, infer=True, seed=0, **options):
    """3 prompts x 4 responses, shuffled, every prompt starting with the same ``system_prompt`` tokens, with verl's
    batch options (``options`` override them)."""
    td = vs.rollout_batch(system_prompt=system_prompt, shuffle=True, seed=seed)
    return vs.assign(vs.batch_options(engine, td, infer=infer), **options)


def engine_pair(path, **options):
    """A patched engine whose first no-grad and grad micro-batches (its self-checks against verl's own step, which
    embed verl's full rows as well) have run and passed, and its unpatched twin (same weights)."""
    from shared_prefix_logps.integrations.verl import get_patch, unpatch_verl_engine

    patched, unpatched = (vs.build_engine(path, micro_batch_size=MICRO_BATCH, **options) for _ in range(2))
    unpatch_verl_engine(unpatched)
    vs.infer(patched, system_batch(patched))
    vs.forward_backward(patched, system_batch(patched, infer=False), vs.ppo_loss())
    assert [check.passed for check in get_patch(patched).stats.self_checks] == [True, True]
    return patched, unpatched


@pytest.fixture(scope="module")
def engines(process_group, tmp_path_factory):
    return engine_pair(vs.save_model(tmp_path_factory.mktemp("qwen2"), "qwen2"))


@pytest.fixture
def tree_calls(monkeypatch):
    """The number of rows of every call the searched trie served."""
    return spy_tree_calls(monkeypatch)


def counted(engine, run):
    """``run()``'s result and the number of token ids the engine's input embedding received meanwhile."""
    counter = vs.TokenCounter(engine)
    try:
        result = run()
    finally:
        counter.close()
    return result, counter.tokens


def micro_batches(td, size: int = MICRO_BATCH) -> list[tuple[set[tuple[int, ...]], int]]:
    """verl's micro-batches of ``td`` (consecutive rows; no dynamic batch size): the distinct prompts (valid tokens) of
    each and its number of valid response tokens."""
    width = td["responses"].shape[1]
    valid = td["attention_mask"].bool()
    out = []
    for start in range(0, len(td), size):
        rows = range(start, min(start + size, len(td)))
        prompts = {tuple(td["prompts"][i][valid[i, :-width]].tolist()) for i in rows}
        out.append((prompts, int(valid[rows.start : rows.stop, -width:].sum())))
    return out


def two_level_floor(td) -> int:
    """The fewest tokens the two-level trie can embed for ``td``, counted from the rows alone: in each micro-batch each
    distinct prompt but its last token (the prompts' node call) and every valid response token (the completions'),
    no padding."""
    return sum(sum(len(prompt) - 1 for prompt in prompts) + responses for prompts, responses in micro_batches(td))


def response(nested, td):
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(nested, td)


@pytest.mark.parametrize("remove_padding", [True, False], ids=["rmpad", "padded"])
def test_infer_batch_shares_the_system_prompt(engines, tree_calls, monkeypatch, remove_padding):
    """Old-policy log-probs and entropy: the searched trie serves both micro-batches, embeds fewer tokens than two-level
    sharing can (and than it does, by the repeated system prompts), and returns the unpatched engine's numbers."""
    from shared_prefix_logps.engine import merge
    from shared_prefix_logps.engine import sharing as grouped

    # The trie's own count: the tiny-node rule would merge each 3-5-token prompt node into its responses.
    monkeypatch.setattr(merge, "MERGE_BELOW_SAVED_TOKENS", 0)
    patched, unpatched = engines
    td = system_batch(patched, seed=1, use_remove_padding=remove_padding)
    ours, deeper = counted(patched, lambda: vs.infer(patched, td))
    assert tree_calls == [MICRO_BATCH, MICRO_BATCH]
    theirs = vs.infer(unpatched, system_batch(unpatched, seed=1, use_remove_padding=remove_padding))
    for key in ("log_probs", "entropy"):
        diff = (response(ours["model_output"][key], td) - response(theirs["model_output"][key], td)).abs().max()
        assert diff.item() < 1e-5, (key, diff.item())
    floor = two_level_floor(td)
    assert deeper < floor, (deeper, floor)

    monkeypatch.setattr(grouped, "DEEPER_SHARING_MIN_TOKENS", 10**9)  # the two-level trie only
    two_level_out, two_level = counted(patched, lambda: vs.infer(patched, td))
    assert len(tree_calls) == 2  # the searched trie not taken this time
    diff = response(two_level_out["model_output"]["log_probs"], td) - response(theirs["model_output"]["log_probs"], td)
    assert diff.abs().max().item() < 1e-5
    assert two_level >= floor, (two_level, floor)
    # each micro-batch embeds its system prompt once where the two-level trie embeds it once per distinct prompt
    repeats = sum(len(prompts) - 1 for prompts, _ in micro_batches(td))
    assert repeats >= 2 and deeper <= two_level - repeats * (SYSTEM - 1), (deeper, two_level, repeats)


@pytest.mark.parametrize("variant", ["rmpad", "padded", "checkpointing"])
def test_training_step_shares_the_system_prompt(engines, process_group, tmp_path, tree_calls, variant):
    """``ppo_loss`` (token-mean, entropy bonus, KL loss) forward and backward: the searched trie serves both
    micro-batches with gradients and embeds fewer tokens than the two-level trie can; every micro-batch's loss, every
    metric and every parameter's gradient (within 1e-4 of its largest entry) are the unpatched engine's. Also with
    verl's remove-padding off, and with its non-reentrant gradient checkpointing."""
    from shared_prefix_logps.integrations.verl import get_patch

    if variant == "checkpointing":
        engines = engine_pair(vs.save_model(tmp_path, "qwen2"), gradient_checkpointing=True)
        tree_calls.clear()  # the new engines' first micro-batches
    patched, unpatched = engines
    loss_fn = vs.ppo_loss(loss_agg_mode="token-mean", entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
    options = dict(infer=False, seed=2, use_remove_padding=variant != "padded")
    td = system_batch(patched, **options)
    (ours, our_grads), deeper = counted(patched, lambda: vs.forward_backward(patched, td, loss_fn))
    assert tree_calls == [MICRO_BATCH, MICRO_BATCH]
    theirs, their_grads = vs.forward_backward(unpatched, system_batch(unpatched, **options), loss_fn)
    losses = torch.tensor(ours["loss"], dtype=torch.float64), torch.tensor(theirs["loss"], dtype=torch.float64)
    assert len(losses[0]) == 2 and torch.allclose(*losses, rtol=1e-5, atol=1e-7), losses
    vs.assert_metrics_close(ours["metrics"], theirs["metrics"])
    worst = vs.gradient_error(our_grads, their_grads)
    assert worst < 1e-4, worst
    assert deeper < two_level_floor(td), (deeper, two_level_floor(td))
    stats = get_patch(patched).stats
    assert stats.fallback_calls == 0 and all(check.passed for check in stats.self_checks)


def test_prompts_sharing_too_little_take_the_two_level_trie(engines, tree_calls):
    """A shared system prompt of 8 tokens saves too little for the searched trie: the two-level trie serves every
    micro-batch, with the unpatched engine's log-probs, entropies, losses and gradients."""
    from shared_prefix_logps.integrations.verl import get_patch

    patched, _ = engines
    served = get_patch(patched).stats.shared_calls
    results = []
    for engine in engines:
        td = system_batch(engine, system_prompt=SHORT_SYSTEM, seed=3)
        out = vs.infer(engine, td)["model_output"]
        train = system_batch(engine, system_prompt=SHORT_SYSTEM, seed=4, infer=False)
        trained, grads = vs.forward_backward(engine, train, vs.ppo_loss(entropy_coeff=0.01))
        results.append(([response(out[key], td) for key in ("log_probs", "entropy")], trained["loss"], grads))
    assert tree_calls == [] and get_patch(patched).stats.shared_calls == served + 4
    (ours, our_loss, our_grads), (theirs, their_loss, their_grads) = results
    for mine, verl in zip(ours, theirs):
        assert (mine - verl).abs().max().item() < 1e-5
    assert torch.allclose(torch.tensor(our_loss), torch.tensor(their_loss), rtol=1e-5, atol=1e-7)
    assert vs.gradient_error(our_grads, their_grads) < 1e-4


def test_bf16_mixed_precision(process_group, tmp_path, tree_calls):
    """verl's default mixed precision (bf16 parameters and autocast): the searched trie serves both micro-batches, and
    its log-probs are as close to a float32 engine's as verl's own bf16 log-probs are."""
    from shared_prefix_logps.integrations.verl import unpatch_verl_engine

    path = vs.save_model(tmp_path, "qwen2")
    bf16 = dict(mixed_precision={"param_dtype": "bf16", "reduce_dtype": "fp32", "buffer_dtype": "fp32"})
    ours, theirs = (vs.build_engine(path, micro_batch_size=MICRO_BATCH, **bf16) for _ in range(2))
    reference = vs.build_engine(path, micro_batch_size=MICRO_BATCH)
    for engine in (theirs, reference):
        unpatch_verl_engine(engine)
    logps = {}
    for name, engine in (("ours", ours), ("verl", theirs), ("fp32", reference)):
        td = system_batch(engine, seed=5)
        logps[name] = response(vs.infer(engine, td)["model_output"]["log_probs"], td).float()
    assert tree_calls == [MICRO_BATCH, MICRO_BATCH]
    our_error = (logps["ours"] - logps["fp32"]).abs().max().item()
    verl_error = (logps["verl"] - logps["fp32"]).abs().max().item()
    assert 0 < our_error <= 1.5 * verl_error + 1e-2, (our_error, verl_error)


def _fsdp_worker(rank, port, path, results):
    """Process 0's prompts share a system prompt, process 1's do not: their no-grad micro-batches make different
    numbers of forwards (one per trie depth, or the two-level trie's two), which the plug-in joins. With gradients the
    searched trie stays off under several processes (their forwards must pair one for one) and the two-level trie
    trains."""
    set_rank_environment(rank, port)
    faulthandler.dump_traceback_later(240, exit=True)  # a process left waiting for a collective dies with its stack
    torch.set_num_threads(1)
    vs.use_cpu_platform()
    torch.distributed.init_process_group("gloo")
    from shared_prefix_logps.engine import merge
    from shared_prefix_logps.integrations.verl import get_patch, unpatch_verl_engine

    # Process 0's trie keeps its 3-5-token prompt nodes (the tiny-node rule would merge them into the responses and
    # leave two depths, as many forwards as process 1's two-level trie): the processes' forward counts must differ here.
    merge.MERGE_BELOW_SAVED_TOKENS = 0
    tree_calls = {"no grad": 0, "grad": 0}

    def count(batch):
        tree_calls["grad" if torch.is_grad_enabled() else "no grad"] += 1

    spy_searched_plans(count)
    patched, unpatched = (vs.build_engine(path, micro_batch_size=MICRO_BATCH) for _ in range(2))
    unpatch_verl_engine(unpatched)
    out = {}
    for name, engine in (("patched", patched), ("unpatched", unpatched)):
        batch = vs.rollout_batch(system_prompt=SYSTEM if rank == 0 else 0, shuffle=True, seed=50 + rank)
        td = vs.batch_options(engine, batch)
        result = vs.infer(engine, td)["model_output"]
        logps, entropy = (response(result[key], td) for key in ("log_probs", "entropy"))
        batch = vs.rollout_batch(system_prompt=SYSTEM, shuffle=True, seed=52 + rank, temperature=0.9)
        td = vs.assign(vs.batch_options(engine, batch, infer=False), global_batch_size=24)
        loss_fn = vs.ppo_loss(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
        with engine.train_mode():
            trained = engine.train_batch(td, loss_function=loss_fn)
        out[name] = dict(
            logps=logps,
            entropy=entropy,
            loss=trained["loss"],
            metrics={key: vs.metric_values(value) for key, value in trained["metrics"].items()},
            params=vs.full_parameters(engine),
        )
    patch = get_patch(patched)
    out["stats"] = dict(
        tree_calls=tree_calls,
        shared=patch.stats.shared_calls,
        fallbacks=patch.stats.fallback_calls,
        checks=[check.passed for check in patch.stats.self_checks],
        padding_forwards=patch.lockstep.padding_forwards,
    )
    results[rank] = out
    torch.distributed.destroy_process_group()


def test_two_process_fsdp2(tmp_path):
    """Two gloo processes under FSDP2: old-policy log-probs and entropies (1e-5) and one optimizer step of
    ``ppo_loss`` (SGD: equal parameters after the step mean equal gradients) as the unpatched engines compute them;
    the searched trie served process 0's two no-grad micro-batches (process 1's have no system prompt) and both
    processes' two training micro-batches (both hold the system prompt)."""
    path = vs.save_model(tmp_path / "model", "qwen2")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_fsdp_worker, args=(free_port(), path, results), nprocs=2, join=True)
        results = dict(results)
    for rank in range(2):
        ours, theirs = results[rank]["patched"], results[rank]["unpatched"]
        for key in ("logps", "entropy"):
            assert (ours[key] - theirs[key]).abs().max().item() < 1e-5, (rank, key)
        vs.assert_same_training_step(ours, theirs, rank)
        stats = results[rank]["stats"]
        assert stats["shared"] == 4 and stats["fallbacks"] == 0 and stats["checks"] == [True, True], stats
        # Training shares the system prompt both processes' batches hold: the searched trie with gradients too.
        assert stats["tree_calls"] == {"no grad": 2 if rank == 0 else 0, "grad": 2}, stats
    # process 0 made one forward per trie depth, process 1 two (the two-level trie): the counts differed and were joined
    assert results[0]["stats"]["padding_forwards"] + results[1]["stats"]["padding_forwards"] > 0
