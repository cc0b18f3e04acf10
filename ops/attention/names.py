"""Backend names, importable without torch (configs validate against them)."""

ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "torch", "cpu", "flash_attn", "xformers")
