"""Backend names, importable without torch (configs validate against them)."""

ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "torch", "flash_attn", "xformers")
