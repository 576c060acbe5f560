"""The OpenAI request bodies fuel serve accepts, as pydantic models, and their sampling
parameters.

Decides which fields are read, their types, and which requests are refused as unsupported
(``n`` > 1, ``best_of`` > 1, ``echo``, ``suffix``, non-text message parts): a refused field is
a 400 naming it, never a silently ignored one. Fields OpenAI defines that change nothing here
(``user``, ``logit_bias`` when empty, ``service_tier`` ...) are ignored, as other
OpenAI-compatible servers do. Ranges are checked once, by
:class:`~fuel.runtime.sampling.SamplingParams`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fuel.runtime.sampling import SamplingParams


class Unsupported(ValueError):
    def __init__(self, param: str, detail: str):
        self.param, self.detail = param, detail
        super().__init__(detail)


def checked_text(text: str, param: str) -> str:
    """``text`` when it is Unicode text; a lone surrogate (JSON allows the escape ``\\ud800``,
    which is no character and cannot be encoded or tokenized) is refused naming the field and
    where it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise Unsupported(param, f"`{param}` holds a lone surrogate (U+{ord(text[error.start]):04X}) "
                                 f"at character {error.start}: not Unicode text") from None
    return text


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    """The fields both endpoints share; ``top_k``, ``min_p``, ``stop_token_ids`` and
    ``ignore_eos`` are vLLM's extensions (sent by the openai client as ``extra_body``)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None

    def _common(self) -> None:
        if self.n not in (None, 1):
            raise Unsupported("n", f"`n` = {self.n}: only one choice per request is supported")
        if self.logit_bias:
            raise Unsupported("logit_bias", "`logit_bias` is not supported")

    def sampling(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        self._common()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        stop = [checked_text(text, "stop") for text in stop]
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0, min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed, max_tokens=max_tokens, stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()), logprobs=logprobs,
            ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def checked(self) -> None:
        if self.echo:
            raise Unsupported("echo", "`echo` is not supported")
        if self.best_of not in (None, 1):
            raise Unsupported("best_of", f"`best_of` = {self.best_of}: only 1 is supported")
        if self.suffix:
            raise Unsupported("suffix", "`suffix` is not supported")

    def prompt_input(self) -> str | list[int]:
        """The one prompt (text or token ids); a list of several prompts is refused."""
        prompt: Any = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise Unsupported("prompt", f"{len(prompt)} prompts in one request: send one per request")
            prompt = prompt[0]
        return checked_text(prompt, "prompt") if isinstance(prompt, str) else prompt


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        param = f"messages[{index}].content"
        if isinstance(self.content, str):
            return checked_text(self.content, param)
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise Unsupported(param, f"content part of type {part.type!r}: only text parts are supported")
            parts.append(part.text)
        return checked_text("".join(parts), param)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def message_dicts(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
                for i, m in enumerate(self.messages)]

    def logprob_count(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise Unsupported("top_logprobs", "`top_logprobs` needs `logprobs`: true")
            return None
        return self.top_logprobs or 0


__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "StreamOptions", "Unsupported",
           "checked_text"]
