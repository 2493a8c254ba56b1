"""The Flax Qwen3-MoE against transformers' Qwen3MoeForCausalLM (torch): logits, the
learner's own routing, routing replay, parameter gradients by torch autograd (the LM
objective plus the load-balancing loss), and the grouped matmuls against numpy.

Reference: transformers' own model loaded from the same HF directory, its experts run by
the literal per-expert loop (`experts_implementation="eager"`). Replay in the reference is
transformers' router with its top-k replaced by the recorded ids (the weights are its own
softmax at those ids, renormalised when norm_topk_prob): an independent implementation of
what `moe.route` does with `replay`.

Tolerances (tests/float_tolerance.py): forward in fp32 on both sides, so logits agree to
fp32 rounding at their own scale; gradients: JAX fp32 against torch float64 (as
grad_parity_test.py), relative L2 error per leaf <= 1e-4 (measured <= 4e-6).
Routing is discontinuous: every test first checks that no token's k-th and (k+1)-th
router probabilities are within 2e-5 of each other (fp32 rounding of a probability is
~1e-7), so both sides must choose the same experts.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from float_tolerance import assert_close_at_scale
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM

from bridge.model import layouts, tiny_model
from learner_jax.model import model, moe

CONFIGS = {
    # layers 0 and 2 sparse, 1 dense (mlp_only_layers); renormalised top-k; untied head
    "norm_mlp_only": tiny_model.tiny_config(
        "qwen3_moe", num_layers=3, mlp_only_layers=(1,), tie_word_embeddings=False
    ),
    # every second layer sparse (decoder_sparse_step=2: layers 1, 3); raw top-k weights; k=3
    "step2_raw": tiny_model.tiny_config(
        "qwen3_moe",
        num_layers=4,
        decoder_sparse_step=2,
        norm_topk_prob=False,
        num_experts_per_tok=3,
    ),  # fmt: skip
}
IMPLS = {
    "blocks_4": model.ModelOptions(moe_matmul="blocks", moe_block=4),  # blocks pad, some empty
    "ragged_dot": model.ModelOptions(moe_matmul="ragged_dot"),
}
B, T = 3, 10
TIE_GAP = 2e-5


def make_model(path, cfg, seed=1):
    """HF dir with std-0.2 weights (logits O(1)) and the same weights as Flax params."""
    tiny_model.make_tiny_model(str(path), cfg, seed)
    weights = tiny_model.random_hf_weights(cfg, seed, std=0.2)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path), layouts.hf_to_flax(cfg, weights)


def batch(cfg, seed=0):
    """Row 0 full, row 1 right-padded, row 2 left-padded (positions from the segments)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, cfg.vocab_size, (B, T)).astype(np.int32)
    seg = np.ones((B, T), np.int32)
    seg[1, 7:] = 0
    seg[2, :3] = 0
    tokens[seg == 0] = tiny_model.PAD_ID
    pos = np.asarray(model.positions_from_segments(jnp.asarray(seg)))
    return tokens, seg, pos


def load_torch(hf_dir, dtype):
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, experts_implementation="eager")


def replay_routers(hf, cfg, routing):
    """Make transformers' routers use `routing` [B, T, L, k] instead of their top-k."""
    for j, i in enumerate(cfg.moe_layers):
        gate = hf.model.layers[i].mlp.gate
        ids = torch.tensor(routing[:, :, j].reshape(-1, cfg.num_experts_per_tok)).long()

        def forward(h, gate=gate, ids=ids):
            logits = torch.nn.functional.linear(h.reshape(-1, gate.hidden_dim), gate.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float).to(logits.dtype)
            w = probs.gather(-1, ids)
            if gate.norm_topk_prob:
                w = w / w.sum(-1, keepdim=True)
            return logits, w, ids

        gate.forward = forward


def torch_forward(hf, tokens, seg, pos):
    return hf(
        input_ids=torch.tensor(tokens).long(),
        attention_mask=torch.tensor(seg > 0).long(),
        position_ids=torch.tensor(pos).long(),
        output_router_logits=True,
    )


def check_no_near_ties(router_logits, k):
    """router_logits [..., E]: the k-th and (k+1)-th probabilities are TIE_GAP apart."""
    x = np.asarray(router_logits, np.float64)
    p = np.exp(x - x.max(-1, keepdims=True))
    p = np.sort(p / p.sum(-1, keepdims=True), -1)
    gap = p[..., -k] - p[..., -k - 1]
    assert gap.min() > TIE_GAP, f"a near-tie in the routing ({gap.min():.2e}): pick another seed"


def flax_forward(cfg, params, tokens, seg, pos, opts, routing=None):
    """(logits [B, T, V], model.Routing) jitted."""
    net = model.Transformer(cfg, options=opts)

    def fwd(p, routing):
        logits, state = net.apply({"params": p}, tokens, pos, seg, routing=routing, mutable=["moe"])
        return logits, model._routing(cfg, state)

    return jax.device_get(jax.jit(fwd)(params, routing))


def lowest_experts(router_logits, k):
    """The k least likely experts of each token: recorded routing that surely differs
    from the learner's own top k (E >= 2k), [L, B, T, E] -> [B, T, L, k]."""
    ids = np.argsort(np.asarray(router_logits), axis=-1, kind="stable")[..., :k]
    return np.moveaxis(ids, 0, 2).astype(np.int32)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_own_routing_match_transformers(tmp_path, name):
    cfg = CONFIGS[name]
    hf_dir, params = make_model(tmp_path, cfg)
    tokens, seg, pos = batch(cfg)
    out = torch_forward(load_torch(hf_dir, torch.float32), tokens, seg, pos)
    ref = out.logits.detach().numpy()
    real = seg > 0
    assert ref[real].std() > 0.5  # logits large enough for the tolerance to mean something
    # transformers records router logits of every token, one [B*T, E] per MoE layer
    ref_router = np.stack([r.detach().numpy().reshape(B, T, -1) for r in out.router_logits])
    check_no_near_ties(ref_router[:, real], cfg.num_experts_per_tok)
    ref_top = np.argsort(-ref_router, axis=-1, kind="stable")[..., : cfg.num_experts_per_tok]
    for impl, opts in IMPLS.items():
        logits, seen = flax_forward(cfg, params, tokens, seg, pos, opts)
        print(f"{name} {impl}: max |logits - transformers| {np.abs(logits - ref)[real].max():.2e}")
        assert_close_at_scale(logits[real], ref[real], err_msg=impl)
        # padding tokens' hidden states are meaningless on both sides: real tokens only
        assert_close_at_scale(seen.router_logits[:, real], ref_router[:, real], err_msg=impl)
        # The learner's own routing, [B, T, L, k], as sets per token and layer.
        own = np.sort(seen.experts, axis=-1)[real]
        np.testing.assert_array_equal(own, np.sort(np.moveaxis(ref_top, 0, 2), -1)[real], impl)


def test_routing_replay_routes_to_the_recorded_experts(tmp_path):
    """Replayed ids (each token's k least likely experts, never its own top k) change the
    logits, and they change them to what transformers computes routing to those ids. A
    replay that silently falls back to the learner's own routing fails the first check."""
    cfg = CONFIGS["norm_mlp_only"]
    hf_dir, params = make_model(tmp_path, cfg)
    tokens, seg, pos = batch(cfg, seed=1)
    real = seg > 0
    opts = IMPLS["blocks_4"]
    own_logits, own = flax_forward(cfg, params, tokens, seg, pos, opts)
    check_no_near_ties(own.router_logits[:, real], cfg.num_experts_per_tok)
    routing = lowest_experts(own.router_logits, cfg.num_experts_per_tok)
    assert not (np.sort(routing, -1) == np.sort(own.experts, -1)).all(-1).any()

    logits, seen = flax_forward(cfg, params, tokens, seg, pos, opts, jnp.asarray(routing))
    hf = load_torch(hf_dir, torch.float32)
    replay_routers(hf, cfg, routing)
    out = torch_forward(hf, tokens, seg, pos)
    ref = out.logits.detach().numpy()
    assert np.abs(logits - own_logits)[real].max() > 1e3 * np.abs(logits - ref)[real].max()
    assert_close_at_scale(logits[real], ref[real])
    # The learner still reports its own top k under replay (for agreement / trust): the
    # top k of its router on the replayed forward's hidden states.
    ref_router = np.stack([r.detach().numpy().reshape(B, T, -1) for r in out.router_logits])
    check_no_near_ties(ref_router[:, real], cfg.num_experts_per_tok)
    ref_top = np.argsort(-ref_router, axis=-1, kind="stable")[..., : cfg.num_experts_per_tok]
    np.testing.assert_array_equal(
        np.sort(seen.experts, -1)[real], np.sort(np.moveaxis(ref_top, 0, 2), -1)[real]
    )
    # Both grouped matmuls replay alike.
    rd, _ = flax_forward(cfg, params, tokens, seg, pos, IMPLS["ragged_dot"], jnp.asarray(routing))
    assert_close_at_scale(rd[real], ref[real])


def test_bad_recorded_routing_is_refused(tmp_path):
    cfg = CONFIGS["norm_mlp_only"]
    params = layouts.hf_to_flax(cfg, tiny_model.random_hf_weights(cfg))
    tokens, seg, pos = batch(cfg)
    net = model.Transformer(cfg)
    k, layers = cfg.num_experts_per_tok, len(cfg.moe_layers)
    with pytest.raises(ValueError, match="expected"):
        net.apply(
            {"params": params}, tokens, pos, seg, routing=np.zeros((B, T, layers + 1, k), np.int32)
        )
    with pytest.raises(ValueError, match="integer"):
        net.apply(
            {"params": params}, tokens, pos, seg, routing=np.zeros((B, T, layers, k), np.float32)
        )


def _rel_err(got, want):
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


@pytest.mark.parametrize("replay", [False, True], ids=["own", "replay"])
def test_gradients_match_torch_autograd(tmp_path, replay):
    """d/dparams of sum c[b,t] log p(target) + AUX * load-balancing loss, JAX (fp32) against
    torch autograd through transformers (float64), every parameter through the layout
    table. With replay the routing weights are the router's softmax at the recorded ids,
    so the router's gradient flows through them (R3)."""
    aux_w = 10.0  # large enough that the router's gradient depends on the aux term
    cfg = CONFIGS["norm_mlp_only"]
    hf_dir, params = make_model(tmp_path, cfg)
    tokens, seg, pos = batch(cfg, seed=2)
    real = seg > 0
    targets = np.roll(tokens, -1, axis=1)
    weight = (real & np.roll(real, -1, axis=1)) * np.random.default_rng(3).uniform(0.5, 1.5, (B, T))
    _, own = flax_forward(cfg, params, tokens, seg, pos, IMPLS["blocks_4"])
    check_no_near_ties(own.router_logits[:, real], cfg.num_experts_per_tok)
    routing = lowest_experts(own.router_logits, cfg.num_experts_per_tok) if replay else None

    net = model.Transformer(cfg, options=IMPLS["blocks_4"])

    def objective(p):
        (logp, *_), seen = model.token_stats_and_routing(
            net, p, tokens, pos, seg, targets, routing=routing
        )
        lg = seen.router_logits
        aux = moe.load_balancing_loss(
            lg.reshape(lg.shape[0], -1, lg.shape[-1]), real.reshape(-1), cfg.num_experts_per_tok
        )
        return (logp * weight).sum() + aux_w * aux, aux

    (value, aux), grads = jax.device_get(
        jax.jit(jax.value_and_grad(objective, has_aux=True))(params)
    )

    hf = load_torch(hf_dir, torch.float64)
    if replay:
        replay_routers(hf, cfg, routing)
    out = torch_forward(hf, tokens, seg, pos)
    logp = torch.log_softmax(out.logits, -1).gather(-1, torch.tensor(targets).long()[..., None])[
        ..., 0
    ]
    ref_value = (logp * torch.tensor(weight)).sum() + aux_w * out.aux_loss
    ref_value.backward()
    ref_aux = float(out.aux_loss.detach())
    assert abs(float(aux) - ref_aux) <= 1e-5 * ref_aux
    assert abs(float(value) - float(ref_value.detach())) <= 1e-5 * abs(float(ref_value.detach()))
    ref_grads = {n: p.grad.numpy() for n, p in hf.named_parameters()}
    # transformers' fused experts -> its checkpoint tensors (layouts_test checks this split)
    m = cfg.moe_intermediate_size
    for i in cfg.moe_layers:
        gate_up = ref_grads.pop(f"model.layers.{i}.mlp.experts.gate_up_proj")
        down = ref_grads.pop(f"model.layers.{i}.mlp.experts.down_proj")
        for e in range(cfg.num_experts):
            pre = f"model.layers.{i}.mlp.experts.{e}"
            ref_grads[f"{pre}.gate_proj.weight"] = gate_up[e, :m]
            ref_grads[f"{pre}.up_proj.weight"] = gate_up[e, m:]
            ref_grads[f"{pre}.down_proj.weight"] = down[e]
    ref_flax = layouts.hf_to_flax(cfg, ref_grads)
    errs = {
        jax.tree_util.keystr(path): _rel_err(g, r)
        for (path, g), r in zip(
            jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_flax), strict=True
        )
    }
    print(f"replay={replay}: worst leaf relative L2 error {max(errs.values()):.2e}")
    assert max(errs.values()) <= 1e-4, sorted(errs.items(), key=lambda x: -x[1])[:3]


@pytest.mark.parametrize("impl,block", [("blocks", 3), ("blocks", 16), ("ragged_dot", 0)])
def test_grouped_matmul_against_numpy(impl, block):
    """Row r times its expert's matrix, forward and both gradients, with experts that get
    no rows and a block size that does not divide the groups."""
    rng = np.random.default_rng(0)
    e, m, kdim, n = 6, 23, 5, 4
    ids = rng.choice([0, 2, 3, 5], m).astype(np.int32)  # experts 1 and 4 get nothing
    x, w = rng.standard_normal((m, kdim)), rng.standard_normal((e, kdim, n))
    dy = rng.standard_normal((m, n))
    want = np.einsum("mk,mkn->mn", x, w[ids])

    def f(x, w):
        return (moe.grouped_matmul(x, w, jnp.asarray(ids), impl, block or 64) * dy).sum()

    y = moe.grouped_matmul(
        jnp.asarray(x, jnp.float32),
        jnp.asarray(w, jnp.float32),
        jnp.asarray(ids),
        impl,
        block or 64,
    )
    assert_close_at_scale(y, want, scale=np.abs(x).max() * np.abs(w).max() * kdim)
    dx, dw = jax.jit(jax.grad(f, argnums=(0, 1)))(
        jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)
    )
    want_dx = np.einsum("mn,mkn->mk", dy, w[ids])
    want_dw = np.zeros_like(w)
    np.add.at(want_dw, ids, np.einsum("mk,mn->mkn", x, dy))
    assert_close_at_scale(dx, want_dx, scale=np.abs(dy).max() * np.abs(w).max() * n)
    assert_close_at_scale(dw, want_dw, scale=np.abs(x).max() * np.abs(dy).max() * m)
    assert not np.asarray(dw)[[1, 4]].any()


def test_load_balancing_loss_matches_transformers():
    """moe.load_balancing_loss against transformers' function on random logits, with a
    padding mask, 3 layers."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    rng = np.random.default_rng(0)
    layers, b, t, e, k = 3, 2, 7, 8, 2
    logits = rng.standard_normal((layers, b * t, e))
    mask = np.ones((b, t))
    mask[1, 4:] = 0
    ref = load_balancing_loss_func(tuple(torch.tensor(x) for x in logits), e, k, torch.tensor(mask))
    ours = moe.load_balancing_loss(
        jnp.asarray(logits, jnp.float32), jnp.asarray(mask.reshape(-1)), k
    )
    assert_close_at_scale(ours, float(ref), scale=e * k)
