"""Hot swap of store versions into a running vLLM engine: parity, refusals, rollback, canary.

The "learner" here is transformers (torch fp32) on the very weights published: it computes
the canary log-probs that go into the manifest and the reference the engine is held to.
Every refusal is followed by an exact before/after comparison of the engine's log-probs.
"""

import dataclasses
import os

import ml_dtypes
import numpy as np
import pytest

from bridge.contracts import canary
from bridge.model import tiny_model
from bridge.store.layout import LAYOUT
from bridge.store.weight_store import CorruptVersionError, VersionNotFoundError, WeightStore
from rollout_gpu import canary as engine_canary
from rollout_gpu import weight_swap
from rollout_gpu.engine import SampleRequest

pytestmark = pytest.mark.vllm

# Sequences other than the canary's probes, to check the engine itself, not the canary.
CHECK_SEED = 7


def bf16(weights):
    return {k: v.astype(ml_dtypes.bfloat16) for k, v in weights.items()}


class Reference:
    """transformers fp32 log-probs for given HF weights (the independent implementation)."""

    def __init__(self, model_dir):
        import torch
        import transformers

        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(model_dir), dtype=torch.float32
        ).eval()

    def logprobs(self, weights, token_lists):
        torch = self.torch
        sd = {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in weights.items()}
        missing, unexpected = self.model.load_state_dict(sd, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        out = []
        with torch.no_grad():
            for ids in token_lists:
                logits = self.model(torch.tensor([ids])).logits[0, :-1]  # [T-1, V]
                lp = torch.log_softmax(logits, -1)[
                    torch.arange(len(ids) - 1), torch.tensor(ids[1:])
                ]
                out.append(lp.double().numpy())
        return out

    def next_token_logprobs(self, weights, ids):
        self.logprobs(weights, [ids])  # loads the weights
        with self.torch.no_grad():
            logits = self.model(self.torch.tensor([ids])).logits[0, -1]  # [V]
        return self.torch.log_softmax(logits, -1).double().numpy()


class Harness:
    """One engine + store + the worker's EngineVersion, with helpers to publish versions."""

    def __init__(self, engine, model_dir, store_dir):
        self.engine = engine
        self.cfg = engine.model_config()
        self.ref = Reference(model_dir)
        self.store_dir = str(store_dir)
        self.store = WeightStore(f"file://{store_dir}")
        self.current = weight_swap.EngineVersion()
        n_tok = len(engine.tokenizer)
        self.probes = canary.probe_token_lists(n_tok, tiny_model.BOS_ID)
        self.checks = canary.probe_token_lists(n_tok, tiny_model.BOS_ID, length=40, seed=CHECK_SEED)
        self.initial = self.engine_lps()

    def engine_lps(self):
        return engine_canary.engine_prompt_logprobs(self.engine, self.checks)

    def greedy_first_token(self, ids):
        """(token, logprob) of a greedy 1-token generation: reads the prefix cache."""
        request = SampleRequest(prompt_token_ids=ids, max_tokens=1, temperature=0.0)
        [[sample]] = self.engine.generate([request])
        return sample.token_ids[0], sample.logprobs[0]

    def publish(self, weights, dtype="float32", canary_weights=None, perturb=0.0, version=None):
        """Publish `weights` with a canary computed on `canary_weights` (default: the same)."""
        version = (self.store.latest() or 0) + 1 if version is None else version
        ref = self.ref.logprobs(
            canary_weights if canary_weights is not None else weights, self.probes
        )
        ref[0] = ref[0] + perturb
        extra = {"canary": canary.canary_payload(self.probes, ref)}
        self.store.publish(version, version, weights.items(), self.cfg.to_hf_dict(), dtype, extra)
        return version

    def array_dir(self, version, name):
        return os.path.join(self.store_dir, LAYOUT.array_prefix(version, name))

    def load(self, version):
        return weight_swap.load_version(self.engine, self.store, version, self.current)


def assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def qwen3(vllm_engine, tiny_model_dir, tmp_path_factory):
    h = Harness(vllm_engine, tiny_model_dir, tmp_path_factory.mktemp("swap_store"))
    h.w1 = tiny_model.random_hf_weights(h.cfg, seed=123)
    h.v1 = h.publish(h.w1)
    h.load(h.v1)
    yield h
    # Give the session engine back with the weights it was started with.
    weight_swap.restore(vllm_engine, weight_swap.EngineVersion())
    assert_same(h.engine_lps(), h.initial)


def test_fp32_swap_matches_transformers(qwen3):
    h = qwen3
    assert h.current.version == h.v1
    got, want = h.engine_lps(), h.ref.logprobs(h.w1, h.checks)
    diff = max_diff(got, want)
    print(f"qwen3 fp32 engine vs transformers: max|diff|={diff:.3g}")
    assert diff <= 1e-3
    assert max_diff(got, h.initial) > 0.05  # the swap really changed the model


def test_bf16_version_into_fp32_engine(qwen3):
    h = qwen3
    w2 = bf16(tiny_model.random_hf_weights(h.cfg, seed=124))
    v2 = h.publish(w2, dtype="bfloat16")
    result = h.load(v2)
    print(f"qwen3 bf16 version canary: {result}")
    assert result.ok and result.kl <= 1e-3 and h.current.version == v2
    assert max_diff(h.engine_lps(), h.ref.logprobs(w2, h.checks)) <= 1e-3
    h.load(h.v1)  # back to v1 for the refusal tests
    assert max_diff(h.engine_lps(), h.ref.logprobs(h.w1, h.checks)) <= 1e-3


def test_generation_after_swap_does_not_reuse_stale_kv(qwen3):
    """Prompt-logprob requests (the canary) bypass the prefix cache; generation does not."""
    h = qwen3
    # Longer than one KV block (128 on CPU): its first block is cached with v1's K/V.
    [long] = canary.probe_token_lists(len(h.engine.tokenizer), 1, 1, length=200, seed=3)
    tok1, lp1 = h.greedy_first_token(long)
    assert abs(lp1 - h.ref.next_token_logprobs(h.w1, long)[tok1]) <= 1e-4
    # Same weights but every v_proj negated: stale cached values would be sign-flipped.
    w_neg = {k: (-w if "v_proj" in k else w) for k, w in h.w1.items()}
    h.load(h.publish(w_neg))
    tok2, lp2 = h.greedy_first_token(long)
    want = h.ref.next_token_logprobs(w_neg, long)[tok2]
    print(f"after swap: first-token logprob {lp2:.6f}, transformers {want:.6f}, v1 {lp1:.6f}")
    assert abs(lp2 - want) <= 1e-4
    h.load(h.v1)
    tok3, lp3 = h.greedy_first_token(long)
    assert tok3 == tok1 and abs(lp3 - lp1) <= 1e-5


def _corrupt_chunk(h, v):
    name = "model.layers.1.mlp.up_proj.weight"
    chunk = os.path.join(h.array_dir(v, name), "c", "0", "0")
    with open(chunk, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x40]))
    return CorruptVersionError, f"{name} checksum mismatch"


def _delete_manifest(h, v):
    os.remove(os.path.join(h.store_dir, LAYOUT.manifest_key(v)))
    return VersionNotFoundError, "has no manifest"


def _truncate_array(h, v):
    name = "model.embed_tokens.weight"
    chunk = os.path.join(h.array_dir(v, name), "c", "0", "0")
    os.truncate(chunk, os.path.getsize(chunk) // 2)
    return CorruptVersionError, name


@pytest.mark.parametrize(
    "damage", [_corrupt_chunk, _delete_manifest, _truncate_array], ids=lambda f: f.__name__[1:]
)
def test_damaged_version_is_refused_and_engine_keeps_serving(qwen3, damage):
    h = qwen3
    before = h.engine_lps()
    v = h.publish(tiny_model.random_hf_weights(h.cfg, seed=200))
    exc, cause = damage(h, v)
    with pytest.raises(exc, match=cause) as err:
        h.load(v)
    print(f"refused ({damage.__name__[1:]}): {err.value}")
    assert h.current.version == h.v1
    assert_same(h.engine_lps(), before)


def test_wrong_shape_is_refused_before_touching_engine(qwen3):
    h = qwen3
    before = h.engine_lps()
    good = tiny_model.random_hf_weights(h.cfg, seed=201)
    name = "model.layers.0.self_attn.q_proj.weight"
    w = {**good, name: np.ascontiguousarray(good[name].T)}  # [D, N*H] instead of [N*H, D]
    # The store accepts any shape; the loader checks it against the engine's architecture.
    v = h.publish(w, canary_weights=good)
    with pytest.raises(weight_swap.WeightSwapError, match=rf"{name}: shape \(64, 128\)") as err:
        h.load(v)
    print(f"refused (wrong shape): {err.value}")
    assert h.current.version == h.v1
    assert_same(h.engine_lps(), before)


def test_version_of_another_architecture_is_refused(qwen3):
    h = qwen3
    before = h.engine_lps()
    # Same shapes, different rope_theta: only the manifest's model_config can tell.
    other = dataclasses.replace(h.cfg, rope_theta=1e6)
    v = (h.store.latest() or 0) + 1
    h.store.publish(v, v, h.w1.items(), other.to_hf_dict(), "float32")
    with pytest.raises(weight_swap.WeightSwapError, match="rope_theta"):
        h.load(v)
    assert_same(h.engine_lps(), before)


def test_missing_or_nonfinite_tensor_is_refused(qwen3):
    h = qwen3
    before = h.engine_lps()
    w = tiny_model.random_hf_weights(h.cfg, seed=202)
    del w["model.norm.weight"]
    with pytest.raises(weight_swap.WeightSwapError, match=r"missing \['model.norm.weight'\]"):
        weight_swap.swap_weights(h.engine, w, current=h.current)
    w = tiny_model.random_hf_weights(h.cfg, seed=202)
    w["model.layers.1.mlp.down_proj.weight"][3, 4] = np.nan
    with pytest.raises(weight_swap.WeightSwapError, match="down_proj.weight: 1 non-finite"):
        weight_swap.swap_weights(h.engine, w, current=h.current)
    assert_same(h.engine_lps(), before)


def test_reload_failure_inside_vllm_rolls_back(qwen3):
    """A failure inside vLLM's reload, after earlier layers were already replaced."""
    h = qwen3
    before = h.engine_lps()
    w = tiny_model.random_hf_weights(h.cfg, seed=203)
    # A caller whose shape table is wrong for the last tensor: our check passes, vLLM's
    # loader asserts when it reaches model.norm (every decoder layer is already new).
    shapes = weight_swap.expected_hf_shapes(h.engine)
    shapes["model.norm.weight"] = (h.cfg.hidden_size + 1,)
    w["model.norm.weight"] = np.ones(h.cfg.hidden_size + 1, np.float32)
    with pytest.raises(weight_swap.ReloadFailed, match=f"restored version {h.v1}"):
        weight_swap.swap_weights(h.engine, w, shapes, h.current)
    assert_same(h.engine_lps(), before)


def test_canary_catches_transposed_square_tensor(qwen3):
    h = qwen3
    before = h.engine_lps()
    good = tiny_model.random_hf_weights(h.cfg, seed=204)
    bad = dict(good)
    name = "model.layers.0.self_attn.v_proj.weight"
    assert good[name].shape[0] == good[name].shape[1]  # square: shape checks cannot see it
    bad[name] = np.ascontiguousarray(good[name].T)
    v = h.publish(bad, canary_weights=good)  # a conversion bug after the learner's canary
    with pytest.raises(weight_swap.CanaryMismatch, match="failed its canary") as err:
        h.load(v)
    print(f"transposed v_proj canary: {err.value.result}")
    assert err.value.result.max_abs_diff > 1e-2
    assert v in h.current.bad_versions and h.current.version == h.v1
    assert_same(h.engine_lps(), before)
    with pytest.raises(weight_swap.WeightSwapError, match="marked bad"):
        h.load(v)


def test_canary_catches_perturbed_learner_logprobs(qwen3):
    h = qwen3
    before = h.engine_lps()
    v = h.publish(tiny_model.random_hf_weights(h.cfg, seed=205), perturb=0.01)
    with pytest.raises(weight_swap.CanaryMismatch):
        h.load(v)
    assert_same(h.engine_lps(), before)


def test_canary_compare_criteria():
    ref = [np.array([-1.0, -2.0, -3.0])]
    assert canary.compare([ref[0] + 5e-4], ref, "float32").ok
    assert not canary.compare([ref[0] + 2e-3], ref, "float32").ok
    # bf16: RMS within 5% of the spread, at least 0.5: 0.041 here (std of -1, -2, -3)
    assert canary.compare([ref[0] + 0.03], ref, "bfloat16").ok
    assert not canary.compare([ref[0] + 0.06], ref, "bfloat16").ok
    wide = [np.array([-30.0, -20.0, -10.0])]  # spread 8.2: a trained model's probe tokens
    assert canary.compare([wide[0] + 0.3], wide, "bfloat16").ok
    assert not canary.compare([wide[0] + 0.5], wide, "bfloat16").ok
    flat = [np.array([-4.9, -4.8, -4.85])]  # spread below the 0.5 floor: limit 0.025
    assert canary.compare([flat[0] + 0.02], flat, "bfloat16").ok
    assert not canary.compare([flat[0] + 0.03], flat, "bfloat16").ok
    with pytest.raises(ValueError, match="needs 2 log-probs"):
        canary.canary_payload([[1, 5, 6]], [np.zeros(3)])


@pytest.fixture(scope="module")
def llama_bf16(tiny_model_dirs, tmp_path_factory, extra_vllm_engine):
    """The second family, on a bf16 engine (the dtype GPU workers serve in)."""
    model_dir = tiny_model_dirs["llama"]
    engine = extra_vllm_engine(
        model_dir, dtype="bfloat16", max_model_len=256, seed=0, max_num_seqs=8
    )
    return Harness(engine, model_dir, tmp_path_factory.mktemp("swap_store_llama"))


@pytest.mark.slow
def test_second_family_bf16_engine(llama_bf16):
    h = llama_bf16
    assert h.cfg.family == "llama" and not h.cfg.tie_word_embeddings
    w = bf16(tiny_model.random_hf_weights(h.cfg, seed=123))
    result = h.load(h.publish(w, dtype="bfloat16"))
    got, want = h.engine_lps(), h.ref.logprobs(w, h.checks)
    kl = canary.compare(got, want, "bfloat16")
    print(f"llama bf16 engine: canary {result}; check sequences {kl}")
    assert result.ok and kl.ok and kl.kl <= 1e-3
    assert max_diff(got, h.initial) > 0.05
    # A fp32 version into the bf16 engine is judged by the bf16 criterion and passes too,
    # peaked weights included (logits of a few units, as a trained model's: their bf16
    # rounding costs more than 1e-3 of canary KL).
    w32 = tiny_model.random_hf_weights(h.cfg, seed=124, std=0.2)
    peaked = h.load(h.publish(w32, dtype="float32"))
    print(f"llama bf16 engine, peaked fp32 version: canary {peaked}")
    assert peaked.ok
    # A square tensor transposed after the learner's canary (a conversion bug) is still
    # caught on the bf16 engine, on flat weights, where every error is small.
    good = tiny_model.random_hf_weights(h.cfg, seed=126)
    name = "model.layers.0.self_attn.v_proj.weight"
    assert good[name].shape[0] == good[name].shape[1]
    bad = {**good, name: np.ascontiguousarray(good[name].T)}
    with pytest.raises(weight_swap.CanaryMismatch) as err:
        h.load(h.publish(bad, canary_weights=good))
    print(f"llama bf16 engine, transposed v_proj: canary {err.value.result}")
    # And a refusal keeps the bf16 engine on its version as well.
    before = h.engine_lps()
    v = h.publish(tiny_model.random_hf_weights(h.cfg, seed=125))
    os.remove(os.path.join(h.store_dir, LAYOUT.manifest_key(v)))
    with pytest.raises(VersionNotFoundError):
        h.load(v)
    assert_same(h.engine_lps(), before)
