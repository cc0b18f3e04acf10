"""qwen3: Qwen3 opens `<think>` itself when it reasons; an output that does not start with it (thinking
disabled through `chat_template_kwargs={"enable_thinking": false}`) is all content."""

from __future__ import annotations

from raytp.openai.reasoning.base import ReasoningParser, Split


class Qwen3ReasoningParser(ReasoningParser):
    def parse(self, text: str, final: bool) -> Split:
        if text.startswith(self.start):
            return self._after_start(text, len(self.start), final)
        if not final and self.start.startswith(text):
            return Split("", "")
        return Split("", text)
