"""Request and response models for scoring, shared by the API tier and the engine.

``ScoreRequest.parse`` is the one entry point for untrusted input: every validation failure
becomes an ``InvalidRequestError`` whose ``param`` is the dotted path of the offending field
(``scoring.queries.0.options``), ready for the OpenAI error shape.
"""

from __future__ import annotations

import contextlib
import json
from functools import lru_cache
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    StrictFloat,
    StrictInt,
    Tag,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from spinf_worker import templates
from spinf_worker.errors import InvalidRequestError, SpinfError

DEFAULT_MAX_COMBINATIONS = 4096  # grid cap at parse time; the engine may apply a stricter one
MAX_QUERIES = 1024
MAX_QUERY_ID_LENGTH = 128

# Extraction queries ({*}, {n}, {$}): decoding limits, (default, lowest, highest).
MAX_TOKENS = (32, 1, 256)      # tokens decoded for one answer
BEAM_WIDTH = (4, 1, 16)        # answers searched side by side; candidates defaults to it
# Generated {*} slots (``generate``).
GENERATE_MAX_TOKENS = (64, 1, 512)
GENERATE_TEMPERATURE = (0.0, 0.0, 2.0)
GENERATE_MAX_STOPS = 4
MAX_SEED = 2**63 - 1

# Our validators raise PydanticCustomError carrying the InvalidRequestError under this context
# key; `parse` takes message, code and (relative) param from it. Pydantic substitutes context
# keys written in braces into its own copy of the message, which user text could trigger, so
# the exact message is read from the carried error, never from pydantic's copy.
_CARRIED = "spinf_error"
_OUR_ERROR = "spinf_invalid_request"

# Union branch labels that pydantic puts into error locations; they are not request fields.
_CONTENT_TAGS = {"string_content", "part_list"}
_PART_TAGS = {"text_part", "image_url_part", "input_audio_part"}


def _invalid(message: str, *, param: str | None = None,
             code: str | None = None) -> PydanticCustomError:
    """An error raised inside a validator; ``param`` is relative to the model raising it."""
    return _carry(InvalidRequestError(message, param=param, code=code))


def _carry(error: InvalidRequestError) -> PydanticCustomError:
    return PydanticCustomError(_OUR_ERROR, error.message, {_CARRIED: error})


# ---- request ---------------------------------------------------------------------------


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageUrlPart(BaseModel):
    type: Literal["image_url"]
    image_url: dict[str, Any]


class InputAudioPart(BaseModel):
    type: Literal["input_audio"]
    input_audio: dict[str, Any]


def _part_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return {"text": "text_part", "image_url": "image_url_part",
            "input_audio": "input_audio_part"}.get(kind)


ContentPart = Annotated[
    Annotated[TextPart, Tag("text_part")]
    | Annotated[ImageUrlPart, Tag("image_url_part")]
    | Annotated[InputAudioPart, Tag("input_audio_part")],
    Discriminator(_part_tag, custom_error_type="invalid_content_part",
                  custom_error_message="content part type must be 'text', 'image_url' or "
                                       "'input_audio'"),
]

# A callable discriminator validates only the branch that matches the input, so a bad list
# reports the list's problem rather than also "not a valid string".
Content = Annotated[
    Annotated[str, Tag("string_content")] | Annotated[list[ContentPart], Tag("part_list")],
    Discriminator(lambda value: "string_content" if isinstance(value, str) else "part_list"),
]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI messages carry fields we do not use

    role: Literal["system", "developer", "user", "assistant"]
    content: Content

    def text(self, *, param: str = "messages") -> str:
        """The message as plain text: string content, or its text parts joined with "".

        ``param`` names this message in the error (the caller knows its index)."""
        if isinstance(self.content, str):
            return self.content
        pieces = []
        for part in self.content:
            if not isinstance(part, TextPart):
                raise InvalidRequestError("this model reads text only", param=param,
                                          code="unsupported_content")
            pieces.append(part.text)
        return "".join(pieces)


def _check_range(value: int | float, limits: tuple, *, name: str, where: str) -> None:
    _default, low, high = limits
    if not (low <= value <= high):  # NaN fails too
        raise _invalid(f"{name} {where}must be between {low} and {high}, got {value}",
                       param=name, code="value_out_of_range")


class GenerateSpec(BaseModel):
    """A generated ``{*}`` slot: free text up to a stop string or ``max_tokens``, instead of a
    span searched with a beam. ``temperature`` 0 is greedy; above 0 sampling uses ``seed``."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: StrictInt = GENERATE_MAX_TOKENS[0]
    stop: list[str] = Field(default_factory=list)
    temperature: StrictFloat = GENERATE_TEMPERATURE[0]
    seed: StrictInt | None = None

    @model_validator(mode="after")
    def _check(self) -> GenerateSpec:
        _check_range(self.max_tokens, GENERATE_MAX_TOKENS, name="max_tokens", where="")
        _check_range(self.temperature, GENERATE_TEMPERATURE, name="temperature", where="")
        if len(self.stop) > GENERATE_MAX_STOPS:
            raise _invalid(f"stop has {len(self.stop)} strings; at most {GENERATE_MAX_STOPS} "
                           "are allowed", param="stop", code="value_out_of_range")
        for index, stop in enumerate(self.stop):
            if stop == "":
                raise _invalid(f"stop string {index} is empty", param=f"stop.{index}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise _invalid(f"seed must be between 0 and {MAX_SEED}, got {self.seed}",
                           param="seed", code="value_out_of_range")
        return self


_EXTRACTION_FIELDS = ("max_tokens", "beam_width", "candidates", "generate")
_SEARCH_FIELDS = ("max_tokens", "beam_width", "candidates")  # not with ``generate``


class Query(BaseModel):
    """One question. Its template is checked at parse time, so a bad template fails the
    request before any work is queued.

    ``{?}`` queries need ``options``. Extraction queries (``{*}``, ``{n}``, ``{$}``) must not
    have them; they take ``max_tokens``, ``beam_width`` and ``candidates`` (set to their
    defaults after parsing), and ``{*}`` alone may instead ask for ``generate``, in which
    case those three stay None."""

    model_config = ConfigDict(extra="forbid")  # a misspelt field must not be silently dropped

    id: str = Field(min_length=1, max_length=MAX_QUERY_ID_LENGTH)
    template: str
    options: list[str] | None = None
    values: dict[str, list[str]] = Field(default_factory=dict)
    max_tokens: StrictInt | None = None
    beam_width: StrictInt | None = None
    candidates: StrictInt | None = None
    generate: GenerateSpec | None = None

    _parsed: templates.Template | None = PrivateAttr(default=None)

    @property
    def parsed_template(self) -> templates.Template:
        if self._parsed is None:  # built without validation (model_construct)
            self._parsed = templates.parse_template(self.template)
        return self._parsed

    @property
    def slot_kind(self) -> str:
        """``"?"``, ``"*"``, ``"n"`` or ``"$"``."""
        return self.parsed_template.slot.kind

    @model_validator(mode="after")
    def _check(self) -> Query:
        try:
            parsed = templates.parse_template(self.template, param="template")
            slot = templates.check_template(parsed, param="template")
        except InvalidRequestError as error:
            raise _carry(error) from None
        if slot.kind == templates.SCORED:
            self._forbid(_EXTRACTION_FIELDS, "the scored slot {?}", "extraction slots "
                         "({*}, {n}, {$})")
            self._check_options()
        else:
            self._check_extraction(slot.kind)
        try:
            templates.check_grid(parsed, self.values, max_combinations=DEFAULT_MAX_COMBINATIONS,
                                 param="values")
        except InvalidRequestError as error:
            raise _carry(error) from None
        self._parsed = parsed
        return self

    def _forbid(self, fields: tuple[str, ...], has: str, applies_to: str) -> None:
        for name in fields:
            if getattr(self, name) is not None:
                raise _invalid(f"query {self.id!r} has {has}; {name!r} applies only to "
                               f"{applies_to}", param=name, code="field_not_allowed")

    def _check_options(self) -> None:
        if self.options is None:
            raise _invalid(f"query {self.id!r} has a scored slot {{?}} and needs options",
                           param="options", code="missing_options")
        if not self.options:
            raise _invalid(f"options of query {self.id!r} must not be empty", param="options")
        seen: set[str] = set()
        for index, option in enumerate(self.options):
            if option == "":
                raise _invalid(f"option {index} of query {self.id!r} is empty",
                               param=f"options.{index}")
            if option in seen:
                raise _invalid(f"duplicate option {option!r} in query {self.id!r}",
                               param=f"options.{index}", code="duplicate_option")
            seen.add(option)

    def _check_extraction(self, kind: str) -> None:
        slot = f"the extraction slot {{{kind}}}"
        self._forbid(("options",), slot, "the scored slot {?}")
        if self.generate is not None:
            if kind != "*":
                self._forbid(("generate",), slot, "the span slot {*}")
            self._forbid(_SEARCH_FIELDS, "a generated slot ('generate')", "searched "
                         "extraction slots; set generate.max_tokens for a generated slot")
            return
        where = f"of query {self.id!r} "
        if self.max_tokens is None:
            self.max_tokens = MAX_TOKENS[0]
        _check_range(self.max_tokens, MAX_TOKENS, name="max_tokens", where=where)
        if self.beam_width is None:
            self.beam_width = BEAM_WIDTH[0]
        _check_range(self.beam_width, BEAM_WIDTH, name="beam_width", where=where)
        if self.candidates is None:
            self.candidates = self.beam_width
        if not 1 <= self.candidates <= self.beam_width:
            raise _invalid(f"candidates {where}must be between 1 and beam_width "
                           f"({self.beam_width}), got {self.candidates}", param="candidates",
                           code="value_out_of_range")


def query_layout_key(queries: list[Query]) -> tuple[str, ...]:
    return tuple(q.model_dump_json(exclude={"id"}) for q in queries)


class Scoring(BaseModel):
    model_config = ConfigDict(extra="forbid")

    queries: list[Query] = Field(default_factory=list, max_length=MAX_QUERIES)

    _layout_key: tuple[str, ...] | None = PrivateAttr(default=None)

    def layout_key(self) -> tuple[str, ...]:
        """Per query its JSON without the id: all its layout depends on (computed once; a
        validated block is shared by the requests that send it, see ``ScoreRequest.parse``)."""
        if self._layout_key is None:
            self._layout_key = query_layout_key(self.queries)
        return self._layout_key

    @model_validator(mode="after")
    def _unique_ids(self) -> Scoring:
        first_index: dict[str, int] = {}
        for index, query in enumerate(self.queries):
            if query.id in first_index:
                raise _invalid(
                    f"duplicate query id {query.id!r} (queries {first_index[query.id]} and "
                    f"{index})", param=f"queries.{index}.id", code="duplicate_query_id")
            first_index[query.id] = index
        return self


class PackRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1)
    version: str | None = None
    categories: list[str] | None = None


class ScoreRequest(BaseModel):
    # OpenAI clients send fields such as `user` or `temperature`; they mean nothing here.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[Message] | None = None
    text: str | None = None  # shorthand for one user message; exactly one of messages/text
    scoring: Scoring = Field(default_factory=Scoring)   # may be left out when packs are given
    packs: list[PackRef] = Field(default_factory=list)  # parsed here, judged by the engine
    custom_id: str | None = None

    @field_validator("messages")
    @classmethod
    def _messages_not_empty(cls, messages: list[Message] | None) -> list[Message] | None:
        if messages is not None and not messages:
            raise _invalid("messages must not be empty")
        return messages

    @model_validator(mode="after")
    def _one_content_source(self) -> ScoreRequest:
        if self.messages is None and self.text is None:
            raise _invalid("give the content as 'messages' or 'text'", param="messages",
                           code="missing_content")
        if self.messages is not None and self.text is not None:
            raise _invalid("give either 'messages' or 'text', not both", param="text")
        if not self.scoring.queries and not self.packs:
            raise _invalid("nothing to score: give at least one query in scoring.queries or "
                           "a prompt pack in packs", param="scoring.queries",
                           code="missing_queries")
        return self

    def content_messages(self) -> list[Message]:
        """The content as messages; ``text`` becomes a single user message."""
        if self.messages is not None:
            return list(self.messages)
        return [Message(role="user", content=self.text)]

    @classmethod
    def parse(cls, data: dict | ScoreRequest) -> ScoreRequest:
        """Validate untrusted input; any failure is an ``InvalidRequestError``.

        Bulk jobs send the same ``scoring`` block with every document: a block already
        validated is reused (by its JSON text) instead of checked again."""
        if isinstance(data, ScoreRequest):
            return data
        key = _scoring_key(data)
        if key is not None:
            # a bad block fails here uncached; validating the whole request names its field
            with contextlib.suppress(ValidationError):
                data = {**data, "scoring": _scoring_from_json(key)}
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            raise _to_invalid_request(error) from None


@lru_cache(maxsize=256)
def _scoring_from_json(text: str) -> Scoring:
    """A validated scoring block, shared by the requests that send the same JSON text."""
    return Scoring.model_validate_json(text)


def _scoring_key(data: Any) -> str | None:
    """The JSON text of a request's scoring block (None when there is none to key)."""
    scoring = data.get("scoring") if isinstance(data, dict) else None
    if not isinstance(scoring, dict):
        return None
    try:
        return json.dumps(scoring, allow_nan=False)
    except (TypeError, ValueError):   # not JSON (keys or values): validation will say
        return None


def _to_invalid_request(error: ValidationError) -> InvalidRequestError:
    """Report the first validation problem; the OpenAI error shape holds one param."""
    problems = error.errors(include_url=False)
    first = problems[0]
    path = [str(step) for step in first["loc"] if step not in _CONTENT_TAGS | _PART_TAGS]
    carried = (first.get("ctx") or {}).get(_CARRIED) if first["type"] == _OUR_ERROR else None
    if carried is not None and carried.param:
        path.append(carried.param)
    param = ".".join(path) or None
    message = carried.message if carried is not None else _describe(first, param)
    code = carried.code if carried is not None else None
    if len(problems) > 1:
        message += f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})"
    return InvalidRequestError(message, param=param, code=code)


def _describe(problem: dict, param: str | None) -> str:
    if problem["type"] == "model_type" and not problem["loc"]:
        return "the request body must be a JSON object"
    if problem["type"] == "extra_forbidden":
        return f"unknown field {param!r}"
    return f"{param}: {problem['msg']}" if param else problem["msg"]


# ---- response --------------------------------------------------------------------------


class OptionScore(BaseModel):
    text: str
    logprob: float  # summed over the option's tokens
    p: float  # softmax over the given options
    floor_p: float  # p for the same question with empty content


class AmountValue(BaseModel):
    """The value of a ``{$}`` candidate; ``currency`` is an ISO 4217 style code or None."""

    amount: float
    currency: str | None

    @model_serializer(mode="wrap")
    def _keep_currency(self, handler) -> dict:
        data = handler(self)
        data["currency"] = self.currency  # null, not missing, even with exclude_none
        return data


class Candidate(BaseModel):
    """One answer of an extraction slot, most likely first in ``candidates``."""

    text: str  # the decoded text, without the stop string
    logprob: float  # summed over the answer's tokens
    p: float  # exp(logprob): the model's probability of this answer (not renormalised)
    value: float | int | AmountValue | None = None  # {n}: the number, {$}: the amount

    @model_serializer(mode="wrap")
    def _drop_missing_value(self, handler) -> dict:
        data = handler(self)
        if self.value is None:
            data.pop("value", None)  # spans have no value
        return data


class CombinationScore(BaseModel):
    """A scored combination has ``options`` and ``residual``; an extraction combination has
    ``candidates`` (and ``options == []``). Fields that are None are left out of every dump,
    so scored results keep exactly the keys they always had."""

    values: dict[str, str]
    options: list[OptionScore] = Field(default_factory=list)
    residual: float | None = None  # 1 - sum(exp(logprob)): mass outside the options
    candidates: list[Candidate] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler) -> dict:
        data = handler(self)
        for name in ("residual", "candidates"):
            if getattr(self, name) is None:
                data.pop(name, None)
        return data


class QueryScore(BaseModel):
    id: str
    combinations: list[CombinationScore]


class Usage(BaseModel):
    prompt_tokens: int
    scored_tokens: int
    total_tokens: int


class ScoreResponse(BaseModel):
    id: str
    object: Literal["score"] = "score"
    created: int
    model: str
    system_fingerprint: str
    usage: Usage
    queries: list[QueryScore]
    packs: list[dict] = Field(default_factory=list)


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error shape ``{"error": {...}}``."""

    error: ErrorBody

    @classmethod
    def from_error(cls, error: SpinfError) -> ErrorResponse:
        return cls.model_validate(error.to_openai())
