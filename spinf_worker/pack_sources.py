"""Where packs come from: the official packs/, local directories and git repositories.

A source is a directory path, ``github:owner/repo[@ref][#subdir]`` (the hosted API's form: the
repository https://github.com/owner/repo.git) or ``git+URL[@rev][#subdir]``
(``git+file:///srv/packs@v1.2``, ``git+https://host/org/packs.git@3f2c...``). A git source is fetched into the user cache as a
bare mirror, the revision is resolved to its commit sha, and that commit's tree is exported
once into a directory named after the sha: an export never changes after it is written, so
every process that loads the same sha reads the same files. A full sha or a tag already in the
cache needs no network.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .packs import Pack, PackError, load_packs, merge_packs, official_packs

GIT_TIMEOUT_S = 300.0
SHA_PREFIX = re.compile(r"^[0-9a-f]{7,40}$")
GITHUB = re.compile(r"^github:(?P<owner>[A-Za-z0-9][A-Za-z0-9-]*)/(?P<repo>[A-Za-z0-9._-]+)"
                    r"(?:@(?P<ref>[^#]+))?(?:#(?P<subdir>.+))?$")
GITHUB_URL = "https://github.com/{owner}/{repo}.git"   # what a github: source clones

Packs = dict[str, dict[str, Pack]]    # id -> version -> Pack, the newest first


@dataclass(frozen=True)
class GitSource:
    url: str                 # what git clones (file:///..., https://..., ssh://...)
    rev: str | None          # branch, tag or sha; None: the remote's default branch
    subdir: str = ""         # packs are the *.json under this folder of the repository
    given: str = field(default="", compare=False)    # the spec as written (github:...)

    @property
    def spec(self) -> str:
        return self.given or (f"git+{self.url}" + (f"@{self.rev}" if self.rev else "")
                              + (f"#{self.subdir}" if self.subdir else ""))


@dataclass(frozen=True)
class Fetched:
    source: GitSource
    commit: str              # the resolved sha: what was loaded
    path: Path               # the exported tree (read it, never write it)


def parse_source(text: str) -> GitSource | Path:
    """A source's spec, parsed; nothing is fetched."""
    if text.startswith("github:"):
        m = GITHUB.match(text)
        if m is None:
            raise PackError(text, "(source): a GitHub source is github:owner/repo[@ref][#subdir]")
        url = GITHUB_URL.format(owner=m["owner"], repo=m["repo"])
        return GitSource(url=url, rev=m["ref"] or None, subdir=(m["subdir"] or "").strip("/"),
                         given=text)
    if not text.startswith("git+"):
        return Path(text)
    rest = text[len("git+"):]
    rest, _, subdir = rest.partition("#")
    # the revision follows the last "@" after the URL's path starts (user@host stays in the URL)
    scheme, sep, tail = rest.partition("://")
    url_tail, at, rev = tail.rpartition("@") if "@" in tail.split("/", 1)[-1] else (tail, "", "")
    if not sep or not url_tail:
        raise PackError(text, "(source): not a git source; expected git+SCHEME://HOST/PATH[@rev]")
    return GitSource(url=f"{scheme}://{url_tail}", rev=rev or None, subdir=subdir.strip("/"))


def cache_root() -> Path:
    from platformdirs import user_cache_path

    base = os.environ.get("SPINF_CACHE_DIR")
    return (Path(base) if base else user_cache_path("spinf-serve", appauthor=False)) / "packs"


def _git(*args: str, cwd: Path | None = None) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S,
                              env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})
    except FileNotFoundError:
        raise PackError("git", "(source): git is not installed; git and github: pack sources "
                        "need it") from None
    except subprocess.TimeoutExpired:
        raise PackError("git", f"(source): git {args[0]} took longer than "
                        f"{GIT_TIMEOUT_S:.0f}s") from None
    if done.returncode != 0:
        # git's first fatal line says why (offline: "Could not resolve host"); one is enough
        lines = (done.stderr.strip() or done.stdout.strip() or "failed").splitlines()
        why = next((line for line in lines if line.startswith(("fatal:", "error:"))), lines[0])
        raise PackError(f"git {' '.join(args[:2])}", f"(source): {why}")
    return done.stdout


def _resolve(mirror: Path, rev: str) -> str | None:
    try:
        return _git("--git-dir", str(mirror), "rev-parse", "--verify", "--quiet",
                    f"{rev}^{{commit}}").strip()
    except PackError:
        return None


def _fixed(mirror: Path, rev: str) -> bool:
    if SHA_PREFIX.match(rev):
        return _resolve(mirror, rev) is not None
    return _resolve(mirror, f"refs/tags/{rev}") is not None


def fetch(source: GitSource, cache: Path | None = None) -> Fetched:
    """The source's revision, resolved to a commit and exported under the cache."""
    home = (cache or cache_root()) / hashlib.sha256(source.url.encode()).hexdigest()[:16]
    mirror = home / "mirror.git"
    home.mkdir(parents=True, exist_ok=True)
    if not (mirror / "HEAD").exists():
        tmp = Path(tempfile.mkdtemp(prefix="mirror-", dir=home))
        try:
            try:
                _git("clone", "--quiet", "--mirror", "--", source.url, str(tmp / "m"))
            except PackError as err:
                raise PackError(source.spec, f"(source): cannot fetch {source.url}: "
                                + err.problems[0].removeprefix("(source): ")) from None
            with contextlib.suppress(OSError):      # another process cloned it first
                (tmp / "m").rename(mirror)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        fetched = True
    else:
        fetched = False
    rev = source.rev or "HEAD"
    # a sha or a tag already in the mirror does not move: no fetch (works offline); a branch
    # or the default branch is fetched so it means what the remote means now
    commit = _resolve(mirror, rev) if fetched or _fixed(mirror, rev) else None
    if commit is None and not fetched:
        _git("--git-dir", str(mirror), "fetch", "--quiet", "--prune", "origin")
        commit = _resolve(mirror, rev)
    if commit is None:
        raise PackError(source.spec, f"(source): revision {rev!r} not found in {source.url}")
    tree = home / commit
    if not tree.is_dir():
        _export(mirror, commit, tree)
    return Fetched(source, commit, tree)


def _export(mirror: Path, commit: str, tree: Path) -> None:
    """``git archive`` of the commit, unpacked beside ``tree`` and renamed into place."""
    raw = subprocess.run(["git", "--git-dir", str(mirror), "archive", "--format=tar", commit],
                         capture_output=True, check=True, timeout=GIT_TIMEOUT_S).stdout
    tmp = Path(tempfile.mkdtemp(prefix="export-", dir=tree.parent))
    with tarfile.open(fileobj=io.BytesIO(raw)) as archive:
        archive.extractall(tmp, filter="data")
    try:
        tmp.rename(tree)
    except OSError:              # another process exported the same commit first
        shutil.rmtree(tmp, ignore_errors=True)


def load_source(text: str, cache: Path | None = None) -> Packs:
    """The packs of one source, each checked; errors name the source, file, field and reason.
    A pack's ``source`` says where it came from (a git source: its commit)."""
    return _load(text, cache)[0]


def _load(text: str, cache: Path | None) -> tuple[Packs, str | None]:
    """(packs, the commit for a git source)."""
    source = parse_source(text)
    if isinstance(source, Path):
        if not source.is_dir():
            raise PackError(text, "(source): not a directory of packs")
        return load_packs(source, source=text), None
    got = fetch(source, cache)
    folder = got.path / source.subdir if source.subdir else got.path
    if not folder.is_dir():
        raise PackError(source.spec, f"(source): no folder {source.subdir!r} at {got.commit}")
    base = text.split("#")[0].rsplit("@", 1)[0] if source.rev else text.split("#")[0]
    shown = f"{base}@{got.commit}" + (f"#{source.subdir}" if source.subdir else "")
    packs = load_packs(folder, shown=shown, source=shown)
    if not packs:
        raise PackError(shown, "(source): no packs (*.json) in the repository")
    return packs, got.commit


def load_sources(sources: list[str] | tuple[str, ...] = (), cache: Path | None = None
                 ) -> Packs:
    """The official packs plus every source's: id -> version -> Pack (the newest first; one
    id@version comes from one place only)."""
    packs = official_packs()
    for text in sources:
        merge_packs(packs, load_source(text, cache))
    return packs


def pin_sources(sources: list[str] | tuple[str, ...], cache: Path | None = None) -> list[str]:
    """Each git source with its revision replaced by the commit it resolves to now, every pack
    checked: tiers of one process (API and worker) then load the same commit."""
    pinned = []
    for text in sources:
        _packs, commit = _load(text, cache)
        if commit is None:
            pinned.append(text)
        else:
            base = text.split("#")[0]
            base = base.rsplit("@", 1)[0] if parse_source(text).rev else base
            subdir = parse_source(text).subdir
            pinned.append(f"{base}@{commit}" + (f"#{subdir}" if subdir else ""))
    return pinned
