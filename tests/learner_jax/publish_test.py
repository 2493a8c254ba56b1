"""Publishing sharded Flax params: shards land at the right HF positions, nothing is gathered."""

import jax
import ml_dtypes
import numpy as np
import pytest
from jax._src import array as jax_array
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bridge.model import layouts, tiny_model
from bridge.store.weight_store import WeightStore
from learner_jax import publish
from learner_jax.model import hf_import, sharding

N, H, D = 4, 8, 6  # heads, head dim, model dim of the mapper tests


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == 8, "tests/conftest.py sets 8 CPU devices"
    return Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "tensor"))


@pytest.fixture
def gathers(monkeypatch):
    """Records every host fetch of a multi-device, not fully replicated jax.Array."""
    seen = []
    original = jax_array.ArrayImpl._value

    def spy(self):
        if len(self.sharding.device_set) > 1 and not self.is_fully_replicated:
            seen.append(self.shape)
        return original.fget(self)

    monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(spy))
    return seen


def _assemble(arr, transform):
    """HF array built only from the pieces the adapter yields, plus a coverage count."""
    full_hf = transform.to_hf(np.zeros(arr.shape, np.float32))
    out = np.full(full_hf.shape, np.nan, np.float32)
    count = np.zeros(full_hf.shape, int)
    for index, block in publish._pieces(arr, transform):
        out[index] = block
        count[index] += 1
    return out, count


@pytest.mark.parametrize(
    "transform, shape, spec",
    [
        (layouts.IDENTITY, (12, D), P("tensor", "fsdp")),
        (layouts.LINEAR, (D, 12), P("fsdp", "tensor")),
        (layouts.heads_in(N, H), (D, N, H), P("fsdp", "tensor", None)),
        (layouts.heads_in(N, H), (D, N, H), P(None, "fsdp", "tensor")),  # partial H, 2 heads
        (layouts.heads_in(N, H), (D, N, H), P("data", None, ("fsdp", "tensor"))),
        (layouts.heads_bias(N, H), (N, H), P("tensor", None)),
        (layouts.heads_bias(N, H), (N, H), P(None, ("fsdp", "tensor"))),
        (layouts.heads_out(N, H), (N, H, D), P("tensor", None, "fsdp")),
        (layouts.heads_out(N, H), (N, H, D), P("fsdp", "tensor", None)),
    ],
)
def test_pieces_land_where_the_layout_transform_puts_them(mesh, transform, shape, spec):
    values = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    arr = jax.device_put(values, NamedSharding(mesh, spec))
    out, count = _assemble(arr, transform)
    np.testing.assert_array_equal(count, 1)  # covered exactly once, replicas dropped
    np.testing.assert_array_equal(out, transform.to_hf(values))


SPECS = {
    "embed": P("tensor", "fsdp"),
    "q_proj": P("fsdp", "tensor", None),
    "k_proj": P("fsdp", None, "tensor"),  # head_dim sharded: per-head pieces
    "v_proj": P("fsdp", "tensor", None),
    "o_proj": P("tensor", None, "fsdp"),
    "gate_proj": P("fsdp", "tensor"),
    "up_proj": P("fsdp", "tensor"),
    "down_proj": P("tensor", "fsdp"),
    "lm_head": P("fsdp", "tensor"),
    "q_norm": P("tensor"),
}


def _sharded_params(cfg, mesh):
    hf = tiny_model.random_hf_weights(cfg, seed=3)
    flax_params = layouts.hf_to_flax(cfg, hf)
    sharded = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.device_put(
            x, NamedSharding(mesh, SPECS.get(path[-2].key, P()) if len(path) > 1 else P())
        ),
        flax_params,
    )
    return hf, sharded


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_sharded_publish_round_trips_without_gather(tmp_path, mesh, gathers, family):
    cfg = tiny_model.tiny_config(family)
    hf, params = _sharded_params(cfg, mesh)
    n_sharded = 0
    for name, source in publish.hf_sources(cfg, params):
        full = np.prod(source.shape)
        sizes = [block.size for _, block in source.pieces]
        assert sum(sizes) == full, name
        if len(sizes) > 1:
            n_sharded += 1
            assert max(sizes) < full, name
    assert n_sharded >= 7 * cfg.num_layers + 1  # every kernel and the embedding

    store = WeightStore(f"file://{tmp_path}")
    manifest = publish.publish_params(store, 0, 7, cfg, params, dtype="float32")
    assert gathers == []
    assert manifest.arrays.keys() == hf.keys()
    back = store.read_all(0)
    for name, x in hf.items():
        assert back[name].dtype == np.float32
        np.testing.assert_array_equal(back[name], x, err_msg=name)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_untied", "qwen2", "llama"])
def test_hf_dir_to_store_to_torch_is_bit_exact(family, tiny_model_dirs, tmp_path, mesh, gathers):
    """The whole bridge, fp32: an HF dir imported onto the (2, 2, 2) mesh, published shard by
    shard, read by the worker's path (checksummed read + numpy -> torch) equals, bit for bit,
    the state dict transformers itself loads from that directory."""
    import torch
    import transformers

    from rollout_gpu.weight_swap import to_torch

    if family == "qwen3_untied":
        cfg = tiny_model.tiny_config("qwen3", tie_word_embeddings=False)
        hf_dir = tiny_model.make_tiny_model(str(tmp_path / "model"), cfg, seed=7)
    else:
        hf_dir = tiny_model_dirs[family]
    cfg, params = hf_import.load_hf_params(hf_dir, mesh=mesh, rules=sharding.DEFAULT_RULES)
    assert any(len(leaf.sharding.device_set) > 1 and not leaf.is_fully_replicated
               for leaf in jax.tree_util.tree_leaves(params))  # fmt: skip
    store = WeightStore(f"file://{tmp_path}/store")
    publish.publish_params(store, 0, 0, cfg, params, dtype="float32")
    assert gathers == []
    state = {name: to_torch(x) for name, x in store.read_all(0).items()}

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    want = dict(model.named_parameters())  # a tied lm_head is the embedding, listed once
    assert state.keys() == want.keys()
    for name, tensor in want.items():
        assert state[name].dtype == torch.float32 and state[name].shape == tensor.shape, name
        assert torch.equal(state[name], tensor.detach()), name


def test_sharded_bf16_publish_equals_ml_dtypes_cast(mesh, gathers):
    cfg = tiny_model.tiny_config("qwen3")
    hf, params = _sharded_params(cfg, mesh)
    store = WeightStore("memory://publish_test_bf16")
    publish.publish_params(store, 1, 1, cfg, params, extra={"canary": {"ids": [1, 2]}})
    assert gathers == []
    assert store.manifest(1).extra == {"canary": {"ids": [1, 2]}}
    for name, x in store.read(1):
        assert x.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(
            x.view(np.uint16), hf[name].astype(ml_dtypes.bfloat16).view(np.uint16)
        )


def test_numpy_params_are_refused_with_a_clear_error(tmp_path):
    cfg = tiny_model.tiny_config("qwen3")
    params = layouts.hf_to_flax(cfg, tiny_model.random_hf_weights(cfg))
    store = WeightStore(f"file://{tmp_path}")
    with pytest.raises(TypeError, match="not a jax.Array"):
        publish.publish_params(store, 0, 0, cfg, params)
    assert store.versions() == []


def test_gather_spy_sees_a_full_fetch(mesh, gathers):
    # Guards the no-gather assertions above against a spy that records nothing.
    arr = jax.device_put(np.ones((8, 8), np.float32), NamedSharding(mesh, P("fsdp", "tensor")))
    np.asarray(arr)
    assert gathers == [(8, 8)]


def test_sharded_moe_publish_round_trips_without_gather(tmp_path, mesh, gathers):
    """Stacked experts split over fsdp (4 of 8 a device) and their width over tensor: each
    expert's HF tensor is cut from the shards that hold it, bit-exact, never gathered."""
    cfg = tiny_model.tiny_config("qwen3_moe", num_layers=2)
    hf = tiny_model.random_hf_weights(cfg, seed=3)
    shardings = sharding.param_shardings(cfg, mesh)
    params = jax.device_put(layouts.hf_to_flax(cfg, hf), shardings)
    experts = params["layers_0"]["mlp"]["experts"]["down_proj"]
    assert experts.sharding.shard_shape(experts.shape)[0] == cfg.num_experts // 2
    store = WeightStore(f"file://{tmp_path}")
    manifest = publish.publish_params(store, 0, 1, cfg, params, dtype="float32")
    assert gathers == []
    assert manifest.arrays.keys() == hf.keys()
    back = store.read_all(0)
    for name, x in hf.items():
        np.testing.assert_array_equal(back[name], x, err_msg=name)
