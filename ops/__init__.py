"""Tensor ops below the model: paged attention backends (`ops.attention`) and KV-cache ops (`ops.cache_ops`).

Nothing is imported here, so `import ops.attention` stays cheap; import the submodules you need.
"""
