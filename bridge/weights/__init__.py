"""The weights seam: each version kind is one strategy, with its writer and its loader.

    kinds.py              Kind, kind_of(manifest), strategy_of(manifest), writer_for(...)
    sides.py              what the learner (LearnerSide) and a worker (EngineSide,
                          EngineStarter) offer the strategies
    full.py               full versions: FullVersions (read, relay parts, load), FullWriter
    delta.py              delta versions: DeltaVersions, DeltaWriter, `bridge.delta.enabled`
    delta_codec.py        a tensor's patch: encode / decode / apply
    delta_publisher.py    DeltaPublisher: patches on the previous version, anchors
    delta_reconstruct.py  a delta version rebuilt along its chain, verified
    adapter.py            LoRA adapter versions: AdapterVersions, AdapterWriter, the base
    adapter_store.py      adapter versions in the store's `adapters/` sub-store (PEFT)

The learner (learner_jax/rl/weights.py) writes through `writer_for(...)`; a worker loads
through `strategy_of(manifest).load(...)` (rollout_gpu/weight_swap.py) and builds its
engine through `strategy_of(manifest).engine_recipe(...)` (rollout_gpu/worker.py); the store
and the relay read a version's tensors and objects through `strategy_of(manifest)`
(bridge/store/weight_store.py, bridge/broadcast/chunks.py, rollout_gpu/relay_cache.py).
"""
