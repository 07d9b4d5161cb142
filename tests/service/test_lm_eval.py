"""lm-evaluation-harness itself (`lm_eval --model local-completions`) runs a multiple-choice
task defined here (a local JSONL and a task YAML, nothing from a hub) against a live server
on the tiny model; its accuracy equals the one computed from the engine's own scores."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from ..conftest import WAIT_S
from .live import InProcessWorker, LiveServer

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


def test_lm_eval_local_completions_accuracy_equals_the_engines(tiny_engine, tiny_dir,
                                                               settings, tmp_path):
    from transformers import AutoTokenizer

    docs = items()
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
""")
    out = tmp_path / "out"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "OPENAI_API_KEY": "unused"}
    with LiveServer(settings) as server, InProcessWorker(tiny_engine, settings):
        run = subprocess.run(
            [str(Path(sys.executable).parent / "lm_eval"), "--model", "local-completions",
             "--model_args", f"base_url={server.v1}/completions,model={tiny_engine.model_name},"
             f"tokenizer={tiny_dir},tokenizer_backend=huggingface,num_concurrent=1,"
             "max_retries=1",
             "--tasks", TASK, "--include_path", str(tasks), "--output_path", str(out)],
            env=env, capture_output=True, text=True, timeout=10 * WAIT_S)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    results = [json.loads(p.read_text()) for p in out.rglob("results_*.json")]
    assert len(results) == 1, list(out.rglob("*"))
    accuracy = results[0]["results"][TASK]["acc,none"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert accuracy == engine_accuracy(tiny_engine, tokenizer, docs)
