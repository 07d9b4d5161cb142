"""The OpenAI chat-completions face of scoring (torch-free): a chat request carrying a
``scoring`` block (or ``packs``) becomes a ScoreRequest, and a ScoreResponse goes back in the
``chat.completion`` shape. Used by POST /v1/chat/completions and by batches on that endpoint."""

from __future__ import annotations

from typing import Any

from .errors import InvalidRequestError
from .protocol import ScoreRequest


def score_request_from_chat(body: Any) -> ScoreRequest:
    """A chat completion request carrying a ``scoring`` block, as a ScoreRequest.

    Raises InvalidRequestError for anything that would need text generation."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    if body.get("scoring") is None and not body.get("packs"):
        raise InvalidRequestError(
            "this server scores options instead of generating text: send a 'scoring' block "
            "or 'packs' (with the OpenAI SDK: extra_body={'scoring': {'queries': [...]}})",
            param="scoring", code="generation_not_supported")
    if body.get("stream"):
        raise InvalidRequestError("scoring answers in one response; 'stream' must be false",
                                  param="stream", code="stream_not_supported")
    if body.get("messages") is None:
        raise InvalidRequestError("'messages' is required", param="messages",
                                  code="missing_content")
    return ScoreRequest.parse(body)


def score_to_chat_completion(score: dict) -> dict:
    """A ScoreResponse (as a dict) in the chat.completion shape: the message is the most
    likely option (or extracted candidate) of the first query's first combination, or the
    first pack's decision when only packs were asked; ``scoring`` holds the full scores."""
    if score["queries"]:
        combination = score["queries"][0]["combinations"][0]
        answers = combination.get("options") or combination.get("candidates") or []
        content = max(answers, key=lambda answer: answer["p"])["text"] if answers else ""
    else:
        content = score["packs"][0]["decision"]["label"] if score.get("packs") else ""
    tokens = score.get("usage", {}).get("total_tokens", 0)
    return {
        "id": "chatcmpl-" + score["id"].removeprefix("score-"),
        "object": "chat.completion",
        "created": score["created"],
        "model": score["model"],
        "system_fingerprint": score.get("system_fingerprint"),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "finish_reason": "stop", "logprobs": None}],
        # Everything was read, nothing generated: all tokens count as prompt tokens.
        "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens},
        "scoring": score,
    }
