"""The outputs of `tool_choice` named and `"required"`, which a JSON-schema constraint shapes (see
`raytp/openai/tools.py`): parsed like the registered parsers, so they stream the same way.

named: the whole output is the named function's arguments object.
required: the whole output is `[{"name": ..., "parameters": {...}}, ...]` (vLLM's shape for it).
Neither has content.
"""

from __future__ import annotations

from raytp.openai.tool_parsers.base import CallSnapshot, Snapshot, ToolParser, calls_in_array
from raytp.openai.tool_parsers.json_scan import skip_ws


class NamedCallParser(ToolParser):
    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, final: bool) -> Snapshot:
        return Snapshot("", [CallSnapshot(self.name, text.strip())])


class RequiredCallsParser(ToolParser):
    def parse(self, text: str, final: bool) -> Snapshot:
        j = skip_ws(text, 0)
        if j < len(text) and text[j] == "[":
            return Snapshot("", calls_in_array(text, j, final, ("parameters", "arguments"))[0])
        return Snapshot("")
