"""LoRA adapters: PEFT checkpoints read (peft_config.py, torch-free; checkpoint.py), cut into each rank's
tensor-parallel shard (sharding.py), kept resident per layer (slots.py) by the rank's LoRAManager (manager.py)
and applied to the step's tokens batched by adapter (context.py)."""
