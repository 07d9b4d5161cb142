"""floor_p: the same queries over empty content, scored once and kept.

A floor value depends only on (presentation, template, combinations, options, case
sensitivity): it is scored in a
DocTree of its own, one per query, so its bits don't depend on the other queries, and kept
in an LRU for the life of the engine.
"""

from __future__ import annotations

import json
from collections import OrderedDict

from ..protocol import Query
from .runner import DocScores


def floor_key(mode: str, query: Query, case_insensitive: bool) -> tuple:
    return (mode, query.template, json.dumps(query.combinations, sort_keys=True),
            json.dumps(query.values, sort_keys=True), tuple(query.options), case_insensitive)


class FloorCache:
    def __init__(self, size: int):
        self.size = size
        self._scores: OrderedDict[tuple, DocScores] = OrderedDict()

    def get(self, key: tuple) -> DocScores | None:
        found = self._scores.get(key)
        if found is not None:
            self._scores.move_to_end(key)
        return found

    def put(self, key: tuple, scores: DocScores) -> None:
        self._scores[key] = scores
        self._scores.move_to_end(key)
        while len(self._scores) > self.size:
            self._scores.popitem(last=False)

    def __len__(self) -> int:
        return len(self._scores)
