"""The YAML configuration: what a good file gives, and errors that name the file, the field
and the reason."""

from __future__ import annotations

import json
import textwrap

import pytest

from spinf_worker.ingest.config import ConfigError, load
from spinf_worker.ingest.items import Item, plain_text

from .helpers import QUERIES


def _write(tmp_path, text: str):
    path = tmp_path / "feeds.yaml"
    path.write_text(textwrap.dedent(text))
    (tmp_path / "q.json").write_text(json.dumps(QUERIES))
    return path


def test_a_good_file_with_defaults_and_flags(tmp_path):
    path = _write(tmp_path, """
        name: markets
        queries: q.json
        interval_s: 120
        feeds:
          - name: wire
            url: https://example.com/feed.xml
            pack: spinf/support-triage
          - jsonl: data/articles.jsonl
            interval_s: 5
          - stream: "news:articles"
        sinks: [jsonl:out/results.jsonl]
        """)
    config = load(path, sinks=["webhook:https://hooks.example.com/x"])
    assert config.name == "markets"
    wire, articles, stream = config.sources
    assert (wire.kind, wire.interval_s) == ("feed", 120)
    # a list is the queries; the packs go in the same scoring block
    assert wire.scoring["scoring"] == {"queries": QUERIES,
                                       "packs": [{"id": "spinf/support-triage"}]}
    assert (articles.name, articles.kind, articles.interval_s) == ("articles", "jsonl", 5)
    assert articles.target == str(tmp_path / "data/articles.jsonl")  # relative to the file
    assert (stream.name, stream.target) == ("news:articles", "news:articles")
    assert config.sinks == (f"jsonl:{tmp_path / 'out/results.jsonl'}",
                            "webhook:https://hooks.example.com/x")


@pytest.mark.parametrize(("text", "message"), [
    ("feeds: [{url: http://a/f, jsonl: x.jsonl}]\nsinks: [jsonl:o]\nqueries: q.json",
     "feeds.yaml: feeds.0 (http://a/f): give exactly one of url, jsonl or stream (got url, jsonl)"),
    ("feeds: [{url: http://a/f, intervall: 5}]\nsinks: [jsonl:o]\nqueries: q.json",
     "feeds.yaml: feeds.0.intervall (http://a/f): unknown field"),
    ("feeds: [{url: ftp://a/f}]\nsinks: [jsonl:o]\nqueries: q.json",
     "feeds.0.url (ftp://a/f): url must be http(s)://, not 'ftp://a/f'"),
    ("feeds: [{url: http://a/f, interval_s: 0}]\nsinks: [jsonl:o]\nqueries: q.json",
     "feeds.0.interval_s (http://a/f): Input should be greater than 0"),
    ("feeds: [{url: http://a/f}]\nsinks: [s3:bucket]\nqueries: q.json",
     "sinks: sink 's3:bucket' must be jsonl:PATH, redis:STREAM or webhook:URL"),
    ("feeds: [{url: http://a/f}]\nsinks: [jsonl:o]",
     "feeds.0 (a/f): nothing to score with: give a pack or queries"),
    ("feeds: [{url: http://a/f, pack: acme/nope}]\nsinks: [jsonl:o]\nqueries: q.json",
     "feeds.0 (a/f): pack.0: no pack 'acme/nope'"),
    ("feeds: [{url: http://a/f, pack: {id: spinf/support-triage, decision: {thresholds: {nope: 0.5}}}}]\n"
     "sinks: [jsonl:o]\nqueries: q.json", "spinf/support-triage has no category 'nope'"),
    ("feeds: [{url: http://a/f, queries: missing.json}]\nsinks: [jsonl:o]",
     "feeds.0 (a/f): cannot read the queries file"),
    ("feeds: [{url: http://a/f, name: x}, {jsonl: f.jsonl, name: x}]\nsinks: [jsonl:o]\n"
     "queries: q.json", "feeds.1 (x): the name 'x' is taken by feeds.0"),
    ("feeds: [{url: http://a/f}]\nqueries: q.json", "no sinks"),
    ("sinks: [jsonl:o]\nqueries: q.json", "no sources"),
    ("feeds:\n  - url: http://a/f\n   name: bad indent\n", "feeds.yaml: line 3, column 4: not valid YAML: expected <block end>"),
    ("- just\n- a list\n", "the top level must be a mapping"),
])
def test_errors_name_the_file_the_field_and_the_reason(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load(path)
    assert message in caught.value.message
    assert caught.value.message.startswith(str(path)), caught.value.message


def test_bad_queries_are_reported_with_their_file(tmp_path):
    path = _write(tmp_path, "feeds: [{url: http://a/f}]\nsinks: [jsonl:o]\nqueries: bad.json")
    (tmp_path / "bad.json").write_text('[{"id": "x", "template": "no slot", "options": [" a"]}]')
    with pytest.raises(ConfigError, match=r"feeds.0 \(a/f\): bad.json: .*") as caught:
        load(path)
    (tmp_path / "bad.json").write_text("[{")
    with pytest.raises(ConfigError, match=r"bad.json line 1 column 3"):
        load(path)
    assert "template" in caught.value.message


def test_item_identity_and_text():
    item = Item(feed="f", title="Hello", text=plain_text("<p>One &amp; two</p><p>three</p>"))
    assert item.text == "One & two\n\nthree"
    assert item.item_id.startswith("sha256:")
    assert Item(feed="f", title="x", text="y", link="http://l").item_id == "http://l"
    same_link = Item(feed="g", title="other", text="z", link="http://l", guid="1")
    assert set(same_link.identities()) & set(Item(feed="f", title="x", text="y",
                                                  link="http://l").identities())
    # GUIDs are per feed
    assert not set(Item(feed="a", title="t", text="1", guid="1").identities()) & \
        set(Item(feed="b", title="t", text="2", guid="1").identities())
