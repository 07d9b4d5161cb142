"""A request's ``scoring.packs`` entry resolved against the loaded packs (no torch): the API
checks it before anything is queued, the engine before it lays the pack out."""

from __future__ import annotations

from .errors import InvalidRequestError
from .packs import Pack, find_pack
from .protocol import PackRef


def resolve(packs: dict, ref: PackRef, index: int) -> tuple[Pack, str]:
    """(the pack, the context the content is wrapped in); InvalidRequestError for an unknown
    pack, version or context, or a bad decision override."""
    where = f"scoring.packs.{index}"
    pack = find_pack(packs, ref.id, ref.version, param=f"{where}.id")
    pack.check_decision(ref.decision, f"{where}.decision")
    context = ref.context or next(iter(pack.contexts))
    if context not in pack.contexts:
        raise InvalidRequestError(
            f"{pack.id} has no context {context!r}; contexts: {', '.join(pack.contexts)}",
            param=f"{where}.context", code="invalid_field")
    return pack, context
