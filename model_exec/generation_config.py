"""The model's recommended sampling defaults, from its generation_config.json, as vLLM's
`--generation-config` applies them; torch-free (the controller and the HTTP ingress read them).

`auto` (the default) reads the model's own file; `vllm` ignores it (raytp's built-in defaults, vLLM's
name for the setting); any other value is a folder holding a generation_config.json. The defaults fill
only what a request leaves unset: offline `LLM` uses them when it is given no SamplingParams at all
(`LLM.get_default_sampling_params`), the OpenAI routes for each field a request omits or sends as null.

EOS ids are another matter: a generation_config.json that lists several is honoured whatever this
setting (vLLM reads them from the model's file under `vllm` too), see `source.read_model_config`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from request.errors import RequestError
from request.sampling_params import SamplingParams

GENERATION_CONFIG = "generation_config.json"
# SamplingParams fields the model may set a default for (HF and vLLM spell them alike) ...
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# ... and HF's max_new_tokens, which is vLLM's max_tokens
MAX_NEW_TOKENS = "max_new_tokens"


class ModelFiles(Protocol):
    """Where a model's files are: what this module reads of `model_exec.source.ModelSource`, which satisfies
    it. A protocol, so that source.py (which merges the EOS ids read here) sits above this module."""

    @property
    def kind(self) -> str: ...  # "safetensors" | "gguf"

    @property
    def path(self) -> str: ...  # the weights' directory

    @property
    def metadata_dir(self) -> str: ...  # config.json and the tokenizer (converted once for a GGUF)


def check_generation_config_setting(setting: str) -> None:
    """`auto`, `vllm` or a folder path (whether the folder holds the file is checked when it is read)."""
    if not isinstance(setting, str) or not setting:
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder path, got {setting!r}.")


def generation_config_file(src: ModelFiles, setting: str) -> Path | None:
    """The generation_config.json that `setting` names for model `src`; None when there is none.

    `auto` and `vllm` both point at the model's own file (`vllm` still takes its EOS ids, not its sampling
    defaults). For a GGUF model: a generation_config.json beside the .gguf file, else the one derived
    from the GGUF's `general.sampling.*` metadata (`model_exec.gguf_metadata`).
    Raises ValueError for a folder that holds no generation_config.json.
    """
    check_generation_config_setting(setting)
    if setting not in ("auto", "vllm"):
        path = Path(setting).expanduser() / GENERATION_CONFIG
        if not path.is_file():
            raise ValueError(f"generation_config {setting!r}: no {GENERATION_CONFIG} in that folder.")
        return path
    candidates = [Path(src.path, GENERATION_CONFIG)]
    if src.kind == "gguf":
        candidates.append(Path(src.metadata_dir, GENERATION_CONFIG))
    return next((p for p in candidates if p.is_file()), None)


def read_generation_config(path: Path | None) -> dict[str, Any]:
    """The file as a dict ({} for None); ValueError naming it when it is not a JSON object."""
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def eos_token_ids(gen_config: dict[str, Any]) -> tuple[int, ...]:
    """generation_config.json's `eos_token_id`: one id or a list of them."""
    eos = gen_config.get("eos_token_id")
    return (eos,) if isinstance(eos, int) else tuple(eos or ())


def sampling_defaults(src: ModelFiles, setting: str) -> dict[str, Any]:
    """SamplingParams keyword arguments the model recommends (vLLM's `get_diff_sampling_param`): the
    fields its generation_config.json sets to a value (null counts as unset), `max_new_tokens` as
    `max_tokens`; {} under `vllm` or when the model has no such file.

    Raises ValueError naming the file for a value SamplingParams would refuse, so a bad file stops the
    engine at start instead of failing every request.
    """
    if setting == "vllm":
        check_generation_config_setting(setting)
        return {}
    path = generation_config_file(src, setting)
    gen = read_generation_config(path)
    out = {name: gen[name] for name in SAMPLING_FIELDS if gen.get(name) is not None}
    if gen.get(MAX_NEW_TOKENS) is not None:
        out["max_tokens"] = gen[MAX_NEW_TOKENS]
    if out:
        try:
            SamplingParams(**out)
        except RequestError as e:
            raise ValueError(f"{path}: {e.message}") from None
    return out
