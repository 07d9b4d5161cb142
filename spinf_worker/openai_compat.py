"""The OpenAI chat-completions face of scoring (torch-free): a chat request carrying a
``scoring`` block is a ScoreRequest, and the reply is the score response plus ``choices`` (as
the hosted API answers it; the OpenAI SDKs read it). Used by POST /v1/chat/completions and by
batches on that endpoint."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from . import jsonio
from .errors import InvalidRequestError
from .protocol import ScoreRequest, ScoreResponse


class ChatMessage(BaseModel):
    role: str = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    finish_reason: str = "stop"
    logprobs: None = None


class ChatScoreResponse(ScoreResponse):
    """The reply of /v1/chat/completions: the score response and one choice, the most likely
    answer of the first query."""

    choices: list[ChatChoice]


def score_request_from_chat(body: Any, read_by_orjson: bool = False) -> ScoreRequest:
    """A chat completion request carrying a ``scoring`` block, as a ScoreRequest
    (``read_by_orjson``: as ScoreRequest.parse).

    Raises InvalidRequestError for anything that would need text generation."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object", code="invalid_field")
    if body.get("scoring") is None:
        raise InvalidRequestError(
            "this server scores and extracts, it does not chat: send a 'scoring' block with "
            "your questions (with the OpenAI SDK: extra_body={'scoring': {'queries': [...]}})",
            param="scoring", code="scoring_required")
    if body.get("stream"):
        raise InvalidRequestError("scoring answers in one response; 'stream' must be false",
                                  param="stream", code="invalid_field")
    return ScoreRequest.parse(body, read_by_orjson=read_by_orjson)


def score_to_chat_completion(score: dict) -> dict:
    """A score response (as a dict) with ``choices``: one message, the most likely option (or
    answer) of the first input's first query's first combination, or the first pack's
    decision when only packs were asked."""
    first = score["results"][0] if score.get("results") else {}
    if isinstance(first, jsonio.RawJSON):   # an input's result the engine wrote as JSON
        first = jsonio.loads(first, long_integers=False)
    content = ""
    if first.get("queries"):
        combination = first["queries"][0]["combinations"][0]
        answers = combination.get("options") or combination.get("answers") or []
        if answers:
            content = max(answers, key=lambda answer: answer.get("p") or 0)["text"]
    elif first.get("packs"):
        content = "unsafe" if first["packs"][0]["decision"].get("unsafe") else "safe"
    return {**score,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": "stop", "logprobs": None}]}
