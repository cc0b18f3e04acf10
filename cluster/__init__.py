"""raytp's engine layer: the engine loop, its one output road, the controller actor, executors and workers.

    engine.py            LLMEngine: admission (one request check), schedule -> execute -> update
    output_processor.py  the one road from tokens to RequestDeltas (detokenize, stop strings, logprobs, best_of)
    detokenizer.py       incremental detokenization
    outputs.py           RequestDelta (the stream) and RequestOutput (the whole result, folded from it)
    controller.py        EngineLoop: the engine on an event loop, streaming per request (in the Serve
                         replica's process; as the EngineController actor for batch replicas)
    executor.py          Executor interface and the in-process executor
    ray_executor.py      one Ray worker actor per tensor-parallel rank, in a placement group
    worker.py            Worker: a rank's protocol (the tensors live in model_exec.shard)

Users import from `raytp` (the front door); nothing here imports it.
"""
