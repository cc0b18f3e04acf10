"""hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per message (Qwen2.5, Hermes 2/3).

Text outside the tags is content. A tag body that is not a call object (or that breaks off) is skipped
up to its closing tag, keeping whatever call it had named so far; a call object whose closing tag is
missing ends where the object does.
"""

from __future__ import annotations

import json
from typing import Any

from raytp.openai.tool_parsers.base import Snapshot, ToolParser, call_at, plain_text
from raytp.openai.tool_parsers.json_scan import skip_ws

START, END = "<tool_call>", "</tool_call>"
ARG_KEYS = ("arguments", "parameters")


class HermesToolParser(ToolParser):
    def structural_tag(self, schemas: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
        structures = [
            {"begin": f'{START}\n{{"name": {json.dumps(name)}, "arguments": ', "schema": schema, "end": f"}}\n{END}"}
            for name, schema in schemas.items()
        ]
        return {"structures": structures, "triggers": [START]}

    def parse(self, text: str, final: bool) -> Snapshot:
        snap = Snapshot("")
        pos = 0
        while True:
            start = text.find(START, pos)
            if start < 0:
                snap.content += plain_text(text[pos:], final, bool(snap.calls), START)
                return snap
            snap.content += text[pos:start].rstrip()
            body = skip_ws(text, start + len(START))
            after = body
            if body < len(text) and text[body] == "{":
                found = call_at(text, body, final, ARG_KEYS)
                if found.call is not None:
                    snap.calls.append(found.call)
                if found.arriving(text):  # a closing tag now could be inside one of its strings
                    return snap
                after = found.scan.end
                if found.scan.complete:
                    j = skip_ws(text, after)
                    if text.startswith(END, j):
                        pos = j + len(END)
                        continue
                    if not final and END.startswith(text[j:]):
                        return snap
                    pos = after  # a call without its closing tag: what follows is text or the next call
                    continue
            close = text.find(END, after)
            if close < 0:
                return snap
            pos = close + len(END)
