"""The worker's engine in a process of its own (``SPINF_ENGINE_PROCESS``, ``--engine-process``).

With a small model a pass is host-bound, and in one process the queue's per-entry work
(reading, JSON, validation, storing replies) and the engine's own host work (layout, launch,
readout, replies) take turns on one interpreter lock. Here the child process loads the engine
and makes every torch call; the worker's process keeps the I/O and never initialises CUDA.

The worker uses an EngineProcess where it uses an Engine, from the engine thread as before
(queue/engine_thread.py): ``start_batch`` sends the pass and returns at once, ``finish`` waits
for its outcomes; the child runs them in the order sent, so passes stay two deep.

What crosses the pipe, each chosen for the child's time (figures on the 2-core CPU, a news
document of 470 tokens and 56 questions):
- a request goes as its entry's JSON text; the child validates it again (~0.3 ms, the scoring
  block cached) where unpickling a validated ScoreRequest took ~3 ms;
- ``row_parts`` runs here, on a copy of the engine's Preparer the child sends once loaded:
  asking the child would cost a round trip per entry behind a running pass, and tokenising a
  content there ~1.2 ms. The ids it tokenises here go with the next pass (~0.03 ms to unpickle),
  so the child lays contents out without tokenising them again;
- a ScoreResponse comes back as its plain data written by orjson (``Scored``): the worker
  stores it without validating the model again; reading a reply of 56 questions back took
  ~0.13 ms so, ~0.5 ms unpickled as a dict.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import pickle
import signal
import threading
from collections import OrderedDict
from dataclasses import dataclass
from types import SimpleNamespace

from ..completions import CompletionRequest
from ..logs import logging_config
from ..protocol import ScoreRequest, ScoreResponse, Timing
from . import jsonio

STOP_TIMEOUT_S = 30.0      # a child asked to stop gets this long, then it is killed


class EngineProcessDied(RuntimeError):
    """The engine's process ended unasked: the worker stops and exits with this error."""


def read_request(payload: str | bytes) -> ScoreRequest | CompletionRequest:
    """A work entry's request from its JSON text (raises the request's own SpinfError)."""
    body, exact = jsonio.read(payload)
    if isinstance(body, dict) and "completion" in body:
        # POST /v1/completions: the request the API validated (completions.py)
        return CompletionRequest.model_validate(body["completion"])
    scoring = body.get("scoring") if isinstance(body, dict) else None
    # read by orjson, the block written back by orjson is its exact JSON text: the key of
    # the block ScoreRequest.parse has validated already (bulk jobs repeat it)
    key = jsonio.dumps(scoring) if exact and isinstance(scoring, dict) else None
    return ScoreRequest.parse(body, scoring_json=key)


def score_counts(response: ScoreResponse) -> tuple[int, int, int, int]:
    """What the queue's statistics count of a reply: documents, questions, real rows, rows."""
    questions = sum(len(q.combinations) for r in response.results for q in r.queries)
    return len(response.results), questions, response._rows, response._padded_rows


@dataclass
class Scored:
    """A ScoreResponse as the engine process sends it back: its plain data less the timing as
    JSON (what the worker stores writes non-finite floats as null all the same), the timing
    (the worker sets the queue's share) and its ``score_counts``."""

    data: bytes
    timing: Timing
    counts: tuple[int, int, int, int]

    @classmethod
    def of(cls, response: ScoreResponse) -> Scored:
        data = response.plain()
        data.pop("timing")
        return cls(jsonio.dumps(data), response.timing, score_counts(response))

    def plain(self) -> dict:
        return {**jsonio.loads(self.data, long_integers=False),
                "timing": self.timing.model_dump()}


@dataclass
class Sent:
    """A request as the worker holds it (``request``, for ``row_parts``) with its entry's JSON
    text (``payload``), which is what goes to the child."""

    request: ScoreRequest | CompletionRequest
    payload: str | bytes


class EngineProcess:
    """An Engine's face for the Worker, its engine in a child process. ``start`` it (blocks
    until the model is loaded); ``close`` it after the worker stopped."""

    takes_payloads = True     # the Worker hands passes over as ``Sent``

    def __init__(self, process, conn, front: dict):
        self._process, self._conn = process, conn
        self._sending = threading.Lock()
        self._passes = 0
        self.pid = process.pid
        self.model_name, self.fingerprint = front["model_name"], front["fingerprint"]
        self.device, self.settings = front["device"], front["settings"]
        self.manifest, self.media_kinds = front["manifest"], front["media_kinds"]
        self.preparer, self.pad_id = front["preparer"], front["pad_id"]
        self.config = SimpleNamespace(**front["config"])
        tok = self.preparer.presenter.tokenizer
        self.checkpoint = SimpleNamespace(tokenizer=tok, **front["checkpoint"])

    @classmethod
    def start(cls, spec, settings, load=None) -> EngineProcess:
        """Load ``spec``'s engine in a new process with ``load(spec, settings)`` (a module's
        function; default serve.load_engine); raises the load's error."""
        if load is None:
            from ..serve import load_engine as load
        context = multiprocessing.get_context("spawn")     # no CUDA state to inherit
        conn, child_conn = context.Pipe()
        process = context.Process(target=_child, args=(child_conn, load, spec, settings,
                                                        os.getpid(), logging_config()),
                                  name="spinf-engine", daemon=True)
        process.start()
        child_conn.close()     # only the child holds its end: its death ends our reads
        try:
            kind, value = conn.recv()
        except (EOFError, OSError):
            process.join(STOP_TIMEOUT_S)
            raise EngineProcessDied("the engine process exited with code "
                                    f"{process.exitcode} while loading the model") from None
        if kind == "error":
            process.join(STOP_TIMEOUT_S)
            raise value
        return cls(process, conn, value)

    # ---- what the Worker calls: row_parts as it parses entries, the rest on the engine thread

    def row_parts(self, request: ScoreRequest | CompletionRequest):
        if isinstance(request, CompletionRequest):
            from ..engine.completion import PreparedCompletion

            return PreparedCompletion.row_parts(self, request)
        return self.preparer.row_parts(request)

    def start_batch(self, sent: list[Sent]) -> RemoteBatch:
        """Send a pass; its launch's errors are raised by ``finish``."""
        self._passes += 1
        self._send("start", self._passes, [s.payload for s in sent], self._take_roots())
        return RemoteBatch(self, self._passes)

    def score_batch(self, sent: list[Sent]) -> list:
        self._send("score", 0, [s.payload for s in sent], self._take_roots())
        return self._receive()

    # ---- the pipe ------------------------------------------------------------------------

    def _take_roots(self) -> dict[str, list[int]]:
        """The contents row_parts tokenised since the last pass. One tokenised while this
        swaps may miss it: the child then tokenises it itself."""
        roots, self.preparer._roots = self.preparer._roots, OrderedDict()
        return roots

    def _send(self, *message) -> None:
        try:
            with self._sending:
                self._conn.send(message)
        except OSError as err:
            raise self._died() from err

    def _receive(self):
        try:
            kind, value = self._conn.recv()
        except (EOFError, OSError) as err:
            raise self._died() from err
        if kind == "error":
            raise value
        return value

    def _died(self) -> EngineProcessDied:
        self._process.join(1.0)
        return EngineProcessDied(f"the engine process (pid {self.pid}) exited with code "
                                 f"{self._process.exitcode}")

    async def died(self) -> EngineProcessDied:
        """Returns once the child has ended (the Worker stops then): its error."""
        loop = asyncio.get_running_loop()
        ended = loop.create_future()
        loop.add_reader(self._process.sentinel,
                        lambda: ended.done() or ended.set_result(None))
        try:
            await ended
        finally:
            loop.remove_reader(self._process.sentinel)
        return self._died()

    def close(self) -> None:
        """Stop the child after its passes (blocks up to STOP_TIMEOUT_S, then kills it)."""
        with contextlib.suppress(EngineProcessDied):
            self._send("stop", 0, None, None)
        self._process.join(STOP_TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()


class RemoteBatch:
    """A pass sent to the child; ``finish`` reads its outcomes (as ScoringBatch.finish)."""

    def __init__(self, engine: EngineProcess, number: int):
        self.engine, self.number = engine, number

    def finish(self) -> list:
        self.engine._send("finish", self.number, None, None)
        return self.engine._receive()


# ---- the child -------------------------------------------------------------------------


def _child(conn, load, spec, settings, parent: int, logging=None) -> None:
    """Load the engine, send what the worker needs of it, then run what comes, in order."""
    from ..child_processes import dies_with_parent
    from ..engine.engine import freeze_heap
    from ..engine.prepare import ROOT_CACHE
    from ..logs import configure_logging

    if logging is not None:       # the worker's (JSON lines or a console's)
        configure_logging(*logging)

    # The worker stops it, after its last pass: a Ctrl-C or a SIGTERM to the whole group
    # (systemd's control group) is the worker's to handle. Its death is not: then this ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if (die := dies_with_parent(signal.SIGKILL)) is not None:
        die()
    if os.getppid() != parent:    # it died before that
        return
    try:
        engine = load(spec, settings)
    except BaseException as err:  # noqa: BLE001 - the worker raises it
        conn.send(("error", _portable(err)))
        return
    conn.send(("ready", _front(engine)))
    freeze_heap()
    batches: dict[int, object] = {}
    while True:
        try:
            kind, number, payloads, roots = conn.recv()
        except EOFError:          # the worker is gone
            return
        if kind == "stop":
            return
        if roots:
            cache = engine.preparer._roots
            cache.update(roots)
            while len(cache) > ROOT_CACHE:
                cache.popitem(last=False)
        try:
            if kind == "start":   # an error waits for the pass's finish
                batches[number] = _started(engine, payloads)
                continue
            if kind == "finish":
                batch = batches.pop(number)
                if isinstance(batch, BaseException):
                    raise batch
                outcomes = batch.finish()
            else:
                outcomes = engine.score_batch([read_request(p) for p in payloads])
            reply = ("ok", [_plain(o) for o in outcomes])
        except Exception as err:  # noqa: BLE001 - the worker handles it as an engine error
            reply = ("error", _portable(err))
        try:
            conn.send(reply)
        except (pickle.PicklingError, TypeError, AttributeError) as err:   # nothing was sent
            conn.send(("error", RuntimeError(f"a reply could not be sent: {err!r}")))


def _started(engine, payloads: list):
    try:
        return engine.start_batch([read_request(p) for p in payloads])
    except Exception as err:  # noqa: BLE001 - raised by the pass's finish
        return err


def _plain(outcome):
    """An outcome as it crosses: a ScoreResponse as Scored, anything else as is."""
    if isinstance(outcome, ScoreResponse):
        return Scored.of(outcome)
    return _portable(outcome) if isinstance(outcome, BaseException) else outcome


def _portable(err: BaseException) -> BaseException:
    """``err``, or a RuntimeError naming it where it does not pickle."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001 - any pickling trouble
        return RuntimeError(f"{type(err).__name__}: {err}")


def _front(engine) -> dict:
    """What the worker reads of the engine, and the Preparer its row_parts run on."""
    preparer = engine.preparer
    return {"model_name": engine.model_name, "fingerprint": engine.fingerprint,
            "device": str(engine.device), "settings": engine.settings,
            "manifest": engine.manifest, "media_kinds": engine.media_kinds,
            "preparer": preparer, "pad_id": engine.pad_id,
            "config": {"vocab_size": engine.config.vocab_size,
                       "max_position_embeddings": engine.config.max_position_embeddings},
            "checkpoint": {"config": engine.checkpoint.config,
                           "bos_token_id": engine.checkpoint.bos_token_id,
                           "eos_token_id": engine.checkpoint.eos_token_id}}
