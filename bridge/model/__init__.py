"""The model as data: architecture config, presets, layout tables, the tiny-model factory.

`config.py` reads an HF config.json into a frozen `ModelConfig`; `presets.py` holds real
shapes (Qwen3-0.6B, ...) for benchmarks; `layouts.py` maps learner parameter names to HF
names, shapes and layouts, one invertible table per family; `dtypes.py` is the one table of
weight dtypes; `hf_files.py` says which files of an HF directory are weights and which are
config and tokenizer; `tiny_model.py` writes tiny HF directories (random weights + a
character tokenizer) that transformers and vLLM load.
"""
