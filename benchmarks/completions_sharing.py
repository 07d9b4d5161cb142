"""Multiple-choice items as lm-evaluation-harness sends them, three ways: /v1/completions (one
request per option), /v1/score (one request per item) and transformers (one sequence per option).

Items: ``--items`` contexts of ``--context-tokens`` tokens (default 500 x 300), windows of the
articles of ``../shared/data`` (news_articles.jsonl, then ag_news_sample.jsonl, as one token
stream, evenly spaced), each followed by one question, with four one-token options.

1. **completions**: ``spinf-serve serve`` as a subprocess (``service_http.Service``: a fresh state
   dir, the project's packages as of HEAD or the working tree), then every (item, option) as its
   own ``POST /v1/completions`` with lm-eval's ``local-completions`` body (the context and the
   option as one prompt, ``echo``, ``logprobs: 1``, ``max_tokens: 1``, ``temperature: 0``),
   ``--concurrency`` at a time (``--completion-concurrency``: another number); the option's
   log-likelihood is the sum of its tokens' echoed logprobs. Prompts of one pass that begin
   with the same blocks read them once (engine/prompt_blocks.py): an item's four prompts read
   its context once.
2. **score**: the same service, one ``POST /v1/score`` per item (the context as the content,
   the question as the template, the four options), same concurrency.
3. **transformers**: the checkpoint in transformers, one forward per (item, option) sequence
   (batch 1, fp32 on the CPU, bf16 with ``--device cuda``).
4. with ``--engine``, **engine_completions** and **engine_score**: the same requests scored
   in this process (``Engine.score_batch`` of all of them at once, after a warm-up call of
   each way), before the service starts: the most the service could reach each way, and so
   the ceiling of its completions/score ratio. The echoed logprobs put the LM head (and its
   log-softmax over the vocabulary) on every prompt row, where a score request reads out one
   row per option: on a model whose LM head outweighs its body (the 270M's 262k x 640 against
   ~100M body parameters) that, not the service, caps the ratio.

Items/s each (wall time from the first request to the last answer, after a warm-up request;
served, each way's requests are sent ``--rounds`` times and the last round is timed, the first
kept as ``*_first_round_s``: the worker meets a way's pass shapes in the rounds before), and
each way's last round as the service saw it (``*_service``: its tiers' CPU seconds, and
with ``--api-workers`` the worker's "pass done" log lines: passes and the steps'
milliseconds), and the largest |difference| of an option's log-likelihood between
completions and the other two. The figures go to stdout as a table and to
``<out>/<date>-completions-sharing-<commit>.json``.

    /work/main/.venv/bin/python benchmarks/completions_sharing.py --items 16
    python benchmarks/completions_sharing.py --device cuda          # on a GPU host: 500 items
    python benchmarks/completions_sharing.py --device cuda --api-workers 2 --redis-server PATH
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from service_http import (
    HTTP_TIMEOUT_S,
    POLL_S,
    ROOT,
    Service,
    cpu_model,
    free_port,
    sh,
    snapshot,
)

DATA = ROOT.parent / "shared" / "data"
QUESTION = "\n\nQuestion: Which topic is this text mainly about?\nAnswer:"
OPTIONS = [" World", " Sports", " Business", " Science"]


def items(tokenizer, n: int, context_tokens: int, data: Path = DATA) -> list[str]:
    """n contexts of ``context_tokens`` tokens, evenly spaced over the articles' tokens."""
    texts = [row.get("text") or f"{row['title']}\n{row['description']}"
             for name in ("news_articles.jsonl", "ag_news_sample.jsonl")
             for row in map(json.loads, (data / name).read_text(encoding="utf-8").splitlines())]
    stream = [t for text in texts for t in tokenizer.encode(text + "\n\n",
                                                            add_special_tokens=False).ids]
    step = max(1, (len(stream) - context_tokens) // max(1, n - 1))
    return [tokenizer.decode(stream[i * step:i * step + context_tokens]) for i in range(n)]


async def post(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    """POST and wait for the result (following the job when the server answers 202)."""
    r = await client.post(path, json=body, headers={"X-Sync-Timeout": str(HTTP_TIMEOUT_S)})
    if r.status_code == 202:
        while True:
            await asyncio.sleep(POLL_S)
            job = (await client.get(r.json()["url"])).json()
            if job.get("status_code") is not None:
                if job["status_code"] != 200:
                    raise RuntimeError(f"{path} job failed: {job}")
                return job["response"]
    if r.status_code != 200:
        raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:500]}")
    return r.json()


async def timed_posts(url: str, path: str, bodies: list[dict], concurrency: int
                      ) -> tuple[list[dict], float]:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=HTTP_TIMEOUT_S) as client:
        await post(client, path, bodies[0])          # warm-up

        async def one(body: dict) -> dict:
            async with limit:
                return await post(client, path, body)

        t0 = time.perf_counter()
        out = await asyncio.gather(*(one(b) for b in bodies))
        return out, time.perf_counter() - t0


def completion_bodies(model: str, contexts: list[str]) -> list[dict]:
    """lm-eval's local-completions loglikelihood body, one per (item, option)."""
    return [{"model": model, "prompt": c + QUESTION + o, "echo": True, "logprobs": 1,
             "max_tokens": 1, "temperature": 0} for c in contexts for o in OPTIONS]


def completion_scores(tokenizer, contexts: list[str], bodies: list[dict]) -> list[float]:
    """Each option's log-likelihood: the echoed logprobs of the prompt's tokens past the
    context's (lm-eval's split), the one generated token left out."""
    out = []
    for k, body in enumerate(bodies):
        context = contexts[k // len(OPTIONS)] + QUESTION
        n_context = 1 + len(tokenizer.encode(context, add_special_tokens=False).ids)
        lps = body["choices"][0]["logprobs"]["token_logprobs"]
        out.append(sum(lps[n_context:-1]))
    return out


def score_bodies(contexts: list[str]) -> list[dict]:
    return [{"text": c, "scoring": {"case_insensitive": False, "queries": [
        {"id": "topic", "template": QUESTION + "{?}", "options": OPTIONS}]}} for c in contexts]


@torch.inference_mode()
def run_transformers(path: Path, tokenizer, bos: int, contexts: list[str], device: str
                     ) -> tuple[list[float], float]:
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    seqs = []
    for c in contexts:
        n_context = 1 + len(tokenizer.encode(c + QUESTION, add_special_tokens=False).ids)
        for o in OPTIONS:
            ids = [bos, *tokenizer.encode(c + QUESTION + o, add_special_tokens=False).ids]
            seqs.append((ids, n_context))
    model(torch.tensor([seqs[0][0]], device=device))      # warm-up
    scores = []
    t0 = time.perf_counter()
    for ids, n_context in seqs:
        logits = model(torch.tensor([ids], device=device)).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        scores.append(sum(lp[j - 1, ids[j]].item() for j in range(n_context, len(ids))))
    return scores, time.perf_counter() - t0


def run_engine(args: argparse.Namespace, contexts: list[str]) -> dict[str, float]:
    """Seconds of one ``Engine.score_batch`` of every completion request and of every score
    request, in this process (the engine freed before the service starts)."""
    from spinf_worker.completions import CompletionRequest
    from spinf_worker.engine import Engine
    from spinf_worker.engine.engine import EngineSettings

    engine = Engine.load(args.model, device=args.device, load_format=args.load_format,
                         settings=EngineSettings(scheme=args.quant) if args.quant else None)
    ways = {"engine_completions": [CompletionRequest.parse(b) for b in completion_bodies(
                engine.model_name, contexts)],
            "engine_score": score_bodies(contexts)}
    seconds = {}
    engine.warm_up()    # CUDA: every pass size compiled (and captured) before any timing
    for way, requests in ways.items():
        # warm-up: on CUDA the readouts' and the layouts' first calls
        engine.score_batch(requests if args.device == "cuda" else requests[:len(OPTIONS)])
        t0 = time.perf_counter()
        out = engine.score_batch(requests)
        seconds[way] = time.perf_counter() - t0
        if failed := [o for o in out if isinstance(o, Exception)]:
            raise RuntimeError(f"{way}: {failed[0]}")
        if args.profile:
            profile_call(engine, way, requests, args.device)
    del engine
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return seconds


def profile_call(engine, way: str, requests: list, device: str, rows: int = 25) -> None:
    """One more call of ``way``: the device's busiest kernels (torch.profiler) and the host's
    busiest functions (cProfile), to stdout."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        engine.score_batch(requests)
        if device == "cuda":
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    if device == "cuda":
        busy = sum(e.self_device_time_total for e in events) / 1e6
        print(f"== {way}: {wall:.3f} s under the profiler, kernels {busy:.3f} s")
        print(events.table(sort_by="self_cuda_time_total", row_limit=rows))
    host = cProfile.Profile()
    host.enable()
    engine.score_batch(requests)
    if device == "cuda":
        torch.cuda.synchronize()
    host.disable()
    print(f"== {way}: the host's busiest functions")
    pstats.Stats(host).sort_stats("tottime").print_stats(rows)


def split_service(args: argparse.Namespace, src: Path, tmp: Path, model_dir: Path):
    """service_gpu's private redis-server, ``api --workers N`` and one worker, running ``src``:
    the API's per-request work in processes of its own, beside the worker's."""
    from service_gpu import Service as SplitService

    return SplitService(argparse.Namespace(
        redis_server=args.redis_server, api_workers=args.api_workers,
        model=args.model or str(model_dir), device=args.device,
        load_format=args.load_format, quant=args.quant, docs=args.items * len(OPTIONS),
        device_workers=1, switch_interval_ms=None, setting=[]),
        tmp, root=src)


def serve(args: argparse.Namespace, src: Path, tmp: Path, model_dir: Path,
          contexts: list[str]) -> tuple:
    """The service's two ways: its model's name, the completions' answers and seconds, the
    scores' answers and seconds."""
    if args.api_workers:
        service = split_service(args, src, tmp, model_dir)
    else:
        service = Service(src, tmp, free_port(), args.model)
        service.command[service.command.index("--device") + 1] = args.device
        service.command += ["--load-format", args.load_format] + (
            ["--quant", args.quant] if args.quant else [])
    service.start()
    from service_gpu import tier_cpu_s, utc_now, worker_steps

    def pids(service) -> dict[str, int]:
        """The service's processes by tier (``serve``: one for API and worker)."""
        return {"serve": service.process.pid} if isinstance(service, Service) else {
            name: pid for name, pid in service.pids().items() if name != "redis"}

    steps = {}
    try:
        service.wait_ready()
        with httpx.Client(base_url=service.url) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
        ways = {"completions": ("/v1/completions", completion_bodies(model, contexts),
                                args.completion_concurrency or args.concurrency),
                "score": ("/v1/score", score_bodies(contexts), args.concurrency)}
        answers, seconds = {}, {}
        for way, (path, bodies, concurrency) in ways.items():
            # rounds before the last one: the worker meets the way's shapes (a service
            # scores such requests all day; the last round is its steady state)
            for _ in range(args.rounds):
                since, cpu = utc_now(), tier_cpu_s(pids(service))
                answers[way], seconds[way] = asyncio.run(timed_posts(service.url, path, bodies,
                                                                     concurrency))
                seconds.setdefault(f"{way}_first", seconds[way])
            cpu = {tier: round(s - cpu[tier], 2) for tier, s in tier_cpu_s(pids(service)).items()}
            steps[way] = {"cpu_s": cpu}
            if not isinstance(service, Service):
                steps[way].update(worker_steps(service.worker_log_lines(), since, utc_now()))
    except BaseException:
        print(service.log_tail(30) if isinstance(service, Service)
              else service.tail("worker", 30), file=sys.stderr)
        raise
    finally:
        service.stop()
    return model, answers, seconds, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=500)
    ap.add_argument("--context-tokens", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--completion-concurrency", type=int, default=None, metavar="N",
                    help="/v1/completions requests in flight (default: --concurrency); "
                         "four times --concurrency keeps as many items in flight as the "
                         "score way (an item is one request per option)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="the service's device and the transformers baseline's")
    ap.add_argument("--model", default=None, help="default: the packaged one")
    ap.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                    help="dummy: random weights of --model's shape (speed only; the "
                         "transformers baseline is then skipped)")
    ap.add_argument("--quant", default=None, help="the service's --quant (default: its own)")
    ap.add_argument("--data", type=Path, default=DATA, help="dir with the news data")
    ap.add_argument("--commit", default=None, help="when the checkout has no .git")
    ap.add_argument("--tree", choices=("head", "worktree"), default="head")
    ap.add_argument("--rev", default="HEAD",
                    help="the revision measured with --tree head (another one: a comparison)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--engine", action="store_true",
                    help="also both ways in-process, before the service (the ratio's ceiling)")
    ap.add_argument("--engine-only", action="store_true",
                    help="only the two in-process ways: no service, no transformers")
    ap.add_argument("--profile", action="store_true",
                    help="with --engine/--engine-only: one more call of each way profiled "
                         "(device kernels and host functions, to stdout)")
    ap.add_argument("--api-workers", type=int, default=0, metavar="N",
                    help="the service as separate processes: a private redis-server "
                         "(--redis-server), `spinf-serve api --workers N` and one `worker` "
                         "(default 0: one `spinf-serve serve`)")
    ap.add_argument("--redis-server", default="redis-server",
                    help="with --api-workers: the redis-server binary to run")
    ap.add_argument("--rounds", type=int, default=2,
                    help="served: each way's requests sent this many times, the last timed "
                         "(the rounds before: the worker meets the way's shapes first)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    commit = args.commit or sh(f"git rev-parse --short {args.rev}")
    if args.load_format == "dummy" or args.engine_only:
        args.skip_transformers = True
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="spinf-completions-bench-") as tmp:
        src = Path(tmp) / "src"
        snapshot(args.tree, commit, src)
        sys.path.insert(0, str(src))
        from spinf_worker.models.loader import load_checkpoint

        ckpt = load_checkpoint(args.model, load_format=args.load_format)
        tok, bos = ckpt.tokenizer, ckpt.bos_token_id
        contexts = items(tok, args.items, args.context_tokens, args.data)
        in_process = run_engine(args, contexts) if args.engine or args.engine_only else {}
        served = None if args.engine_only else serve(args, src, Path(tmp), ckpt.path, contexts)
    r = dict(date=datetime.date.today().isoformat(), commit=commit, device=args.device,
             machine=cpu_model() if args.device == "cpu" else torch.cuda.get_device_name(),
             threads=torch.get_num_threads(), load_avg_1m_at_start=load_at_start,
             model=args.model, load_format=args.load_format, quant=args.quant,
             items=args.items, options=len(OPTIONS), context_tokens=args.context_tokens,
             concurrency=args.concurrency, api_workers=args.api_workers,
             completion_concurrency=args.completion_concurrency or args.concurrency)
    if served is not None:
        model, answers, seconds, steps = served
        c_scores = completion_scores(tok, contexts, answers["completions"])
        s_scores = [o["logprob"] for body in answers["score"] for o in
                    body["results"][0]["queries"][0]["combinations"][0]["options"]]
        c_s, s_s = seconds["completions"], seconds["score"]
        r.update(model=model, rounds=args.rounds, completions_s=c_s,
                 completions_items_per_s=args.items / c_s,
                 completions_first_round_s=seconds["completions_first"],
                 score_s=s_s, score_items_per_s=args.items / s_s,
                 score_first_round_s=seconds["score_first"],
                 max_abs_completions_vs_score=max(abs(a - b) for a, b in
                                                  zip(c_scores, s_scores, strict=True)),
                 completions_vs_score=s_s / c_s,
                 **{f"{way}_service": way_steps for way, way_steps in steps.items()})
    if in_process:
        r.update({f"{way}_s": s for way, s in in_process.items()})
        r.update({f"{way}_items_per_s": args.items / s for way, s in in_process.items()},
                 engine_completions_vs_score=in_process["engine_score"]
                 / in_process["engine_completions"])
    if not args.skip_transformers:
        t_scores, t_s = run_transformers(ckpt.path, tok, bos, contexts, args.device)
        r.update(transformers_s=t_s, transformers_items_per_s=args.items / t_s,
                 max_abs_completions_vs_transformers=max(
                     abs(a - b) for a, b in zip(c_scores, t_scores, strict=True)))
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    slug = Path(r["model"] or "model").name.replace("/", "--")   # two models side by side
    split = f"-api{args.api_workers}" if args.api_workers else ""
    path = out / f"{r['date']}-completions-sharing-{args.device}-{slug}{split}-{commit}.json"
    path.write_text(json.dumps(r, indent=1) + "\n")
    print("| way | items/s | s |\n|---|---|---|")
    for way in ("completions", "score", "engine_completions", "engine_score", "transformers"):
        if f"{way}_s" in r:
            print(f"| {way} | {r[f'{way}_items_per_s']:.2f} | {r[f'{way}_s']:.1f} |")
    print(json.dumps({k: v for k, v in r.items()
                      if k.startswith("max_abs") or k.endswith("_vs_score")}))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
