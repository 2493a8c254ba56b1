"""The policy network and its numerics: what the learner computes, not how it trains.

`model.py` (the Flax decoder for Qwen3, Qwen2 and Llama), its attention (`attention.py`,
with the Pallas TPU kernel in `splash.py`), per-token log-probs from hidden states
(`logprobs.py`) under the sampler's truncation as vLLM applies it (`truncation.py`),
decoding with a KV cache (`kv_decode.py`), the run's dtypes (`dtypes.py`), the mesh and
the logical-axis rules that shard it (`sharding.py`), loading an HF checkpoint into
sharded parameters (`hf_import.py`) and the model directory a run trains (`model_dir.py`).
"""
