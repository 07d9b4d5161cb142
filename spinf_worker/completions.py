"""The OpenAI legacy completions face (torch-free): ``POST /v1/completions`` with ``echo`` and
``logprobs``, the request evaluation tools send to read a text's log-likelihood.

A request is one or more prompts (a string, a list of strings, token ids or lists of ids);
each is read as one sequence, its token logprobs are readouts of the pass (engine/
completion.py), and up to ``MAX_COMPLETION_TOKENS`` tokens are decoded greedily after it.
Fields the server does not implement, or values it cannot honour (sampling, ``n`` > 1,
streaming), are a 400 naming them, never silently ignored."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, TypeAdapter, model_serializer

from .errors import InvalidRequestError
from .plain_reply import PlainReply

MAX_COMPLETION_TOKENS = 16   # greedy tokens after a prompt (each one reads the prompt again)
MAX_LOGPROBS = 20            # top-N per position
MAX_PROMPTS = 1000           # prompts in one request
MAX_STOP = 4                 # stop strings, as OpenAI allows

# Fields of OpenAI's legacy completions request. Those not in SUPPORTED are accepted only at
# their neutral value (what a client sends when it asks for nothing special).
SUPPORTED = {"model", "prompt", "echo", "logprobs", "max_tokens", "stop", "n", "temperature",
             "top_p", "seed", "user", "stream", "best_of", "presence_penalty",
             "frequency_penalty", "logit_bias", "suffix"}


class CompletionRequest(BaseModel):
    """A validated completions request, as it is queued: ``prompts`` are strings or token id
    lists, one per choice."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompts: list[str | list[int]]
    echo: bool = False
    logprobs: int | None = None
    max_tokens: int = 16
    stop: list[str] = Field(default_factory=list)

    # each prompt's (ids, text, character offsets) as the engine read it when it laid the
    # request out (engine/completion.py): its pass reads them again, never the tokenizer
    _encoded: list | None = PrivateAttr(default=None)

    @classmethod
    def parse(cls, body: Any) -> CompletionRequest:
        """The request from an OpenAI completions body; InvalidRequestError (400, ``param``
        naming the field) for anything it cannot honour."""
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        unknown = sorted(k for k in body if k not in SUPPORTED)
        if unknown:
            raise InvalidRequestError(
                f"unsupported field(s) for /v1/completions: {', '.join(unknown)}",
                param=unknown[0])
        _neutral(body, "n", (1,), "only n=1 is supported")
        _neutral(body, "best_of", (1,), "only best_of=1 is supported")
        _neutral(body, "stream", (False,), "completions answer in one response; 'stream' "
                                           "must be false")
        _neutral(body, "suffix", ("",), "'suffix' (insertion) is not supported")
        _neutral(body, "logit_bias", ({},), "'logit_bias' is not supported")
        for name in ("presence_penalty", "frequency_penalty"):
            _neutral(body, name, (0,), f"'{name}' is not supported (only 0)")
        if "user" in body and body["user"] is not None and not isinstance(body["user"], str):
            raise InvalidRequestError("'user' must be a string", param="user")
        if "seed" in body and body["seed"] is not None and (
                not isinstance(body["seed"], int) or isinstance(body["seed"], bool)):
            raise InvalidRequestError("'seed' must be an integer", param="seed")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise InvalidRequestError("'model' must be a string", param="model")
        echo = body.get("echo", False)
        if echo is None:
            echo = False
        if not isinstance(echo, bool):
            raise InvalidRequestError("'echo' must be true or false", param="echo")
        logprobs = _integer(body, "logprobs", None, 0, MAX_LOGPROBS)
        max_tokens = _integer(body, "max_tokens", 16, 0, MAX_COMPLETION_TOKENS,
                              hint=f" (greedy decoding of up to {MAX_COMPLETION_TOKENS} "
                                   "tokens; 0 scores the prompt only)")
        if max_tokens > 0:
            # greedy only: sampling settings must say so
            temperature = body.get("temperature")
            if temperature is not None and (not _number(temperature) or temperature != 0):
                raise InvalidRequestError(
                    "only greedy decoding is supported: 'temperature' must be 0 (or left out)",
                    param="temperature")
            top_p = body.get("top_p")
            if top_p is not None and (not _number(top_p) or top_p != 1):
                raise InvalidRequestError(
                    "only greedy decoding is supported: 'top_p' must be 1 (or left out)",
                    param="top_p")
        else:
            for name in ("temperature", "top_p"):
                value = body.get(name)
                if value is not None and not _number(value):
                    raise InvalidRequestError(f"'{name}' must be a number", param=name)
        return cls(model=model, prompts=_prompts(body), echo=echo, logprobs=logprobs,
                   max_tokens=max_tokens, stop=_stop(body.get("stop")))


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _neutral(body: dict, name: str, allowed: tuple, message: str) -> None:
    if name not in body or body[name] is None:
        return
    value = body[name]
    if isinstance(value, bool) != any(isinstance(a, bool) for a in allowed) or value not in allowed:
        raise InvalidRequestError(message, param=name)


def _integer(body: dict, name: str, default: int | None, lo: int, hi: int, hint: str = ""
             ) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise InvalidRequestError(f"'{name}' must be an integer from {lo} to {hi}{hint}",
                                  param=name)
    return value


def _token_ids(value: list, param: str) -> list[int]:
    if not value:
        raise InvalidRequestError("a prompt of token ids must not be empty", param=param)
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise InvalidRequestError("token ids must be integers >= 0", param=param)
    return list(value)


def _prompts(body: dict) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if prompt is None:
        raise InvalidRequestError("'prompt' is required: a string, a list of strings, a list "
                                  "of token ids or a list of such lists", param="prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequestError("'prompt' must be a string, a non-empty list of strings, a "
                                  "list of token ids or a list of such lists", param="prompt")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [_token_ids(prompt, "prompt")]
    if len(prompt) > MAX_PROMPTS:
        raise InvalidRequestError(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    prompts: list[str | list[int]] = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            prompts.append(p)
        elif isinstance(p, list):
            prompts.append(_token_ids(p, f"prompt[{i}]"))
        else:
            raise InvalidRequestError("each prompt must be a string or a list of token ids",
                                      param=f"prompt[{i}]")
    return prompts


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if (not isinstance(stop, list) or len(stop) > MAX_STOP
            or not all(isinstance(s, str) and s for s in stop)):
        raise InvalidRequestError(f"'stop' must be a non-empty string or a list of up to "
                                  f"{MAX_STOP} of them", param="stop")
    return stop


# ---- the response ------------------------------------------------------------------------


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None
    finish_reason: str


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(PlainReply):
    """OpenAI's ``text_completion`` object."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: CompletionUsage

    HELD = "choices"     # a token, a logprob, a top-N and an offset per prompt token

    @classmethod
    def of_engine(cls, data: dict[str, Any]) -> CompletionResponse:
        """The reply of data the engine built in this shape, its ``choices`` (nearly all of
        it) validated only once read: a worker stores the data as it is (``plain``)."""
        return cls._held_back(data)

    @classmethod
    def _validate_held(cls, value: Any) -> Any:
        return _CHOICES.validate_python(value)

    @model_serializer(mode="wrap")
    def _dump(self, handler):   # unannotated: the schema stays the model's
        self._complete()
        return handler(self)

    def plain(self) -> dict[str, Any]:
        """``model_dump()``, without dumping the model where the engine kept the data it was
        built from (no field of it is changed after)."""
        return self.model_dump() if self._plain is None else self._plain


_CHOICES = TypeAdapter(list[CompletionChoice])
