"""The request vocabulary: what a caller says about one request, shared by every layer above.

`SamplingParams`, `StructuredOutputsParams`, `LoRARequest` and the typed request errors are the words the
front door (`raytp/`), the engine (`cluster/`) and the scheduler all use, so they sit in this bottom package,
which imports nothing of the project and no torch: the HTTP layer builds them, the engine checks them
against the model (`request.check`), and the scheduler reads them.
"""
