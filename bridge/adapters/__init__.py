"""LoRA adapters across the bridge: the PEFT file layout (HF tensor names, adapter_config.json)
and adapter versions in the versioned, digested weight store (numpy only)."""
