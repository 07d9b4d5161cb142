"""Packs from git repositories (git+URL and github:owner/repo): pinned revisions, the cache,
precise errors (a local repo stands in for the remote)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from spinf_worker import pack_sources
from spinf_worker.pack_sources import (
    GitSource,
    fetch,
    load_source,
    load_sources,
    parse_source,
    pin_sources,
)
from spinf_worker.packs import PackError

# the smallest pack: one question, one category, per_category
PACK = {"pack": "acme/git-pack", "version": "1.0.0", "model": "google/gemma-3-270m",
        "contexts": {"text": "{X}"},
        "scoring": {"queries": [{"id": "a", "template": "\n\nQ?\nA:{?}",
                                 "options": [" yes", " no"]}]},
        "reads": [{"id": "a", "query": "a", "kind": "pair", "mean": 0.0, "sd": 1.0,
                   "category": "c"}],
        "categories": {"c": {"platt": [1.0, 0.0], "threshold": 0.5}},
        "decision": {"mode": "per_category"}}

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(repo, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def commit(repo, files: dict, message: str) -> str:
    for name, data in files.items():
        path = repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))
        git(repo, "add", name)
    git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", message)
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path):
    path = tmp_path / "packs-repo"
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    return path


def test_parse_source():
    assert parse_source("git+file:///srv/p@v1#packs") == GitSource("file:///srv/p", "v1", "packs")
    assert parse_source("git+ssh://git@host/org/p.git") == GitSource("ssh://git@host/org/p.git",
                                                                     None)
    assert parse_source("git+https://host/p.git@abc1234").rev == "abc1234"
    assert str(parse_source("some/dir")) == "some/dir"
    with pytest.raises(PackError, match="not a git source"):
        parse_source("git+/no/scheme")
    # the hosted API's form: nothing is fetched until the source is loaded
    assert parse_source("github:acme/packs@v1.2#packs") == GitSource(
        "https://github.com/acme/packs.git", "v1.2", "packs")
    assert parse_source("github:acme/packs") == GitSource("https://github.com/acme/packs.git",
                                                          None)
    with pytest.raises(PackError, match="github:owner/repo"):
        parse_source("github:acme")


def test_pinned_revision_from_a_local_repo(repo, tmp_path):
    cache = tmp_path / "cache"
    first = commit(repo, {"packs/p.json": PACK}, "1.0.0")
    second = commit(repo, {"packs/p.json": {**PACK, "version": "1.1.0"}}, "1.1.0")
    url = f"git+file://{repo}"

    old = load_source(f"{url}@{first}", cache)["acme/git-pack"]["1.0.0"]
    assert old.summary()["source"] == f"{url}@{first}"
    latest = load_source(f"{url}@main", cache)["acme/git-pack"]
    assert list(latest) == ["1.1.0"] and latest["1.1.0"].source == f"{url}@{second}"
    short = load_source(f"{url}@{first[:10]}#packs", cache)["acme/git-pack"]
    assert list(short) == ["1.0.0"]
    # the export of a commit is a directory named after it, written once
    got = fetch(GitSource(f"file://{repo}", first), cache)
    assert got.commit == first and got.path.name == first
    assert (got.path / "packs" / "p.json").exists()

    # a branch moves: pinning resolves it now, and the pin keeps meaning that commit
    (tmp_path / "local").mkdir()
    pinned = pin_sources([f"{url}@main#packs", str(tmp_path / "local")], cache)
    assert pinned == [f"{url}@{second}#packs", str(tmp_path / "local")]
    commit(repo, {"packs/p.json": {**PACK, "version": "1.2.0"}}, "1.2.0")
    assert list(load_source(pinned[0], cache)["acme/git-pack"]) == ["1.1.0"]
    assert list(load_source(f"{url}@main", cache)["acme/git-pack"]) == ["1.2.0"]
    # with the official packs, by id and version
    packs = load_sources([f"{url}@{first}", f"{url}@{second}"], cache)
    assert "spinf/support-triage" in packs and list(packs["acme/git-pack"]) == ["1.1.0",
                                                                                "1.0.0"]
    with pytest.raises(PackError, match="acme/git-pack@1.0.0 also comes from"):
        load_sources([f"{url}@{first}", f"{url}@{first}#packs"], cache)
    # a fixed revision already in the cache needs no remote
    shutil.rmtree(repo)
    assert list(load_source(f"{url}@{first}", cache)["acme/git-pack"]) == ["1.0.0"]


def test_github_sources_clone_their_repository(repo, tmp_path, monkeypatch):
    """github:owner/repo@ref is the git repository of that name; a local one stands in."""
    sha = commit(repo, {"p.json": PACK}, "one")
    monkeypatch.setattr(pack_sources, "GITHUB_URL", f"file://{tmp_path}/{{repo}}")
    packs = load_source("github:acme/packs-repo@main", tmp_path / "cache")
    assert packs["acme/git-pack"]["1.0.0"].source == f"github:acme/packs-repo@{sha}"
    assert pin_sources(["github:acme/packs-repo@main"], tmp_path / "cache") == [
        f"github:acme/packs-repo@{sha}"]
    # offline (here: no such repository) it fails with one clear line
    with pytest.raises(PackError) as err:
        load_source("github:acme/elsewhere@v1", tmp_path / "cache")
    message = str(err.value)
    assert message.startswith(f"github:acme/elsewhere@v1: (source): cannot fetch "
                              f"file://{tmp_path}/elsewhere: ")
    assert "\n" not in message


def test_bad_pack_in_git_names_commit_file_field_and_reason(repo, tmp_path):
    bad = {**PACK, "reads": [{**PACK["reads"][0], "category": "d"}]}
    sha = commit(repo, {"good.json": PACK, "sub/bad.json": bad}, "bad")
    with pytest.raises(PackError) as caught:
        load_source(f"git+file://{repo}@{sha}", tmp_path / "cache")
    assert str(caught.value) == (f"git+file://{repo}@{sha}/sub/bad.json: reads.0.category: "
                                 "'d' is not a category; categories.c: no read feeds it")
    with pytest.raises(PackError, match="revision 'nope' not found"):
        load_source(f"git+file://{repo}@nope", tmp_path / "cache")
    with pytest.raises(PackError, match="cannot fetch"):
        load_source(f"git+file://{tmp_path}/missing@main", tmp_path / "cache")


def test_cli_and_settings_take_git_sources(repo, tmp_path, monkeypatch, capsys):
    from spinf_worker.cli import main
    from spinf_worker.queue.settings import ServiceSettings

    monkeypatch.setenv("SPINF_CACHE_DIR", str(tmp_path / "cache"))
    sha = commit(repo, {"p.json": PACK}, "one")
    assert main(["packs", "--json", "--packs", f"git+file://{repo}@main"]) == 0
    listed = {row["id"]: row for row in map(json.loads, capsys.readouterr().out.splitlines())}
    assert listed["acme/git-pack"]["source"] == f"git+file://{repo}@{sha}"
    assert listed["spinf/moderation"]["source"] == "official"
    assert main(["packs", "--packs", f"git+file://{repo}@main"]) == 0
    assert f"acme/git-pack@1.0.0  1 queries (1 prompts)  categories: c  mode per_category  " \
        f"lock -  from git+file://{repo}@{sha}" in capsys.readouterr().out
    commit(repo, {"p.json": {**PACK, "version": "x y"}}, "broken")
    assert main(["packs", "--packs", f"git+file://{repo}@main"]) == 2
    assert "p.json: version: String should match pattern" in capsys.readouterr().err

    monkeypatch.setenv("SPINF_PACKS", json.dumps([f"git+file://{repo}@{sha}"]))
    assert ServiceSettings().packs == [f"git+file://{repo}@{sha}"]
