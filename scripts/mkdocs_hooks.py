"""mkdocs hooks: links from docs/ to files of the repository outside it.

The pages link to repository files by relative path (`../PACKS.md`,
`../benchmarks/results/x.png`), which works where the Markdown is read in the repository. In
the site:

- an image outside docs/ is copied into the site under `_repo/<its path>` and the link points
  there;
- any other file outside docs/ becomes a link to `repo_url` (when mkdocs.yml sets one) or its
  path in code;
- a link to a path that does not exist in the repository fails the build.
"""

from __future__ import annotations

import os
import posixpath
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

IMAGE_SUFFIXES = {".png", ".svg", ".jpg", ".jpeg", ".gif", ".webp"}
COPY_DIR = "_repo"
# [text](target) and ![alt](target); a target has no spaces (the pages' style)
LINK = re.compile(r"(!?)\[([^\]\n]*)\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _outside_links(markdown: str):
    """(match, target path, anchor) for each relative link outside fenced blocks."""
    inside = False
    offset = 0
    for line in markdown.splitlines(keepends=True):
        if FENCE.match(line):
            inside = not inside
        elif not inside:
            for match in LINK.finditer(line):
                target = match.group(3)
                if "://" in target or target.startswith(("#", "/", "mailto:")):
                    continue
                path, _, anchor = target.partition("#")
                yield offset + match.start(), offset + match.end(), match, path, anchor
        offset += len(line)


def _repo_path(docs_dir: Path, page_src: str, target: str) -> str | None:
    """The target's path relative to the repository root when it lies outside docs/."""
    resolved = Path(os.path.normpath(docs_dir / posixpath.dirname(page_src) / target))
    try:
        resolved.relative_to(docs_dir)
        return None
    except ValueError:
        pass
    root = docs_dir.parent
    if not resolved.exists():
        raise PluginError(f"{page_src}: links to {target}, which is not in the repository")
    return resolved.relative_to(root).as_posix()


def on_files(files, config):
    docs_dir = Path(config["docs_dir"]).resolve()
    for page in [f for f in files if f.src_uri.endswith(".md")]:
        text = Path(page.abs_src_path).read_text(encoding="utf-8")
        for *_span, match, path, _anchor in _outside_links(text):
            repo_path = _repo_path(docs_dir, page.src_uri, path)
            if repo_path and match.group(1) and Path(path).suffix.lower() in IMAGE_SUFFIXES:
                uri = f"{COPY_DIR}/{repo_path}"
                if files.get_file_from_path(uri) is None:
                    files.append(File.generated(config, uri,
                                                abs_src_path=str(docs_dir.parent / repo_path)))
    return files


def on_page_markdown(markdown, page, config, files):
    docs_dir = Path(config["docs_dir"]).resolve()
    repo_url = (config.get("repo_url") or "").rstrip("/")
    pieces, last = [], 0
    for start, end, match, path, anchor in _outside_links(markdown):
        repo_path = _repo_path(docs_dir, page.file.src_uri, path)
        if repo_path is None:
            continue
        bang, label = match.group(1), match.group(2)
        if bang and Path(path).suffix.lower() in IMAGE_SUFFIXES:
            copied = posixpath.relpath(f"{COPY_DIR}/{repo_path}",
                                       posixpath.dirname(page.file.src_uri) or ".")
            replacement = f"![{label}]({copied})"
        elif repo_url:
            replacement = f"[{label}]({repo_url}/blob/main/{repo_path}" + \
                (f"#{anchor}" if anchor else "") + ")"
        else:
            plain = label.strip("`")
            replacement = f"`{repo_path}`" if plain in (repo_path, Path(repo_path).name) \
                else f"{label} (`{repo_path}`)"
        pieces += [markdown[last:start], replacement]
        last = end
    return "".join(pieces) + markdown[last:] if pieces else markdown
