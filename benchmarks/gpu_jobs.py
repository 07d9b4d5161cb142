"""GPU engine jobs beyond gpu_bench.py's news job, one job per invocation (each a few minutes
on one H200), on random weights of the models' shapes (as ``--load-format dummy`` builds them):

    python benchmarks/gpu_jobs.py slots  --data DIR --tokenizer DIR --out benchmarks/results
    python benchmarks/gpu_jobs.py long   --data DIR --tokenizer DIR --out benchmarks/results
    python benchmarks/gpu_jobs.py 27b    --data DIR --tokenizer DIR --out benchmarks/results
    python benchmarks/gpu_jobs.py sweeps --data DIR --tokenizer DIR --out benchmarks/results
    python benchmarks/gpu_jobs.py hybrid --data DIR --tokenizer DIR --out benchmarks/results
    python benchmarks/gpu_jobs.py hybrid-long --data DIR --tokenizer DIR --out benchmarks/results

- ``slots``: the news job (24 articles x 470 tokens x 56 questions) with and without four
  extraction slots per document (cpu_slots.SLOTS: two ``{*}``, one ``{n}``, one ``{$}``, beams
  of 4) on the Gemma-3-12B shape: seconds of each, what the slots add (target <= 60%), decoded
  tokens per slot, the questions' logprobs unchanged by the slots, a document's answers
  alone vs packed.
- ``long``: the 56 questions over documents of 512, 2k, 8k and 32k tokens (windows of the
  articles joined end to end, ~64k content tokens per length), 12B shape: questions/s,
  tokens/s, passes and peak memory per length; tokens/s at 8k over 512 (target >= 0.8). A 32k
  document is larger than a pass (16,384 rows): it gets a pass of its own.
- ``27b``: the news job on the Gemma-3-27B shape and on the 12B shape: questions/s of each,
  27B over 12B (target >= 0.45).
- ``sweeps``: 12B shape, questions/s against questions per document (7 to 224: the first of
  the news questions, or all of them again as "Question 2:", ...) and against document length
  (256 to 8k tokens); a PNG of both (plot_sweeps.py) where matplotlib imports, else the JSON.
- ``hybrid``: the news job on the Qwen3.5-27B shape (48 Gated DeltaNet layers, 16 gated
  full-attention ones), bf16 then fp8 (``--schemes``): questions/s, a document's bits alone vs
  packed, peak memory.
- ``decider``: the news questions put to a decision model on the Qwen3.5-27B shape, as the
  hosted pplx-decider answers them: its own prompt format, each answer one of 255 code
  tokens read out over the codes alone (a question offers ``DECISION_OPTIONS`` of them):
  questions/s, a document's bits alone vs packed, peak memory.
- ``hybrid-long``: the 56 questions over documents of 512, 2k and 8k tokens (``--lengths``) on
  the Qwen3.5-27B shape, the DeltaNet roots by chunks (kernels/delta_triton.py's default for
  roots of CHUNKED_ROOT rows or more) and token by token: questions/s, tokens/s, a document's
  bits alone vs packed per length; tokens/s at 8k over 512 for each.

Each writes ``<date>-gpu-<job>-<commit>.json`` under ``--out`` and prints a summary. fp8 by
default (``--scheme``). ``--tiny``: the same code on the CPU with a tiny random Gemma 3 (fp32,
two articles, short lengths; a few minutes on two cores), to run a job end to end without a
GPU; its figures mean nothing (``<date>-cpu-tiny-<job>-<commit>.json``).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_slots import SLOTS  # noqa: E402
from gpu_bench import GEMMA_12B, invariance, nvidia_smi_used_gib, random_checkpoint  # noqa: E402

from spinf_worker.engine import Engine, EngineSettings  # noqa: E402
from spinf_worker.engine.packer import pack  # noqa: E402
from spinf_worker.models.loader import Checkpoint, load_checkpoint  # noqa: E402
from spinf_worker.tools.news_job import (  # noqa: E402
    ARTICLES,
    build_requests,
    checked,
    doc_layouts,
    load_docs,
    questions_answered,
    tokens_read,
)

ROOT = Path(__file__).resolve().parents[1]
# the public Gemma 3 27B's text config (transformers' Gemma3TextConfig fields, as GEMMA_12B)
GEMMA_27B = dict(GEMMA_12B, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                 num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                 query_pre_attn_scalar=168)
# --tiny: a two-layer Gemma 3 (one sliding layer, one global) on the real vocabulary
TINY = dict(GEMMA_12B, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
            sliding_window=128, layer_types=["sliding_attention", "full_attention"])
TINY_27B = dict(TINY, hidden_size=96, num_hidden_layers=3,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"])

# the public Qwen3.5-27B's text config (dense hybrid: three Gated DeltaNet layers to one gated
# full-attention layer); the vocabulary is the Gemma tokenizer's here (262,144 against
# 248,320), so that the news job's token ids exist
QWEN3_5_27B = dict(model_type="qwen3_5_text", vocab_size=262144, hidden_size=5120,
                   intermediate_size=17408, num_hidden_layers=64,
                   layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16,
                   num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                   linear_num_key_heads=16, linear_num_value_heads=48,
                   linear_key_head_dim=128, linear_value_head_dim=128,
                   linear_conv_kernel_dim=4, rms_norm_eps=1e-6, hidden_act="silu",
                   attn_output_gate=True, tie_word_embeddings=False,
                   max_position_embeddings=262144,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                    "partial_rotary_factor": 0.25})
TINY_QWEN3_5 = dict(QWEN3_5_27B, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    layer_types=["linear_attention"] * 3 + ["full_attention"],
                    num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                    linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=16, linear_value_head_dim=16)

# the hosted decision model's readout: 255 codes, each one token; a question offers a few
DECISION_CODES, DECISION_OPTIONS = 255, 8
DECISION_PROMPT = {"content": "Item:\n{content}\n", "question": "\nQ: {question}\nCode:"}

LONG_LENGTHS, TINY_LONG_LENGTHS = [512, 2048, 8192, 32768], [256, 1024]
HYBRID_LENGTHS = [512, 2048, 8192]
CHUNKED_FROM = 256       # hybrid-long's chunked form: roots of this many rows or more
SWEEP_QUESTIONS, TINY_SWEEP_QUESTIONS = [7, 14, 28, 56, 112, 224], [7, 56, 112]
SWEEP_LENGTHS, TINY_SWEEP_LENGTHS = [256, 512, 1024, 2048, 4096, 8192], [64, 256]


class Bench:
    """A job's models, documents and timing, on the GPU or (``--tiny``) the CPU."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.tiny = args, args.tiny
        self.device = "cpu" if self.tiny else "cuda"
        self.scheme = "fp32" if self.tiny else args.scheme
        if args.tokenizer is not None:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
        else:   # the default model's (its config and tokenizer only)
            self.tokenizer = load_checkpoint(None, load_format="dummy").tokenizer
        self.questions = json.loads(args.questions.read_text())
        commit = args.commit or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=ROOT).stdout.strip() or "unknown"
        self.row = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "job": args.job,
                    "device": ("cpu (tiny model: figures mean nothing)" if self.tiny
                               else torch.cuda.get_device_name()),
                    "torch": torch.__version__, "scheme": self.scheme,
                    "model": "tiny" if self.tiny else "random weights of the shape"}
        kind = "cpu-tiny" if self.tiny else "gpu"
        args.out.mkdir(parents=True, exist_ok=True)
        self.path = args.out / f"{self.row['date']}-{kind}-{args.job}-{commit}.json"

    def save(self) -> None:   # after every stage, so a run cut short still leaves its figures
        self.path.write_text(json.dumps(self.row, indent=1))

    def engine(self, config: dict | Checkpoint, **settings) -> Engine:
        """An engine of random weights of ``config``'s shape (or of a checkpoint built so)."""
        ckpt = config if isinstance(config, Checkpoint) else random_checkpoint(config,
                                                                               self.tokenizer)
        return Engine(ckpt, device=self.device,
                      settings=EngineSettings(scheme=self.scheme, **settings))

    def release(self) -> None:
        gc.collect()
        if not self.tiny:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def articles(self, n: int) -> list[str]:
        return load_docs(self.args.data, self.tokenizer, n, self.args.doc_tokens)

    def windows(self, length: int, count: int) -> list[str]:
        return windows(self.args.data, self.tokenizer, length, count)

    def measure(self, engine: Engine, requests: list[dict]) -> tuple[dict, list]:
        return measure(engine, requests, self.args.repeat, cuda=not self.tiny)

    def sync(self) -> None:
        if not self.tiny:
            torch.cuda.synchronize()

    def peak_gib(self) -> float | None:
        return None if self.tiny else round(torch.cuda.max_memory_allocated() / 2**30, 2)

    def record(self, prefix: str, figures: dict) -> None:
        self.row.update({f"{prefix}_{k}": v for k, v in figures.items()})
        self.save()
        print(json.dumps({prefix: figures}), flush=True)


def windows(data: Path, tokenizer, length: int, count: int) -> list[str]:
    """``count`` documents of ``length`` tokens: consecutive windows of the articles joined
    end to end (from the start again when they run out)."""
    stream: list[int] = []
    with (data / ARTICLES).open(encoding="utf-8") as lines:
        for line in lines:
            stream += tokenizer.encode(json.loads(line)["text"] + "\n\n",
                                       add_special_tokens=False).ids
            if len(stream) >= length * count:
                break
    while len(stream) < length * count:
        stream += stream
    return tokenizer.decode_batch([stream[i * length:(i + 1) * length] for i in range(count)])


def sweep_doc_count(length: int, sweep_tokens: int) -> int:
    """Documents of a length point of the sweeps: ``sweep_tokens`` of content, at least 4."""
    return max(4, sweep_tokens // length)


def measure(engine: Engine, requests: list[dict], repeat: int, cuda: bool) -> tuple[dict, list]:
    """The first call (compiles the pass sizes' kernels, scores the floors), one more (later
    calls pack without floors: their pass sizes compile there), then the median of
    ``repeat`` calls."""
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    checked(engine.score_batch(requests))
    first = time.perf_counter() - t0
    engine.score_batch(requests)
    times = []
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        responses = checked(engine.score_batch(requests))
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    flats = doc_layouts(engine, requests)
    passes = pack(flats, engine.settings.max_pass_tokens)
    questions, tokens = questions_answered(responses), tokens_read(responses)
    return {"questions_per_s": round(questions / seconds, 1),
            "tokens_per_s": round(tokens / seconds),
            "seconds": round(seconds, 4), "first_call_seconds": round(first, 2),
            "docs": len(requests), "questions": questions, "tokens_read": tokens,
            "content_tokens": sum(f.root for f in flats),
            "passes": len(passes), "largest_pass_rows": max(p.rows for p in passes),
            "peak_gib": (round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda
                         else None)}, responses


def option_logprobs(response, n_queries: int) -> list[float]:
    """The option logprobs of a response's first ``n_queries`` queries."""
    return [o.logprob for q in response.results[0].queries[:n_queries]
            for c in q.combinations for o in c.options]


def figures_of(response) -> list:
    """Everything a response says of its queries (answers, p, mass, logprobs), as JSON."""
    return response.model_dump(mode="json")["results"][0]["queries"]


def job_slots(bench: Bench) -> None:
    engine = bench.engine(TINY if bench.tiny else GEMMA_12B)
    docs = bench.articles(bench.args.docs)
    n_q = len(bench.questions["queries"])
    plain_requests = build_requests(docs, bench.questions)
    slot_requests = build_requests(docs, {**bench.questions,
                                          "queries": bench.questions["queries"] + SLOTS})
    plain, plain_responses = bench.measure(engine, plain_requests)
    bench.record("without_slots", plain)
    slots, slot_responses = bench.measure(engine, slot_requests)
    bench.record("with_slots", slots)
    n_slots = len(SLOTS) * len(docs)
    k = len(docs) // 2
    alone = engine.score_batch([slot_requests[k]])[0]
    backwards = engine.score_batch(slot_requests[::-1])[len(docs) - 1 - k]
    bench.row.update({
        "docs": len(docs), "questions_per_doc": n_q, "slots_per_doc": len(SLOTS),
        "slots_added_fraction": round(slots["seconds"] / plain["seconds"] - 1, 3),
        "slots_target_met": slots["seconds"] <= 1.6 * plain["seconds"],
        "decode_ms_per_slot": round((slots["seconds"] - plain["seconds"]) / n_slots * 1e3, 3),
        "decoded_tokens_per_slot": round(
            sum(r.usage.completion_tokens for r in slot_responses) / n_slots, 1),
        "slots_with_an_answer": sum(bool(c.answers) for r in slot_responses
                                    for q in r.results[0].queries[n_q:] for c in q.combinations),
        "scores_unchanged_by_slots": all(
            option_logprobs(a, n_q) == option_logprobs(b, n_q)
            for a, b in zip(plain_responses, slot_responses, strict=True)),
        "answers_bit_identical_alone_vs_packed": (
            figures_of(alone) == figures_of(slot_responses[k]) == figures_of(backwards)),
    })
    bench.save()
    summary(bench, ["without_slots_questions_per_s", "with_slots_questions_per_s",
                    "without_slots_seconds", "with_slots_seconds", "slots_added_fraction",
                    "slots_target_met", "decode_ms_per_slot", "decoded_tokens_per_slot",
                    "slots_with_an_answer", "scores_unchanged_by_slots",
                    "answers_bit_identical_alone_vs_packed", "with_slots_peak_gib"])


def job_long(bench: Bench) -> None:
    lengths = bench.args.lengths or (TINY_LONG_LENGTHS if bench.tiny else LONG_LENGTHS)
    config = TINY if bench.tiny else GEMMA_12B
    # content up to the longest document (the hosted default stops at 4,096 tokens); the
    # context (max_position_embeddings) bounds content plus the longest question
    engine = bench.engine(config, max_content_tokens=max(lengths) + 1024,
                          max_pass_tokens=bench.args.max_pass_tokens)
    bench.row.update({"lengths": lengths, "max_pass_tokens": engine.settings.max_pass_tokens,
                      "context": config["max_position_embeddings"],
                      "questions_per_doc": len(bench.questions["queries"])})
    for length in lengths:
        bench.release()
        docs = bench.windows(length, max(1, bench.args.long_tokens // length))
        figures, _ = bench.measure(engine, build_requests(docs, bench.questions))
        figures["doc_tokens"] = length
        bench.record(f"len{length}", figures)
    base, long = bench.row.get("len512_tokens_per_s"), bench.row.get("len8192_tokens_per_s")
    if base and long:
        bench.row["tokens_per_s_8k_over_512"] = round(long / base, 3)
        bench.row["long_target_met"] = long >= 0.8 * base
    bench.save()
    summary(bench, [f"len{n}_{k}" for n in lengths
                    for k in ("questions_per_s", "tokens_per_s", "passes", "peak_gib")]
            + ["tokens_per_s_8k_over_512", "long_target_met"])


def job_27b(bench: Bench) -> None:
    docs = bench.articles(bench.args.docs)
    requests = build_requests(docs, bench.questions)
    shapes = ({"12b": TINY, "27b": TINY_27B} if bench.tiny
              else {"12b": GEMMA_12B, "27b": GEMMA_27B})
    for name, config in shapes.items():
        bench.release()
        engine = bench.engine(config)
        load_peak = bench.peak_gib()
        figures, _ = bench.measure(engine, requests)
        figures["load_peak_gib"] = load_peak
        figures["nvidia_smi_used_gib"] = None if bench.tiny else nvidia_smi_used_gib()
        bench.record(name, figures)
        del engine
    bench.row["27b_over_12b_questions_per_s"] = round(
        bench.row["27b_questions_per_s"] / bench.row["12b_questions_per_s"], 3)
    bench.row["27b_target_met"] = bench.row["27b_over_12b_questions_per_s"] >= 0.45
    bench.save()
    summary(bench, ["12b_questions_per_s", "27b_questions_per_s", "27b_over_12b_questions_per_s",
                    "27b_target_met", "12b_peak_gib", "27b_peak_gib", "27b_load_peak_gib"])


def job_hybrid(bench: Bench) -> None:
    """The news job on the Qwen3.5-27B shape (Gated DeltaNet beside full attention), each
    scheme of ``--schemes``: questions/s and a document's bits alone vs packed."""
    docs = bench.articles(bench.args.docs)
    requests = build_requests(docs, bench.questions)
    schemes = ["fp32"] if bench.tiny else bench.args.schemes
    for scheme in schemes:
        bench.release()
        bench.scheme = scheme
        engine = bench.engine(TINY_QWEN3_5 if bench.tiny else QWEN3_5_27B)
        load_peak = bench.peak_gib()
        figures, responses = bench.measure(engine, requests)
        figures["load_peak_gib"] = load_peak
        figures["bit_identical_alone_vs_packed"] = invariance(engine, requests, responses,
                                                              len(requests) // 2)
        bench.record(f"qwen3_5_27b_{scheme}", figures)
        del engine
    bench.save()
    summary(bench, [f"qwen3_5_27b_{s}_{k}" for s in schemes
                    for k in ("questions_per_s", "tokens_per_s", "seconds", "passes",
                              "bit_identical_alone_vs_packed", "peak_gib", "load_peak_gib")])


def decision_codes(tokenizer, n: int) -> list[str]:
    """``n`` codes of one token each, in id order: lower-case ASCII words of the vocabulary
    that encode back to their own token alone."""
    codes = []
    for token_id in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([token_id])
        if (2 <= len(text) <= 6 and text.isascii() and text.isalpha() and text.islower()
                and tokenizer.encode(text, add_special_tokens=False).ids == [token_id]):
            codes.append(text)
            if len(codes) == n:
                return codes
    raise SystemExit(f"the tokenizer has fewer than {n} one-token codes")


def decider_checkpoint(config: dict, tokenizer, codes: list[str]) -> Checkpoint:
    """A random checkpoint of ``config``'s shape served as a decision model over ``codes``
    (the manifest a checkpoint's spinf-manifest.json would give)."""
    from spinf_worker.manifest import Decision
    from spinf_worker.manifest import load as load_manifest

    ckpt = random_checkpoint(config, tokenizer)
    ckpt.manifest = load_manifest(None, "decider", config).model_copy(update={
        "capabilities": ["score"],
        "decision": Decision(codes=codes, prompt=DECISION_PROMPT)})
    return ckpt


def decision_requests(docs: list[str], questions: dict, options: list[str]) -> list[dict]:
    """The news questions' texts (their templates' "Question: ...?"), each offering
    ``options``, about each document."""
    queries = [{"id": q["id"], "options": options,
                "template": q["template"].split("Question: ", 1)[-1].split("\n", 1)[0]
                + "{?}"} for q in questions["queries"]]
    return [{"text": d, "scoring": {"queries": queries, "case_insensitive": False}}
            for d in docs]


def job_decider(bench: Bench) -> None:
    """The news questions to a decision model of 255 codes on the Qwen3.5-27B shape."""
    codes = decision_codes(bench.tokenizer, DECISION_CODES)
    requests = decision_requests(bench.articles(bench.args.docs), bench.questions,
                                 codes[:DECISION_OPTIONS])
    bench.release()
    engine = bench.engine(decider_checkpoint(TINY_QWEN3_5 if bench.tiny else QWEN3_5_27B,
                                             bench.tokenizer, codes))
    load_peak = bench.peak_gib()
    figures, responses = bench.measure(engine, requests)
    figures["load_peak_gib"] = load_peak
    figures["codes"], figures["options_per_question"] = len(codes), DECISION_OPTIONS
    figures["bit_identical_alone_vs_packed"] = invariance(engine, requests, responses,
                                                          len(requests) // 2)
    bench.record("decider", figures)
    bench.save()
    summary(bench, [f"decider_{k}" for k in (
        "questions_per_s", "tokens_per_s", "seconds", "passes",
        "bit_identical_alone_vs_packed", "peak_gib", "load_peak_gib")])


def job_hybrid_long(bench: Bench) -> None:
    """Long documents on the Qwen3.5-27B shape, the DeltaNet roots by chunks and token by
    token (every root below the chunked path's threshold)."""
    lengths = bench.args.lengths or (TINY_LONG_LENGTHS if bench.tiny else HYBRID_LENGTHS)
    engine = bench.engine(TINY_QWEN3_5 if bench.tiny else QWEN3_5_27B,
                          max_content_tokens=max(lengths) + 1024,
                          max_pass_tokens=bench.args.max_pass_tokens)
    modes = ["chunked"]   # the CPU has one path (kernels/delta_tree.py's, by chunks)
    if not bench.tiny:
        from spinf_worker.kernels import delta_triton

        modes.append("recurrent")
        chunked = delta_triton.CHUNKED_ROOT
        bench.row["chunked_root_rows"] = CHUNKED_FROM
    for mode in modes:
        if not bench.tiny:           # recurrent: every root token by token
            delta_triton.CHUNKED_ROOT = CHUNKED_FROM if mode == "chunked" else 1 << 62
        for length in lengths:
            bench.release()
            docs = bench.windows(length, max(2, bench.args.long_tokens // length))
            requests = build_requests(docs, bench.questions)
            figures, responses = bench.measure(engine, requests)
            figures["doc_tokens"] = length
            figures["bit_identical_alone_vs_packed"] = invariance(engine, requests, responses, 1)
            bench.record(f"{mode}_len{length}", figures)
        base = bench.row.get(f"{mode}_len{lengths[0]}_tokens_per_s")
        top = bench.row.get(f"{mode}_len{lengths[-1]}_tokens_per_s")
        if base and top:
            bench.row[f"{mode}_tokens_per_s_longest_over_shortest"] = round(top / base, 3)
    if not bench.tiny:
        delta_triton.CHUNKED_ROOT = chunked
    bench.save()
    summary(bench, [f"{m}_len{n}_{k}" for m in modes for n in lengths
                    for k in ("questions_per_s", "tokens_per_s", "bit_identical_alone_vs_packed",
                              "peak_gib")]
            + [f"{m}_tokens_per_s_longest_over_shortest" for m in modes])


def question_set(questions: dict, n: int) -> list[dict]:
    """The first ``n`` news questions; past the 56, all of them again as "Question 2:", ...
    (other tokens after the shared "\\n\\nQuestion", so a repeat is read, not shared)."""
    base, out, round_ = questions["queries"], [], 1
    while len(out) < n:
        for q in base:
            if round_ == 1:
                out.append(q)
            else:
                out.append({**q, "id": f"{q['id']}_{round_}",
                            "template": q["template"].replace("Question:",
                                                              f"Question {round_}:", 1)})
        round_ += 1
    return out[:n]


def job_sweeps(bench: Bench) -> None:
    lengths = bench.args.lengths or (TINY_SWEEP_LENGTHS if bench.tiny else SWEEP_LENGTHS)
    engine = bench.engine(TINY if bench.tiny else GEMMA_12B,
                          max_content_tokens=max(lengths) + 1024)
    docs = bench.articles(bench.args.docs)
    counts = bench.args.question_counts or SWEEP_QUESTIONS
    bench.row.update({"docs": len(docs), "doc_tokens": bench.args.doc_tokens,
                      "question_counts": counts, "by_questions": []})
    for n in counts:
        figures, _ = bench.measure(engine, build_requests(
            docs, {"queries": question_set(bench.questions, n)}))
        bench.row["by_questions"].append({"questions_per_doc": n, **figures})
        bench.save()
        print(json.dumps({"questions_per_doc": n, **figures}), flush=True)
    bench.row.update({"lengths": lengths, "by_length": []})
    for length in lengths:
        count = sweep_doc_count(length, bench.args.sweep_tokens)
        figures, _ = bench.measure(engine, build_requests(bench.windows(length, count),
                                                          bench.questions))
        bench.row["by_length"].append({"doc_tokens": length, **figures})
        bench.save()
        print(json.dumps({"doc_tokens": length, **figures}), flush=True)
    try:
        from plot_sweeps import plot
    except ImportError:   # no matplotlib here: plot from the JSON elsewhere
        print(f"no matplotlib: python benchmarks/plot_sweeps.py {bench.path}")
    else:
        print(f"plot: {plot(bench.path)}")
    print("\n| questions/doc | questions/s | tokens/s |\n| --- | --- | --- |")
    for p in bench.row["by_questions"]:
        print(f"| {p['questions_per_doc']} | {p['questions_per_s']} | {p['tokens_per_s']} |")
    print("\n| doc tokens | questions/s | tokens/s | peak GiB |\n| --- | --- | --- | --- |")
    for p in bench.row["by_length"]:
        print(f"| {p['doc_tokens']} | {p['questions_per_s']} | {p['tokens_per_s']} | "
              f"{p['peak_gib']} |")


def summary(bench: Bench, keys: list[str]) -> None:
    print(f"\n{bench.path}\n| key | value |\n| --- | --- |")
    for k in keys:
        print(f"| {k} | {bench.row.get(k)} |")


JOBS = {"slots": job_slots, "long": job_long, "27b": job_27b, "sweeps": job_sweeps,
        "hybrid": job_hybrid, "hybrid-long": job_hybrid_long, "decider": job_decider}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("job", choices=sorted(JOBS))
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--questions", type=Path,
                        default=ROOT / "benchmarks" / "news_questions.json")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="dir with tokenizer.json (default: the default model's)")
    parser.add_argument("--scheme", default="fp8", choices=["bf16", "fp8"])
    parser.add_argument("--schemes", nargs="*", default=["bf16", "fp8"],
                        help="hybrid: the schemes measured, one after the other")
    parser.add_argument("--docs", type=int, default=24, help="news-job articles")
    parser.add_argument("--doc-tokens", type=int, default=470)
    parser.add_argument("--repeat", type=int, default=3, help="timed calls (median)")
    parser.add_argument("--lengths", type=int, nargs="*", default=None,
                        help="long / sweeps: document lengths in tokens")
    parser.add_argument("--long-tokens", type=int, default=None,
                        help="long: content tokens per length (default 65536; tiny 1024)")
    parser.add_argument("--max-pass-tokens", type=int, default=None,
                        help="long: rows of a pass (default: the engine's, 16384 on CUDA)")
    parser.add_argument("--sweep-tokens", type=int, default=None,
                        help="sweeps: content tokens per length, at least 4 documents "
                             "(default 11280, the news job's; tiny 512)")
    parser.add_argument("--question-counts", type=int, nargs="*", default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--commit", default=None, help="when the checkout has no .git")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU, a tiny random model, short lengths: the job runs end to end")
    args = parser.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --tiny to check the job on the CPU")
    if not (args.data / ARTICLES).is_file():
        parser.error(f"no {ARTICLES} in {args.data} (--data DIR)")
    if args.tiny:
        args.docs, args.repeat = min(args.docs, 2), 1
        args.question_counts = args.question_counts or TINY_SWEEP_QUESTIONS
    args.long_tokens = args.long_tokens or (1024 if args.tiny else 65536)
    # the longest document larger than a pass, as 32k is
    if args.tiny and args.job in ("long", "hybrid-long"):
        args.max_pass_tokens = args.max_pass_tokens or 1024
    args.sweep_tokens = args.sweep_tokens or (512 if args.tiny else 11280)
    JOBS[args.job](Bench(args))


if __name__ == "__main__":
    main()
