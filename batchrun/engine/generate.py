"""The engine's convenience surface (the seed's API): requests as text, token ids or chat
messages; run to the end; generate a list of prompts in one call."""

from __future__ import annotations

from batchrun.engine.types import Output, SamplingParams


class Requests:
    """Mixed into Engine, which provides prompts, add_tokens, has_work and step."""

    def add_request(self, prompt: str | list[int] | None = None,
                    params: SamplingParams | None = None, *, messages: list[dict] | None = None,
                    tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
                    enable_thinking: bool | None = None) -> int:
        """Queue a request (token ids, a raw prompt, or chat messages); returns its id."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt (text or token ids) and messages")
        if messages is not None:
            ids = self.prompts.encode_chat(messages, tools=tools, enable_thinking=enable_thinking,
                                           chat_template_kwargs=chat_template_kwargs)
        elif isinstance(prompt, str):
            ids = self.prompts.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        return self.add_tokens(ids, params or SamplingParams())

    def run(self) -> list[Output]:
        """Step until every queued request has finished; outputs ordered by request id."""
        outputs = []
        while self.has_work():
            outputs.extend(self.step())
        return sorted(outputs, key=lambda o: o.request_id)

    def generate(self, prompts: list[str | list[int] | list[dict]],
                 params: SamplingParams | None = None, **sampling) -> list[Output]:
        """Run prompts to the end: each a text, token ids, or a chat (a list of messages).
        Sampling comes from `params` or keyword arguments (max_tokens=8, temperature=0.7...).
        Returns one Output per prompt, in order."""
        if params is None:
            params = SamplingParams(**sampling)
        elif sampling:
            raise ValueError("give sampling as params or as keyword arguments, not both")
        ids = [self.add_request(messages=p, params=params) if _is_chat(p)
               else self.add_request(p, params) for p in prompts]
        done = {o.request_id: o for o in self.run()}
        return [done[i] for i in ids]



def _is_chat(prompt: object) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
