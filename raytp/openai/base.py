"""The pydantic bases of the OpenAI schemas, and what every request model does before its fields are read.

`null` means "the default" for every optional field, as in vLLM: clients (the official ones included)
send `"n": null`, `"stream": null`. A field whose declared type admits None keeps it (`max_tokens: null`
on completions means "as many as fit", as in vLLM). Unknown fields are ignored, as vLLM does, and each
unknown name is logged once per process, so an operator sees what clients send that raytp does not know.
"""

from __future__ import annotations

import logging
import threading
import types
import typing
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, model_validator

logger = logging.getLogger(__name__)

_logged_unknown: set[tuple[str, str]] = set()  # (model, field) names already logged by this process
_logged_lock = threading.Lock()


def _admits_none(annotation: Any) -> bool:
    if annotation is None or annotation is type(None) or annotation is Any:
        return True
    if typing.get_origin(annotation) is Annotated:
        return _admits_none(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_admits_none(a) for a in typing.get_args(annotation))
    return False


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class OpenAIRequest(OpenAIModel):
    # JSON's Infinity/NaN literals (which Python's json module accepts) are refused.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _nulls_and_unknowns(cls, data: Any) -> Any:
        """null -> the field's default (for fields whose type has no None); unknown names logged once."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        names = set(fields) | {f.alias for f in fields.values() if f.alias}
        with _logged_lock:  # handlers parse on several threads (the batch runner, Serve's loop)
            unknown = [k for k in data if k not in names and (cls.__name__, k) not in _logged_unknown]
            _logged_unknown.update((cls.__name__, k) for k in unknown)
        for key in unknown:
            logger.warning("%s: unknown request field %r ignored (logged once per process)", cls.__name__, key)
        return {
            k: v
            for k, v in data.items()
            if v is not None or k not in fields or fields[k].is_required() or _admits_none(fields[k].annotation)
        }
