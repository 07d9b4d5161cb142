"""Request and response models for scoring, shared by the API tier and the engine.

``ScoreRequest.parse`` is the one entry point for untrusted input: every validation failure
becomes an ``InvalidRequestError`` whose ``param`` is the dotted path of the offending field
(``scoring.queries.0.options``), ready for the OpenAI error shape.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Annotated, Any, ClassVar, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    StrictFloat,
    StrictInt,
    StrictStr,
    Tag,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from spinf_worker import jsonio, media, templates
from spinf_worker.errors import InvalidRequestError, SpinfError
from spinf_worker.plain_reply import PlainReply

MAX_QUERIES = 10_000
# The hosted API's media limits (a request's `limits` may lower them): frames per video,
# seconds of audio, pixels of an image as its header declares them.
DEFAULT_MEDIA_LIMITS = {"max_frames": 1024, "max_audio_seconds": 600,
                        "max_image_pixels": 50_000_000}
MAX_ID_LENGTH = 128

# Extraction slots ({*}, {n}, {$}), the hosted API's limits: (default, lowest, highest).
MAX_TOKENS = (16, 1, 64)       # tokens decoded for one searched answer
TOP_K = (5, 1, 20)             # answers returned
GENERATE_MAX_TOKENS = 100      # a generated slot's max_tokens
GENERATE_TEMPERATURE = (0.0, 2.0)
GENERATE_TOP_K = (1, 100)
GENERATE_N = (1, 6)
MAX_SEED = 2**31 - 1
SLOT_RESULT_KINDS = {"?": "score", "*": "text", "n": "number", "$": "currency"}

# Our validators raise PydanticCustomError carrying the InvalidRequestError under this context
# key; `parse` takes message, code and (relative) param from it. Pydantic substitutes context
# keys written in braces into its own copy of the message, which user text could trigger, so
# the exact message is read from the carried error, never from pydantic's copy.
_CARRIED = "spinf_error"
_OUR_ERROR = "spinf_invalid_request"

# Union branch labels that pydantic puts into error locations; they are not request fields.
_CONTENT_TAGS = {"string_content", "part_list"}
_PART_TAGS = {"text_part", "image_url_part", "input_audio_part", "video_part"}
_VALUE_TAGS = {"combinations:list", "combinations:all", "generate:flag", "generate:spec",
               "parameter:bool", "parameter:int", "parameter:float", "parameter:str"}


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


class ImageUrl(BaseModel):
    """An image: a ``data:image/...;base64,`` URL (``https://`` only where the server fetches
    remote images: the API inlines it before queueing). Its format and size are read from
    its header here (``media.image_info``), so bytes that are no image are refused at once."""

    url: str
    detail: Literal["low", "auto", "high"] = "auto"   # high reads as auto

    _info: media.ImageInfo | None = PrivateAttr(default=None)   # None: a remote URL

    @model_validator(mode="after")
    def _check(self) -> ImageUrl:
        if media.is_remote(self.url):
            return self
        try:
            self._info = media.image_info(media.image_bytes(self.url),
                                          DEFAULT_MEDIA_LIMITS["max_image_pixels"])
        except media.MediaError as error:
            error.param = "url"
            raise _carry(error) from None
        return self


class InputAudio(BaseModel):
    data: str
    format: Literal["wav", "mp3", "flac", "ogg", "m4a", "webm"]

    _seconds: float | None = PrivateAttr(default=None)   # None: unknown until decoded
    # (sample frames, rate), once measured (measure_audio)
    _length: tuple[int, int] | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check(self) -> InputAudio:
        try:
            self._seconds = media.audio_seconds(media.b64decode(self.data, "audio data"),
                                                self.format)
        except media.MediaError as error:
            error.param = "data"
            raise _carry(error) from None
        return self


class VideoFrame(BaseModel):
    t: float = Field(ge=0, allow_inf_nan=False)     # seconds from the start of the video
    image_url: ImageUrl

    @field_validator("t", mode="before")
    @classmethod
    def _number(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _invalid("t is a number of seconds", code="invalid_field")
        return value


class Video(BaseModel):
    """Frames the caller sampled, in time order; each is read as its ``mm:ss`` timestamp
    followed by the image."""

    frames: list[VideoFrame]
    detail: Literal["low", "auto", "high"] = "low"

    @model_validator(mode="after")
    def _check(self) -> Video:
        if not self.frames:
            raise _invalid("a video needs at least one frame", param="frames",
                           code="invalid_field")
        for k in range(1, len(self.frames)):
            if self.frames[k].t < self.frames[k - 1].t:
                raise _invalid("frames must be in time order (t not decreasing)",
                               param=f"frames.{k}.t", code="invalid_field")
        return self


def frame_time(t: float) -> str:
    """A video frame's timestamp as Gemma's video prompt writes it: ``mm:ss``."""
    return f"{int(t // 60):02d}:{int(t % 60):02d}"


class ImageUrlPart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudioPart(BaseModel):
    type: Literal["input_audio"]
    input_audio: InputAudio


class VideoPart(BaseModel):
    type: Literal["video"]
    video: Video


MediaPart = ImageUrlPart | InputAudioPart | VideoPart


def _part_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):    # an object or array type is no known part: a 400
        return None
    return {"text": "text_part", "image_url": "image_url_part",
            "input_audio": "input_audio_part", "video": "video_part"}.get(kind)


ContentPart = Annotated[
    Annotated[TextPart, Tag("text_part")]
    | Annotated[ImageUrlPart, Tag("image_url_part")]
    | Annotated[InputAudioPart, Tag("input_audio_part")]
    | Annotated[VideoPart, Tag("video_part")],
    Discriminator(_part_tag, custom_error_type="unsupported_content",
                  custom_error_message="content part type must be 'text', 'image_url', "
                                       "'input_audio' or 'video'"),
]

# A callable discriminator validates only the branch that matches the input, so a bad list
# reports the list's problem rather than also "not a valid string".
Content = Annotated[
    Annotated[str, Tag("string_content")] | Annotated[list[ContentPart], Tag("part_list")],
    Discriminator(lambda value: "string_content" if isinstance(value, str) else "part_list"),
]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI messages carry fields we do not use

    role: Literal["system", "developer", "user", "assistant"] = "user"
    content: Content

    def text(self, *, param: str = "messages", image: str | None = None,
             audio: str | None = None) -> str:
        """The message as plain text: string content, or its text parts joined with "";
        ``image``: the text each image is read as, an image part's or a video frame's (a
        video: each frame as ``mm:ss`` + " " + the image, frames joined by a space); None:
        media are left out. ``audio``: the text an audio part is read as (None: left out).

        ``param`` names this message in the error (the caller knows its index)."""
        if isinstance(self.content, str):
            return self.content
        out = []
        for part in self.content:
            if isinstance(part, TextPart):
                out.append(part.text)
            elif image is not None and isinstance(part, ImageUrlPart):
                out.append(image)
            elif image is not None and isinstance(part, VideoPart):
                out.append(" ".join(f"{frame_time(f.t)} {image}" for f in part.video.frames))
            elif audio is not None and isinstance(part, InputAudioPart):
                out.append(audio)
        return "".join(out)

    def media_parts(self) -> list[tuple[int, MediaPart]]:
        """(index in content, part) of every media part."""
        if isinstance(self.content, str):
            return []
        return [(k, p) for k, p in enumerate(self.content) if not isinstance(p, TextPart)]


def _check_range(value: int | float, low: int | float, high: int | float, *, name: str) -> None:
    if not (low <= value <= high):  # NaN fails too
        raise _invalid(f"{name} must be between {low} and {high}, got {value}", param=name,
                       code="invalid_field")


class Calibration(BaseModel):
    """A caller's correction of an extraction's top answer:
    p_calibrated = sigmoid(a * logit(p) + b)."""

    model_config = ConfigDict(extra="forbid")

    a: StrictFloat = 1.0
    b: StrictFloat = 0.0


class GenerateSpec(BaseModel):
    """A ``{*}`` slot written freely instead of searched: ``temperature`` 0 is greedy; above
    0 each token is sampled from the ``top_k`` most likely inside the ``top_p`` nucleus,
    reproducibly from ``seed``; ``n`` sequences. ``generate: true`` is all the defaults."""

    model_config = ConfigDict(extra="forbid")

    temperature: StrictFloat = 0.0
    top_p: StrictFloat = 1.0
    top_k: StrictInt | None = None
    seed: StrictInt = 0
    n: StrictInt = 1

    @model_validator(mode="after")
    def _check(self) -> GenerateSpec:
        _check_range(self.temperature, *GENERATE_TEMPERATURE, name="temperature")
        if not 0 < self.top_p <= 1:
            raise _invalid(f"top_p must be in (0, 1], got {self.top_p}", param="top_p",
                           code="invalid_field")
        if self.top_k is not None:
            _check_range(self.top_k, *GENERATE_TOP_K, name="top_k")
        _check_range(self.seed, 0, MAX_SEED, name="seed")
        _check_range(self.n, *GENERATE_N, name="n")
        return self


_EXTRACTION_FIELDS = ("max_tokens", "top_k", "calibration", "generate")

# Like Content, the unions below are validated by the one branch that fits the value, so an
# error is that branch's and its path the field's (plain unions report every branch, under
# labels such as "bool" or "list[dict[str,str]]" in the path).
Combinations = Annotated[
    Annotated[list[dict[str, str]], Tag("combinations:list")]
    | Annotated[Literal["all"], Tag("combinations:all")],
    Discriminator(lambda v: "combinations:all" if isinstance(v, str) else "combinations:list"),
]
Generate = Annotated[
    Annotated[bool, Tag("generate:flag")] | Annotated[GenerateSpec, Tag("generate:spec")],
    Discriminator(lambda v: "generate:flag" if isinstance(v, bool) else "generate:spec"),
]


def _parameter_tag(value: Any) -> str | None:
    for kind in (bool, int, float, str):   # bool first: it is an int too
        if isinstance(value, kind):
            return f"parameter:{kind.__name__}"
    return None


ParameterValue = Annotated[
    Annotated[bool, Tag("parameter:bool")] | Annotated[StrictInt, Tag("parameter:int")]
    | Annotated[StrictFloat, Tag("parameter:float")] | Annotated[StrictStr, Tag("parameter:str")],
    Discriminator(_parameter_tag, custom_error_type="invalid_field",
                  custom_error_message="a parameter is a string, a number or a boolean"),
]


class Query(BaseModel):
    """One question. Its template and combinations are checked at parse time, so a bad query
    fails the request before any work is queued.

    ``{?}`` queries need ``options`` (their duplicates are judged by ``Scoring``, which knows
    ``case_insensitive``). Extraction queries (``{*}``, ``{n}``, ``{$}``) have none; they
    take ``max_tokens`` (set to its default after parsing), ``top_k`` and ``calibration``,
    and ``{*}`` alone may be ``generate``d instead (no ``top_k`` or ``calibration`` then)."""

    model_config = ConfigDict(extra="forbid")  # a misspelt field must not be silently dropped

    id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    template: str
    options: list[str] | None = None
    combinations: Combinations | None = None
    values: dict[str, list[str]] | None = None
    empty_floor: bool | None = None   # None: the scoring block's
    # a named group (a pack's "<id>@<version>"): laid out after the ungrouped queries
    group: str | None = Field(default=None, max_length=MAX_ID_LENGTH)
    max_tokens: StrictInt | None = None
    top_k: StrictInt | None = None
    calibration: Calibration | None = None
    generate: Generate | None = None

    # cached properties: read per document on the bulk path, and a plain attribute once
    # computed (a pydantic private attribute goes through __getattr__ every time)
    @cached_property
    def parsed_template(self) -> templates.Template:
        return templates.parse_template(self.template)

    @cached_property
    def n_prompts(self) -> int:
        """The query's prompts: one per combination."""
        return templates.check_combinations(self.parsed_template, self.combinations,
                                            self.values, param="")

    @cached_property
    def slot_kind(self) -> str:
        """``"?"``, ``"*"``, ``"n"`` or ``"$"``."""
        return self.parsed_template.slot.kind

    @property
    def kind(self) -> str:
        """The result's ``kind``: score, text, number or currency."""
        return SLOT_RESULT_KINDS[self.slot_kind]

    @property
    def generation(self) -> GenerateSpec | None:
        """The generation settings of a generated slot (``generate: true``: the defaults)."""
        if self.generate is None or self.generate is False:
            return None
        return GenerateSpec() if self.generate is True else self.generate

    @cached_property
    def grid(self) -> list[templates.Combination]:
        """The filled combinations (a query of a shared block is asked of every request
        that sends the block: expanded once). Read only."""
        return templates.expand(self.parsed_template, self.combinations, self.values)

    def combinations_list(self) -> list[templates.Combination]:
        return self.grid

    @model_validator(mode="after")
    def _check(self) -> Query:
        try:
            parsed = templates.parse_template(self.template, param="template")
            slot = templates.check_template(parsed, param="template")
            templates.check_combinations(parsed, self.combinations, self.values, param="")
        except InvalidRequestError as error:
            if error.param and error.param.startswith("."):
                error.param = error.param[1:]
            raise _carry(error) from None
        if slot.kind == templates.SCORED:
            self._forbid(_EXTRACTION_FIELDS, "the scored slot {?}",
                         "extraction slots ({*}, {n}, {$})")
            self._check_options()
        else:
            self._check_extraction(slot.kind)
        return self

    def _forbid(self, fields: tuple[str, ...], has: str, applies_to: str) -> None:
        for name in fields:
            if getattr(self, name) is not None:
                raise _invalid(f"query {self.id!r} has {has}; {name!r} applies only to "
                               f"{applies_to}", param=name, code="invalid_field")

    def _check_options(self) -> None:
        if self.options is None:
            raise _invalid(f"query {self.id!r} has a scored slot {{?}} and needs options",
                           param="options", code="missing_value")
        if not self.options:
            raise _invalid(f"query {self.id!r} needs at least one option", param="options",
                           code="too_many_options")
        for index, option in enumerate(self.options):
            if option == "":
                raise _invalid(f"option {index} of query {self.id!r} is empty",
                               param=f"options.{index}")

    def _check_extraction(self, kind: str) -> None:
        slot = f"the extraction slot {{{kind}}}"
        self._forbid(("options",), slot, "the scored slot {?}")
        generation = self.generation
        if generation is not None:
            if kind != "*":
                self._forbid(("generate",), slot, "the text slot {*}")
            self._forbid(("top_k", "calibration"), "a generated slot",
                         "searched slots: a generated answer has no probability")
        if self.generate is False:
            self.generate = None
        where = f" of query {self.id!r}"
        high = GENERATE_MAX_TOKENS if generation is not None else MAX_TOKENS[2]
        if self.max_tokens is None:
            self.max_tokens = MAX_TOKENS[0]
        if not 1 <= self.max_tokens <= high:
            raise _invalid(f"max_tokens{where} must be between 1 and {high} "
                           f"({GENERATE_MAX_TOKENS} for a generated slot), got "
                           f"{self.max_tokens}", param="max_tokens", code="invalid_field")
        if self.top_k is not None:
            _check_range(self.top_k, *TOP_K[1:], name="top_k")

    @property
    def answers_kept(self) -> int:
        """How many answers a searched slot returns (``top_k``, default 5)."""
        return self.top_k if self.top_k is not None else TOP_K[0]


def query_layout_key(queries: list[Query], case_insensitive: bool = False) -> tuple[str, ...]:
    """Per query its JSON without the id: all its layout depends on."""
    return (f"case={case_insensitive}",
            *(q.model_dump_json(exclude={"id"}) for q in queries))


class PackRef(BaseModel):
    """A prompt pack run on the call's inputs (``scoring.packs``): its questions in their own
    group, the content in the pack's ``context``, its categories and decision in the result."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    version: str | None = None
    context: str | None = None
    decision: dict[str, Any] | None = None     # mode, threshold, thresholds, critical
    include_queries: bool | None = None


class Limits(BaseModel):
    """A call's limits (the hosted API's); a request may lower them, never raise them."""

    model_config = ConfigDict(extra="forbid")

    max_content_tokens: int = Field(4096, gt=0)
    max_query_tokens: int = Field(256, gt=0)
    max_prompts_per_input: int = Field(10_000, gt=0)
    max_processed_tokens: int = Field(2_000_000, gt=0)
    max_extractions_per_input: int = Field(10, ge=0)
    max_options: int = Field(1000, gt=0)
    max_option_tokens: int = Field(5, gt=0)
    max_frames: int = Field(DEFAULT_MEDIA_LIMITS["max_frames"], gt=0)
    max_audio_seconds: int = Field(DEFAULT_MEDIA_LIMITS["max_audio_seconds"], gt=0)
    max_image_pixels: int = Field(DEFAULT_MEDIA_LIMITS["max_image_pixels"], gt=0)

    def capped(self, by: Limits) -> Limits:
        return Limits(**{k: min(getattr(self, k), getattr(by, k)) for k in Limits.model_fields})


DEFAULT_LIMITS = Limits()


class Scoring(BaseModel):
    model_config = ConfigDict(extra="forbid")

    queries: list[Query] = Field(default_factory=list, max_length=MAX_QUERIES)
    empty_floor: bool = True
    case_insensitive: bool | None = None   # None: true, or the packs' rule when packs run
    packs: list[PackRef] | None = None

    @property
    def ignores_case(self) -> bool:
        return self.case_insensitive is not False

    _layout_key: tuple[str, ...] | None = PrivateAttr(default=None)
    _params: dict[str, str] | None = PrivateAttr(default=None)
    _shared: dict[str, Query] | None = PrivateAttr(default=None)
    _fits: Limits | None = PrivateAttr(default=None)   # the queries passed these limits
    # and their tokens these limits under this tokenizer (request_limits.check_request)
    _tokens_fit: tuple | None = PrivateAttr(default=None)
    _checked: bool = PrivateAttr(default=False)

    def shared_queries(self) -> dict[str, Query]:
        """The queries by id, computed once like ``layout_key``."""
        if self._shared is None:
            self._shared = {q.id: q for q in self.queries}
        return self._shared

    def query_params(self) -> dict[str, str]:
        """Per query id where the query is (``scoring.queries.K``), computed once like
        ``layout_key``."""
        if self._params is None:
            self._params = {q.id: f"scoring.queries.{k}" for k, q in enumerate(self.queries)}
        return self._params

    def layout_key(self) -> tuple[str, ...]:
        """Per query its JSON without the id (computed once; a validated block is shared by
        the requests that send it, see ``ScoreRequest.parse``)."""
        if self._layout_key is None:
            self._layout_key = query_layout_key(self.queries, self.ignores_case)
        return self._layout_key

    @model_validator(mode="after")
    def _check(self) -> Scoring:
        # pydantic runs this again on an instance given as a request's block (the shared
        # block of ScoreRequest.parse): checked once is enough, it is frozen in use
        if self._checked:
            return self
        first_index: dict[str, int] = {}
        for index, query in enumerate(self.queries):
            if query.id in first_index:
                raise _invalid(
                    f"query id {query.id!r} is used twice (queries {first_index[query.id]} "
                    f"and {index})", param=f"queries.{index}.id", code="duplicate_id")
            first_index[query.id] = index
            check_options(query, self.ignores_case, f"queries.{index}")
        seen: set[str] = set()
        for index, ref in enumerate(self.packs or []):
            if ref.id in seen:
                raise _invalid(f"pack {ref.id!r} is listed twice", param=f"packs.{index}.id",
                               code="duplicate_id")
            seen.add(ref.id)
        self._checked = True
        return self


def check_options(query: Query, case_insensitive: bool, param: str,
                  max_options: int = DEFAULT_LIMITS.max_options) -> None:
    """A scored query's options: at most ``max_options``, none twice (ignoring case and the
    leading space when the scoring is case-insensitive: both would score the same)."""
    if query.options is None:
        return
    if len(query.options) > max_options:
        raise _invalid(f"{len(query.options):,} options; the limit is {max_options:,}",
                       param=f"{param}.options", code="too_many_options")
    seen: dict[str, int] = {}
    for index, option in enumerate(query.options):
        key = option.strip().casefold() if case_insensitive else option
        if key in seen:
            same = " ignoring case" if case_insensitive else ""
            raise _invalid(f"options {seen[key]} and {index} of query {query.id!r} are the "
                           f"same{same}", param=f"{param}.options.{index}",
                           code="duplicate_option")
        seen[key] = index


class Input(BaseModel):
    """One content of a call and what to ask it: the shared queries (all, or ``query_ids``)
    and its own ``queries``."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    messages: list[Message] = Field(min_length=1)
    query_ids: list[str] | None = None
    queries: list[Query] | None = None
    parameters: dict[str, ParameterValue] | None = None


def media_kinds(messages: list[Message]) -> set[str]:
    """The media kinds (image, audio, video) of a content's parts."""
    return {media.MEDIA_PARTS[part.type] for m in messages for _, part in m.media_parts()}


def check_media(messages: list[Message], limits: Limits, where: str) -> None:
    """A content's media within the call's limits (frames per video, seconds of audio where
    the header tells them, pixels per image)."""
    for m, message in enumerate(messages):
        for k, part in message.media_parts():
            at = f"{where}.{m}.content.{k}"
            images: list[tuple[ImageUrl, str]] = []
            if isinstance(part, ImageUrlPart):
                images.append((part.image_url, f"{at}.image_url.url"))
            elif isinstance(part, VideoPart):
                frames = part.video.frames
                if len(frames) > limits.max_frames:
                    raise _invalid(f"{len(frames):,} frames; at most {limits.max_frames:,} per "
                                   "video", param=f"{at}.video.frames", code="invalid_field")
                images += [(f.image_url, f"{at}.video.frames.{j}.image_url.url")
                           for j, f in enumerate(frames)]
            else:
                seconds = part.input_audio._seconds
                if seconds is not None and seconds > limits.max_audio_seconds:
                    raise _invalid(f"the audio is {seconds:,.1f} s; at most "
                                   f"{limits.max_audio_seconds:,} s",
                                   param=f"{at}.input_audio.data", code="invalid_media")
            for image, param in images:
                info = image._info
                if info is not None and info.pixels > limits.max_image_pixels:
                    raise _invalid(f"the image is {info.width}x{info.height} = "
                                   f"{info.pixels:,} pixels; at most "
                                   f"{limits.max_image_pixels:,}", param=param,
                                   code="invalid_media")


def measure_audio(messages: list[Message], limits: Limits, where: str) -> None:
    """Each audio part's length (a WAV's from its header, the other formats' by decoding
    them: audio_decode.py, run it off the event loop) within the call's max_audio_seconds;
    ``invalid_media`` naming a part that cannot be decoded or is longer."""
    from spinf_worker.audio_decode import audio_length

    limit = limits.max_audio_seconds
    for m, message in enumerate(messages):
        for k, part in message.media_parts():
            if not isinstance(part, InputAudioPart) or part.input_audio._length is not None:
                continue
            audio = part.input_audio
            try:
                samples, rate = audio_length(audio.data, audio.format, limit)
                if samples > limit * rate:
                    raise media.MediaError(f"the audio is {samples / rate:,.1f} s; at most "
                                           f"{limit:,} s")
            except media.MediaError as error:
                error.param = f"{where}.{m}.content.{k}.input_audio.data"
                raise
            audio._length, audio._seconds = (samples, rate), samples / rate


@dataclass(frozen=True)
class Document:
    """One input as the engine reads it: its messages and every query asked of it (the
    shared ones chosen, then its own); a pack's are added by the engine."""

    input_id: str
    messages: list[Message]
    queries: list[Query]
    layout_key: tuple[str, ...]
    parameters: dict[str, Any] | None


class ScoreRequest(BaseModel):
    """The hosted API's request: one content (``messages``, input "0") or many (``inputs``),
    the ``scoring`` block shared by all of them. ``text`` is a shorthand for one user
    message."""

    # OpenAI clients send fields such as `user` or `temperature`; they mean nothing here.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[Message] | None = Field(default=None, min_length=1)
    inputs: list[Input] | None = Field(default=None, min_length=1)
    text: str | None = None
    scoring: Scoring = Field(default_factory=Scoring)
    endpoint: str | None = Field(default=None, min_length=1, max_length=MAX_ID_LENGTH)
    limits: Limits | None = None
    custom_id: str | None = None

    _documents: list[Document] | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check(self) -> ScoreRequest:
        given = [name for name in ("messages", "inputs", "text") if getattr(self, name) is not None]
        if len(given) != 1:
            raise _invalid("send exactly one of messages (one content) or inputs (many)"
                           + (f"; got {' and '.join(given)}" if given else ""),
                           param="messages", code="invalid_field")
        self._documents = self._split()
        return self

    @property
    def effective_limits(self) -> Limits:
        return DEFAULT_LIMITS if self.limits is None else self.limits.capped(DEFAULT_LIMITS)

    def documents(self) -> list[Document]:
        """The call's inputs, each with the queries asked of it."""
        if self._documents is None:   # built without validation
            self._documents = self._split()
        return self._documents

    def _split(self) -> list[Document]:
        scoring, limits = self.scoring, self.effective_limits
        shared = scoring.shared_queries()
        if self.inputs is None:
            messages = (self.messages if self.messages is not None
                        else [Message(role="user", content=self.text)])
            if scoring._fits != limits:   # a shared block is checked once per limits
                self._check_queries(list(shared.values()), limits, "scoring.queries")
                scoring._fits = limits
            check_media(messages, limits, "messages")
            return [Document("0", messages, list(shared.values()), scoring.layout_key(), None)]
        documents, ids = [], set()
        for i, inp in enumerate(self.inputs):
            where = f"inputs.{i}"
            if inp.id in ids:
                raise _invalid(f"input id {inp.id!r} is used twice", param=f"{where}.id",
                               code="duplicate_id")
            ids.add(inp.id)
            documents.append(self._document(inp, shared, limits, where))
        return documents

    def _document(self, inp: Input, shared: dict[str, Query], limits: Limits,
                  where: str) -> Document:
        scoring = self.scoring
        if inp.query_ids is None and not inp.queries:
            chosen, key = list(shared.values()), scoring.layout_key()
        else:
            chosen = []
            for k, qid in enumerate(inp.query_ids if inp.query_ids is not None else shared):
                if qid not in shared:
                    raise _invalid(f"no shared query {qid!r}", param=f"{where}.query_ids.{k}",
                                   code="unknown_query_id")
                chosen.append(shared[qid])
            taken = {q.id for q in chosen}
            for k, q in enumerate(inp.queries or []):
                if q.id in taken:
                    raise _invalid(f"query id {q.id!r} is used twice for this input",
                                   param=f"{where}.queries.{k}.id", code="duplicate_id")
                check_options(q, scoring.ignores_case, f"{where}.queries.{k}",
                              limits.max_options)
                taken.add(q.id)
                chosen.append(q)
            key = query_layout_key(chosen, scoring.ignores_case)
        self._check_queries(chosen, limits, where)
        check_media(inp.messages, limits, f"{where}.messages")
        return Document(inp.id, inp.messages, chosen, key, inp.parameters)

    def _check_queries(self, queries: list[Query], limits: Limits, where: str) -> None:
        if not queries and not self.scoring.packs:
            raise _invalid("nothing to score: give at least one query in scoring.queries "
                           "or a prompt pack in scoring.packs", param=where,
                           code="empty_queries")
        prompts = extractions = 0
        for q in queries:
            prompts += q.n_prompts
            if q.slot_kind != templates.SCORED:
                extractions += q.n_prompts
        if extractions > limits.max_extractions_per_input:
            raise _invalid(f"{extractions} extraction slots (queries x combinations) for one "
                           f"input; at most {limits.max_extractions_per_input}", param=where,
                           code="too_many_extractions")
        if prompts > limits.max_prompts_per_input:
            raise _invalid(f"{prompts:,} prompts for one input; at most "
                           f"{limits.max_prompts_per_input:,}", param=where,
                           code="too_many_prompts")

    @classmethod
    def parse(cls, data: dict | ScoreRequest, *, scoring_json: str | bytes | None = None,
              read_by_orjson: bool = False) -> ScoreRequest:
        """Validate untrusted input; any failure is an ``InvalidRequestError``.

        Bulk jobs send the same ``scoring`` block with every document: a block already
        validated is reused (by its JSON text) instead of checked again. ``scoring_json``:
        that text, when the caller has it (exactly ``data["scoring"]`` as JSON), so that it
        is not written again. ``read_by_orjson``: ``data`` is what orjson read from a body
        (nothing in it orjson cannot write back as the same value), so its block's text is
        orjson's, not the json module's (several times slower, once a request)."""
        if isinstance(data, ScoreRequest):
            return data
        key = scoring_json if scoring_json is not None else scoring_key(data, read_by_orjson)
        if key is not None:
            # a bad block fails here uncached; validating the whole request names its field
            with contextlib.suppress(ValidationError):
                data = {**data, "scoring": _scoring_from_json(key)}
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            raise _to_invalid_request(error) from None


@lru_cache(maxsize=256)
def _scoring_from_json(text: str | bytes) -> Scoring:
    """A validated scoring block, shared by the requests that send the same JSON text."""
    return Scoring.model_validate_json(text)


def scoring_key(data: Any, read_by_orjson: bool = False) -> str | bytes | None:
    """The JSON text of a request's scoring block (None when there is none to key).
    ``read_by_orjson``: ``data`` came from orjson, so orjson writes it back exactly (it would
    write a NaN the json module refuses as null: only data it read can go its way)."""
    scoring = data.get("scoring") if isinstance(data, dict) else None
    if not isinstance(scoring, dict):
        return None
    # not JSON, or absurdly nested (orjson writes 255 levels at most): validation will say
    try:
        if read_by_orjson:
            return orjson.dumps(scoring)
        return json.dumps(scoring, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None


def _to_invalid_request(error: ValidationError) -> InvalidRequestError:
    """Report the first validation problem; the OpenAI error shape holds one param."""
    problems = error.errors(include_url=False)
    first = problems[0]
    path = [str(step) for step in first["loc"]
            if step not in _CONTENT_TAGS | _PART_TAGS | _VALUE_TAGS]
    carried = (first.get("ctx") or {}).get(_CARRIED) if first["type"] == _OUR_ERROR else None
    if carried is not None and carried.param:
        path.append(carried.param)
    param = ".".join(path) or None
    message = carried.message if carried is not None else _describe(first, param)
    code = (carried.code if carried is not None else None) or (
        "unsupported_content" if first["type"] == "unsupported_content" else "invalid_field")
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
    logprob: float        # summed over the option's tokens (and its spellings)
    p: float              # normalised over the query's options
    floor_p: float | None  # p of the same question on empty content (None: no floor asked)


class ScoredCombination(BaseModel):
    values: dict[str, str]
    options: list[OptionScore]
    residual: float                  # the next-token mass outside every option
    floor_residual: float | None     # the same on empty content


class _Optional(BaseModel):
    """A reply model whose ``OPTIONAL`` fields are left out while None: the hosted shape has
    them only where they apply (``value`` for numbers, ``packs`` when packs ran, ...)."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):   # unannotated: the schema stays the model's
        self._complete()
        data = handler(self)
        for name in self.OPTIONAL:
            if data.get(name, 0) is None:
                del data[name]
        return data

    def _complete(self) -> None:
        """Validate any field held back until it is read (ScoreResponse.of_engine's)."""


class Answer(_Optional):
    """One answer of an extraction slot: a searched one has ``p`` (``value`` for numbers and
    ``currency`` for amounts); a generated one has ``finish`` ("stop" | "length")."""

    OPTIONAL = ("p", "value", "currency", "finish")

    text: str
    p: float | None = None
    value: float | None = None
    currency: str | None = None
    finish: Literal["stop", "length"] | None = None


class ExtractedCombination(_Optional):
    OPTIONAL = ("mass", "p_negative", "p_calibrated")

    values: dict[str, str]
    answers: list[Answer]
    mass: float | None = None          # the probability on every answer found
    p_negative: float | None = None    # numbers: the top value's magnitude, share negative
    p_calibrated: float | None = None  # the top answer's p through the query's calibration


class ScoredQuery(BaseModel):
    id: str
    combinations: list[ScoredCombination]


class ExtractedQuery(_Optional):
    OPTIONAL = ("generate",)

    id: str
    kind: Literal["text", "number", "currency"]
    generate: bool | None = None
    combinations: list[ExtractedCombination]


def _query_tag(value: Any) -> str:
    """Which query shape ``value`` is. Validating and serialising a response ask once per
    query, so the common cases are told apart by exact type first: ``isinstance`` against a
    model class goes through ABCMeta's check (microseconds, thousands of times a second), and
    a missing attribute of a model costs an exception."""
    kind = type(value)
    if kind is dict:
        return "extracted" if value.get("kind") else "scored"
    if kind is ScoredQuery:
        return "scored"
    if kind is ExtractedQuery or isinstance(value, ExtractedQuery):
        return "extracted"
    return "scored"


QueryResult = Annotated[
    Annotated[ScoredQuery, Tag("scored")] | Annotated[ExtractedQuery, Tag("extracted")],
    Discriminator(_query_tag),
]


class PackResult(BaseModel):
    id: str
    version: str
    context: str
    categories: dict[str, dict[str, Any]]   # {score, percentile, flagged}
    decision: dict[str, Any]                # {unsafe, mode, ...}


class InputResult(_Optional):
    OPTIONAL = ("packs",)

    input_id: str
    queries: list[QueryResult]
    packs: list[PackResult] | None = None


class Usage(BaseModel):
    """Token counts (a server of one's own bills nothing: ``billed_tokens`` is 0)."""

    model_config = ConfigDict(extra="allow")

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, Any]
    inputs: int
    content: dict[str, Any]
    scoring: dict[str, Any]
    processed_tokens: int
    billed_tokens: int = 0


class Timing(BaseModel):
    model_config = ConfigDict(extra="allow")

    wall_ms: int = 0
    queue_ms: int = 0
    compile_ms: int = 0
    score_ms: int = 0
    gpu_busy_ms: int = 0


class ScoreResponse(PlainReply, _Optional):
    OPTIONAL = ("endpoint",)

    id: str                       # "scr_" + a ULID
    object: Literal["score"] = "score"
    created: int
    model: str                    # as the request named it
    endpoint: str | None = None
    system_fingerprint: str       # "fp_" + 10 hex: equal fingerprints, comparable scores
    results: list[InputResult]
    warnings: list[dict[str, Any]] = Field(default_factory=list)
    usage: Usage
    timing: Timing = Field(default_factory=Timing)

    # what the queue's statistics read (rows a pass holds); not part of the reply
    _rows: int = PrivateAttr(default=0)
    _padded_rows: int = PrivateAttr(default=0)
    _questions: int = PrivateAttr(default=0)   # combinations over the results' queries
    HELD = "results"     # the engine's data less its timing is the reply's _plain

    @classmethod
    def of_engine(cls, data: dict[str, Any], timing: dict[str, int]) -> ScoreResponse:
        """The reply of data the engine built in the hosted shape (``plain`` less the
        timing), its ``results`` (nearly all of it) validated only once read: a worker hands
        the data on with ``plain`` and never builds a model per query and option."""
        return cls._held_back(data, timing=timing)

    @classmethod
    def _validate_held(cls, value: Any) -> Any:
        # an input's result the engine wrote as JSON already (engine/respond.py) read back
        return _INPUT_RESULTS.validate_python(
            [jsonio.loads(r, long_integers=False) if isinstance(r, jsonio.RawJSON) else r
             for r in value])

    def plain(self) -> dict[str, Any]:
        """``model_dump()``, without dumping the model where the engine kept the data it was
        built from (a worker stores thousands of replies a second): that data with the
        timing as it is now (the worker sets the queue's share). Any other field changed
        after the engine built the reply is not seen."""
        if self._plain is None:
            return self.model_dump()
        return {**self._plain, "timing": self.timing.model_dump()}


_INPUT_RESULTS = TypeAdapter(list[InputResult])


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
