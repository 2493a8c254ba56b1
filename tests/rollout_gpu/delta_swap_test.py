"""Delta versions into the session's real vLLM engine: partial in-place reloads, catch-up,
refusals (tampered patch, tampered base) with the old version still serving, canary.

Each delta swap's engine log-probs are held EXACTLY to those of a full swap of the same
weights (the reference path the delta must not change), and the canary (transformers fp32
log-probs of the published weights, in the manifest) runs on every version.
"""

import numpy as np
import pytest

from bridge.contracts import canary
from bridge.model import layouts, tiny_model
from bridge.store.layout import LAYOUT
from bridge.store.manifest import CorruptVersionError
from bridge.store.weight_store import WeightStore
from bridge.weights.delta_publisher import DeltaPublisher
from bridge.weights.delta_reconstruct import choose_path, links
from rollout_gpu import canary as engine_canary
from rollout_gpu import weight_swap

pytestmark = pytest.mark.vllm


def _ref_logprobs(model_dir):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(model_dir), dtype=torch.float32
    ).eval()

    def logprobs(weights, token_lists):
        sd = {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in weights.items()}
        model.load_state_dict(sd, strict=False)
        out = []
        with torch.no_grad():
            for ids in token_lists:
                lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], -1)
                out.append(lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].double().numpy())
        return out

    return logprobs


class Run:
    """A delta-publishing "learner" (numpy) beside the engine, and the worker's state."""

    def __init__(self, engine, model_dir, store_dir):
        self.engine, self.cfg = engine, engine.model_config()
        self.store = WeightStore(str(store_dir))
        self.pub = DeltaPublisher(self.store, anchor_every=5, max_density=0.5)
        self.ref = _ref_logprobs(model_dir)
        n_tok = len(engine.tokenizer)
        self.probes = canary.probe_token_lists(n_tok, tiny_model.BOS_ID)
        self.checks = canary.probe_token_lists(n_tok, tiny_model.BOS_ID, length=40, seed=7)
        self.current = weight_swap.EngineVersion()
        self.rng = np.random.default_rng(0)
        self.weights = {}

    def publish(self, version, weights):
        extra = {"canary": canary.canary_payload(self.probes, self.ref(weights, self.probes))}
        self.pub.publish(version, version, weights.items(), self.cfg.to_hf_dict(), "float32", extra)
        self.weights[version] = weights

    def step(self, weights, names, frac=0.02):
        """Move `frac` of the elements of `names` (an RL step's sparse change)."""
        out = dict(weights)
        for n in names:
            w = weights[n].copy()
            mask = self.rng.random(w.shape) < frac
            w[mask] += self.rng.standard_normal(int(mask.sum())).astype(np.float32) * 0.05
            out[n] = w
        return out

    def lps(self):
        return engine_canary.engine_prompt_logprobs(self.engine, self.checks)

    def load(self, version):
        return weight_swap.load_version(self.engine, self.store, version, self.current)


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def run(vllm_engine, tiny_model_dir, tmp_path_factory):
    r = Run(vllm_engine, tiny_model_dir, tmp_path_factory.mktemp("delta_store"))
    w = tiny_model.random_hf_weights(r.cfg, seed=321)
    r.publish(0, w)
    r.load(0)
    yield r
    weight_swap.restore(vllm_engine, weight_swap.EngineVersion())


def _full_swap_lps(r, version):
    """The engine's log-probs after a FULL swap of `version`'s weights, then back to the
    version the worker serves (also a full swap)."""
    weight_swap.swap_weights(r.engine, r.weights[version], None, r.current)
    got = r.lps()
    weight_swap.restore(r.engine, r.current)
    return got


def test_delta_swap_reloads_only_changed_modules_and_equals_full_swap(run):
    r = run
    names = ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    r.publish(1, r.step(r.weights[0], names))
    manifest = r.store.manifest(1)
    assert {n for n, p in manifest.delta.tensors.items() if p.kind != "same"} == set(names)
    reloaded = weight_swap.reload_names(set(names), list(layouts.hf_shapes(r.cfg)))
    # k_proj brings q/v (one fused qkv_proj), up_proj brings gate_proj: 5 of all tensors.
    assert len(reloaded) == 5 and "model.layers.0.self_attn.q_proj.weight" in reloaded
    before = r.lps()
    result = r.load(1)
    assert result is not None and result.ok  # the canary ran on the delta version
    got = r.lps()
    assert r.current.version == 1
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(got, before, strict=True)) > 1e-4
    _same(got, _full_swap_lps(r, 1))


def test_worker_that_missed_seven_versions_catches_up_by_patches(run):
    r = run
    assert r.current.version == 1
    layer_names = list(layouts.hf_shapes(r.cfg))
    for v in range(2, 9):  # 5 is an anchor (anchor_every=5) carrying its patch on 4
        r.publish(v, r.step(r.weights[v - 1], layer_names[v % 3 :: 3]))
    assert r.store.manifest(5).is_full and r.store.manifest(5).delta.base == 4
    from_full, path = choose_path(links(r.store, 8, 1), 1)
    assert not from_full and [m.version for m in path] == list(range(2, 9))
    assert r.load(8).ok
    _same(r.lps(), _full_swap_lps(r, 8))


def test_tampered_patch_and_tampered_base_are_refused_old_version_serving(run):
    r = run
    v = r.current.version
    names = ["model.layers.0.mlp.down_proj.weight"]
    r.publish(v + 1, r.step(r.weights[v], names))
    key = LAYOUT.patch_key(v + 1, names[0])
    blob = bytearray(r.store.kv.read(key).result().value)
    blob[len(blob) // 2] ^= 0x40
    r.store.kv.write(key, bytes(blob)).result()
    before = r.lps()
    with pytest.raises(CorruptVersionError, match="down_proj"):
        r.load(v + 1)
    assert r.current.version == v
    _same(r.lps(), before)
    blob[len(blob) // 2] ^= 0x40
    r.store.kv.write(key, bytes(blob)).result()  # repaired: only the base is at fault below
    # A tampered base: the worker's host copy is damaged AND the anchor in the store is, so
    # neither the patch path nor the anchor path rebuilds the manifest's tensors.
    r.publish(v + 2, r.step(r.weights[v + 1], names))
    served = r.current.tensors
    damaged = dict(served)
    damaged[names[0]] = served[names[0]].copy()
    damaged[names[0]].reshape(-1)[3] += 1.0
    r.current.tensors = damaged
    anchor = r.store.manifest(v + 2).anchor
    chunk = LAYOUT.chunk_key(anchor, names[0], (0, 0))
    data = bytearray(r.store.kv.read(chunk).result().value)
    data[8] ^= 0x01
    r.store.kv.write(chunk, bytes(data)).result()
    with pytest.raises(CorruptVersionError):
        r.load(v + 2)
    assert r.current.version == v
    _same(r.lps(), before)
    r.current.tensors = served


def test_worker_behind_a_relay_takes_patches_and_refuses_tampered_ones(run):
    """The worker's real path (WeightVersions -> PeerSwap -> its relay -> load_version) with a
    parent relay: three versions behind, it catches up by patches from the parent; a patch the
    parent tampers with is refused on arrival (reported) and taken from the store; when the
    store's copy is bad too the version is refused and the old one keeps serving."""
    import time

    from bridge.control.protocol import Heartbeat, HeartbeatResponse, VersionAnnouncement
    from rollout_gpu.peer_swap import PeerSwap
    from rollout_gpu.relay import Relay
    from rollout_gpu.versions import VersionState, WeightVersions

    r = run
    v = max(r.weights)  # the newest published; the worker serves r.current.version <= v
    layer_names = list(layouts.hf_shapes(r.cfg))
    bad = {"on": False}

    def tamper(key, body):
        if bad["on"] and f"/{LAYOUT.delta}/" in key:
            return body[:-1] + bytes([body[-1] ^ 0x01])
        return body

    parent = Relay(keep_versions=16, tamper=tamper)
    parent.start()
    peers = PeerSwap(stall_s=10)
    versions = WeightVersions(peers)
    versions.current = r.current

    def publish(version):
        r.publish(version, r.step(r.weights[version - 1], layer_names[version % 4 :: 4]))
        parent.fetch(version, [r.store.spec], timeout=60, whole=False)  # follows as hops

    def announce_and_swap(version):
        ann = VersionAnnouncement(version=version, store=r.store.spec, published_at=version)
        versions.hear(HeartbeatResponse(announcement=ann, broadcast_mode="chain",
                                        relay_parent=parent.url))  # fmt: skip
        deadline = time.monotonic() + 120
        while versions.state() in (VersionState.FETCHING, VersionState.SWAP_READY):
            assert time.monotonic() < deadline
            versions.ensure(r.engine)
            time.sleep(0.05)
        return Heartbeat(worker_version=-1, **peers.heartbeat_fields()).broadcast

    try:
        for k in (1, 2, 3):
            publish(v + k)
        behind = range(r.current.version + 1, v + 4)
        for old in behind:
            if old <= v:
                parent.fetch(old, [r.store.spec], timeout=60, whole=False)
        rep = announce_and_swap(v + 3)
        assert r.current.version == v + 3 and not rep.bad_sources
        hops = sum(r.store.manifest(k).delta.nbytes for k in behind)
        assert hops <= rep.bytes_from_peers < r.store.manifest(v + 3).total_bytes
        assert rep.bytes_from_store < len(behind) * 16 << 10  # the manifests
        _same(r.lps(), _full_swap_lps(r, v + 3))

        bad["on"] = True
        publish(v + 4)
        rep = announce_and_swap(v + 4)
        assert r.current.version == v + 4
        assert {(b.source, b.kind) for b in rep.bad_sources} == {(parent.url, "corrupt")}
        _same(r.lps(), _full_swap_lps(r, v + 4))

        target = v + 5
        publish(target)
        if r.store.manifest(target).is_full:  # an anchor is read whole after a bad patch
            target += 1
            publish(target)
        # The parent verified the target; now the store's copy of a patch is damaged too.
        name = next(n for n, p in r.store.manifest(target).delta.tensors.items()
                    if p.kind == "patch")  # fmt: skip
        key = LAYOUT.patch_key(target, name)
        blob = bytearray(r.store.kv.read(key).result().value)
        blob[len(blob) // 2] ^= 0x10
        r.store.kv.write(key, bytes(blob)).result()
        before = r.lps()
        announce_and_swap(target)
        assert versions.state() is VersionState.REFUSED
        assert r.current.version == v + 4
        _same(r.lps(), before)
    finally:
        peers.close()
        parent.stop()
