"""The model as data: architecture config, presets, layout tables, the tiny-model factory.

`config.py` reads an HF config.json into a frozen `ModelConfig`; `presets.py` holds real
shapes (Qwen3-0.6B, ...) for benchmarks; `layouts.py` maps learner parameter names to HF
names and layouts, one invertible table per family; `tiny_model.py` writes tiny HF
directories (random weights + a character tokenizer) that transformers and vLLM load.
"""
