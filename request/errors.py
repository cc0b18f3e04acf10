"""Typed errors for what a user can get wrong in a request.

Raised where the fact is checked (SamplingParams, the engine's request check) and mapped to an
HTTP status by type, never by parsing the message: a `RequestError` is a 400 whose `param`
names the offending field, with OpenAI's error `type` and an optional machine-readable `code`.
Torch-free, so the HTTP ingress and the controller share it.
"""

from __future__ import annotations


class RequestError(ValueError):
    """A bad request (HTTP 400). Subclasses ValueError: callers that catch ValueError keep working."""

    error_type = "invalid_request_error"  # OpenAI's error `type` for every client mistake

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param  # the request field at fault, as the OpenAI API names it
        self.code = code  # e.g. "context_length_exceeded"; None when OpenAI defines none

    def __reduce__(self) -> tuple[type[RequestError], tuple[str, str | None, str | None]]:
        # Crosses Ray (controller -> ingress) with its fields intact.
        return (type(self), (self.message, self.param, self.code))


class PromptTooLongError(RequestError):
    """The prompt leaves no room for a completion within max_model_len (or the KV cache)."""

    def __init__(
        self, message: str, param: str | None = "prompt", code: str | None = "context_length_exceeded"
    ) -> None:
        super().__init__(message, param, code)
