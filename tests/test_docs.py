"""The docs site (docs/, mkdocs.yml): it builds with `mkdocs build --strict`, its generated
reference is fresh, and every code block of its pages runs.

Code blocks run against one live server on loopback (a real uvicorn, real Redis, a real
worker on the tiny random model): the pages write the server as http://127.0.0.1:8000, which
is replaced by the live server's URL. In a page, the blocks run in order, in one working
directory (with `fixtures/` and `packs/` of the repository beside them) and, for python, one
namespace:

- ```python: executed; ```bash: `bash -e -o pipefail` with .venv/bin first on the PATH;
- ```json: a request body, POSTed to /v1/score, which must answer 200;
- ```text: output, listings and grammars: never run.

The line before a block may say how else to take it:

- `<!-- not-tested: REASON -->`: it cannot run here (docker, kubectl, a GPU, the hosted API);
- `<!-- docs-test: response [PATH] -->` (json): a response (or the part of it at PATH, e.g.
  `results.0.queries.2`); every field it shows (and each list's first elements) must be in
  the live response to the page's previous request block, `"…"` standing for what is left
  out;
- `<!-- docs-test: pack -->` (json): a prompt pack file; it must load;
- `<!-- docs-test: ingest-config -->` (yaml): an `ingest --config` file; it must validate;
- `<!-- docs-test: default-model -->`: needs the real default model (its answers, or a
  command that loads it); runs in the slow test, against a live server on the default
  model, after the page's blocks before it (on the tiny one) have left their files.

Any other block, or a fence without a language, fails the static test.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from spinf_worker.queue.settings import ServiceSettings

from .conftest import TINY_CORPUS, WAIT_S, write_tiny_gemma3, write_tiny_tokenizer
from .service.live import InProcessWorker, LiveServer

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md"))
LOCAL_URL = "http://127.0.0.1:8000"
REDIS_URL = os.environ.get("SPINF_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
RUNS = {"python", "bash", "json"}
NEVER_RUN = {"text"}
KINDS = {"response": {"json"}, "pack": {"json"}, "ingest-config": {"yaml"},
         "default-model": {"python", "bash", "json"}}
# a block may run a whole CLI job on the real model (parity: two passes of the news job) on a
# loaded 2-core machine: a deadline against hangs, far past any run
BLOCK_TIMEOUT_S = 5 * WAIT_S
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")
MARKER = re.compile(r"^\s*<!--\s*(?P<what>not-tested|docs-test):\s*(?P<arg>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int           # the opening fence's line, 1-based
    lang: str
    code: str
    marker: tuple[str, str] | None   # ("not-tested", reason) | ("docs-test", kind)

    @property
    def where(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{page}:{self.line}"

    @property
    def kind(self) -> str:
        """skip | text | run | response | pack | default-model"""
        if self.marker and self.marker[0] == "not-tested":
            return "skip"
        if self.marker:
            return self.marker[1].split(" ")[0]
        return "text" if self.lang in NEVER_RUN else "run"

    @property
    def argument(self) -> str:
        """What follows the kind in the marker (a response's path)."""
        return self.marker[1].partition(" ")[2].strip() if self.marker else ""


def parse_blocks(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        lang = opening["info"].strip().split(" ")[0]
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        found = MARKER.match(previous)
        marker = (found["what"], found["arg"]) if found else None
        body, j = [], i + 1
        while j < len(lines):
            closing = FENCE.match(lines[j])
            if closing and closing["fence"].startswith(fence[0] * len(fence)) \
                    and not closing["info"].strip():
                break
            line = lines[j]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            j += 1
        else:
            raise AssertionError(f"{page.relative_to(ROOT)}:{i + 1}: the block is never closed")
        blocks.append(Block(page, i + 1, lang, "\n".join(body) + "\n", marker))
        i = j + 1
    return blocks


ALL_BLOCKS = [b for page in PAGES for b in parse_blocks(page)]


# ------------------------------------------------------------------ static checks

def test_every_block_runs_or_says_why_not():
    problems = []
    for block in ALL_BLOCKS:
        if not block.lang:
            problems.append(f"{block.where}: a fence without a language (```text for output)")
        elif block.marker and block.marker[0] == "not-tested":
            if not block.marker[1]:
                problems.append(f"{block.where}: not-tested needs a reason")
        elif block.marker:
            kind = block.kind
            if block.lang not in KINDS.get(kind, ()):
                problems.append(f"{block.where}: docs-test: {kind} does not apply to "
                                f"```{block.lang}")
        elif block.lang not in RUNS | NEVER_RUN:
            problems.append(f"{block.where}: a ```{block.lang} block cannot run here: mark it "
                            "<!-- not-tested: reason -->")
    assert not problems, "\n".join(problems)
    # the pages do have code that runs
    assert sum(b.kind == "run" for b in ALL_BLOCKS) >= 40


def test_the_block_parser_reads_markers_and_indented_fences(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("Text\n\n<!-- not-tested: needs docker -->\n```bash\ndocker ps\n```\n\n"
                    "- a list item:\n\n    ```python\n    print(1)\n    ```\n\n"
                    "<!-- docs-test: response -->\n```json\n{\"a\": 1}\n```\n"
                    "````text\n```\n````\n")
    first, second, third, fourth = parse_blocks(page)
    assert (first.kind, first.marker) == ("skip", ("not-tested", "needs docker"))
    assert (second.lang, second.code, second.kind) == ("python", "print(1)\n", "run")
    assert (third.kind, third.code) == ("response", '{"a": 1}\n')
    assert (fourth.kind, fourth.code) == ("text", "```\n")


def test_a_python_block_that_never_ends_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "BLOCK_TIMEOUT_S", 1)
    page = tmp_path / "loop.md"
    page.write_text("```python\nwhile True:\n    pass\n```\n")
    with pytest.raises(TimeoutError, match="still running"):
        PageRun(page, tmp_path / "work", LOCAL_URL).run_python(parse_blocks(page)[0])


def test_the_response_check_finds_invented_and_missing_fields():
    real = {"results": [{"input_id": "0", "queries": [{"id": "q", "answers": [{"text": "x"}]}]}]}
    shown = {"results": [{"input_id": "0", "queries": [{"id": "q", "answers": [
        {"text": "x", "currency": "USD"}, "…"]}]}], "…": 0}
    assert list(_not_in(shown, real, "$", SCHEMA_FIELDS)) == []   # an absent amount's currency
    invented = {"results": [{"input_id": "0", "queries": [{"id": "q", "answer": []}]}]}
    assert list(_not_in(invented, real, "$", SCHEMA_FIELDS)) == ["$.results[0].queries[0].answer"]
    missing = {"results": [{"packs": [{"id": "p"}]}]}               # a container must be there
    assert list(_not_in(missing, real, "$", SCHEMA_FIELDS)) == ["$.results[0].packs"]


# ------------------------------------------------------------------ the site and the reference

def _reference_module():
    spec = importlib.util.spec_from_file_location("docs_reference",
                                                  ROOT / "scripts" / "docs_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_site_builds_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    site = tmp_path / "site"
    for page in ("index.html", "quickstart.html", "reference/api.html",
                 "reference/configuration.html", "agent-skill/SKILL.html",
                 "engineering/precision.html", "ARCHITECTURE.html"):
        assert (site / page).is_file(), page
    # images of the repository outside docs/ are copied in
    assert list((site / "_repo" / "benchmarks" / "results").glob("*.png"))


def test_generated_reference_is_fresh():
    stale = [str(path) for path, text in _reference_module().render_all().items()
             if not (ROOT / path).is_file() or (ROOT / path).read_text(encoding="utf-8") != text]
    assert not stale, f"stale: {stale}: run python scripts/docs_reference.py"


def test_every_setting_is_documented():
    """A setting without a description, or one the configuration page does not name, fails."""
    module = _reference_module()
    page = (DOCS / "reference" / "configuration.md").read_text(encoding="utf-8")
    service, engine = module.service_settings(), module.engine_settings()
    ingest = [row for rows in module.ingest_settings().values() for row in rows]
    assert len(service) >= 25 and len(engine) >= 8 and len(ingest) >= 15
    for row in service + engine + ingest:
        assert len(row["description"]) > 10, f"{row['name']}: no description"
        assert f"| `{row['name']}` |" in page, row["name"]
    for row in service:
        assert f"`{row['env']}`" in page
    # every SPINF_* variable the code reads is on the page
    read = set()
    for path in [*ROOT.glob("spinf_worker/**/*.py"), *ROOT.glob("api/**/*.py")]:
        read |= set(re.findall(r"\bSPINF_[A-Z][A-Z0-9_]*\b", path.read_text(encoding="utf-8")))
    missing = sorted(name for name in read if f"`{name}`" not in page)
    assert not missing, f"environment variables not on the configuration page: {missing}"
    # every command and flag of the CLI is there
    from spinf_worker.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    for command, subparser in sub.choices.items():
        assert f"### `spinf-serve {command}`" in page
        for action in subparser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help") and action.help != "==SUPPRESS==":
                    assert f"`{option}`" in page, (command, option)


# ------------------------------------------------------------------ running the blocks

class Live:
    """One server (uvicorn + worker on an engine) for the module, and what pages left."""

    def __init__(self, engine, prefix: str):
        self.settings = ServiceSettings(redis_url=REDIS_URL, prefix=prefix, max_wait_ms=20,
                                        claim_idle_ms=1500, heartbeat_s=0.5,
                                        worker_ttl_s=WAIT_S, sync_timeout_s=WAIT_S / 2)
        self.server = LiveServer(self.settings)
        self.worker = InProcessWorker(engine, self.settings)

    def __enter__(self) -> Live:
        self.server.start()
        self.worker.start()
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(Exception):
            self.worker.stop()
        self.server.stop()
        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=f"{self.settings.prefix}:*", count=1000):
            client.delete(key)
        client.close()

    @property
    def url(self) -> str:
        return self.server.url


def _ping_redis() -> None:
    try:
        redis.Redis.from_url(REDIS_URL).ping()
    except redis.ConnectionError as err:
        pytest.fail(f"tests need Redis at {REDIS_URL} (.ci/run starts one): {err}")


@pytest.fixture(scope="module")
def docs_engine(tmp_path_factory):
    """The tiny random Gemma 3 of tests/conftest.py, its tokenizer trained on the pages and
    the official packs besides the tiny corpus: options must be 1-5 tokens, as the pages'
    are in a real model's vocabulary (262k for Gemma), not in the tiny corpus's ~750."""
    from spinf_worker.engine import Engine

    corpus = "\n".join([TINY_CORPUS, *(p.read_text(encoding="utf-8") for p in PAGES),
                        *(p.read_text(encoding="utf-8") for p in (ROOT / "packs").rglob("*.json"))])
    tokenizer = write_tiny_tokenizer(tmp_path_factory.mktemp("docs-tokenizer"), corpus, 4096)
    model = write_tiny_gemma3(tmp_path_factory.mktemp("docs-tiny"), tokenizer)
    return Engine.load(str(model), device="cpu")


@pytest.fixture(scope="module")
def live(docs_engine):
    _ping_redis()
    with Live(docs_engine, f"spinf-docs-{uuid.uuid4().hex[:10]}") as server:
        yield server


class PageRun:
    """Runs one page's blocks in order: a working directory and a python namespace."""

    def __init__(self, page: Path, workdir: Path, url: str):
        self.page, self.url = page, url
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        for name in ("fixtures", "packs"):
            (workdir / name).symlink_to(ROOT / name)
        self.namespace: dict = {"__name__": "__main__"}
        self.last_response: dict | None = None
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SPINF_")}
        self.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{self.env.get('PATH', '')}"

    def code(self, block: Block) -> str:
        return block.code.replace(LOCAL_URL, self.url)

    def run(self, block: Block) -> None:
        kind = block.kind
        if kind == "response":
            self.check_response(block)
        elif kind == "pack":
            from spinf_worker.packs import pack_from_data

            pack_from_data(json.loads(block.code), block.where)
        elif kind == "ingest-config":
            import yaml

            from spinf_worker.ingest.config import IngestConfig

            IngestConfig.model_validate(yaml.safe_load(block.code))
        elif block.lang == "python":
            self.run_python(block)
        elif block.lang == "bash":
            self.run_bash(block)
        elif block.lang == "json":
            self.post(block)
        else:
            raise AssertionError(f"{block.where}: nothing runs a ```{block.lang} block")

    def run_python(self, block: Block) -> None:
        """In this process (the page's namespace), with no SPINF_* variable set, stopped by
        SIGALRM if it runs past BLOCK_TIMEOUT_S (a loop that polls for ever)."""
        cwd, saved = os.getcwd(), {k: os.environ.pop(k) for k in list(os.environ)
                                   if k.startswith("SPINF_")}

        def too_long(*_):
            raise TimeoutError(f"{block.where}: still running after {BLOCK_TIMEOUT_S} s")

        previous = signal.signal(signal.SIGALRM, too_long)
        signal.alarm(int(BLOCK_TIMEOUT_S))
        os.chdir(self.workdir)
        try:
            exec(compile(self.code(block), block.where, "exec"), self.namespace)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
            os.chdir(cwd)
            os.environ.update(saved)

    def run_bash(self, block: Block) -> None:
        result = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", self.code(block)],
                                cwd=self.workdir, env=self.env, capture_output=True, text=True,
                                timeout=BLOCK_TIMEOUT_S)
        assert result.returncode == 0, (f"{block.where}: exit {result.returncode}\n"
                                        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")

    def post(self, block: Block) -> None:
        body = json.loads(self.code(block))
        reply = httpx.post(f"{self.url}/v1/score", json=body, timeout=WAIT_S)
        assert reply.status_code == 200, f"{block.where}: {reply.status_code} {reply.text}"
        self.last_response = reply.json()

    def check_response(self, block: Block) -> None:
        assert self.last_response is not None, f"{block.where}: no request block before it"
        shown, real = json.loads(block.code), self.last_response
        for step in filter(None, block.argument.split(".")):
            real = real[int(step)] if isinstance(real, list) else real[step]
        problems = list(_not_in(shown, real, block.argument or "$", SCHEMA_FIELDS))
        assert not problems, f"{block.where}: fields the live response lacks: {problems}"


def _schema_fields() -> set[str]:
    """Every field name of the API's shapes (the committed OpenAPI schema)."""
    schema = json.loads((DOCS / "reference" / "openapi.json").read_text(encoding="utf-8"))
    return {name for shape in schema["components"]["schemas"].values()
            for name in shape.get("properties", {})}


def _not_in(shown, real, where: str, optional: frozenset = frozenset()):
    """Paths of the fields `shown` has and `real` lacks; "…" stands for anything left out.
    A value the response leaves out when it has none (`optional`: a scalar field of the API's
    shapes, such as an amount's `currency`) may be missing from `real`, not invented; an
    object or a list shown must be there."""
    if isinstance(shown, dict):
        if not isinstance(real, dict):
            yield f"{where} (not an object)"
            return
        for key, value in shown.items():
            if key in ("…", "..."):
                continue
            if key not in real:
                if key not in optional or isinstance(value, (dict, list)):
                    yield f"{where}.{key}"
            else:
                yield from _not_in(value, real[key], f"{where}.{key}", optional)
    elif isinstance(shown, list):
        if not isinstance(real, list):
            yield f"{where} (not a list)"
            return
        for i, value in enumerate(shown):
            if value in ("…", "..."):
                continue
            if i < len(real):
                yield from _not_in(value, real[i], f"{where}[{i}]", optional)


TESTED = ("run", "response", "pack", "ingest-config")
SCHEMA_FIELDS = frozenset(_schema_fields())


def _run_page(page: Path, url: str, workdir: Path) -> int:
    """Runs the page's blocks in page order; returns how many ran."""
    run = PageRun(page, workdir, url)
    ran = 0
    for block in parse_blocks(page):
        if block.kind in TESTED:
            run.run(block)
            ran += 1
    return ran


PAGES_WITH_CODE = [p for p in PAGES
                   if any(b.kind in TESTED for b in parse_blocks(p))]


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_blocks_run(page, live, tmp_path):
    expected = sum(b.kind in TESTED for b in parse_blocks(page))
    ran = _run_page(page, live.url, tmp_path / "work")
    assert ran == expected, f"{ran} of {expected} blocks ran"


def test_committed_openapi_is_what_the_live_server_serves(live):
    served = httpx.get(f"{live.url}/openapi.json", timeout=WAIT_S).json()
    committed = json.loads((DOCS / "reference" / "openapi.json").read_text(encoding="utf-8"))
    assert served == committed, "stale: run python scripts/docs_reference.py"


DEFAULT_MODEL_PAGES = [p for p in PAGES if any(b.kind == "default-model" for b in parse_blocks(p))]


@pytest.mark.slow
@pytest.mark.parametrize("page", DEFAULT_MODEL_PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_default_model_blocks_run(page, live, default_engine, tmp_path):
    """The page again, in order, its default-model blocks against a server on the real
    default model (the others against the tiny one, for the files and names they leave)."""
    _ping_redis()
    blocks = parse_blocks(page)
    ran = 0
    with Live(default_engine, f"spinf-docs-{uuid.uuid4().hex[:10]}") as real:
        run = PageRun(page, tmp_path / "work", live.url)
        for block in blocks:
            if block.kind in TESTED:
                run.run(block)
            elif block.kind == "default-model":
                run.url = real.url
                try:
                    if block.lang == "python":
                        run.run_python(block)
                    elif block.lang == "bash":
                        run.run_bash(block)
                    else:
                        run.post(block)
                finally:
                    run.url = live.url
                ran += 1
    assert ran == sum(b.kind == "default-model" for b in blocks) > 0
