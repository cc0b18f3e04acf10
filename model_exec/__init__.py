"""Model execution: model definitions, tensor-parallel layers, weight loading.

Kept import-light on purpose: import the submodule you need (`model_exec.config`,
`model_exec.weights`, `model_exec.models`, ...), so that importing the package does
not pull in torch or transformers.
"""
