"""GPU benchmark: the news job (24 documents x ~470 tokens x 56 two-option questions) on
one GPU, engine (bf16, fp8) against transformers one-sequence-per-question, in one run.

    python benchmarks/gpu_bench.py --data DIR_WITH_news_articles.jsonl \
        --tokenizer DIR_WITH_tokenizer.json [--model270 HF_DIR] --out OUT_DIR

Models: a Gemma-3-12B-shaped stack with random weights, and the 270M (real weights from
--model270, else random weights of its shape); stage ``qwen3``: a Qwen3-8B-shaped stack with
random weights, fused CUDA forward against module by module. Stages: ``--only``. Prints a
table; writes one flat JSON per run.

Options are scored exactly as given (``"case_insensitive": false``: the work of the figures in
RESULTS.md); ``--case-insensitive`` sends the hosted default (each option also scored as its
single-token case and leading-space spellings); the JSON's ``case_insensitive`` says which.
Tokens read are the responses' ``usage.processed_tokens`` (content once plus the query tree).

Without a GPU, ``--cpu-check N`` runs the request building, the response parsing and the
invariance check of the engine stages on N documents with the default model on the CPU
(no figures are measured):

    python benchmarks/gpu_bench.py --cpu-check 3
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from spinf_worker.engine import Engine, EngineSettings
from spinf_worker.models.loader import Checkpoint, load_checkpoint
from spinf_worker.quant.fp8_static import SCALES_FILE
from spinf_worker.tools.news_job import (  # the job's work, shared with `spinf-serve bench`
    bits,
    build_requests,
    checked,
    doc_layouts,
    load_docs,
    questions_answered,
    tokens_read,
)

ROOT = Path(__file__).resolve().parents[1]
GEMMA_12B = dict(model_type="gemma3_text", vocab_size=262144, hidden_size=3840,
                 intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=256, sliding_window=1024,
                 query_pre_attn_scalar=256, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                 max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True,
                 bos_token_id=2, eos_token_id=1, pad_token_id=0)
# A Qwen3-8B-shaped body (with the Gemma tokenizer's vocabulary, the one the job is tokenised with)
QWEN3_8B = dict(model_type="qwen3", vocab_size=262144, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                rope_theta=1_000_000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
                tie_word_embeddings=False, bos_token_id=2, eos_token_id=1, pad_token_id=0)
GEMMA_270M = dict(GEMMA_12B, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                  num_attention_heads=4, num_key_value_heads=1, sliding_window=512,
                  max_position_embeddings=32768)


def random_checkpoint(config: dict, tokenizer) -> Checkpoint:
    """A checkpoint of ``config``'s shape with random weights (the engine draws them)."""
    return Checkpoint(name="random", config=config, weights=None, tokenizer=tokenizer,
                      bos_token_id=2, eos_token_id=1, chat_template=None,
                      weights_digest="random", path=Path("."))


def cuda_time(fn, repeat: int = 3) -> float:
    """Median wall seconds of ``fn`` with the device synchronised around it."""
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def gemm_ceilings(shapes: list[tuple[int, int, int]]) -> dict:
    """TFLOP/s of cuBLAS bf16, torch._scaled_mm fp8 (row-wise scales) and our invariant Triton
    kernel (bf16, fp8) at the same shapes: the cost of invariance."""
    from spinf_worker.kernels.triton_matmul import matmul
    from spinf_worker.quant.fp8 import quantize_rows, quantize_weight

    out = {}
    for m, n, k in shapes:
        for name, tflops in _gemm_shape(matmul, quantize_rows, quantize_weight, m, n, k).items():
            out[f"gemm_{m}x{n}x{k}_{name}_tflops"] = tflops
    return out


def _gemm_shape(matmul, quantize_rows, quantize_weight, m: int, n: int, k: int) -> dict:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    aq, sa = quantize_rows(a)
    wq, sw = quantize_weight(w)
    runs = {
        "cublas_bf16": lambda: a @ w.t(),
        "scaled_mm_fp8": lambda: torch._scaled_mm(aq, wq.t(), scale_a=sa[:, None],
                                                  scale_b=sw[None, :], out_dtype=torch.bfloat16),
        "triton_bf16": lambda: matmul(a, w),
        "triton_fp8": lambda: matmul(aq, wq, a_scale=sa, w_scale=sw, out_dtype=torch.bfloat16),
    }
    out = {}
    for name, fn in runs.items():
        fn()
        dt = cuda_time(lambda fn=fn: [fn() for _ in range(10)]) / 10
        out[name] = round(2 * m * n * k / dt / 1e12, 1)
    return out


def gate_up_rates(rows: int, shapes: list[tuple[int, int]]) -> dict:
    """The MLP's first half in fp8, [rows, K] -> fp8 [rows, I]: the gate|up GEMM alone, the
    GEMM then gelu_mul (bf16 [rows, 2 I] written and read back), and gate_up_act (GELU * up
    in the GEMM's epilogue): ms and TFLOP/s of the GEMM's work."""
    out = {}
    for width, k in shapes:
        for name, fn in _gate_up_runs(rows, width, k).items():
            fn()
            dt = cuda_time(lambda fn=fn: [fn() for _ in range(10)]) / 10
            key = f"gate_up_{rows}x{width}x{k}_{name}"
            out[f"{key}_ms"] = round(dt * 1e3, 3)
            out[f"{key}_tflops"] = round(2 * rows * 2 * width * k / dt / 1e12, 1)
    return out


def _gate_up_runs(rows: int, width: int, k: int) -> dict:
    from spinf_worker.kernels.fused import gate_up_act, gelu_mul
    from spinf_worker.kernels.triton_matmul import matmul
    from spinf_worker.quant.fp8 import quantize_rows, quantize_weight

    x8, xs = quantize_rows(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16))
    w8, ws = quantize_weight(torch.randn(2 * width, k, device="cuda", dtype=torch.bfloat16))

    def gemm():
        return matmul(x8, w8, a_scale=xs, w_scale=ws, out_dtype=torch.bfloat16)

    return {"gemm": gemm, "gemm_then_gelu_mul": lambda: gelu_mul(gemm(), quant=True),
            "gate_up_gelu": lambda: gate_up_act(w8, ws, x8, xs)}


def linear_flops(cfg: dict, tokens: int) -> float:
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i
    return 2.0 * tokens * per_layer * cfg["num_hidden_layers"]


def invariance(engine: Engine, requests: list[dict], reference: list, k: int) -> bool:
    """Document k alone and packed in reverse order score the same bits as in ``reference``."""
    alone = engine.score_batch([requests[k]])[0]
    reverse = engine.score_batch(requests[::-1])[len(requests) - 1 - k]
    return bits(alone) == bits(reference[k]) == bits(reverse)


def nvidia_smi_used_gib() -> float | None:
    """The device's memory in use as nvidia-smi reports it (None without nvidia-smi)."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,"
                              "nounits", f"--id={torch.cuda.current_device()}"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return round(float(out.split()[0]) / 1024, 2)    # MiB


def run_engine(name: str, ckpt: Checkpoint, scheme: str, requests: list[dict],
               max_pass_tokens: int | None = None, cuda_graphs: bool = True, fuse: bool = True,
               fp8_scales: Path | None = None) -> tuple[dict, list]:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    engine = Engine(ckpt, device="cuda",
                    settings=EngineSettings(scheme=scheme, max_pass_tokens=max_pass_tokens,
                                            cuda_graphs=cuda_graphs, fuse=fuse,
                                            fp8_scales=str(fp8_scales) if fp8_scales else None))
    load_peak = torch.cuda.max_memory_allocated()
    t0 = time.perf_counter()
    first = checked(engine.score_batch(requests))  # compiles masks/kernels, fills the floor cache
    warm = time.perf_counter() - t0
    for _ in range(2):   # later calls pack without the floors: their pass sizes compile here
        engine.score_batch(requests)
    seconds = cuda_time(lambda: engine.score_batch(requests), repeat=5)
    responses = checked(engine.score_batch(requests))
    tokens = tokens_read(responses)
    questions = questions_answered(responses)
    flats = doc_layouts(engine, requests)
    from spinf_worker.engine.packer import pack
    from spinf_worker.engine.runner import PASS_BUCKET
    passes = pack(flats, engine.settings.max_pass_tokens)
    padded = sum(-(-p.rows // PASS_BUCKET) * PASS_BUCKET for p in passes)
    # Invariance: document 5 alone vs packed with the other 23 (and in reverse order).
    identical = invariance(engine, requests, responses, 5) and bits(first[5]) == bits(responses[5])
    # Mask build cost of one full pass.
    docs = [flats[i] for i in passes[0].docs]
    rows = -(-passes[0].rows // PASS_BUCKET) * PASS_BUCKET
    mask_s = cuda_time(lambda: engine.runner.flex_plan(docs, rows), repeat=3)
    row = {
        f"{name}_{scheme}_questions_per_s": round(questions / seconds, 1),
        f"{name}_{scheme}_tokens_per_s": round(tokens / seconds),
        f"{name}_{scheme}_seconds": round(seconds, 4),
        f"{name}_{scheme}_first_call_seconds": round(warm, 2),
        f"{name}_{scheme}_tokens_read": tokens,
        f"{name}_{scheme}_passes": len(passes),
        f"{name}_{scheme}_pass_fill_ratio": round(sum(f.tokens for f in flats) / padded, 3),
        f"{name}_{scheme}_mask_build_ms_per_pass": round(mask_s * 1000, 2),
        f"{name}_{scheme}_linear_tflops_achieved": round(
            linear_flops(ckpt.config, tokens) / seconds / 1e12, 1),
        f"{name}_{scheme}_load_peak_gpu_gib": round(load_peak / 2**30, 2),
        f"{name}_{scheme}_peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        # what the caching allocator held at its peak, and the device's use as nvidia-smi
        # reports it (the allocator keeps its peak's blocks, plus the CUDA context)
        f"{name}_{scheme}_peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
        f"{name}_{scheme}_nvidia_smi_used_gib": nvidia_smi_used_gib(),
        f"{name}_{scheme}_bit_identical": identical,
        f"{name}_{scheme}_cuda_graphs": engine.runner.graphs is not None,
    }
    return row, responses


def static_scales(ckpt: Checkpoint, requests: list[dict], device: str = "cuda") -> Path:
    """fp8-static input scales for ``ckpt`` calibrated on the job's own requests (as
    ``spinf-serve quantize fp8-static`` does: bf16, module by module) -> the scales file."""
    from spinf_worker.quant.fp8_static import save_scales, scale_of
    from spinf_worker.tools.fp8_calibrate import record_amax

    engine = Engine(ckpt, device=device, settings=EngineSettings(
        scheme="bf16" if device == "cuda" else "fp32", fuse=False, cuda_graphs=False))
    amax, _ = record_amax(engine, requests)
    del engine
    gc.collect()         # the bf16 engine's cycles: else its weights outlive it into the next load
    if device == "cuda":
        torch.cuda.empty_cache()
    path = Path(tempfile.mkdtemp()) / SCALES_FILE
    save_scales(path, {name: scale_of(a) for name, a in amax.items()}, {"model": ckpt.name})
    return path


def baseline_model(ckpt: Checkpoint, device: str = "cuda", dtype=torch.bfloat16):
    """transformers' Gemma3ForCausalLM of the checkpoint (random weights drawn on the device
    when it has none), sdpa attention."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    if device == "cuda":
        torch.cuda.empty_cache()
    if ckpt.weights is None:
        cfg = Gemma3TextConfig(**{k: v for k, v in ckpt.config.items() if k != "model_type"})
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = Gemma3ForCausalLM(cfg)
        torch.set_default_dtype(default)
    else:
        model = Gemma3ForCausalLM.from_pretrained(ckpt.path, dtype=dtype).to(device)
    model = model.eval()
    model.config._attn_implementation = "sdpa"
    return model


def baseline_batches(ckpt: Checkpoint, docs: list[str], queries: list[dict], device: str = "cuda",
                     max_batch_tokens: int | None = None) -> list[tuple]:
    """One sequence per (document, question): BOS, the document, the template up to the slot;
    a document's sequences batched (left padding, explicit positions), in batches of at most
    ``max_batch_tokens`` padded tokens when given. Each batch: ids, mask, positions, tokens."""
    tok = ckpt.tokenizer
    prefixes = [tok.encode(q["template"].split("{?}")[0], add_special_tokens=False).ids
                for q in queries]
    batches = []
    for doc in docs:
        content = tok.encode(doc, add_special_tokens=False).ids
        seqs = [[ckpt.bos_token_id, *content, *p] for p in prefixes]
        width = max(map(len, seqs))
        step = max(1, max_batch_tokens // width) if max_batch_tokens else len(seqs)
        for start in range(0, len(seqs), step):
            part = seqs[start:start + step]
            ids = torch.zeros(len(part), width, dtype=torch.long)
            mask = torch.zeros(len(part), width, dtype=torch.long)
            for i, s in enumerate(part):
                ids[i, width - len(s):] = torch.tensor(s)
                mask[i, width - len(s):] = 1
            pos = (mask.cumsum(1) - 1).clamp(min=0)
            batches.append((ids.to(device), mask.to(device), pos.to(device),
                            sum(map(len, part))))
    return batches


def baseline_forward(model, batches: list[tuple]) -> None:
    """The batches through the model, logits only at the last position."""
    with torch.inference_mode():
        for ids, mask, pos, _ in batches:
            model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=1)


def run_baseline(name: str, ckpt: Checkpoint, docs: list[str], questions: dict,
                 n_docs: int) -> dict:
    """transformers, bf16, sdpa: one sequence per question, the 56 questions of a document
    batched (left padding, explicit positions), logits only at the last position."""
    model = baseline_model(ckpt)
    batches = baseline_batches(ckpt, docs[:n_docs], questions["queries"])
    baseline_forward(model, batches)
    seconds = cuda_time(lambda: baseline_forward(model, batches), repeat=2)
    n_q = n_docs * len(questions["queries"])
    return {f"{name}_baseline_questions_per_s": round(n_q / seconds, 1),
            f"{name}_baseline_docs": n_docs,
            f"{name}_baseline_tokens_read": sum(b[3] for b in batches)}


def delta_p(a: list, b: list) -> tuple[float, float]:
    """Mean and max |Δp| over every option of two runs' responses."""
    diffs = [abs(oa.p - ob.p) for ra, rb in zip(a, b, strict=True)
             for ia, ib in zip(ra.results, rb.results, strict=True)
             for qa, qb in zip(ia.queries, ib.queries, strict=True)
             for ca, cb in zip(qa.combinations, qb.combinations, strict=True)
             for oa, ob in zip(ca.options, cb.options, strict=True)]
    return sum(diffs) / len(diffs), max(diffs)


def cpu_check(args: argparse.Namespace) -> None:
    """The engine stages' request building and response parsing on the CPU (no GPU needed):
    the default model, ``--cpu-check`` documents, the same figures' inputs, no timing."""
    engine = Engine.load(None, device="cpu")
    questions = json.loads(args.questions.read_text())
    docs = load_docs(args.data, engine.checkpoint.tokenizer, args.cpu_check, args.doc_tokens)
    requests = build_requests(docs, questions, args.case_insensitive)
    responses = checked(engine.score_batch(requests))
    flats = doc_layouts(engine, requests)
    mean_dp, max_dp = delta_p(responses, responses)
    out = {"device": "cpu", "docs": len(docs), "case_insensitive": args.case_insensitive,
           "questions": questions_answered(responses), "tokens_read": tokens_read(responses),
           "real_rows": sum(f.tokens for f in flats), "rows": sum(f.length for f in flats),
           "options_scored": sum(len(bits(r)) for r in responses),
           "bit_identical": invariance(engine, requests, responses, len(requests) // 2),
           "delta_p_self": [mean_dp, max_dp]}
    print(json.dumps(out))
    assert out["questions"] == len(docs) * len(questions["queries"]), out
    assert out["tokens_read"] == out["real_rows"], out
    assert out["bit_identical"] and out["delta_p_self"] == [0.0, 0.0], out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--questions", type=Path, default=ROOT / "benchmarks" / "news_questions.json")
    parser.add_argument("--tokenizer", type=Path, help="dir with tokenizer.json (required)")
    parser.add_argument("--model270", default=None, help="real 270M (HF dir or default id)")
    parser.add_argument("--docs", type=int, default=24)
    parser.add_argument("--doc-tokens", type=int, default=470)
    parser.add_argument("--baseline-docs-12b", type=int, default=4)
    parser.add_argument("--baseline-docs-270m", type=int, default=24)
    parser.add_argument("--only", default="ceilings,gate_up,270m,12b,qwen3")
    parser.add_argument("--pass-tokens-12b", type=int, nargs="*", default=[32768],
                        help="also run the 12B in fp8 with these pass budgets")
    parser.add_argument("--pass-tokens-270m", type=int, nargs="*", default=[8192],
                        help="also run the 270M in fp8 with these pass budgets")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--schemes-12b", type=lambda s: s.split(","), default=["bf16", "fp8"])
    parser.add_argument("--static", action="store_true",
                        help="also fp8-static (270m: the committed scales of the real model, "
                             "else scales calibrated on the job's own documents)")
    parser.add_argument("--commit", default=None, help="when the checkout has no .git")
    parser.add_argument("--case-insensitive", action="store_true",
                        help="the hosted default: options over their case spellings")
    parser.add_argument("--cpu-check", type=int, default=0, metavar="N",
                        help="no GPU: check request building and response parsing on N docs")
    args = parser.parse_args()
    if args.cpu_check:
        cpu_check(args)
        return
    if args.tokenizer is None:
        parser.error("--tokenizer is required")
    only = set(args.only.split(","))
    args.out.mkdir(parents=True, exist_ok=True)

    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    questions = json.loads(args.questions.read_text())
    docs = load_docs(args.data, tokenizer, args.docs, args.doc_tokens)
    requests = build_requests(docs, questions, args.case_insensitive)
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                           capture_output=True, text=True,
                                           cwd=ROOT).stdout.strip() or "unknown"
    row = {"date": time.strftime("%Y-%m-%d"), "commit": commit,
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "docs": len(docs), "questions_per_doc": len(questions["queries"]),
           "case_insensitive": args.case_insensitive}
    if "ceilings" in only:
        row.update(gemm_ceilings([(16384, 15360, 3840), (16384, 3840, 15360),
                                  (16384, 2048, 640), (1000, 15360, 3840)]))
        print(json.dumps(row), flush=True)
    if "gate_up" in only:
        row.update(gate_up_rates(16384, [(2048, 640), (15360, 3840)]))
        print(json.dumps(row), flush=True)

    path = args.out / f"{row['date']}-gpu-{commit}.json"

    def save() -> None:   # after every stage, so a run cut short still leaves its figures
        path.write_text(json.dumps(row, indent=1))

    if "270m" in only:
        ckpt = load_checkpoint(args.model270) if args.model270 else random_checkpoint(GEMMA_270M, tokenizer)
        name = "270m" if args.model270 else "270m_random"
        results = {}
        for scheme in ("bf16", "fp8"):    # both always: the fp8 vs bf16 agreement below
            figures, results[scheme] = run_engine(name, ckpt, scheme, requests)
            row.update(figures)
            save()
            print(json.dumps(figures), flush=True)
        if args.static:
            committed = ROOT / "quantizations" / "google--gemma-3-270m" / SCALES_FILE
            scales = committed if args.model270 else static_scales(ckpt, requests)
            figures, static = run_engine(name, ckpt, "fp8-static", requests, fp8_scales=scales)
            row.update(figures)
            row[f"{name}_fp8_static_vs_bf16_max_abs_dp"] = round(
                delta_p(results["bf16"], static)[1], 5)
            save()
            print(json.dumps(figures), flush=True)
        # the same engine without CUDA graphs: what launching kernel by kernel costs
        figures, eager = run_engine(f"{name}_eager", ckpt, "bf16", requests, cuda_graphs=False)
        row.update(figures)
        for tokens in args.pass_tokens_270m:   # smaller passes: the device starts sooner
            figures, _ = run_engine(f"{name}_pass{tokens}", ckpt, "fp8", requests, tokens)
            row.update(figures)
            print(json.dumps(figures), flush=True)
        row[f"{name}_graphs_equal_eager"] = delta_p(results["bf16"], eager) == (0.0, 0.0)
        print(json.dumps(figures), flush=True)
        mean_dp, max_dp = delta_p(results["bf16"], results["fp8"])
        row.update({f"{name}_fp8_vs_bf16_mean_abs_dp": round(mean_dp, 5),
                    f"{name}_fp8_vs_bf16_max_abs_dp": round(max_dp, 5)})
        row.update(run_baseline(name, ckpt, docs, questions, args.baseline_docs_270m))
        print(json.dumps(row), flush=True)
    if "12b" in only:
        ckpt = random_checkpoint(GEMMA_12B, tokenizer)
        for scheme in args.schemes_12b:
            figures, _ = run_engine("12b", ckpt, scheme, requests)
            row.update(figures)
            save()
            print(json.dumps(figures), flush=True)
        if args.static:
            scales = static_scales(ckpt, requests)
            figures, _ = run_engine("12b", ckpt, "fp8-static", requests, fp8_scales=scales)
            row.update(figures)
            save()
            print(json.dumps(figures), flush=True)
        for tokens in args.pass_tokens_12b:   # larger passes: fewer, larger GEMMs
            figures, _ = run_engine(f"12b_pass{tokens}", ckpt, "fp8", requests, tokens)
            row.update(figures)
            save()
            print(json.dumps(figures), flush=True)
        if args.baseline_docs_12b:
            row.update(run_baseline("12b", ckpt, docs, questions, args.baseline_docs_12b))
    if "qwen3" in only:   # the Llama/Qwen3 stack: fused forward against module by module
        ckpt = random_checkpoint(QWEN3_8B, tokenizer)
        for name, scheme, fuse in (("qwen3_8b", "bf16", True), ("qwen3_8b", "fp8", True),
                                   ("qwen3_8b_unfused", "fp8", False)):
            figures, _ = run_engine(name, ckpt, scheme, requests, fuse=fuse)
            row.update(figures)
            save()
            print(json.dumps(figures), flush=True)
    for name in ("270m", "270m_random", "12b"):
        base = row.get(f"{name}_baseline_questions_per_s")
        for scheme in ("bf16", "fp8"):
            q = row.get(f"{name}_{scheme}_questions_per_s")
            if base and q:
                row[f"{name}_{scheme}_speedup_vs_baseline"] = round(q / base, 1)
    save()
    print("\n| key | value |\n| --- | --- |")
    for k, v in row.items():
        print(f"| {k} | {v} |")


if __name__ == "__main__":
    main()
