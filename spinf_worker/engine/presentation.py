"""How content is shown to the model, and cached tokenisation.

``raw`` (base models): the messages' text joined by blank lines. ``chat`` (instruct models):
the checkpoint's chat template, without a generation prompt. Either way the root of a DocTree
is BOS + the presented content; template prefixes and options are tokenised on their own, with
no BOS, and their ids concatenated after it.
"""

from __future__ import annotations

from functools import lru_cache

from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import InvalidRequestError
from ..model_names import INSTRUCT_NAME, auto_presentation  # noqa: F401 - the rule, here too


def choose_mode(requested: str, model_name: str, chat_template: str | None) -> str:
    if requested == "auto":
        return auto_presentation(model_name, bool(chat_template))
    if requested == "chat" and not chat_template:
        raise InvalidRequestError(f"model {model_name} has no chat template", param="presentation")
    if requested not in ("raw", "chat"):
        raise InvalidRequestError(f"unknown presentation {requested!r}", param="presentation")
    return requested


def _raise(message: str):
    raise InvalidRequestError(f"chat template: {message}", param="messages")


class Presenter:
    def __init__(self, tokenizer, bos_id: int, mode: str, chat_template: str | None = None,
                 bos_text: str = "<bos>", eos_text: str = "<eos>", frame=None):
        """``frame``: a decision model's content format (text -> the text it is shown)."""
        self.tokenizer, self.bos_id, self.mode = tokenizer, bos_id, mode
        self.frame = frame
        self.bos_text, self.eos_text = bos_text, eos_text
        self._template = None
        if mode == "chat":
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(chat_template)
        self.encode = lru_cache(maxsize=65536)(self._encode)

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def present(self, messages: list[dict]) -> str:
        """Presented text of ``[{"role", "content": str}, ...]``; empty content for the floor."""
        if self.mode == "raw":
            text = "\n\n".join(m["content"] for m in messages)
        else:
            text = self._template.render(messages=messages, add_generation_prompt=False,
                                         bos_token=self.bos_text, eos_token=self.eos_text)
            text = text.removeprefix(self.bos_text)   # BOS is added as an id, never as text
        return text if self.frame is None else self.frame(text)

    def root_ids(self, messages: list[dict]) -> list[int]:
        return self.root_ids_batch([self.present(messages)])[0]

    def root_ids_batch(self, texts: list[str]) -> list[list[int]]:
        """BOS + each presented text's ids; the texts are tokenised in parallel, without
        character offsets (nothing reads a root's; a quarter of the tokenizer's time)."""
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [[self.bos_id, *e.ids] for e in encodings]

    def floor_root_ids(self) -> list[int]:
        return self.root_ids([{"role": "user", "content": ""}])
