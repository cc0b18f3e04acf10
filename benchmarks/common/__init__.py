"""What the benchmark scripts share; none of these is a benchmark of its own (the scripts are benchmarks/*.py,
each documented in docs/benchmarks.md).

    workload.py       the request sets: random token-id prompts and output lengths, from a seed
    serving_load.py   Poisson arrivals of streamed completions against a server, and what they measured
    servers.py        `raytp serve` and vLLM's api_server as benchmark subprocesses
    vllm_baseline.py  vLLM's CPU build as a baseline: where it lives, how it is started and driven
    proc_mem.py       peak memory of a process tree, sampled from /proc
    hf_model.py       the benchmark model as a Hugging Face safetensors directory
                      (`python -m benchmarks.common.hf_model` prints it)
"""
