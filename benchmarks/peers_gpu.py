"""The news job against vLLM on one GPU: spinf-serve in-process against vLLM's offline engine
(and, optionally, both over HTTP), each part in its own process, one after the other (vLLM
holds ~85% of the device's memory), each writing ``<out>/<date>-peers-<part>-<commit>.json``
as soon as it has figures.

    python benchmarks/peers_gpu.py spinf --tokenizer TOK --data DATA --out OUT
    python benchmarks/peers_gpu.py vllm --scheme bf16 --tokenizer TOK --data DATA --out OUT
    python benchmarks/peers_gpu.py vllm --scheme fp8 ...
    python benchmarks/peers_gpu.py agree-spinf --weights DIR ...   # writes DIR if absent
    python benchmarks/peers_gpu.py agree-vllm --weights DIR ...
    python benchmarks/peers_gpu.py serve ...                        # optional: over HTTP
    python benchmarks/peers_gpu.py sweep-spinf ...                  # the sweeps, each side
    python benchmarks/peers_gpu.py sweep-vllm --scheme bf16|fp8 ...
    python benchmarks/peers_gpu.py sweep-hf ...
    python benchmarks/peers_gpu.py report --out OUT                 # merged JSON + table (+ PNG)

The job: the first 24 articles of news_articles.jsonl cut to 470 tokens x the 56 two-option
questions of news_questions.json (spinf_worker/tools/news_job.py). spinf-serve answers it as
24 requests (``Engine.score_batch``, fp8 and bf16, random weights of the Gemma-3-12B shape,
timed as gpu_bench.py times it). vLLM answers one request per question, built as gpu_bench's
transformers baseline builds it (BOS + the document's tokens + the template's tokens up to the
slot), ``max_tokens=1, logprobs=20, temperature=0``, prefix caching on, ``load_format="dummy"``:
cold (after ``reset_prefix_cache()``) and warm, with and without detokenizing.

Agreement needs the same weights on both sides: ``agree-spinf`` writes random weights of a
smaller shape (``--shape``, default the Gemma 3 1B's: the 12B's would be 24 GB) as an HF
directory (Gemma3ForCausalLM names, bf16 safetensors) and scores it; ``agree-vllm`` loads the
directory with ``load_format="safetensors"`` and scores each (question, option) prompt with
``prompt_logprobs=1`` (the option token's logprob, whatever its rank), and each question's
prompt with ``logprobs=20`` (an option counts there when it is in the top 20).

The sweeps: questions/s against questions per document (7 to 224, gpu_jobs.question_set) and
against document length (256 to 8k tokens, gpu_jobs' windows), the same points on each side:
spinf-serve fp8 and bf16 (timed as gpu_jobs' sweeps), vLLM per scheme (one engine for all the
points, each point as ``vllm`` times the job), transformers one sequence per question (gpu_bench's
baseline, a few documents). ``report`` merges them too, with a PNG (plot_sweeps.lines).

``--tiny``: the spinf and transformers parts on the CPU with a tiny random Gemma 3 (fp32;
figures mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from gpu_bench import GEMMA_12B, GEMMA_270M, random_checkpoint  # noqa: E402
from gpu_jobs import (  # noqa: E402
    SWEEP_LENGTHS,
    SWEEP_QUESTIONS,
    TINY,
    TINY_SWEEP_LENGTHS,
    TINY_SWEEP_QUESTIONS,
    question_set,
    sweep_doc_count,
    windows,
)

from spinf_worker.tools.news_job import load_docs, load_questions  # noqa: E402

GEMMA_1B = dict(GEMMA_12B, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                num_attention_heads=4, num_key_value_heads=1, sliding_window=512,
                max_position_embeddings=32768)
SHAPES = {"12b": GEMMA_12B, "1b": GEMMA_1B, "270m": GEMMA_270M, "tiny": TINY}
VLLM_REPEAT = 3


# --- the job and its records ------------------------------------------------------------------

class Job:
    """The documents, questions and output file of one part."""

    def __init__(self, args: argparse.Namespace, part: str):
        from tokenizers import Tokenizer

        self.args, self.part = args, part
        self.tokenizer = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
        self.tokenizer.post_processor = None
        self.questions = load_questions(args.questions)
        self.docs = load_docs(args.data, self.tokenizer, args.docs, args.doc_tokens)
        commit = args.commit or os.environ.get("COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=ROOT).stdout.strip() or "unknown"
        self.row = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "part": part,
                    "docs": len(self.docs), "questions_per_doc": len(self.questions["queries"]),
                    "tiny": bool(getattr(args, "tiny", False))}
        args.out.mkdir(parents=True, exist_ok=True)
        self.path = args.out / f"{self.row['date']}-peers-{part}-{commit}.json"

    def save(self, **figures) -> None:   # after every stage: a run cut short keeps its figures
        self.row.update(figures)
        self.path.write_text(json.dumps(self.row, indent=1))
        print(json.dumps(figures), flush=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def prompts(self, n_docs: int | None = None, docs: list[str] | None = None,
                queries: list[dict] | None = None) -> list[list[int]]:
        """One prompt per (document, question): BOS, the document, the template up to the slot
        (gpu_bench's baseline sequences); the job's documents and questions unless given."""
        docs = self.docs[:n_docs] if docs is None else docs
        prefixes = [self.encode(q["template"].split("{?}")[0])
                    for q in (self.questions["queries"] if queries is None else queries)]
        return [[2, *self.encode(d), *p] for d in docs for p in prefixes]

    def point(self, figures: dict) -> None:
        """One sweep point more, saved at once (its log line without the lists of runs)."""
        self.row.setdefault("points", []).append(figures)
        self.path.write_text(json.dumps(self.row, indent=1))
        print(json.dumps({k: v for k, v in figures.items() if not isinstance(v, list)}),
              flush=True)

    def option_ids(self) -> list[list[list[int]]]:
        """Each question's options as token ids."""
        return [[self.encode(o) for o in q["options"]] for q in self.questions["queries"]]


def smi() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as err:
        return repr(err)


# --- spinf-serve ------------------------------------------------------------------------------

def spinf_engine(checkpoint, scheme: str, device: str, **settings):
    from spinf_worker.engine import Engine, EngineSettings

    return Engine(checkpoint, device=device,
                  settings=EngineSettings(scheme=scheme, presentation="raw", **settings))


def timed(fn, device: str, repeat: int) -> float:
    """Median wall seconds of ``fn``, the device synchronised around each call."""
    import torch

    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_spinf(args: argparse.Namespace) -> None:
    """Engine.score_batch of the 24 requests, timed as gpu_bench.run_engine times it: a first
    call, two more (their pass sizes compile), the median of five."""
    import torch

    from spinf_worker.tools.news_job import build_requests, checked, questions_answered

    job = Job(args, "spinf")
    device = "cpu" if args.tiny else "cuda"
    checkpoint = random_checkpoint(SHAPES["tiny" if args.tiny else args.shape], job.tokenizer)
    requests = build_requests(job.docs, job.questions)
    job.save(model="tiny" if args.tiny else f"gemma-3-{args.shape} shape, random weights",
             device="cpu" if args.tiny else torch.cuda.get_device_name(), torch=torch.__version__)
    for scheme in (["fp32"] if args.tiny else args.schemes.split(",")):
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        engine = spinf_engine(checkpoint, scheme, device)
        load_s = time.perf_counter() - t
        t = time.perf_counter()
        checked(engine.score_batch(requests))
        first_s = time.perf_counter() - t
        for _ in range(2):
            engine.score_batch(requests)
        seconds = timed(lambda engine=engine: engine.score_batch(requests), device,
                        1 if args.tiny else 5)
        cold = checked(engine.score_batch(requests))
        questions = questions_answered(cold)
        job.save(**{f"spinf_{scheme}_questions_per_s": round(questions / seconds, 1),
                    f"spinf_{scheme}_seconds": round(seconds, 4),
                    f"spinf_{scheme}_questions": questions,
                    f"spinf_{scheme}_load_s": round(load_s, 1),
                    f"spinf_{scheme}_first_call_s": round(first_s, 2),
                    f"spinf_{scheme}_peak_gpu_gib": (
                        round(torch.cuda.max_memory_allocated() / 2**30, 2)
                        if device == "cuda" else None)})
        if args.root_cache_mib:
            # warm: the documents' roots kept from a first call (root_cache_mib), as vLLM's
            # warm runs have them in its prefix cache; every figure as cold
            from spinf_worker.engine.root_cache import RootCache

            engine.roots = RootCache(args.root_cache_mib << 20)
            engine.score_batch(requests)
            warm_s = timed(lambda engine=engine: engine.score_batch(requests), device,
                           1 if args.tiny else 5)
            warm = checked(engine.score_batch(requests))
            same = [w.results == c.results for w, c in zip(warm, cold, strict=True)]
            job.save(**{f"spinf_{scheme}_warm_questions_per_s": round(questions / warm_s, 1),
                        f"spinf_{scheme}_warm_seconds": round(warm_s, 4),
                        f"spinf_{scheme}_warm_kept_roots": len(engine.roots),
                        f"spinf_{scheme}_warm_same_as_cold": all(same),
                        f"spinf_{scheme}_warm_peak_gpu_gib": (
                            round(torch.cuda.max_memory_allocated() / 2**30, 2)
                            if device == "cuda" else None)})
            if not all(same):
                raise SystemExit(f"{scheme}: kept roots changed {same.count(False)} responses")
        del engine


# --- shared random weights --------------------------------------------------------------------

def hf_config(config: dict) -> dict:
    """config.json of a Gemma3ForCausalLM of ``config``'s shape (the fields vLLM 0.26 and
    transformers 5 read)."""
    layers = config["num_hidden_layers"]
    types = config.get("layer_types") or [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    return {**config, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "layer_types": types, "hidden_activation": "gelu_pytorch_tanh",
            "rope_scaling": None, "final_logit_softcapping": None,
            "attn_logit_softcapping": None, "attention_bias": False, "attention_dropout": 0.0,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": config["rope_theta"]},
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": config["rope_local_base_freq"]}},
            "dtype": "bfloat16"}


def hf_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Gemma3ForCausalLM's tensor names and shapes (tied embeddings: no lm_head)."""
    h, i, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], h), "model.norm.weight": (h,)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "pre_feedforward_layernorm.weight": (h,),
            p + "post_feedforward_layernorm.weight": (h,)})
    return shapes


def write_weights(directory: Path, config: dict, tokenizer_dir: Path, seed: int = 0) -> None:
    """Random weights as models/build.py draws them (N(0, 0.02), norms 0: Gemma scales by
    1 + w), in bf16 safetensors under Gemma3ForCausalLM names, with config and tokenizer."""
    import shutil

    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in hf_shapes(config).items():
        t = torch.empty(shape, dtype=torch.float32, device=device)
        if name.endswith("norm.weight"):
            t.zero_()
        else:
            t.normal_(0.0, 0.02, generator=gen)
        tensors[name] = t.to(torch.bfloat16).cpu()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf_config(config), indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, directory / name)


def run_agree_spinf(args: argparse.Namespace) -> None:
    """spinf-serve's option logprobs on the shared weights (bf16; fp32 with --tiny)."""
    from spinf_worker.models.loader import load_checkpoint
    from spinf_worker.tools.news_job import build_requests, checked

    job = Job(args, "agree-spinf")
    shape = "tiny" if args.tiny else args.shape
    if not (args.weights / "model.safetensors").is_file():
        t = time.perf_counter()
        write_weights(args.weights, SHAPES[shape], args.tokenizer)
        job.save(weights_written_s=round(time.perf_counter() - t, 1))
    scheme = "fp32" if args.tiny else args.scheme
    engine = spinf_engine(load_checkpoint(str(args.weights)), scheme,
                          "cpu" if args.tiny else "cuda")
    responses = checked(engine.score_batch(build_requests(job.docs[:args.agree_docs],
                                                          job.questions)))
    logprobs = [[[o.logprob for o in q.combinations[0].options] for q in r.results[0].queries]
                for r in responses]
    job.save(shape=shape, scheme=scheme, weights=str(args.weights), agree_docs=len(responses),
             option_logprobs=logprobs)


# --- vLLM -------------------------------------------------------------------------------------

def vllm_llm(model_dir: Path, scheme: str, load_format: str, max_model_len: int = 2048):
    """vLLM's offline engine as the tested recipe runs it."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from vllm import LLM

    return LLM(model=str(model_dir), tokenizer=str(model_dir), load_format=load_format,
               dtype="bfloat16", enable_prefix_caching=True, max_model_len=max_model_len,
               gpu_memory_utilization=0.85, quantization="fp8" if scheme == "fp8" else None,
               seed=0)


def shape_dir(args: argparse.Namespace) -> Path:
    """A model directory of ``--shape`` with no weights (vLLM's dummy load): config.json and
    the tokenizer."""
    model_dir = args.model_dir / f"{args.shape}-shape"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(hf_config(SHAPES[args.shape]), indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (args.tokenizer / name).is_file():
            (model_dir / name).write_bytes((args.tokenizer / name).read_bytes())
    return model_dir


def vllm_timings(llm, ids: list[list[int]], repeat: int, save, first: bool = True) -> None:
    """One request per prompt, ``max_tokens=1, logprobs=20, temperature=0``, detokenizing
    ("default") and not ("nodetok"): cold (after ``reset_prefix_cache()``) and warm, medians of
    ``repeat``; after an untimed call per mode (it compiles what the first batch needs) when
    ``first``. ``save`` gets each stage's figures, as ``{mode}_{state}_questions_per_s``, ..."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]

    def generate(params) -> tuple[float, int]:
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        assert all(o.outputs and o.outputs[0].logprobs for o in outs), "a request lacks logprobs"
        return seconds, sum(o.num_cached_tokens or 0 for o in outs)

    for mode, detokenize in (("default", True), ("nodetok", False)):
        params = SamplingParams(max_tokens=1, logprobs=20, temperature=0.0, detokenize=detokenize)
        if first:
            save(**{f"{mode}_first_s": round(generate(params)[0], 3)})
        for state in ("cold", "warm"):
            runs, cached = [], []
            for _ in range(repeat):
                if state == "cold":
                    llm.reset_prefix_cache()
                seconds, tokens = generate(params)
                runs.append(seconds)
                cached.append(tokens)
            save(**{f"{mode}_{state}_questions_per_s": round(len(ids) / statistics.median(runs), 1),
                    f"{mode}_{state}_seconds": [round(s, 3) for s in runs],
                    f"{mode}_{state}_cached_tokens": cached})


def run_vllm(args: argparse.Namespace) -> None:
    """One request per question, cold and warm, detokenizing and not; medians of three."""
    t = time.perf_counter()
    import vllm

    job = Job(args, f"vllm-{args.scheme}")
    job.save(vllm_version=vllm.__version__, import_s=round(time.perf_counter() - t, 1),
             scheme=args.scheme)
    model_dir = shape_dir(args)
    ids = job.prompts()
    t = time.perf_counter()
    llm = vllm_llm(model_dir, args.scheme, "dummy")
    job.save(shape=args.shape, init_s=round(time.perf_counter() - t, 1), smi_after_init=smi(),
             requests=len(ids), prompt_tokens=sum(map(len, ids)))
    vllm_timings(llm, ids, VLLM_REPEAT,
                 lambda **figures: job.save(**{f"vllm_{args.scheme}_{k}": v
                                               for k, v in figures.items()}))
    job.save(smi_after_runs=smi())


def run_agree_vllm(args: argparse.Namespace) -> None:
    """vLLM's option logprobs on the shared weights, against agree-spinf's."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    job = Job(args, "agree-vllm")
    ours = json.loads(next(args.out.glob(f"*-peers-agree-spinf-{job.row['commit']}.json"))
                      .read_text())["option_logprobs"]
    llm = vllm_llm(args.weights, args.scheme, "safetensors")
    options = job.option_ids()
    prompts = job.prompts(len(ours))
    # each (question, option): the option's tokens' logprobs, read off prompt_logprobs
    opt_prompts = [(p + o, len(o)) for i, p in enumerate(prompts) for o in options[i % len(options)]]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in opt_prompts],
                        SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0),
                        use_tqdm=False)
    theirs = [sum(o.prompt_logprobs[-n + k][tok].logprob for k, tok in enumerate(p[-n:]))
              for (p, n), o in zip(opt_prompts, outs, strict=True)]
    # each question: the options found among the next token's top 20
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=1, logprobs=20, temperature=0.0),
                        use_tqdm=False)
    top20 = []
    for i, o in enumerate(outs):
        top = o.outputs[0].logprobs[0]
        single = [ids[0] for ids in options[i % len(options)] if len(ids) == 1]
        top20.append([top[t].logprob for t in single]
                     if len(single) == 2 and all(t in top for t in single) else None)
    flat_ours = [lp for doc in ours for q in doc for lp in q]
    job.save(scheme=args.scheme, weights=str(args.weights), agree_docs=len(ours),
             options_single_token=all(len(o) == 1 for q in options for o in q),
             **compare(flat_ours, theirs, "prompt_logprobs"))
    pairs = [(flat_ours[2 * i:2 * i + 2], t) for i, t in enumerate(top20) if t is not None]
    job.save(top20_questions=len(top20), top20_both_options=len(pairs),
             **(compare([x for a, _ in pairs for x in a], [x for _, b in pairs for x in b],
                        "top20") if pairs else {}))


def compare(ours: list[float], theirs: list[float], name: str) -> dict:
    """max and mean |Δ logprob| of two option lists, and how often the pairs' top-1 agree."""
    deltas = [abs(a - b) for a, b in zip(ours, theirs, strict=True)]
    top1 = [(ours[i] >= ours[i + 1]) == (theirs[i] >= theirs[i + 1])
            for i in range(0, len(ours), 2)]
    return {f"{name}_options": len(deltas), f"{name}_max_abs_dlogprob": round(max(deltas), 5),
            f"{name}_mean_abs_dlogprob": round(sum(deltas) / len(deltas), 5),
            f"{name}_top1_agreement": round(sum(top1) / len(top1), 4)}


# --- over HTTP (optional) ---------------------------------------------------------------------

def run_serve(args: argparse.Namespace) -> None:
    """vLLM's OpenAI server (/v1/completions, token-id prompts, ``--in-flight`` at a time),
    then, with ``--redis-server``, spinf-serve's service (/v1/score, the 24 requests at once)."""
    import asyncio

    import httpx

    job = Job(args, "serve")
    ids = job.prompts()
    model_dir = shape_dir(args)
    port = 8011
    # dev mode: the server's POST /reset_prefix_cache, for the cold runs
    env = {**os.environ, "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_SERVER_DEV_MODE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir),
           "--load-format", "dummy", "--dtype", "bfloat16", "--enable-prefix-caching",
           "--max-model-len", "2048", "--gpu-memory-utilization", "0.85", "--port", str(port),
           "--seed", "0", *(["--quantization", "fp8"] if args.scheme == "fp8" else [])]

    async def completions(client: httpx.AsyncClient) -> float:
        gate = asyncio.Semaphore(args.in_flight)

        async def one(p: list[int]) -> None:
            async with gate:
                r = await client.post("/v1/completions", json={
                    "model": str(model_dir), "prompt": p, "max_tokens": 1, "logprobs": 20,
                    "temperature": 0})
                r.raise_for_status()

        t = time.perf_counter()
        await asyncio.gather(*(one(p) for p in ids))
        return time.perf_counter() - t

    async def reset(client: httpx.AsyncClient) -> None:
        (await client.post("/reset_prefix_cache")).raise_for_status()

    server = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        t, healthy = time.perf_counter(), False
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            while not healthy and time.perf_counter() - t < 400 and server.poll() is None:
                with contextlib.suppress(httpx.HTTPError):
                    healthy = client.get("/health").status_code == 200
                time.sleep(0 if healthy else 2)
        job.save(vllm_serve_start_s=round(time.perf_counter() - t, 1), vllm_serve_up=healthy)
        if not healthy:
            sys.exit("vllm serve did not come up")

        async def measure() -> dict:
            async with httpx.AsyncClient(   # httpx's pool holds 100 connections by default
                    base_url=f"http://127.0.0.1:{port}", timeout=300,
                    limits=httpx.Limits(max_connections=args.in_flight)) as client:
                await completions(client)
                cold, warm = [], []
                for _ in range(VLLM_REPEAT):
                    await reset(client)
                    cold.append(await completions(client))
                for _ in range(VLLM_REPEAT):
                    warm.append(await completions(client))
            key = f"vllm_serve_{args.scheme}"
            return {f"{key}_cold_questions_per_s": round(len(ids) / statistics.median(cold), 1),
                    f"{key}_warm_questions_per_s": round(len(ids) / statistics.median(warm), 1),
                    f"{key}_in_flight": args.in_flight}
        job.save(**asyncio.run(measure()))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    if args.redis_server:
        job.save(**spinf_service(args, job, model_dir))


def spinf_service(args: argparse.Namespace, job: Job, model_dir: Path) -> dict:
    """spinf-serve's service (service_gpu.py's: a private redis-server, ``spinf-serve api``, one
    worker) on the same shape: the 24 requests as 24 concurrent ``POST /v1/score``, twice
    untimed (the passes compile), then the median of three."""
    import asyncio
    import tempfile

    import httpx
    from service_gpu import Service

    from spinf_worker.tools.news_job import build_requests

    requests = build_requests(job.docs, job.questions)
    settings = argparse.Namespace(redis_server=args.redis_server, load_format="dummy",
                                  quant="fp32" if args.tiny else args.scheme,
                                  docs=len(requests), api_workers=2, model=str(model_dir),
                                  device="cpu" if args.tiny else "cuda")

    async def scores(url: str) -> list[float]:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            async def one(body: dict) -> None:
                (await client.post("/v1/score", json=body)).raise_for_status()

            runs = []
            for _ in range(2 + VLLM_REPEAT):
                t = time.perf_counter()
                await asyncio.gather(*(one(b) for b in requests))
                runs.append(time.perf_counter() - t)
            return runs[2:]

    with tempfile.TemporaryDirectory() as tmp:
        service = Service(settings, Path(tmp))
        try:
            service.start()
            service.wait_ready()
            runs = asyncio.run(scores(service.url))
        except Exception as err:   # the vLLM side's figures stand without it
            return {"spinf_serve_error": f"{err!r}"[-1500:] + service.tail("worker")}
        finally:
            service.stop()
    questions = len(requests) * len(job.questions["queries"])
    return {f"spinf_serve_{args.scheme}_questions_per_s": round(
                questions / statistics.median(runs), 1),
            f"spinf_serve_{args.scheme}_seconds": [round(r, 3) for r in runs]}


# --- sweeps -----------------------------------------------------------------------------------

def sweep_points(job: Job) -> list[tuple[dict, list[str], list[dict]]]:
    """The sweeps' points, alike on every side, as (label, documents, questions): questions per
    document over the job's ``--docs`` articles of ``--doc-tokens`` (gpu_jobs.question_set: the
    first n news questions, past the 56 all of them again as "Question 2:", ...), then
    document lengths at the 56 questions (gpu_jobs' windows of the articles, as many as
    ``--sweep-tokens`` fill, at least 4; at most ``--length-docs``)."""
    args = job.args
    points = [({"sweep": "questions", "questions_per_doc": n, "doc_tokens": args.doc_tokens},
               job.docs, question_set(job.questions, n)) for n in args.question_counts]
    queries = job.questions["queries"]
    for length in args.lengths:
        count = sweep_doc_count(length, args.sweep_tokens)
        count = min(count, args.length_docs) if args.length_docs else count
        points.append(({"sweep": "length", "questions_per_doc": len(queries),
                        "doc_tokens": length},
                       windows(args.data, job.tokenizer, length, count), queries))
    return points


def sweep_job(args: argparse.Namespace, part: str) -> tuple[Job, list]:
    job = Job(args, part)
    job.row.pop("questions_per_doc")
    job.save(doc_tokens=args.doc_tokens, question_counts=args.question_counts,
             lengths=args.lengths, sweep_tokens=args.sweep_tokens, length_docs=args.length_docs,
             repeat=args.repeat)
    return job, sweep_points(job)


def run_sweep_spinf(args: argparse.Namespace) -> None:
    """Engine.score_batch at each point, timed as gpu_jobs' sweeps time it (gpu_jobs.measure:
    a first call, one more, the median of ``--repeat``), fp8 then bf16 (fp32 with --tiny)."""
    import torch
    from gpu_jobs import measure

    from spinf_worker.tools.news_job import build_requests

    job, points = sweep_job(args, "sweep-spinf")
    device = "cpu" if args.tiny else "cuda"
    checkpoint = random_checkpoint(SHAPES["tiny" if args.tiny else args.shape], job.tokenizer)
    job.save(model="tiny" if args.tiny else f"gemma-3-{args.shape} shape, random weights",
             device="cpu" if args.tiny else torch.cuda.get_device_name(), torch=torch.__version__)
    for scheme in (["fp32"] if args.tiny else args.schemes.split(",")):
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        # content up to the longest document (the hosted default stops at 4,096 tokens)
        engine = spinf_engine(checkpoint, scheme, device, max_content_tokens=max(
            [*args.lengths, args.doc_tokens]) + 1024)
        for label, docs, queries in points:
            figures, _ = measure(engine, build_requests(docs, {"queries": queries}),
                                 args.repeat, cuda=device == "cuda")
            job.point({"side": "spinf", "scheme": scheme, **label, **figures})
        del engine


def run_sweep_vllm(args: argparse.Namespace) -> None:
    """vLLM at each point as ``vllm`` runs the job (vllm_timings: cold and warm, detokenizing
    and not, medians of ``--repeat``), one engine for all the points (``max_model_len``: the
    longest prompt's)."""
    t = time.perf_counter()
    import vllm

    job, points = sweep_job(args, f"sweep-vllm-{args.scheme}")
    job.save(vllm_version=vllm.__version__, import_s=round(time.perf_counter() - t, 1),
             scheme=args.scheme, shape=args.shape)
    prompts = [job.prompts(docs=docs, queries=queries) for _, docs, queries in points]
    # the longest prompt and the one generated token, in whole blocks of 256
    max_model_len = -(-(max(len(p) for ids in prompts for p in ids) + 1) // 256) * 256
    t = time.perf_counter()
    llm = vllm_llm(shape_dir(args), args.scheme, "dummy", max_model_len)
    job.save(init_s=round(time.perf_counter() - t, 1), max_model_len=max_model_len,
             smi_after_init=smi())
    for i, ((label, _, _), ids) in enumerate(zip(points, prompts, strict=True)):
        figures = {"side": "vllm", "scheme": args.scheme, **label,
                   "docs": len(ids) // label["questions_per_doc"], "requests": len(ids),
                   "prompt_tokens": sum(map(len, ids))}
        vllm_timings(llm, ids, args.repeat, figures.update, first=i == 0)
        job.point(figures)
    job.save(smi_after_runs=smi())


def run_sweep_hf(args: argparse.Namespace) -> None:
    """transformers at each point, one sequence per question (gpu_bench's baseline: bf16,
    sdpa, left-padded batches of at most ``--batch-tokens``, logits at the last position only),
    over a few documents (``--docs``, ``--length-docs``); one untimed call, then the median of
    ``--repeat`` per point. A point that runs out of memory says so and the next one runs."""
    import torch
    from gpu_bench import baseline_batches, baseline_forward, baseline_model

    job, points = sweep_job(args, "sweep-hf")
    device = "cpu" if args.tiny else "cuda"
    checkpoint = random_checkpoint(SHAPES["tiny" if args.tiny else args.shape], job.tokenizer)
    t = time.perf_counter()
    model = baseline_model(checkpoint, device, torch.float32 if args.tiny else torch.bfloat16)
    scheme = "fp32" if args.tiny else "bf16"
    job.save(model="tiny" if args.tiny else f"gemma-3-{args.shape} shape, random weights",
             device="cpu" if args.tiny else torch.cuda.get_device_name(), torch=torch.__version__,
             init_s=round(time.perf_counter() - t, 1), batch_tokens=args.batch_tokens)
    warm = False
    for label, docs, queries in points:
        figures = {"side": "hf", "scheme": scheme, **label, "docs": len(docs),
                   "questions": len(docs) * len(queries)}
        batches, seconds = [], None
        try:
            batches = baseline_batches(checkpoint, docs, queries, device, args.batch_tokens)
            if not warm:   # cuBLAS and sdpa pick their kernels
                baseline_forward(model, batches)
                warm = True
            seconds = timed(lambda batches=batches: baseline_forward(model, batches), device,
                            args.repeat)
        except torch.OutOfMemoryError:
            pass   # the traceback holds the point's tensors until this block ends
        if seconds is None:
            batches = []
            torch.cuda.empty_cache()
            job.point({**figures, "error": "out of memory"})
            continue
        job.point({**figures, "questions_per_s": round(figures["questions"] / seconds, 1),
                   "seconds": round(seconds, 4), "tokens_read": sum(b[3] for b in batches)})


# --- report -----------------------------------------------------------------------------------

RATIOS = {   # name: (spinf key, vLLM keys: the best of them)
    "fp8_default_cold": ("spinf_fp8", ["vllm_fp8_default_cold"]),
    "fp8_vs_vllm_best_cold": ("spinf_fp8", ["vllm_bf16_nodetok_cold", "vllm_fp8_nodetok_cold",
                                            "vllm_bf16_default_cold", "vllm_fp8_default_cold"]),
    "bf16_default_warm": ("spinf_bf16", ["vllm_bf16_default_warm"]),
    "bf16_best_warm": ("spinf_bf16", ["vllm_bf16_nodetok_warm", "vllm_bf16_default_warm"]),
    # both sides warm: our roots kept (--root-cache-mib), vLLM's prefix cache
    "bf16_warm_vs_best_warm": ("spinf_bf16_warm", ["vllm_bf16_nodetok_warm",
                                                   "vllm_bf16_default_warm"]),
    "fp8_warm_vs_best_warm": ("spinf_fp8_warm", ["vllm_fp8_nodetok_warm",
                                                 "vllm_fp8_default_warm",
                                                 "vllm_bf16_nodetok_warm"]),
}


def merge(parts: list[dict]) -> dict:
    """The parts' figures under their names (less agree-spinf's raw logprobs), with a ratio
    (spinf q/s over vLLM q/s) per comparison."""
    row = {"date": max(p["date"] for p in parts), "commit": parts[0]["commit"],
           "parts": {p["part"]: {k: v for k, v in p.items()
                                 if k not in ("date", "commit", "part", "option_logprobs")}
                     for p in parts}}
    rates = {k: v for p in parts for k, v in p.items() if k.endswith("_questions_per_s")}
    ratio = {}
    for name, (ours, theirs) in RATIOS.items():
        q = rates.get(f"{ours}_questions_per_s")
        best = max(((rates[f"{k}_questions_per_s"], k) for k in theirs
                    if rates.get(f"{k}_questions_per_s")), default=None)
        if q and best:
            ratio[name] = {"spinf": q, "vllm": best[0], "vllm_run": best[1],
                           "ratio": round(q / best[0], 2)}
    row["ratio"] = ratio
    return row


def table(row: dict) -> str:
    """The markdown table for RESULTS.md."""
    rates = {k: v for p in row["parts"].values() for k, v in p.items()}
    lines = ["| | vLLM cold | vLLM warm | spinf-serve | spinf-serve, roots kept |",
             "|---|---|---|---|---|"]
    for scheme in ("bf16", "fp8"):
        for mode, label in (("default", "logprobs=20"), ("nodetok", "logprobs=20, detokenize=False")):
            cold = rates.get(f"vllm_{scheme}_{mode}_cold_questions_per_s", "")
            warm = rates.get(f"vllm_{scheme}_{mode}_warm_questions_per_s", "")
            ours = rates.get(f"spinf_{scheme}_questions_per_s", "") if mode == "default" else ""
            kept = (rates.get(f"spinf_{scheme}_warm_questions_per_s", "")
                    if mode == "default" else "")
            lines.append(f"| {scheme}, {label} | {cold} | {warm} | {ours} | {kept} |")
    lines += ["", "| comparison | spinf q/s | vLLM q/s (run) | ratio |", "|---|---|---|---|"]
    for name, r in row["ratio"].items():
        lines.append(f"| {name} | {r['spinf']} | {r['vllm']} ({r['vllm_run']}) | {r['ratio']} |")
    serve = row["parts"].get("serve", {})
    if serve:
        lines += ["", "Over HTTP: " + ", ".join(f"{k.removesuffix('_questions_per_s')} {v} q/s"
                                               for k, v in serve.items()
                                               if k.endswith("_questions_per_s"))]
    agree = row["parts"].get("agree-vllm", {})
    if "prompt_logprobs_options" in agree:
        shape = row["parts"].get("agree-spinf", {}).get("shape", "?")
        lines += ["", f"Agreement ({shape} shape, the same random weights on both sides, "
                      f"{agree['scheme']}, {agree['agree_docs']} documents): max |Δ logprob| "
                      f"{agree['prompt_logprobs_max_abs_dlogprob']}, mean "
                      f"{agree['prompt_logprobs_mean_abs_dlogprob']}, top-1 agreement "
                      f"{agree['prompt_logprobs_top1_agreement']} over "
                      f"{agree['prompt_logprobs_options']} options; both options in vLLM's "
                      f"top 20 for {agree.get('top20_both_options')} of "
                      f"{agree.get('top20_questions')} questions."]
    return "\n".join(lines)


SIDES = {"spinf": "spinf-serve", "vllm": "vLLM", "hf": "transformers"}
SWEEP_X = {"questions": "questions_per_doc", "length": "doc_tokens"}


def sweep_series(parts: list[dict]) -> dict[str, dict[str, list[list]]]:
    """label: {sweep: [[x, questions/s], ...]}: spinf-serve per scheme; vLLM per scheme, cold
    with default decoding and the best of its warm runs; transformers."""
    series: dict = {}
    rank = {side: i for i, side in enumerate(SIDES)}
    for part in sorted(parts, key=lambda p: (rank.get(p["part"].split("-")[1], 9), p["part"])):
        for p in part.get("points", []):
            if p["side"] == "vllm":
                warm = [p.get(f"{mode}_warm_questions_per_s") for mode in ("default", "nodetok")]
                values = {f"vLLM {p['scheme']} default, cold": p.get("default_cold_questions_per_s"),
                          f"vLLM {p['scheme']} best warm": max(filter(None, warm), default=None)}
            else:
                values = {f"{SIDES[p['side']]} {p['scheme']}": p.get("questions_per_s")}
            for label, q in values.items():
                if q:
                    series.setdefault(label, {}).setdefault(p["sweep"], []).append(
                        [p[SWEEP_X[p["sweep"]]], q])
    return series


def sweep_style(label: str) -> dict:
    """A colour and marker per server (and vLLM's cold or warm), a dash per scheme."""
    side = ("spinf" if label.startswith("spinf") else "hf" if label.startswith("transformers")
            else "vllm_warm" if label.endswith("warm") else "vllm_cold")
    color, marker = {"spinf": ("tab:blue", "o"), "vllm_cold": ("tab:orange", "s"),
                     "vllm_warm": ("tab:red", "^"), "hf": ("tab:gray", "D")}[side]
    return {"color": color, "marker": marker, "linestyle": "--" if "bf16" in label else "-"}


def rate(q: float | None) -> str:
    return "" if q is None else f"{q:,.0f}" if q >= 100 else f"{q:.1f}"


def sweep_table(series: dict) -> str:
    """A markdown table per sweep: a row per point, a column per line of the plot."""
    lines = []
    for sweep, name in (("questions", "questions per document"), ("length", "document tokens")):
        labels = [label for label in series if series[label].get(sweep)]
        xs = sorted({x for label in labels for x, _ in series[label][sweep]})
        if not xs:
            continue
        values = {label: dict(map(tuple, series[label][sweep])) for label in labels}
        lines += [f"| {name} | " + " | ".join(labels) + " |",
                  "|---" * (len(labels) + 1) + "|"]
        lines += [f"| {x} | " + " | ".join(rate(values[label].get(x)) for label in labels)
                  + " |" for x in xs]
        lines.append("")
    return "\n".join(lines)


def report_sweeps(parts: list[dict], results: Path) -> None:
    """The sweep parts merged (``<date>-peers-sweeps-<commit>.json``), their PNG beside it
    where matplotlib imports, and their table."""
    series = sweep_series(parts)
    row = {"date": max(p["date"] for p in parts), "commit": parts[0]["commit"],
           "parts": {p["part"]: {k: v for k, v in p.items()
                                 if k not in ("date", "commit", "part", "points")}
                     for p in parts},
           "points": [{"part": p["part"], **point} for p in parts for point in p.get("points", [])],
           "series": series}
    path = results / f"{row['date']}-peers-sweeps-{row['commit']}.json"
    path.write_text(json.dumps(row, indent=1))
    print(f"\nwrote {path}")
    spinf = next((p for p in parts if p["part"] == "sweep-spinf"), parts[0])
    hf = next((p for p in parts if p["part"] == "sweep-hf"), None)
    titles = {"questions": f"{spinf['docs']} documents x {spinf.get('doc_tokens', 470)} tokens"
                           + (f" (transformers: {hf['docs']} documents)" if hf else ""),
              "length": "56 questions per document"}
    device = next((p["device"] for p in parts if p.get("device")), "")
    model = spinf.get("model", "")
    try:
        from plot_sweeps import lines
    except ImportError:
        print("no matplotlib here: run report where it imports for the PNG")
    else:
        png = lines(series, titles, f"{device}, {model}, commit {row['commit']}",
                    path.with_suffix(".png"),
                    {label: sweep_style(label) for label in series})
        print(f"wrote {png}")
    print("\n" + sweep_table(series))


def run_report(args: argparse.Namespace) -> None:
    files = sorted(args.out.glob(f"*-peers-*-{args.commit}.json" if args.commit
                                 else "*-peers-*.json"))
    parts = [json.loads(f.read_text()) for f in files]
    parts = [p for p in parts if "part" in p]
    if not parts:
        sys.exit(f"no peers part in {args.out}")
    args.results.mkdir(parents=True, exist_ok=True)
    main = [p for p in parts if not p["part"].startswith("sweep-")]
    if main:
        row = merge(main)
        path = args.results / f"{row['date']}-peers-{row['commit']}.json"
        path.write_text(json.dumps(row, indent=1))
        print(f"wrote {path}\n")
        print(table(row))
    sweeps = [p for p in parts if p["part"].startswith("sweep-")]
    if sweeps:
        report_sweeps(sweeps, args.results)


# --- command line -----------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="part", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--tokenizer", type=Path, default=None,
                        help="dir with tokenizer.json (default: the default model's)")
    common.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    common.add_argument("--questions", type=Path,
                        default=ROOT / "benchmarks" / "news_questions.json")
    common.add_argument("--docs", type=int, default=None, help="articles (default 24; sweep-hf 2)")
    common.add_argument("--doc-tokens", type=int, default=470)
    common.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    common.add_argument("--commit", default=None, help="when the checkout has no .git")
    common.add_argument("--tiny", action="store_true",
                        help="CPU, a tiny random Gemma 3 (spinf parts only)")
    common.add_argument("--shape", choices=sorted(SHAPES), default=None)
    common.add_argument("--scheme", choices=("bf16", "fp8"), default="bf16")
    common.add_argument("--model-dir", type=Path, default=Path("/tmp/peers-models"),
                        help="vllm, serve: where the shape's config and tokenizer are written")
    common.add_argument("--weights", type=Path, default=Path("/tmp/peers-weights"),
                        help="agree-*: the shared random weights' HF directory")
    common.add_argument("--agree-docs", type=int, default=4)
    common.add_argument("--root-cache-mib", type=int, default=0,
                        help="spinf: also warm, the documents' roots kept (this many MiB)")
    for name, fn, shape in (("spinf", run_spinf, "12b"), ("vllm", run_vllm, "12b"),
                            ("agree-spinf", run_agree_spinf, "1b"),
                            ("agree-vllm", run_agree_vllm, "1b"), ("serve", run_serve, "12b")):
        p = sub.add_parser(name, parents=[common])
        p.set_defaults(fn=fn, default_shape=shape)
        if name == "spinf":
            p.add_argument("--schemes", default="fp8,bf16")
        if name == "serve":
            p.add_argument("--in-flight", type=int, default=128)
            p.add_argument("--redis-server", default=None,
                           help="also time spinf-serve's service (its private redis-server)")
    sweep = argparse.ArgumentParser(add_help=False, parents=[common])
    sweep.add_argument("--question-counts", type=int, nargs="*", default=None,
                       help=f"questions per document (default {SWEEP_QUESTIONS})")
    sweep.add_argument("--lengths", type=int, nargs="*", default=None,
                       help=f"document tokens (default {SWEEP_LENGTHS})")
    sweep.add_argument("--sweep-tokens", type=int, default=None,
                       help="content tokens per length, at least 4 documents (default 11280, "
                            "the news job's; tiny 512)")
    sweep.add_argument("--length-docs", type=int, default=None,
                       help="at most this many documents per length")
    sweep.add_argument("--repeat", type=int, default=None, help="timed calls per point (median)")
    for name, fn, repeat in (("sweep-spinf", run_sweep_spinf, 3), ("sweep-vllm", run_sweep_vllm, 1),
                             ("sweep-hf", run_sweep_hf, 1)):
        p = sub.add_parser(name, parents=[sweep])
        p.set_defaults(fn=fn, default_shape="12b", default_repeat=repeat)
        if name == "sweep-spinf":
            p.add_argument("--schemes", default="fp8,bf16")
        if name == "sweep-hf":   # one sequence per question: slow, so few documents
            # (not set_defaults(docs=...): the parents' actions are shared by every part)
            p.set_defaults(default_docs=2, default_length_docs=1)
            p.add_argument("--batch-tokens", type=int, default=32768,
                           help="padded tokens of a forward at most")
    p = sub.add_parser("report")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--commit", default=None, help="only this commit's parts")
    p.set_defaults(fn=run_report)
    args = parser.parse_args()
    if args.part != "report":
        args.shape = args.shape or args.default_shape
        args.docs = args.docs or getattr(args, "default_docs", 24)
        if args.tokenizer is None:
            from spinf_worker.models.loader import load_checkpoint

            args.tokenizer = load_checkpoint(None, load_format="dummy").path
    if args.part.startswith("sweep-"):
        args.question_counts = args.question_counts or (
            TINY_SWEEP_QUESTIONS if args.tiny else SWEEP_QUESTIONS)
        args.lengths = args.lengths or (TINY_SWEEP_LENGTHS if args.tiny else SWEEP_LENGTHS)
        args.sweep_tokens = args.sweep_tokens or (512 if args.tiny else 11280)
        args.repeat = args.repeat or (1 if args.tiny else args.default_repeat)
        args.length_docs = args.length_docs or getattr(args, "default_length_docs", None)
    args.fn(args)


if __name__ == "__main__":
    main()
