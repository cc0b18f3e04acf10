"""POST /tokenize and POST /detokenize (vLLM's extensions): the tokenizer and chat template of the
model the request names, as the generation routes apply them, without running the engine."""

from __future__ import annotations

from raytp.openai.errors import bad_request
from raytp.openai.models import ModelsHandler
from raytp.openai.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse


class TokenizeHandler(ModelsHandler):
    async def create(self, req: TokenizeRequest, request_id: str) -> TokenizeResponse:
        ctx = self.models.resolve(req.model)
        if req.messages is not None and req.prompt is None:
            ids = await ctx.chat_prompt_ids(req.messages, req.add_generation_prompt)
        elif req.prompt is not None and req.messages is None:
            ids = await ctx.encode(req.prompt, req.add_special_tokens)
        else:
            raise bad_request("Send exactly one of prompt or messages.", "prompt")
        return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids)


class DetokenizeHandler(ModelsHandler):
    async def create(self, req: DetokenizeRequest, request_id: str) -> DetokenizeResponse:
        ctx = self.models.resolve(req.model)
        if any(t >= ctx.vocab_size for t in req.tokens):
            raise bad_request(f"tokens must be in [0, {ctx.vocab_size}) (the vocabulary size).", "tokens")
        return DetokenizeResponse(prompt=await ctx.decode(req.tokens))
