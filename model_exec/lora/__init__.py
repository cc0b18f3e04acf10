"""LoRA adapters: PEFT checkpoints read (peft_config.py, torch-free) and applied to the tensor-parallel linear
layers, batched by adapter."""
