"""Backend names, importable without torch (configs validate against them)."""

# The one registry of attention backends: name -> (module under ops.attention, class name, pip requirement).
# Plain strings, so a config can validate a name without importing torch; ops.attention imports the class.
BACKENDS: dict[str, tuple[str, str, str]] = {
    "torch": ("torch_backend", "TorchAttentionBackend", ""),
    "cpu": ("cpu_backend", "CpuAttentionBackend", ""),
    "triton": ("triton_backend", "TritonAttentionBackend", "triton"),
    "flash_attn": ("flash_attn_backend", "FlashAttnBackend", "flash-attn>=2.6"),
    "xformers": ("xformers_backend", "XFormersBackend", "xformers>=0.0.28"),
}
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", *BACKENDS)  # "auto" picks one of them (ops.attention)
