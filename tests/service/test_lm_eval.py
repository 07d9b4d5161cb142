"""lm-evaluation-harness itself (`lm_eval --model local-completions`) runs tasks defined here
(a local JSONL and a task YAML, nothing from a hub) against a live server on the tiny model:
a multiple-choice task, whose accuracy equals the one computed from the engine's own scores,
and a `loglikelihood_rolling` task over texts longer than the model's context, which lm-eval
cuts into windows itself (one echoed prompt per window), whose log-likelihoods equal the
engine's own."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import httpx

from ..conftest import WAIT_S
from .live import InProcessWorker, LiveServer
from .test_api import assert_error

TEXT = ("the invoice was paid twice and the customer asked for a refund while the parcel "
        "never arrived at the address so support opened a ticket")
WORDS = TEXT.split(" ")
TASK = "spinf_local_mc"


def items(n: int = 20) -> list[dict]:
    rng = random.Random(11)
    return [{"context": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))),
             "choices": [rng.choice(WORDS) for _ in range(4)], "label": rng.randrange(4)}
            for _ in range(n)]


def engine_accuracy(engine, tokenizer, docs: list[dict]) -> float:
    """lm-eval's rule computed from the engine: each choice is `context + " " + choice`,
    split into context and continuation ids as lm-eval splits them (the whole text's ids
    past the context's), scored as the sum of the continuation's logprobs; the argmax is
    right when it is the label."""
    right = 0
    for doc in docs:
        context_ids = tokenizer(doc["context"], add_special_tokens=False)["input_ids"]
        scores = []
        for choice in doc["choices"]:
            whole = tokenizer(doc["context"] + " " + choice,
                              add_special_tokens=False)["input_ids"]
            out = engine.complete({"prompt": whole, "echo": True, "logprobs": 0,
                                   "max_tokens": 0})
            scores.append(sum(out.choices[0].logprobs.token_logprobs[len(context_ids):]))
        right += max(range(len(scores)), key=scores.__getitem__) == doc["label"]
    return right / len(docs)


def task_dir(tmp_path: Path, task: str, docs: list[dict], spec: str) -> Path:
    """A directory holding ``task``'s YAML over ``docs`` written as a local JSONL."""
    data = tmp_path / f"{task}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    tasks = tmp_path / "tasks"
    tasks.mkdir(exist_ok=True)
    (tasks / f"{task}.yaml").write_text(f"""task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
{spec}""")
    return tasks


def run_lm_eval(server, engine, tiny_dir, tasks: Path, task: str, out: Path,
                *model_args: str) -> dict:
    """``lm_eval --model local-completions`` on ``task`` against ``server``; its results."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "OPENAI_API_KEY": "unused"}
    run = subprocess.run(
        [str(Path(sys.executable).parent / "lm_eval"), "--model", "local-completions",
         "--model_args", ",".join([f"base_url={server.v1}/completions",
                                   f"model={engine.model_name}", f"tokenizer={tiny_dir}",
                                   "tokenizer_backend=huggingface", "num_concurrent=1",
                                   "max_retries=1", *model_args]),
         "--tasks", task, "--include_path", str(tasks), "--output_path", str(out),
         "--log_samples"],
        env=env, capture_output=True, text=True, timeout=10 * WAIT_S)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    results = [json.loads(p.read_text()) for p in out.rglob("results_*.json")]
    assert len(results) == 1, list(out.rglob("*"))
    return results[0]


def test_lm_eval_local_completions_accuracy_equals_the_engines(tiny_engine, tiny_dir,
                                                               settings, tmp_path):
    from transformers import AutoTokenizer

    docs = items()
    tasks = task_dir(tmp_path, TASK, docs, """output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: label
metric_list:
  - metric: acc
""")
    with LiveServer(settings) as server, InProcessWorker(tiny_engine, settings):
        results = run_lm_eval(server, tiny_engine, tiny_dir, tasks, TASK, tmp_path / "out")
    accuracy = results["results"][TASK]["acc,none"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert accuracy == engine_accuracy(tiny_engine, tokenizer, docs)


ROLLING = "spinf_local_rolling"


def rolling_loglikelihood(engine, tokenizer, text: str, max_length: int
                          ) -> tuple[float, int]:
    """lm-eval's loglikelihood_rolling computed from the engine: the text's ids cut into
    lm-eval's own disjoint windows (a prompt of at most ``max_length`` - 1 ids each, BOS
    before the first), each window's prompt echoed with one greedy token, the continuation's
    logprobs summed, in lm-eval's order; and how many windows it took."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
        token_list=ids, prefix_token=tokenizer.bos_token_id, max_seq_len=max_length - 2,
        context_len=1)]
    total = []
    for context, continuation in windows:
        prompt = context + continuation
        assert len(prompt) <= max_length - 1
        out = engine.complete({"prompt": prompt, "echo": True, "logprobs": 1,
                               "max_tokens": 1})
        total.append(sum(out.choices[0].logprobs.token_logprobs[len(context):-1]))
    return sum(total), len(windows)


def test_lm_eval_loglikelihood_rolling_over_the_context_equals_the_engines(
        tiny_engine, tiny_dir, settings, tmp_path):
    """Texts longer than the model's context (4,096 positions): lm-eval cuts them into
    windows that fit it (max_length = the context) and sends each as an echoed prompt; every
    text's log-likelihood equals the engine's own sum over the same windows, float for
    float. A window one token longer is a 400 naming the context."""
    from transformers import AutoTokenizer

    context = tiny_engine.config.max_position_embeddings
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    rng = random.Random(12)
    texts = [" ".join(rng.choice(WORDS) for _ in range(n)) for n in (5000, 40)]
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    assert lengths[0] > context > lengths[1]
    tasks = task_dir(tmp_path, ROLLING, [{"text": t} for t in texts], """\
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
""")
    with LiveServer(settings) as server, InProcessWorker(tiny_engine, settings):
        results = run_lm_eval(server, tiny_engine, tiny_dir, tasks, ROLLING, tmp_path / "out",
                              f"max_length={context}")
        too_long = httpx.post(f"{server.v1}/completions", timeout=WAIT_S, json={
            "prompt": [tokenizer.bos_token_id, *[10] * context], "echo": True,
            "logprobs": 1, "max_tokens": 0})
    error = assert_error(too_long, 400, "content_too_long", "prompt")
    assert f"context is {context} tokens" in error["message"]
    samples = [json.loads(line) for p in (tmp_path / "out").rglob(f"samples_{ROLLING}_*.jsonl")
               for line in p.read_text().splitlines()]
    # logged as the float's repr (which reads back exactly)
    by_text = {s["doc"]["text"]: float(s["filtered_resps"][0]) for s in samples}
    assert sorted(by_text) == sorted(texts)
    expected = {t: rolling_loglikelihood(tiny_engine, tokenizer, t, context) for t in texts}
    assert expected[texts[0]][1] >= 2 and expected[texts[1]][1] == 1
    for text in texts:
        assert by_text[text] == expected[text][0], len(text)
    words = sum(len(t.split()) for t in texts)
    perplexity = math.exp(-sum(v for v, _ in expected.values()) / words)
    assert math.isclose(results["results"][ROLLING]["word_perplexity,none"], perplexity,
                        rel_tol=1e-12)
