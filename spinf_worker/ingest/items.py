"""An item as every source hands it over, its identities for de-duplication, and the plain
text of HTML snippets."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from html.parser import HTMLParser

from .state import digest

_BLOCK_TAGS = {"p", "br", "div", "li", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "blockquote"}
_SPACES = re.compile(r"[ \t\r\f\v]+")
_BLANK_LINES = re.compile(r"\n\s*\n+")


class _Text(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs) -> None:
        if tag in ("script", "style"):
            self._skip += 1
        elif tag in _BLOCK_TAGS:
            self.parts.append("\n\n")

    def handle_endtag(self, tag) -> None:
        if tag in ("script", "style") and self._skip:
            self._skip -= 1

    def handle_data(self, data) -> None:
        if not self._skip:
            self.parts.append(data)


def plain_text(html: str | None) -> str:
    """The text of an HTML snippet (a feed's summary or content), paragraphs kept."""
    if not html:
        return ""
    if "<" not in html and "&" not in html:
        return html.strip()
    parser = _Text()
    parser.feed(html)
    parser.close()
    text = _SPACES.sub(" ", "".join(parser.parts))
    return _BLANK_LINES.sub("\n\n", "\n".join(line.strip() for line in text.split("\n"))).strip()


@dataclass
class Item:
    feed: str                  # the source's name
    title: str | None
    text: str                  # the content to score (without the title)
    link: str | None = None
    guid: str | None = None
    published: str | None = None   # ISO 8601, as the source gave it or normalised to UTC
    summary_only: bool = False     # a feed item with a summary and no full content

    @property
    def item_id(self) -> str:
        """The feed's GUID, else its link, else a hash of the content."""
        return self.guid or self.link or f"sha256:{digest(self.title or '', self.text)}"

    def identities(self) -> list[str]:
        """Any of these seen before makes the item a duplicate. GUIDs are per feed (two feeds
        may both number their items 1, 2, ...); links and content are not: the same article
        reaching us through two feeds is scored once."""
        found = []
        if self.guid:
            found.append("g:" + digest(self.feed, self.guid))
        if self.link:
            found.append("l:" + digest(self.link))
        found.append("c:" + digest(" ".join((self.title or "").split()),
                                   " ".join(self.text.split())))
        return found

    @property
    def key(self) -> str:
        """The pending-record key: the first identity."""
        return self.identities()[0]

    def content(self) -> str:
        """What the model reads: the title, a blank line, the text."""
        return "\n\n".join(part for part in (self.title, self.text) if part)

    def meta(self) -> dict:
        return {"item_id": self.item_id, "feed": self.feed, "title": self.title,
                "published": self.published, "link": self.link}

    def to_record(self) -> dict:
        return asdict(self)

    @classmethod
    def from_record(cls, data: dict) -> Item:
        return cls(**{k: data.get(k) for k in cls.__dataclass_fields__})


def from_mapping(feed: str, data: dict) -> Item:
    """An item from a JSONL line or a stream entry: ``id``/``guid``, ``title``,
    ``text``/``content``/``summary``/``body``, ``link``/``url``, ``published``. Raises
    ValueError when it has neither text nor title."""
    def first(*names: str) -> str | None:
        for name in names:
            value = data.get(name)
            if value not in (None, ""):
                return str(value)
        return None

    title = first("title", "headline")
    text = plain_text(first("text", "content", "body", "summary", "description"))
    if not text and not title:
        raise ValueError("the item has no text and no title")
    return Item(feed=feed, title=title, text=text, link=first("link", "url"),
                guid=first("guid", "id"), published=first("published", "published_at", "date"))
