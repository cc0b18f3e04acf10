"""deepseek_r1: DeepSeek-R1 and its distills. Their chat template may open `<think>` in the prompt, so
everything before `</think>` is reasoning, opening tag or not; an output that never closes it is all
reasoning (as vLLM's parser decides)."""

from __future__ import annotations

from raytp.openai.reasoning.base import ReasoningParser, Split


class DeepSeekR1ReasoningParser(ReasoningParser):
    def parse(self, text: str, final: bool) -> Split:
        if not final and self.start.startswith(text):
            return Split("", "")  # may be the opening tag, which is not reasoning
        i = len(self.start) if text.startswith(self.start) else 0
        return self._after_start(text, i, final)
