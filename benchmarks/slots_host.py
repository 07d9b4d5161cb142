"""The host's work of decoding extraction slots (engine/decode.py), the model's forward left
out: on a GPU, what the device may wait on between a step's forwards.

The job of benchmarks/cpu_slots.py: news articles cut to 470 tokens, the 56 questions and its
four slots (two ``{*}``, one ``{n}``, one ``{$}``), scored by the default model's engine on the
CPU in passes of ``--max-pass-tokens`` rows (the CUDA passes' 16384 by default). The first run
is real: the scoring pass and every decoding step's forward; it records each pass's slot jobs
and kept keys and values and each step's next-token logprobs under ``--record`` (reused by
later runs of the same job), and the responses beside it (``.json``: two checkouts' records
of the same job, recorded with the same ``--threads``, hold the same bytes when their answers
are the same: the CPU forward's last bits move with the threads). The timed runs then call
``SlotDecoder.decode`` on the recorded jobs, the model's forward answering each step at once
with the recorded logprobs (a fresh copy, timed apart as the device's), so beams, reads and
answers are those of the real run and the decode's own work is all that is timed.

Reported per run (median of ``--repeat``): the decode's host ms in all, per slot and per step
(a step: one forward of every live beam, and the step on the pass's own logprobs before it);
then, from one more run each: the tensor methods that would wait for a GPU (``.item()``,
``.tolist()``, ``.cpu()``, ``.numpy()``, ``bool``/``int``/``float`` of a tensor; on the CPU
every tensor counts, those built on the host too) and the tensor operations the decode
dispatches (each a kernel launch on a GPU; views apart) per step, with their own time. On the
CPU these operations run here, so the host time includes the work a GPU would do (reading the
[beams, vocabulary] logprobs): ``python_ms_per_step`` is the rest. ``cuda_way_kernels_per_step``
counts them again with the decode taking its CUDA branches (strict top, pairwise sums), as a
GPU launches them (none when those sums' last bits part the beams from the record's).
``--cprofile N`` shows the N functions of most own time.

    python benchmarks/slots_host.py [--docs 24] [--repeat 5] [--cprofile 25]
    python benchmarks/slots_host.py --code DIR --record FILE   # another checkout's

The answers of every timed run are checked against the recorded run's: one checkout's code
on another's record decodes the same logprobs to the same answers, or stops.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = Path(sys.argv[sys.argv.index("--code") + 1]) if "--code" in sys.argv else ROOT
sys.path.insert(0, str(CODE))
sys.path.insert(1, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from spinf_worker.tools.news_job import DOC_TOKENS, load_docs, load_questions  # noqa: E402

# what a GPU tensor's host must wait for the device to answer
SYNCS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}


class Syncs(TorchFunctionMode):
    """Counts the tensor methods that read a tensor back to the host."""

    def __init__(self):
        super().__init__()
        self.count = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNCS:
            self.count[name] += 1
        return func(*args, **(kwargs or {}))


class Ops(TorchDispatchMode):
    """Counts the tensor operations dispatched outside the forward (views apart: no kernel)
    and the seconds they took."""

    def __init__(self):
        super().__init__()
        self.kernels = self.views = 0
        self.seconds = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if IN_FORWARD[0]:
            return func(*args, **(kwargs or {}))
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds += time.perf_counter() - t0
        if func.is_view:
            self.views += 1
        else:
            self.kernels += 1
        return out


IN_FORWARD = [False]


class CudaWays:
    """The decode takes its CUDA branches (strict top, pairwise sums; its column tables as a
    GPU's) on the CPU tensors, as a GPU runs it: its kernels counted as a GPU launches them."""

    def __init__(self, engine):
        self.columns = getattr(engine.decoder._vocabulary, "columns", None)

    def __enter__(self):
        torch.Tensor.is_cuda = property(lambda self: True)
        if self.columns is not None:   # tables as a GPU's vocabulary holds them
            self.saved = self.columns.__dict__.copy()
            self.columns.__init__(torch.device("cuda"))
            self.columns.device = torch.device("cpu")

    def __exit__(self, *exc):
        del torch.Tensor.is_cuda
        if self.columns is not None:
            self.columns.__dict__.update(self.saved)


def record(engine, requests: list[dict], path: Path) -> None:
    """One real run: each decode call's jobs and kept keys/values, and its steps' logprobs."""
    decoder, calls = engine.decoder, []
    decode, step = decoder.decode, decoder._step

    def recording_decode(jobs, kept):
        calls.append({"jobs": jobs, "kept": kept, "steps": []})
        found = decode(jobs, kept)
        calls[-1]["found"] = plain(found)
        return found

    def recording_step(beams, plan):
        out = step(beams, plan)
        calls[-1]["steps"].append(out.clone())
        return out

    decoder.decode, decoder._step = recording_decode, recording_step
    try:
        responses = engine.score_batch(requests)
    finally:
        del decoder.decode, decoder._step
    for r in responses:
        if isinstance(r, Exception):
            raise r
    torch.save(calls, path)
    # the responses as served: compare two checkouts' with cmp
    answers = [{k: r.plain()[k] for k in ("results", "usage")} for r in responses]
    path.with_suffix(".json").write_text(json.dumps(answers))


def plain(found) -> list:
    """A decode's answers as plain data (texts, logprobs, tokens, in order)."""
    return [[[f.text, f.logprob, list(f.tokens), f.finish, f.sequence] for f in answers]
            for answers in found]


def replay(engine, calls: list[dict]) -> list[torch.Tensor]:
    """The model answers each decoding step with the recorded logprobs (a fresh copy)."""
    model = engine.model
    steps: list[torch.Tensor] = []

    def forward(ids, pos, plan):
        return torch.zeros(1, 1).expand(ids.shape[0], 1)

    def readout_logprobs(hidden):
        out = steps.pop(0)
        assert hidden.shape[0] == -(-out.shape[0] // 32) * 32, "beams differ from the record"
        return out.clone()

    model.forward, model.readout_logprobs = forward, readout_logprobs
    return steps


def run_once(engine, calls: list[dict], steps: list, modes=()) -> dict:
    """Every recorded decode call once; seconds in all and in the (replayed) forward."""
    model, device = engine.model, [0.0]
    forward, readout = model.forward, model.readout_logprobs

    def timed(fn):
        def inner(*args):
            t0, IN_FORWARD[0] = time.perf_counter(), True
            try:
                return fn(*args)
            finally:
                device[0] += time.perf_counter() - t0
                IN_FORWARD[0] = False
        return inner

    model.forward, model.readout_logprobs = timed(forward), timed(readout)
    total, answers = 0.0, []
    try:
        for call in calls:
            steps[:] = list(call["steps"])
            t0 = time.perf_counter()
            with contextlib.ExitStack() as stack:
                for mode in modes:
                    stack.enter_context(mode)
                found = engine.decoder.decode(call["jobs"], call["kept"])
            total += time.perf_counter() - t0
            assert not steps, "fewer steps than the record"
            answers.append(plain(found))
    finally:
        model.forward, model.readout_logprobs = forward, readout
    return {"total_s": total, "device_s": device[0], "host_s": total - device[0],
            "answers": answers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--max-pass-tokens", type=int, default=16384)
    ap.add_argument("--record", type=Path, default=None,
                    help="the real run's record (default: /tmp/slots_host-<docs>.pt)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch's threads (default 1: the decode's host work is one thread, "
                         "and on a shared machine a second thread waits on others' work)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N")
    ap.add_argument("--answers", type=Path, default=None, help="write the answers here")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--code", default=None, metavar="DIR",
                    help="measure the spinf_worker/ under DIR (default: this checkout's)")
    args = ap.parse_args()

    import spinf_worker
    from spinf_worker.engine import Engine, EngineSettings

    assert Path(spinf_worker.__file__).is_relative_to(CODE), spinf_worker.__file__
    # after spinf_worker: cpu_slots puts this checkout first on the path
    from cpu_slots import SLOTS

    torch.set_num_threads(args.threads)

    engine = Engine.load(None, device="cpu",
                         settings=EngineSettings(max_pass_tokens=args.max_pass_tokens))
    path = args.record or Path(f"/tmp/slots_host-{args.docs}.pt")
    if not path.exists():
        docs = load_docs(Path(args.data), engine.checkpoint.tokenizer, args.docs, DOC_TOKENS)
        questions = load_questions(ROOT / "benchmarks" / "news_questions.json")
        block = {**questions, "case_insensitive": False,
                 "queries": questions["queries"] + SLOTS}
        t0 = time.perf_counter()
        record(engine, [{"text": d, "scoring": block} for d in docs], path)
        print(f"recorded the real run in {time.perf_counter() - t0:.1f} s: {path}")
    calls = torch.load(path, weights_only=False)
    steps = replay(engine, calls)
    slots = sum(len(c["jobs"]) for c in calls)
    # a step: each forward, and the step on the pass's own logprobs before them
    n_steps = sum(len(c["steps"]) + 1 for c in calls)
    beams = sum(s.shape[0] for c in calls for s in c["steps"])

    run_once(engine, calls, steps)     # warm: the vocabulary's tables
    runs = [run_once(engine, calls, steps) for _ in range(args.repeat)]
    for r in runs:
        assert r["answers"] == [c["found"] for c in calls], "answers differ from the record"
    syncs, ops, cuda_ops = Syncs(), Ops(), Ops()
    run_once(engine, calls, steps, [syncs])
    run_once(engine, calls, steps, [ops])
    try:    # the CUDA branches' sums differ in their last bits: beams may part from the record
        run_once(engine, calls, steps, [CudaWays(engine), cuda_ops])
        cuda_kernels = cuda_ops.kernels / n_steps
    except (AssertionError, IndexError):
        cuda_kernels = None

    host = statistics.median(r["host_s"] for r in runs)
    result = {"code": str(CODE), "docs": args.docs, "decode_calls": len(calls), "slots": slots,
              "steps": n_steps, "beam_rows": beams, "repeat": args.repeat,
              "host_ms": host * 1e3, "host_ms_runs": [r["host_s"] * 1e3 for r in runs],
              "host_ms_per_slot": host * 1e3 / slots, "host_ms_per_step": host * 1e3 / n_steps,
              "replayed_forward_ms": statistics.median(r["device_s"] for r in runs) * 1e3,
              "syncs_per_step": sum(syncs.count.values()) / n_steps,
              "syncs": dict(syncs.count),
              # the tensor operations' own time: a GPU's work here (and their launches)
              "tensor_ops_ms_per_step": ops.seconds * 1e3 / n_steps,
              "python_ms_per_step": (host - ops.seconds) * 1e3 / n_steps,
              "kernels_per_step": ops.kernels / n_steps, "views_per_step": ops.views / n_steps,
              "cuda_way_kernels_per_step": cuda_kernels}
    print(f"{slots} slots in {len(calls)} decode calls, {n_steps} steps ({beams} beam rows "
          f"forwarded); median of {args.repeat}")
    for k, v in result.items():
        print(f"{k}: {round(v, 3) if isinstance(v, float) else v}")
    if args.answers:
        args.answers.write_text(json.dumps(runs[-1]["answers"]))
    if args.cprofile:
        profile = cProfile.Profile()
        profile.enable()
        run_once(engine, calls, steps)
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.cprofile)
        print(out.getvalue())


if __name__ == "__main__":
    main()
