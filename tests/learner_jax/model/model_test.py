"""The Flax model against transformers (torch fp32) on tiny Qwen3 / Qwen2 / Llama models,
every attention implementation against the reference one, and remat against none."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from float_tolerance import assert_close_at_scale
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM

from bridge.model import layouts, tiny_model
from learner_jax.model import model

# Together: Qwen3 tied and untied, Qwen2 with bias, Llama with and without bias; GQA ratios
# (num_heads / num_kv_heads) 1, 2 and 4; 3 layers; two rope_theta values.
CONFIGS = {
    "qwen3_tied_gqa2": tiny_model.tiny_config("qwen3", num_layers=3),
    "qwen3_untied_mha": tiny_model.tiny_config(
        "qwen3", num_layers=3, num_kv_heads=4, tie_word_embeddings=False, rope_theta=1e6
    ),
    "qwen2_bias_gqa4": tiny_model.tiny_config("qwen2", num_layers=3, num_kv_heads=1),
    "llama_untied_gqa2": tiny_model.tiny_config("llama", num_layers=3),
    "llama_bias_gqa4": tiny_model.tiny_config(
        "llama", num_layers=3, num_heads=8, num_kv_heads=2, attention_bias=True
    ),
}
# Every attention implementation; small blocks so 'blockwise' really tiles (T = 12 pads
# to 15 with block 5; block 4 divides it) and its causal block skipping runs.
IMPLS = {
    "xla": model.ModelOptions(attention="xla"),
    "dot_product": model.ModelOptions(attention="dot_product"),
    "blockwise_4": model.ModelOptions(attention="blockwise", attention_block=4),
    "blockwise_5": model.ModelOptions(attention="blockwise", attention_block=5),
    "auto": model.ModelOptions(),
    # log-probs over chunks of 5 tokens (T = 12: a padded last chunk), logprobs.py
    "chunked_logprobs": model.ModelOptions(logprob_chunk=5),
}


def make_model(path, cfg, seed=0):
    """Tiny HF dir whose weights have std 0.2: with the default 0.02 the logits are ~1e-3,
    so a 1e-4 tolerance would not test anything. Returns (dir, Flax params via the table)."""
    tiny_model.make_tiny_model(str(path), cfg, seed)
    weights = tiny_model.random_hf_weights(cfg, seed, std=0.2)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path), layouts.hf_to_flax(cfg, weights)


def padded_batch(vocab, seed=0):
    """Rows: left-padded, right-padded, full, left-padded short. segment_ids 0 = padding."""
    t = 12
    seg = np.ones((4, t), np.int32)
    seg[0, :4] = 0
    seg[1, 9:] = 0
    seg[3, :9] = 0
    tokens = np.random.default_rng(seed).integers(3, vocab, (4, t)).astype(np.int32)
    tokens[seg == 0] = tiny_model.PAD_ID
    return tokens, seg


def hf_logits(hf_dir, tokens, seg, positions):
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        out = hf(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(seg > 0, dtype=torch.long),
            position_ids=torch.tensor(np.asarray(positions), dtype=torch.long),
        )
    return out.logits.numpy()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(tmp_path, name):
    cfg = CONFIGS[name]
    hf_dir, params = make_model(tmp_path, cfg)
    tokens, seg = padded_batch(cfg.vocab_size)
    positions = model.positions_from_segments(jnp.asarray(seg))
    ref = hf_logits(hf_dir, tokens, seg, positions)
    real = seg > 0
    assert ref[real].std() > 0.5  # logits large enough for the tolerance to mean something
    targets = np.roll(tokens, -1, axis=1)
    ref_logp = torch.log_softmax(torch.tensor(ref), -1).gather(
        -1, torch.tensor(targets[..., None]).long()
    )
    xla = None
    for impl, opts in IMPLS.items():
        net = model.Transformer(cfg, options=opts)
        ours = np.asarray(net.apply({"params": params}, tokens, positions, seg))
        assert ours.dtype == np.float32 and ours.shape == (4, 12, cfg.vocab_size)
        np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0, err_msg=impl)
        assert np.isfinite(ours).all(), impl  # padding rows too
        xla = ours if xla is None else xla
        # fp32: implementations differ only in summation order (float_tolerance.py)
        assert_close_at_scale(ours[real], xla[real], err_msg=impl)

        # log-probs of the next token, against torch's log_softmax of HF's logits
        logp = model.forward_logprobs(params, cfg, tokens, positions, seg, targets, options=opts)
        np.testing.assert_allclose(
            np.asarray(logp)[real], ref_logp[..., 0].numpy()[real], atol=1e-4, err_msg=impl
        )


def _loss_grads(name, opts, tmp_path):
    """(loss, param gradients) of a masked next-token NLL (the kind of loss the train step
    takes) on a padded + packed batch; the reference ones are cached across tests."""
    if opts == IMPLS["xla"] and name in _REF_GRADS:
        return _REF_GRADS[name]
    cfg = CONFIGS[name]
    _, params = make_model(tmp_path, cfg)
    tokens, seg = padded_batch(cfg.vocab_size)
    seg[2, 6:] = 2  # a packed row too
    pos = model.positions_from_segments(seg)
    targets = np.roll(tokens, -1, axis=1)
    weight = (seg > 0) & (np.roll(seg, -1, axis=1) > 0)

    def loss(p):
        logp = model.forward_logprobs(p, cfg, tokens, pos, seg, targets, options=opts)
        return -(logp * weight).sum() / weight.sum()

    out = jax.device_get(jax.jit(jax.value_and_grad(loss))(params))
    if opts == IMPLS["xla"]:
        _REF_GRADS[name] = out
    return out


_REF_GRADS = {}


def _max_rel_err(a, b):
    """max over leaves of |a - b|_inf / |b|_inf (leaves with tiny gradients stay fair)."""
    errs = jax.tree.map(lambda x, y: float(jnp.abs(x - y).max() / jnp.abs(y).max()), a, b)
    return max(jax.tree.leaves(errs))


@pytest.mark.parametrize(
    "name,impls",
    [("qwen3_tied_gqa2", ["dot_product", "blockwise_4"]), ("qwen2_bias_gqa4", ["blockwise_5"])],
)
def test_param_gradients_agree_between_attention_impls(tmp_path, name, impls):
    loss_ref, ref = _loss_grads(name, IMPLS["xla"], tmp_path)
    for impl in impls:
        loss, grads = _loss_grads(name, IMPLS[impl], tmp_path)
        assert abs(float(loss) - float(loss_ref)) <= 1e-6 * abs(float(loss_ref)), impl
        assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads)), impl
        assert _max_rel_err(grads, ref) <= 1e-5, impl


@pytest.mark.parametrize("remat", ["full", "dots_saveable"])
def test_remat_keeps_param_tree_and_gradients(tmp_path, remat):
    cfg = CONFIGS["qwen2_bias_gqa4"]
    opts = model.ModelOptions(attention="xla", remat=remat)

    def tree(o):
        net = model.Transformer(cfg, options=o)
        one = jnp.ones((1, 4), jnp.int32)
        return jax.eval_shape(lambda: net.init(jax.random.key(0), one, one, one)["params"])

    plain, remat_tree = tree(IMPLS["xla"]), tree(opts)
    assert jax.tree.structure(plain) == jax.tree.structure(remat_tree)  # names and boxing
    assert jax.tree.map(lambda x: (x.shape, x.dtype), nn.unbox(plain)) == jax.tree.map(
        lambda x: (x.shape, x.dtype), nn.unbox(remat_tree)
    )
    loss_ref, ref = _loss_grads("qwen2_bias_gqa4", IMPLS["xla"], tmp_path)
    loss, grads = _loss_grads("qwen2_bias_gqa4", opts, tmp_path)
    assert abs(float(loss) - float(loss_ref)) <= 1e-6
    assert _max_rel_err(grads, ref) <= 1e-6


def test_model_options_are_validated():
    with pytest.raises(ValueError, match="attention must be"):
        model.ModelOptions(attention="flash")
    with pytest.raises(ValueError, match="remat must be"):
        model.ModelOptions(remat="sometimes")
    with pytest.raises(ValueError, match="attention_block"):
        model.ModelOptions(attention_block=0)


def test_positions_from_segments():
    seg = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 2, 2, 2], [0, 0, 0, 0, 0]])
    expected = [[0, 0, 0, 1, 2], [0, 1, 2, 0, 0], [0, 1, 0, 1, 2], [0, 0, 0, 0, 0]]
    np.testing.assert_array_equal(model.positions_from_segments(seg), expected)


def test_packed_segments_equal_separate_sequences(tmp_path):
    """Two sequences packed in one row give the logits each gets alone (mask + positions)."""
    cfg = CONFIGS["qwen3_tied_gqa2"]
    _, params = make_model(tmp_path, cfg)
    fwd = jax.jit(lambda t, p, s: model.Transformer(cfg).apply({"params": params}, t, p, s))
    rng = np.random.default_rng(1)
    a, b = rng.integers(3, 100, 5), rng.integers(3, 100, 6)
    packed = np.concatenate([a, b, [0]])[None].astype(np.int32)
    seg = np.array([[1] * 5 + [2] * 6 + [0]], np.int32)
    out = fwd(packed, model.positions_from_segments(seg), seg)
    for toks, sl in ((a, slice(0, 5)), (b, slice(5, 11))):
        alone = fwd(
            toks[None].astype(np.int32),
            np.arange(len(toks))[None].astype(np.int32),
            np.ones((1, len(toks)), np.int32),
        )
        assert_close_at_scale(out[0, sl], alone[0])


def test_all_padding_row_is_finite(tmp_path):
    cfg = CONFIGS["llama_untied_gqa2"]
    _, params = make_model(tmp_path, cfg)
    seg = np.zeros((2, 6), np.int32)
    seg[1, 2:] = 1
    tokens = np.full((2, 6), 5, np.int32)
    out = model.Transformer(cfg).apply(
        {"params": params}, tokens, model.positions_from_segments(seg), seg
    )
    assert np.isfinite(np.asarray(out)).all()


def test_param_tree_matches_layout_table():
    """init_params builds exactly the tree of bridge/model/layouts.py, with the logical names."""
    for cfg in CONFIGS.values():
        params = nn.unbox(model.abstract_params(cfg))
        flat = {
            tuple(k.key for k in path): x.shape
            for path, x in jax.tree_util.tree_leaves_with_path(params)
        }
        rows = layouts.table(cfg)
        assert set(flat) == {r.flax_path for r in rows}
        hf_shapes = layouts.hf_shapes(cfg)
        for r in rows:  # the inverse transform of an HF-shaped tensor gives our shape
            assert r.transform.from_hf(np.zeros(hf_shapes[r.hf_name])).shape == flat[r.flax_path]
            assert r.flax_shape == flat[r.flax_path]
    boxed = model.abstract_params(CONFIGS["qwen2_bias_gqa4"])
    names = {
        tuple(k.key for k in path): x.names
        for path, x in jax.tree_util.tree_leaves_with_path(
            boxed, is_leaf=lambda x: hasattr(x, "names")
        )
    }
    assert names[("embed", "embedding")] == ("vocab", "embed")
    assert names[("layers_0", "attn", "q_proj", "kernel")] == ("embed", "heads", "kv")
    assert names[("layers_0", "attn", "k_proj", "bias")] == ("kv_heads", "kv")
    assert names[("layers_2", "attn", "o_proj", "kernel")] == ("heads", "kv", "embed")
    assert names[("layers_1", "mlp", "down_proj", "kernel")] == ("mlp", "embed")
    assert names[("final_norm", "scale")] == ("embed",)


def test_bf16_compute_close_to_fp32(tmp_path):
    cfg = CONFIGS["qwen3_tied_gqa2"]
    _, params = make_model(tmp_path, cfg)
    tokens, seg = padded_batch(cfg.vocab_size)
    pos = model.positions_from_segments(seg)
    f32 = model.Transformer(cfg).apply({"params": params}, tokens, pos, seg)
    bf16 = model.Transformer(cfg, dtype=jnp.bfloat16).apply({"params": params}, tokens, pos, seg)
    assert bf16.dtype == jnp.float32
    real = seg > 0
    err = np.abs(np.asarray(bf16) - np.asarray(f32))[real].max()
    assert 0 < err < 0.25 * np.asarray(f32)[real].std()
