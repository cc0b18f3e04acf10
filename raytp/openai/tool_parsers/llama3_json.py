"""llama3_json: Llama 3.1/3.2's JSON tool calls, `<|python_tag|>` (optional) then `{"name": ..., "parameters":
{...}}` objects separated by `;`.

As vLLM decides it: the output is tool calls only when it starts with `<|python_tag|>` or `{`; it is
then all calls, no content. An output that starts with an object without a name is content after all
(plain JSON the user asked for), so nothing is sent until the first object's name has arrived.
"""

from __future__ import annotations

from raytp.openai.tool_parsers.base import Snapshot, ToolParser, call_at
from raytp.openai.tool_parsers.json_scan import skip_ws

BOT = "<|python_tag|>"
ARG_KEYS = ("parameters", "arguments")


class Llama3JsonToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> Snapshot:
        if not final and BOT.startswith(text):
            return Snapshot("")  # may become the tag (or, empty, a call)
        j = len(BOT) if text.startswith(BOT) else 0
        j = skip_ws(text, j)
        if j >= len(text) or text[j] != "{":
            return Snapshot("" if j and j >= len(text) else text)
        snap = Snapshot("")
        while True:
            found = call_at(text, j, final, ARG_KEYS)
            if found.call is None or (found.call.name is None and final):  # not a call after all
                return snap if snap.calls else Snapshot(text)
            if found.call.name is None:  # whether it is a call is still to be seen
                return snap
            snap.calls.append(found.call)
            if not found.scan.complete:
                return snap
            j = skip_ws(text, found.scan.end)
            if j >= len(text) or text[j] != ";":
                return snap
            j = skip_ws(text, j + 1)
            if j >= len(text) or text[j] != "{":
                return snap
