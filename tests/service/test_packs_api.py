"""Packs through the service: SPINF_PACKS (here a pinned git revision) reaches both the API's
GET /v1/packs and the worker's engine, and a pack's scores equal its questions sent plain."""

from __future__ import annotations

import shutil

import httpx
import pytest

from spinf_worker.pack_sources import load_sources, pin_sources

from ..conftest import WAIT_S
from ..test_pack_sources import PACK, commit
from .live import InProcessWorker, LiveServer

TWO = {**PACK, "pack": "acme/service-pack",
       "scoring": {"queries": [*PACK["scoring"]["queries"],
                               {"id": "b", "template": "\n\nAnother?{?}",
                                "options": [" yes", " no", " maybe"]}]},
       "reads": [*PACK["reads"],
                 {"id": "b", "query": "b", "kind": "option", "option": 2, "mu": 0.0, "mean": 0.0,
                  "sd": 1.0, "category": "d"}],
       "categories": {**PACK["categories"], "d": {"platt": [1.0, 0.0], "threshold": 0.9}}}


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_pack_scores_through_the_api_equal_plain_queries(tmp_path, monkeypatch, settings,
                                                             tiny_engine):
    import subprocess

    from spinf_worker.engine import Engine
    from spinf_worker.packs import find_pack

    monkeypatch.setenv("SPINF_CACHE_DIR", str(tmp_path / "cache"))
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "-C", str(repo), "init", "-q", "-b", "main"], check=True)
    sha = commit(repo, {"service.json": TWO}, "pack")
    settings = settings.model_copy(update={"packs": pin_sources([f"git+file://{repo}@main"])})
    assert settings.packs == [f"git+file://{repo}@{sha}"]
    # what serve.load_engine does for a worker: an engine built with the configured packs
    packs = load_sources(settings.packs)
    engine = Engine(tiny_engine.checkpoint, device="cpu", packs=packs)
    text = "I was charged twice for September and I want my money back now."
    with LiveServer(settings) as server, InProcessWorker(engine, settings):
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        listed = {p["id"]: p for p in client.get("/packs").json()["packs"]}
        assert sha in str(listed["acme/service-pack"]["source"])
        assert "spinf/support-triage" in listed

        own = {"id": "own", "template": "\n\nRefund?{?}", "options": [" yes", " no"]}
        ref = {"id": "acme/service-pack", "include_queries": True}
        with_pack = client.post("/score", json={"text": text, "scoring": {
            "queries": [own], "packs": [ref]}})
        assert with_pack.status_code == 200, with_pack.text
        # the pack's queries sent plain: its context is the content itself, its case rule
        plain = client.post("/score", json={"text": text, "scoring": {
            "queries": TWO["scoring"]["queries"], "case_insensitive": False}}).json()
        (result,) = with_pack.json()["results"]
        assert [q["id"] for q in result["queries"]] == ["own", "a", "b"]
        assert result["queries"][1:] == plain["results"][0]["queries"]
        (pack_result,) = result["packs"]
        assert (pack_result["id"], pack_result["version"]) == ("acme/service-pack", "1.0.0")
        expected = find_pack(packs, "acme/service-pack").evaluate(result["queries"][1:], None)
        assert {k: pack_result[k] for k in ("categories", "decision")} == expected

        unknown = client.post("/score", json={"text": text, "scoring": {
            "queries": [own], "packs": [{"id": "acme/nope"}]}})
        assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "unknown_pack"


def test_service_commands_check_packs_before_starting(tmp_path, settings, tiny_dir, capsys):
    """A bad pack source stops `api` / `worker` / `serve` before anything starts; the worker's
    engine gets the configured packs (serve.load_engine)."""
    import json

    from spinf_worker.cli import main
    from spinf_worker.serve import WorkerSpec, load_engine

    (tmp_path / "bad.json").write_text(json.dumps({**PACK, "version": "-one"}))
    assert main(["api", "--redis", settings.redis_url, "--packs", str(tmp_path)]) == 2
    assert f"{tmp_path / 'bad.json'}: version:" in capsys.readouterr().err

    good = tmp_path / "good"
    good.mkdir()
    (good / "p.json").write_text(json.dumps(TWO))
    engine = load_engine(WorkerSpec(model=str(tiny_dir), device="cpu"),
                         settings.model_copy(update={"packs": [str(good)]}))
    assert {"acme/service-pack", "spinf/moderation"} <= set(engine.packs)
