"""mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral 7B v0.3, Mixtral, Nemo tokenizers
before v11). Text before the marker is content; the marker is a special token, so the output is
detokenized with special tokens kept. Tool call ids are 9 alphanumerics, what Mistral's template accepts.
"""

from __future__ import annotations

import random
import string
from typing import ClassVar

from raytp.openai.tool_parsers.base import Snapshot, ToolParser, calls_in_array, plain_text
from raytp.openai.tool_parsers.json_scan import skip_ws

BOT = "[TOOL_CALLS]"
ARG_KEYS = ("arguments", "parameters")
_ID_CHARS = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    needs_special_tokens: ClassVar[bool] = True

    def parse(self, text: str, final: bool) -> Snapshot:
        start = text.find(BOT)
        if start < 0:
            return Snapshot(plain_text(text, final, False, BOT))
        snap = Snapshot(text[:start].rstrip())
        j = skip_ws(text, start + len(BOT))
        if j < len(text) and text[j] == "[":
            snap.calls, _ = calls_in_array(text, j, final, ARG_KEYS)
        return snap

    def make_id(self) -> str:
        return "".join(random.choices(_ID_CHARS, k=9))
