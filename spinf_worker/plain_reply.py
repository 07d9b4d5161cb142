"""Replies the engine builds as plain data, their bulk validated only once read.

A worker stores thousands of replies a second: building a model per query and option (or per
prompt token) only to dump it again costs more host time than the pass, and each one is more
for the cyclic collector to walk. A ``PlainReply`` is validated without its bulk field
(``HELD``: a score reply's results, a completion's choices) and keeps the data it came from;
the field is validated in its place the first time anything reads it (no torch)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, PrivateAttr


class PlainReply(BaseModel):
    HELD: ClassVar[str]     # the field held back

    # the data the engine built this reply from
    _plain: dict | None = PrivateAttr(default=None)

    @classmethod
    def _validate_held(cls, value: Any) -> Any:
        """The held field's value validated (each reply type's own adapter)."""
        raise NotImplementedError

    @classmethod
    def _held_back(cls, data: dict[str, Any], **fields: Any):
        """The reply of ``data`` (and ``fields`` over it), its held field validated later."""
        reply = cls.model_validate({**data, **fields, cls.HELD: []})
        del reply.__dict__[cls.HELD]
        reply._plain = data
        return reply

    def _complete(self) -> None:
        fields, held = self.__dict__, self.HELD
        if held not in fields and self._plain is not None:
            # in its place among the fields: dumps and reprs list them in this order
            now = {**fields, held: self._validate_held(self._plain[held])}
            fields.clear()
            fields.update((name, now[name]) for name in type(self).model_fields if name in now)

    def __getattr__(self, name: str) -> Any:
        if name == self.HELD and self._plain is not None:   # held back
            self._complete()
            return self.__dict__[name]
        return super().__getattr__(name)

    def __eq__(self, other: object) -> bool:
        self._complete()
        if isinstance(other, PlainReply):
            other._complete()
        return super().__eq__(other)

    def __iter__(self):
        self._complete()
        return super().__iter__()

    def __repr_args__(self):
        self._complete()
        return super().__repr_args__()
