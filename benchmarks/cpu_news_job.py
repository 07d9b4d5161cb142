"""CPU throughput job: news articles x 56 two-option questions, engine vs. transformers.

Engine: every document with all its questions in one ``score_batch`` call (read once, packed
into passes). Baseline: transformers' Gemma3ForCausalLM, one sequence per question,
``[BOS] + article + question prefix``, one forward with ``logits_to_keep=1``; the 56 questions of
a document run as one left-padded batch (attention mask + explicit position ids), so that
transformers gets large matmuls too (the sequences differ in length by at most 6 tokens, so there
is little padding). The baseline runs on the first ``--baseline-docs`` documents only; agreement
(max |Δ logprob|, top-1) is measured on that subset.

The code measured is ``spinf_worker/`` as committed at HEAD (a ``git archive`` snapshot, so that
edits in the checkout cannot slip into a run); ``--worktree`` measures the working tree instead.

    python benchmarks/cpu_news_job.py --docs 24 --baseline-docs 3 --max-pass-tokens 8192 \
        --out benchmarks/results

Options are scored exactly as given (``"case_insensitive": false``: the work the figures in
RESULTS.md measure); ``--case-insensitive`` sends the hosted default instead (each option
also scored as its single-token case and leading-space spellings). The JSON says which ran.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from spinf_worker.engine import Engine

ROOT = Path(__file__).resolve().parents[1]
ARTICLES = ROOT.parent / "shared" / "data" / "news_articles.jsonl"
QUESTIONS = ROOT / "benchmarks" / "news_questions.json"
DOC_TOKENS = 470


def sh(cmd: str) -> str:
    return subprocess.run(cmd, shell=True, capture_output=True, text=True, cwd=ROOT).stdout.strip()


def use_code(worktree: bool) -> str:
    """Put the code to measure first on sys.path (HEAD's spinf_worker/, or the working tree);
    returns the short commit."""
    commit, code = sh("git rev-parse --short HEAD"), ROOT
    if not worktree:
        code = Path(tempfile.mkdtemp(prefix="cpu_news_job-"))
        subprocess.run(f"git archive {commit} spinf_worker | tar -x -C {code}", shell=True,
                       check=True, cwd=ROOT)
    sys.path.insert(0, str(code))
    return commit


def cpu_model() -> str:
    line = next(x for x in sh("lscpu").splitlines() if x.startswith("Model name:"))
    return line.split(":", 1)[1].strip()


def load_articles(engine: Engine, n: int) -> list[str]:
    """The first n articles, each cut to its first DOC_TOKENS tokens (the job `spinf-serve
    bench` runs)."""
    from spinf_worker.tools.news_job import load_docs

    return load_docs(ARTICLES.parent, engine.checkpoint.tokenizer, n, DOC_TOKENS)


def scoring_block(case_insensitive: bool = False) -> dict:
    """The 56 questions as a request's ``scoring`` block."""
    return {**json.loads(QUESTIONS.read_text()), "case_insensitive": case_insensitive}


def option_logprobs(response) -> list[list[float]]:
    """Per scored query of the response's one input, the options' logprobs (its first
    combination); extraction queries are left out."""
    return [[o.logprob for o in q.combinations[0].options] for q in response.results[0].queries
            if getattr(q, "kind", None) is None]


def run_engine(engine: Engine, docs: list[str], block: dict) -> dict:
    from spinf_worker.engine.packer import pack
    from spinf_worker.protocol import ScoreResponse
    from spinf_worker.tools.news_job import doc_layouts

    requests = [{"text": d, "scoring": block} for d in docs]
    t0 = time.perf_counter()
    engine.score_batch([{"text": docs[0][:200], "scoring": block}])   # computes the floors
    warmup_s = time.perf_counter() - t0

    t0, c0 = time.perf_counter(), time.process_time()
    responses = engine.score_batch(requests)
    seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    for r in responses:
        if not isinstance(r, ScoreResponse):
            raise RuntimeError(f"engine returned an error: {r!r}")

    # passes, and fill = real tokens / rows run (each document is padded to a 128-row tile)
    flats = doc_layouts(engine, requests)   # the same layout score_batch packed
    passes = pack(flats, engine.settings.max_pass_tokens)
    logprobs = [option_logprobs(r) for r in responses]
    # processed_tokens: the rows laid out (content once plus the query tree, no floors)
    return dict(seconds=seconds, cpu_s=cpu_s, warmup_s=warmup_s, logprobs=logprobs,
                tokens=sum(r.usage.processed_tokens for r in responses), passes=len(passes),
                fill=sum(f.tokens for f in flats) / sum(p.rows for p in passes))


@torch.inference_mode()
def run_baseline(engine: Engine, docs: list[str], block: dict) -> dict:
    from transformers import Gemma3ForCausalLM

    from spinf_worker.templates import expand, parse_template

    model = Gemma3ForCausalLM.from_pretrained(engine.checkpoint.path, dtype=torch.float32).eval()
    enc, bos, pad = engine.presenter.encode, engine.checkpoint.bos_token_id, engine.pad_id
    queries = block["queries"]
    prefixes = [expand(parse_template(q["template"]), None, None)[0].prefix for q in queries]
    option_ids = []
    for q in queries:
        ids = [enc(o) for o in q["options"]]
        assert all(len(i) == 1 for i in ids), f"{q['id']}: options must be single tokens"
        option_ids.append([i[0] for i in ids])

    logprobs, seq_tokens, seconds, cpu_s = [], 0, 0.0, 0.0
    for doc in docs:
        seqs = [[bos, *enc(doc), *enc(p)] for p in prefixes]
        width = max(map(len, seqs))
        ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
        t0, c0 = time.perf_counter(), time.process_time()
        logits = model(input_ids=ids, attention_mask=mask,
                       position_ids=(mask.cumsum(-1) - 1).clamp(min=0), logits_to_keep=1).logits
        lp = torch.log_softmax(logits[:, -1].float(), dim=-1)
        seconds, cpu_s = seconds + time.perf_counter() - t0, cpu_s + time.process_time() - c0
        logprobs.append([[lp[i, t].item() for t in opts] for i, opts in enumerate(option_ids)])
        seq_tokens += sum(map(len, seqs))
    return dict(seconds=seconds, cpu_s=cpu_s, logprobs=logprobs,
                tokens_per_question=seq_tokens / (len(docs) * len(queries)))


def markdown(r: dict, command: str) -> str:
    rows = [
        ("engine", r["questions_per_s"], r["tokens_read"], r["tokens_per_s"], r["engine_s"],
         f"{r['docs']} docs x {r['questions_per_doc']} q, {r['passes']} passes, "
         f"fill {r['pass_fill_ratio']:.3f}"),
        ("transformers", r["baseline_questions_per_s"],
         round(r["baseline_tokens_read_per_question"] * r["baseline_subset_docs"]
               * r["questions_per_doc"]), r["baseline_tokens_per_s"], r["baseline_s"],
         f"{r['baseline_subset_docs']} docs x {r['questions_per_doc']} q, batch = one doc"),
    ]
    table = ["| | questions/s | tokens read | tokens/s | seconds | run |", "|---|---|---|---|---|---|"]
    table += [f"| {n} | {q:.2f} | {t} | {ts:.0f} | {s:.2f} | {note} |" for n, q, t, ts, s, note in rows]
    verdict = "met" if r["speedup"] >= 10 else "NOT met"
    return "\n".join([
        f"## {r['date']} — CPU news job, commit `{r['commit']}`"
        + (" (working tree had uncommitted changes)" if r["dirty"] else ""),
        "",
        f"- machine: {r['machine']}, torch {r['torch']}, {r['threads']} threads "
        f"(1-min load average at start: {r['load_avg_1m_at_start']:.2f})",
        f"- command: `{command}`",
        "- options scored " + ("case-insensitively (the hosted default: the engine's logprob "
                               "sums the spellings, the baseline's does not)"
                               if r["case_insensitive"] else
                               "exactly as given (case_insensitive false)"),
        "",
        *table,
        "",
        f"- speedup: **{r['speedup']:.1f}x** (target >= 10x: {verdict})",
        f"- agreement on the baseline subset: max |Δ logprob| = {r['max_abs_dlogprob']:.2e}, "
        f"top-1 agreement {r['top1_agreement']:.4f}",
        f"- CPU share (CPU s / (wall s x threads); ~1 on an idle machine): engine "
        f"{r['engine_cpu_share']:.2f}, transformers {r['baseline_cpu_share']:.2f}",
        f"- engine warm-up (floors for {r['questions_per_doc']} questions + one short doc): "
        f"{r['warmup_s']:.2f} s, not in the timed figure",
        "", ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=24)
    ap.add_argument("--baseline-docs", type=int, default=3)
    ap.add_argument("--max-pass-tokens", type=int, default=8192)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--worktree", action="store_true", help="measure uncommitted code too")
    ap.add_argument("--no-results-md", action="store_true",
                    help="write the JSON only, not a section of RESULTS.md (trial runs)")
    ap.add_argument("--case-insensitive", action="store_true",
                    help="send the hosted default (options scored over their case and "
                         "leading-space spellings); default: the options exactly as given")
    args = ap.parse_args()
    load_at_start = os.getloadavg()[0]   # other work on the machine skews every figure
    commit = use_code(args.worktree)
    from spinf_worker.engine import Engine, EngineSettings

    block = scoring_block(args.case_insensitive)
    engine = Engine.load(None, device="cpu",
                         settings=EngineSettings(max_pass_tokens=args.max_pass_tokens))
    docs = load_articles(engine, args.docs)
    n_q = len(block["queries"])

    e = run_engine(engine, docs, block)
    b = run_baseline(engine, docs[: args.baseline_docs], block)

    diffs, same = [], []
    for e_doc, b_doc in zip(e["logprobs"][: len(b["logprobs"])], b["logprobs"], strict=True):
        for e_q, b_q in zip(e_doc, b_doc, strict=True):
            diffs += [abs(x - y) for x, y in zip(e_q, b_q, strict=True)]
            same.append(max(range(len(e_q)), key=e_q.__getitem__)
                        == max(range(len(b_q)), key=b_q.__getitem__))

    n_base = min(args.baseline_docs, len(docs)) * n_q
    r = dict(
        questions_per_s=len(docs) * n_q / e["seconds"],
        baseline_questions_per_s=n_base / b["seconds"],
        tokens_read=e["tokens"],
        tokens_per_s=e["tokens"] / e["seconds"],
        baseline_tokens_read_per_question=b["tokens_per_question"],
        baseline_tokens_per_s=b["tokens_per_question"] * n_base / b["seconds"],
        max_abs_dlogprob=max(diffs),
        top1_agreement=sum(same) / len(same),
        passes=e["passes"],
        pass_fill_ratio=e["fill"],
        engine_s=e["seconds"],
        baseline_s=b["seconds"],
        warmup_s=e["warmup_s"],
        # CPU seconds / (wall seconds x threads): well below 1 means something else was running
        engine_cpu_share=e["cpu_s"] / (e["seconds"] * torch.get_num_threads()),
        baseline_cpu_share=b["cpu_s"] / (b["seconds"] * torch.get_num_threads()),
        docs=len(docs),
        questions_per_doc=n_q,
        baseline_subset_docs=min(args.baseline_docs, len(docs)),
        max_pass_tokens=args.max_pass_tokens,
        case_insensitive=args.case_insensitive,
        commit=commit,
        dirty=args.worktree and bool(sh("git status --porcelain -- spinf_worker")),
        date=datetime.date.today().isoformat(),
        machine=f"{cpu_model()}, {sh('nproc')} cores",
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        load_avg_1m_at_start=load_at_start,
    )
    r["speedup"] = r["questions_per_s"] / r["baseline_questions_per_s"]

    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{r['date']}-cpu-{r['commit']}.json"
    path.write_text(json.dumps(r, indent=1) + "\n")
    command = (f"python benchmarks/cpu_news_job.py --docs {args.docs} --baseline-docs "
               f"{args.baseline_docs} --max-pass-tokens {args.max_pass_tokens} --out {args.out}"
               + (" --worktree" if args.worktree else "")
               + (" --case-insensitive" if args.case_insensitive else ""))
    section = markdown(r, command)
    if args.no_results_md:
        print(section)
        print(f"wrote {path}")
        return
    results_md = ROOT / "benchmarks" / "RESULTS.md"
    if not results_md.exists():
        results_md.write_text("# Benchmark results\n\nOne dated section per run, oldest first.\n\n")
    with results_md.open("a", encoding="utf-8") as f:
        f.write(section)
    print(section)
    print(f"wrote {path} and a section of benchmarks/RESULTS.md")


if __name__ == "__main__":
    main()
