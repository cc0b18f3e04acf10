"""raytp's engine layer: the engine loop, its one output road, the controller actor, executors and workers.

    engine.py            LLMEngine: admission (one request check), schedule -> execute -> update
    output_processor.py  the one road from tokens to RequestDeltas (detokenize, stop strings, logprobs, best_of)
    detokenizer.py       incremental detokenization
    outputs.py           RequestDelta (the stream) and RequestOutput (the whole result, folded from it)
    controller.py        EngineController: the engine as an async Ray actor streaming per request
    executor.py          Executor interface and the in-process executor
    ray_executor.py      one Ray worker actor per tensor-parallel rank, in a placement group
    worker.py            Worker: a rank's protocol (the tensors live in model_exec.shard)

Users import from `raytp` (the front door); nothing here imports it.
"""
