"""The jitted train step: 8-device (data=2, fsdp=2, tensor=2) == 1 device, shardings as the
rules say, and micro-batch accumulation == one full batch (RL losses and SFT)."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from float_tolerance import (
    EPS32,
    ULPS,
    assert_close_at_scale,
    assert_trees_close_at_scale,
    gradient_recorder,
    well_conditioned,
)
from jax.sharding import PartitionSpec as P

from bridge.model import tiny_model
from learner_jax.model import model, sharding
from learner_jax.training import losses, optim, train_state, train_step

CFG = tiny_model.tiny_config("qwen3")
B, T = 16, 20
LR = 1e-2
# Adam's first update is lr * g / (|g| + eps): with the default eps=1e-8 a gradient entry
# near 1e-8 turns float rounding (~1e-11) into a visible update difference, whatever the
# implementation. eps=1e-5 keeps that conditioning sane; every other entry still moves ~lr.
OPT = optim.make_optimizer(
    optim.OptimizerConfig(
        learning_rate=LR, warmup_steps=0, total_steps=10, weight_decay=0.1, eps=1e-5
    )
)
MESH_8 = {"data": 2, "fsdp": 2, "tensor": 2}
GRADS = gradient_recorder()  # moves nothing; its state after a step is the step's gradient


def make_rl_batch(seed=0):
    """Rows of different lengths (so micro-batches hold different token counts), a dropped
    row (seq_mask 0), stale behavior log-probs and signed advantages."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, CFG.vocab_size, (B, T + 1))
    prompt = rng.integers(3, 8, B)
    length = rng.integers(10, T + 2, B)
    valid = np.arange(T + 1)[None, :] < length[:, None]
    tokens = np.where(valid, tokens, 0)
    loss_mask = (np.arange(T + 1)[None, :] >= prompt[:, None]) & valid
    seq_mask = np.ones(B)
    seq_mask[5] = 0.0
    return train_step.make_batch(
        tokens,
        loss_mask,
        behavior_logp=np.log(1.0 / CFG.vocab_size) + 0.3 * rng.standard_normal((B, T)),
        advantages=rng.standard_normal(B),
        seq_mask=seq_mask,
        on_policy=(np.arange(B) % 2).astype(np.float32),
    )


@functools.cache
def initial_state(mesh_items, opt=OPT):
    mesh_shape = dict(mesh_items)
    n = int(np.prod(list(mesh_shape.values())))
    mesh = sharding.make_mesh(mesh_shape, jax.devices()[:n])
    _, shardings = train_state.state_shardings(CFG, opt, mesh)
    return mesh, train_state.create_train_state(CFG, opt, mesh, seed=0), shardings


def run_step(mesh_shape, step_cfg, batch, opt=OPT):
    mesh, state, shardings = initial_state(tuple(sorted(mesh_shape.items())), opt)
    before = jax.device_get(state.params)
    # No donation: the cached initial state is reused by several tests.
    step = train_step.jit_step(CFG, opt, step_cfg, mesh, shardings, donate=False)
    new_state, metrics = step(state, train_step.put_batch(batch, mesh))
    return before, new_state, shardings, jax.device_get(metrics)


def test_sharded_step_equals_single_device_and_follows_rules():
    """Compared before the optimizer divides (float_tolerance.py): the gradient, loss and
    Adam's moments (the clipped gradient and its square) at float32 rounding of their own
    scale; parameters after Adam only where |g| is far above that rounding."""
    cfg = train_step.StepConfig(kind="rl", loss=losses.LossConfig(name="grpo", clip_eps=0.2))
    batch = make_rl_batch()
    _, g1, _, _ = run_step({"data": 1}, cfg, batch, GRADS)
    _, g8, _, _ = run_step(MESH_8, cfg, batch, GRADS)
    g1, g8 = jax.device_get(g1.opt_state), jax.device_get(g8.opt_state)
    assert_trees_close_at_scale(g8, g1)

    before, one, _, m1 = run_step({"data": 1}, cfg, batch)
    _, eight, shardings, m8 = run_step(MESH_8, cfg, batch)
    assert len(jax.tree.leaves(eight.params)[0].sharding.device_set) == 8
    # The loss is a mean of per-token terms of size ~|log p| (~5): rounding of that scale.
    assert_close_at_scale(m8["loss"], m1["loss"], scale=np.log(CFG.vocab_size), err_msg="loss")
    assert_close_at_scale(m8["grad_norm"], m1["grad_norm"], err_msg="grad_norm")
    adam1, adam8 = jax.device_get(one.opt_state[1][0]), jax.device_get(eight.opt_state[1][0])
    assert_trees_close_at_scale(adam8.mu, adam1.mu)
    assert_trees_close_at_scale(adam8.nu, adam1.nu, ulps=2 * ULPS)  # squares: twice the ulps
    # After Adam: where the gradient is well above rounding, the direction g / (|g| + eps)
    # agrees to ~1e-3 of its size (well_conditioned's margin), so params to ~1e-3 * lr
    # plus their own rounding. Elsewhere Adam amplifies rounding up to lr: not compared.
    p1, p8 = jax.device_get(one.params), jax.device_get(eight.params)
    for (path, a), b, g in zip(
        jax.tree_util.tree_leaves_with_path(p8),
        jax.tree.leaves(p1),
        jax.tree.leaves(g1),
        strict=True,
    ):
        ok = well_conditioned(g)
        assert ok.mean() > 0.5, jax.tree_util.keystr(path)  # most entries are compared
        np.testing.assert_allclose(
            np.asarray(a)[ok], np.asarray(b)[ok], atol=1e-3 * LR, rtol=4 * EPS32,
            err_msg=jax.tree_util.keystr(path),
        )  # fmt: skip
    # The update is real: every parameter moved by ~lr (Adam), far beyond the tolerance.
    moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - b).max(), one.params, before)
    assert min(jax.tree.leaves(moved)) > 1e-3
    assert int(eight.step) == 1 and m8["tokens"] > 0

    # Layout: every array of the new state carries exactly the sharding the rules give.
    for (path, x), s in zip(
        jax.tree_util.tree_leaves_with_path(eight), jax.tree.leaves(shardings), strict=True
    ):
        assert x.sharding.is_equivalent_to(s, x.ndim), jax.tree_util.keystr(path)
    spec = train_state.spec_tree(eight)
    adam = spec.opt_state[1][0]  # chain(clip, adamw(scale_by_adam, decay, lr)) -> adam state
    for tree in (spec.params, adam.mu, adam.nu):
        assert tree["embed"]["embedding"] == P("tensor", "fsdp")  # (vocab, embed)
        attn, mlp = tree["layers_0"]["attn"], tree["layers_1"]["mlp"]
        assert attn["q_proj"]["kernel"] == P("fsdp", "tensor", None)  # (embed, heads, kv)
        assert attn["o_proj"]["kernel"] == P("tensor", None, "fsdp")  # (heads, kv, embed)
        assert mlp["down_proj"]["kernel"] == P("tensor", "fsdp")  # (mlp, embed)
        assert tree["final_norm"]["scale"] == P("fsdp")
    replicated = [adam.count, spec.step, spec.rng, spec.opt_state[1][2].count]
    assert all(all(a is None for a in s) for s in replicated), replicated


@pytest.mark.parametrize(
    "step_cfg",
    [
        train_step.StepConfig(kind="rl", loss=losses.LossConfig(name="grpo")),
        train_step.StepConfig(kind="sft"),  # normalized by tokens, like dapo
    ],
    ids=["grpo", "sft"],
)
def test_micro_batches_equal_full_batch(step_cfg):
    """1 x 16 rows == 4 x 4 rows; micro-batches have different token counts, so a plain
    mean of micro-batch losses would differ from the full-batch loss."""
    batch = make_rl_batch(seed=1)
    mesh = {"data": 2, "fsdp": 2}  # micro-batches of 4 rows still split over 4 devices
    # Gradients, not parameters after Adam (see float_tolerance.py): same update <=> same g.
    _, full, _, mf = run_step(mesh, step_cfg, batch, GRADS)
    _, acc, _, ma = run_step(mesh, dataclasses.replace(step_cfg, micro_batches=4), batch, GRADS)
    assert_trees_close_at_scale(jax.device_get(acc.opt_state), jax.device_get(full.opt_state))
    for key in ("loss", "grad_norm", "entropy", "tokens"):
        # Per-token terms of log-prob size (~log V) or larger.
        scale = max(abs(float(mf[key])), np.log(CFG.vocab_size))
        assert_close_at_scale(ma[key], mf[key], scale=scale, err_msg=key)
    if step_cfg.kind == "rl":
        # The audit's per-row sums come back in batch row order whatever the micro-batching,
        # and they add up to the step's mismatch metric.
        rows = {k: v for k, v in ma.items() if k.startswith(train_step.ROWS)}
        names = ("k3", "logratio", "tokens", "dev", "var", "evidence")
        assert set(rows) == {train_step.ROWS + n for n in names}
        for key, value in rows.items():
            # A row sums up to T log-prob-sized terms (squared ones for the variance): its
            # rounding is of that size.
            row_scale = T * np.log(CFG.vocab_size) ** (2 if key.endswith("var") else 1)
            assert value.shape == (batch.size,)
            assert_close_at_scale(value, mf[key], scale=row_scale, err_msg=key)
        on = np.asarray(batch.on_policy) > 0
        mask = np.asarray(batch.loss_mask * batch.seq_mask[:, None])
        np.testing.assert_allclose(rows[train_step.ROWS + "tokens"], mask.sum(1) * on)
        kl = rows[train_step.ROWS + "k3"].sum() / max(rows[train_step.ROWS + "tokens"].sum(), 1)
        assert_close_at_scale(kl, ma["mismatch/kl"], err_msg="kl")  # sums of k3 >= 0

    # The exactness is not luck: the per-micro-batch normalizers really differ.
    toks = np.asarray(batch.loss_mask * batch.seq_mask[:, None]).sum(1)
    per_micro = [toks[i::4].sum() for i in range(4)]
    assert len(set(per_micro)) > 1


def test_indivisible_batch_is_rejected():
    mesh, state, _ = initial_state((("data", 1),))
    fn = train_step.make_step_fn(CFG, OPT, train_step.StepConfig(kind="sft", micro_batches=3))
    with pytest.raises(ValueError, match="micro-batches"):
        jax.eval_shape(fn, state, make_rl_batch())  # fails while tracing, before any compile


def test_make_batch_shifts_and_masks():
    tokens = np.array([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]])
    loss_mask = np.array([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
    b = train_step.make_batch(tokens, loss_mask)
    np.testing.assert_array_equal(b.tokens, tokens[:, :-1])
    np.testing.assert_array_equal(b.targets, tokens[:, 1:])
    np.testing.assert_array_equal(b.segment_ids, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(b.positions, [[0, 1, 2, 3, 0], [0, 1, 2, 3, 4]])
    # Row 0: targets 7, 8 are completion tokens; the pad targets are not.
    np.testing.assert_array_equal(b.loss_mask, [[0, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="must all be"):
        train_step.make_batch(tokens, loss_mask[:, :-1])


def test_bf16_compute_keeps_fp32_master_weights():
    batch = make_rl_batch(seed=2)
    cfg32 = train_step.StepConfig(kind="sft")
    _, s32, _, m32 = run_step({"data": 1}, cfg32, batch)
    _, s16, _, m16 = run_step({"data": 1}, dataclasses.replace(cfg32, dtype="bfloat16"), batch)
    assert {x.dtype for x in jax.tree.leaves(s16.params)} == {np.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(s16.opt_state[1][0].mu)} == {np.dtype("float32")}
    # bf16 matmuls: same loss to bf16 precision, but not bitwise the fp32 computation.
    np.testing.assert_allclose(m16["loss"], m32["loss"], rtol=2e-2)
    assert m16["loss"] != m32["loss"]


def test_mismatch_kl_equals_numpy_k3_and_is_never_negative():
    """`mismatch/kl` on on-policy rows and `staleness/kl` on every trained token vs a float64
    numpy k3 of the same log-prob gaps."""
    from learner_jax.model import model

    base = make_rl_batch(seed=3)
    mesh, state, _ = initial_state((("data", 1), ("fsdp", 1), ("tensor", 1)))
    prox = np.asarray(
        model.forward_logprobs(
            jax.device_get(state.params),
            CFG,
            base.tokens,
            base.positions,
            base.segment_ids,
            base.targets,
        ),
        np.float64,
    )
    m = base.loss_mask * base.seq_mask[:, None]
    mm = m * base.on_policy[:, None]
    assert 0 < mm.sum() < m.sum()  # both kinds of rows: the two means differ
    rng = np.random.default_rng(0)
    mesh, state, shardings = initial_state((("data", 1),))
    # One compiled step for the three batches (run_step would compile each anew).
    step = train_step.jit_step(CFG, OPT, train_step.StepConfig(), mesh, shardings, donate=False)
    for scale in (0.0, 1e-4, 0.05):  # exact engine, float-noise gap, a real numerics gap
        behav = (prox + scale * rng.standard_normal(prox.shape)).astype(np.float32)
        batch = dataclasses.replace(base, behavior_logp=behav)
        metrics = jax.device_get(step(state, train_step.put_batch(batch, mesh))[1])
        d = prox - behav.astype(np.float64)
        want = ((np.exp(d) - d - 1.0) * mm).sum() / mm.sum()
        got = float(metrics["mismatch/kl"])
        assert got >= 0.0
        assert abs(got - want) <= 1e-2 * want + 1e-9, (scale, got, want)
        want_all = ((np.exp(d) - d - 1.0) * m).sum() / m.sum()
        got_all = float(metrics["staleness/kl"])
        assert abs(got_all - want_all) <= 1e-2 * want_all + 1e-9, (scale, got_all, want_all)


@pytest.mark.parametrize("remat", ["full", "dots_saveable"])
def test_remat_step_equals_plain_step(remat):
    """Per-layer remat changes memory, not math: same metrics and update on 8 devices."""
    base = train_step.StepConfig(kind="rl", loss=losses.LossConfig(name="grpo"), micro_batches=2)
    opts = model.ModelOptions(attention="blockwise", attention_block=8)
    plain = dataclasses.replace(base, model_options=opts)
    rematted = dataclasses.replace(base, model_options=dataclasses.replace(opts, remat=remat))
    batch = make_rl_batch(seed=3)
    before, ref, _, m_ref = run_step(MESH_8, plain, batch, GRADS)
    _, out, _, m_out = run_step(MESH_8, rematted, batch, GRADS)
    for name in ("loss", "grad_norm", "entropy"):
        scale = max(abs(float(m_ref[name])), np.log(CFG.vocab_size))
        assert_close_at_scale(m_out[name], m_ref[name], scale=scale, err_msg=name)
    # Same gradient <=> same update (compared before Adam divides, float_tolerance.py).
    assert_trees_close_at_scale(jax.device_get(out.opt_state), jax.device_get(ref.opt_state))
    assert jax.tree.structure(before) == jax.tree.structure(jax.device_get(out.params))


def test_sampling_check_rows_equal_numpy_moments_of_the_processed_distribution():
    """The step's per-row sampling-check sums (bridge/contracts/sampling_check.py: sum of
    log p + H, of Var_p[log p] and of the evidence log p - log sum p^2 over on-policy
    completion tokens) equal a float64 numpy
    computation from the model's logits under the run's temperature and top-k, the
    distribution a worker samples from (truncation.py; the target token always kept)."""
    from bridge.contracts import sampling_check
    from learner_jax.model.truncation import Truncation

    batch = make_rl_batch(seed=4)
    temperature, top_k = 0.7, 20
    step_cfg = train_step.StepConfig(temperature=temperature, truncation=Truncation(top_k=top_k))
    mesh, state, _ = initial_state((("data", 1), ("fsdp", 1), ("tensor", 1)))
    logits = model.Transformer(CFG).apply(
        {"params": jax.device_get(state.params)}, batch.tokens, batch.positions, batch.segment_ids
    )
    x = np.asarray(logits, np.float64) / temperature
    kth = np.sort(x, axis=-1)[..., -top_k][..., None]
    targets = np.asarray(batch.targets)
    keep = (x >= kth) | (np.arange(x.shape[-1]) == targets[..., None])
    x = np.where(keep, x, -np.inf)
    logp_all = x - x.max(-1, keepdims=True)
    logp_all = logp_all - np.log(np.exp(logp_all).sum(-1, keepdims=True))
    logp = np.take_along_axis(logp_all, targets[..., None], -1)[..., 0]
    entropy, variance = sampling_check.position_moments(np.where(keep, logp_all, -np.inf))
    mm = np.asarray(batch.loss_mask * batch.seq_mask[:, None] * batch.on_policy[:, None])
    want_dev, want_var, _ = sampling_check.row_sums(logp, entropy, variance, mm)
    collision = sampling_check.log_collision(np.where(keep, logp_all, -np.inf))
    want_evidence = sampling_check.row_evidence(logp, collision, mm)
    *_, metrics = run_step({"data": 1}, step_cfg, batch)
    row_scale = T * np.log(CFG.vocab_size) ** 2
    assert_close_at_scale(metrics[train_step.ROWS + "dev"], want_dev, scale=row_scale)
    assert_close_at_scale(metrics[train_step.ROWS + "var"], want_var, scale=row_scale)
    assert_close_at_scale(metrics[train_step.ROWS + "evidence"], want_evidence, scale=row_scale)
    assert (want_var[mm.sum(1) > 0] > 0).all() and (mm.sum(1) > 0).sum() >= 4  # compared
    assert (metrics[train_step.ROWS + "dev"][mm.sum(1) == 0] == 0).all()  # off-policy rows


def test_entropy_bonus_gradient_is_minus_alpha_times_mean_entropy_gradient():
    """loss.entropy_coef through the jitted step: with zero advantages the policy term has
    no gradient, so the step's gradient is exactly -alpha * grad(mean entropy over the
    counted tokens), computed here directly from the model (dropped row excluded)."""
    alpha = 0.3
    batch = dataclasses.replace(make_rl_batch(seed=4), advantages=np.zeros(B, np.float32))
    mesh = {"data": 1}
    # One compiled step: any gradient of the policy term at zero advantages would show
    # as a difference from the entropy-only gradient below.
    on = train_step.StepConfig(kind="rl", loss=losses.LossConfig(name="grpo", entropy_coef=alpha))
    _, g_on, _, m_on = run_step(mesh, on, batch, GRADS)

    _, state, _ = initial_state((("data", 1),))
    net = model.Transformer(CFG)
    m = np.asarray(batch.loss_mask * batch.seq_mask[:, None], np.float32)

    def mean_entropy(params):
        _, ent, _ = model.token_stats(
            net, params, batch.tokens, batch.positions, batch.segment_ids, batch.targets
        )
        return (ent * m).sum() / m.sum()

    want = jax.tree.map(lambda g: -alpha * g, jax.jit(jax.grad(mean_entropy))(state.params))
    got = jax.device_get(g_on.opt_state)
    assert_trees_close_at_scale(got, jax.device_get(want))
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(got)) > 1e-4  # not vacuous
    # The reported loss is the bonus alone: -alpha * mean entropy (policy term 0).
    ent = float(mean_entropy(state.params))
    assert_close_at_scale(m_on["loss"], -alpha * ent, scale=alpha * np.log(CFG.vocab_size))


def test_kl_penalty_gradient_is_beta_times_the_k3_gradient_to_the_reference_params():
    """loss.kl_coef through the jitted step, the reference given as params: with zero
    advantages the step's gradient is exactly beta * grad of GRPO's sequence-then-batch
    mean of k3(pi_ref || pi), computed here from the model at both param sets; the `kl`
    metric is that mean of k3 over tokens, checked in float64 numpy."""
    beta = 0.4
    batch = dataclasses.replace(make_rl_batch(seed=5), advantages=np.zeros(B, np.float32))
    mesh_items = (("data", 1),)
    mesh, state, shardings = initial_state(mesh_items, GRADS)
    noise = np.random.default_rng(1)
    ref = jax.tree.map(  # another policy: the init params, perturbed
        lambda p: p + 0.05 * noise.standard_normal(p.shape).astype(p.dtype),
        jax.device_get(state.params),
    )
    ref = jax.device_put(ref, shardings.params)
    cfg = train_step.StepConfig(kind="rl", loss=losses.LossConfig(name="grpo", kl_coef=beta))
    step = train_step.jit_step(CFG, GRADS, cfg, mesh, shardings, donate=False)
    with pytest.raises(ValueError, match="reference params"):
        step(state, train_step.put_batch(batch, mesh))  # the penalty without its reference
    new_state, metrics = step(state, train_step.put_batch(batch, mesh), ref)
    half, _ = step(state, train_step.put_batch(batch, mesh), ref, 0.5)  # the schedule's factor
    assert_trees_close_at_scale(
        jax.device_get(half.opt_state),
        jax.tree.map(lambda g: 0.5 * g, jax.device_get(new_state.opt_state)),
    )

    m = np.asarray(batch.loss_mask * batch.seq_mask[:, None], np.float64)
    n = m.sum(axis=1)
    keep = n > 0

    def logp_of(params):
        args = (batch.tokens, batch.positions, batch.segment_ids, batch.targets)
        return model.token_stats(model.Transformer(CFG), params, *args)[0]

    ref_logp = logp_of(ref)

    def penalty(params):
        d = ref_logp - logp_of(params)
        k3 = (jax.numpy.exp(d) - d - 1.0) * m
        return beta * (k3.sum(axis=1)[keep] / n[keep]).mean()

    want = jax.tree.map(np.asarray, jax.grad(penalty)(state.params))
    got = jax.device_get(new_state.opt_state)
    assert_trees_close_at_scale(got, want)
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(got)) > 1e-4  # not vacuous
    d = np.asarray(ref_logp, np.float64) - np.asarray(logp_of(state.params), np.float64)
    kl = ((np.exp(d) - d - 1.0) * m).sum() / m.sum()
    assert kl > 1e-4
    assert_close_at_scale(metrics["kl"], kl, scale=kl)


def test_lora_dropout_leaves_the_audit_and_mismatch_rows_deterministic():
    """With learner.lora.dropout > 0 the loss trains through dropout, but the audit's rows
    (k3, log-ratio, sampling check) and mismatch/kl judge a worker against the policy it
    sampled from, the dropout-free one: the same numbers as with dropout 0, same params.
    A dropout pass would inflate every honest worker's statistics."""
    from flax import traverse_util

    from learner_jax import lora

    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    base = jax.device_get(train_state.create_train_state(CFG, GRADS, mesh, seed=0).params)
    rng = np.random.default_rng(7)
    batch = make_rl_batch(seed=5)
    out = {}
    for dropout in (0.0, 0.5):
        cfg = lora.LoraConfig(rank=4, alpha=8.0, dropout=dropout)
        _, shardings = train_state.state_shardings(CFG, GRADS, mesh, lora=cfg)
        state = train_state.state_from_params(CFG, base, GRADS, mesh, seed=0, lora=cfg)
        if not out:  # nonzero adapters (a fresh lora_b is zero and dropout would not show)
            flat = traverse_util.flatten_dict(jax.device_get(state.params))
            adapters = traverse_util.unflatten_dict(
                {
                    p: (0.3 * rng.standard_normal(v.shape)).astype(np.float32)
                    for p, v in flat.items()
                }
            )
        state = state.replace(params=jax.device_put(adapters, shardings.params))
        step_cfg = train_step.StepConfig(kind="rl", lora=cfg)
        step = train_step.jit_step(CFG, GRADS, step_cfg, mesh, shardings, donate=False)
        out[dropout] = jax.device_get(step(state, train_step.put_batch(batch, mesh))[1])
    plain, dropped = out[0.0], out[0.5]
    assert abs(float(dropped["loss"]) - float(plain["loss"])) > 1e-3  # dropout did act
    # Row sums over <= T tokens of log-probs (magnitude log V), and of their squares.
    log_v = np.log(CFG.vocab_size)
    scales = {"k3": T * log_v, "logratio": T * log_v, "tokens": T}
    scales.update(dev=T * log_v**2, var=T * log_v**2, evidence=T * log_v**2)
    for name, scale in scales.items():
        key = train_step.ROWS + name
        assert_close_at_scale(dropped[key], plain[key], scale=scale, err_msg=name)
    assert float(plain["mismatch/tokens"]) > 0
    for name in ("mismatch/kl", "mismatch/tokens"):
        assert_close_at_scale(dropped[name], plain[name], scale=np.log(CFG.vocab_size) ** 2)
