"""Qwen3.5 (dense hybrid: Gated DeltaNet + gated full attention) on a tiny random checkpoint
written by transformers' ``save_pretrained``: parity with ``Qwen3_5ForCausalLM`` (each full
sequence run alone), bits alone vs packed and whatever else is asked, the root's recurrence
run once per document, the ``qwen3_5`` wrapper, and what the stack refuses."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from spinf_worker.engine.layout import Branch, DocTree
from spinf_worker.errors import InvalidRequestError, UnsupportedModelError

from .conftest import write_tiny_model
from .test_batch_invariance import assert_invariant
from .test_engine_parity import NEWS, QUERIES, check_against_oracle, score
from .test_families import SMALL, _randomise
from .test_query_independence import TARGET, random_query, target_scores

# three DeltaNet layers to one full-attention layer, and a DeltaNet layer after it; two q/k
# heads serving four value heads; RoPE on a quarter of each head (4 of 16 dims)
LAYERS = ["linear_attention"] * 3 + ["full_attention", "linear_attention"]
# a question whose own path is longer than one chunk of the recurrence (64 rows)
LONG = {"id": "long", "template": "\n\n" + " ".join(NEWS.split()[:60]) + "\nTopic:{?}",
        "options": [" business", " the markets"]}


def tiny_qwen3_5(path: Path, tokenizer_dir: Path) -> Path:
    cfg = transformers.Qwen3_5TextConfig(
        **SMALL, num_hidden_layers=len(LAYERS), layer_types=LAYERS, head_dim=16,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_conv_kernel_dim=4, tie_word_embeddings=False)
    return write_tiny_model(path, tokenizer_dir, cfg, lambda model: _randomise(model, 6))


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return tiny_qwen3_5(tmp_path_factory.mktemp("tiny-qwen3_5"), tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def engine(qwen_dir):
    from spinf_worker.engine import Engine

    return Engine.load(str(qwen_dir), device="cpu")


@pytest.fixture(scope="module")
def oracle(qwen_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        qwen_dir, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(model) is transformers.Qwen3_5ForCausalLM
    return model


def test_config(engine):
    from spinf_worker.models.qwen3_5 import GatedDeltaNet, Qwen3_5Model

    cfg = engine.config
    assert type(engine.model) is Qwen3_5Model
    assert cfg.layer_types == tuple(LAYERS) and cfg.rotary_dim == 4
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (2, 4)
    assert isinstance(engine.model.layers[4].linear_attn, GatedDeltaNet)
    assert engine.model.lm_head is not None
    assert engine.manifest.capabilities == ["score"]


def test_parity(engine, oracle):
    """Several questions, multi-token options, a placeholder grid, a bare slot: |Δ| <= 1e-4."""
    check_against_oracle(engine, oracle, NEWS, QUERIES)


def test_parity_root_and_path_over_several_chunks(engine, oracle):
    """A root of several recurrence chunks, a question path longer than a chunk."""
    assert len(engine.presenter.encode(NEWS * 3)) > 2 * 64
    assert len(engine.presenter.encode(LONG["template"])) > 64
    check_against_oracle(engine, oracle, NEWS * 3, [LONG, *QUERIES[1:3]])


@pytest.mark.parametrize("words", [1, 20, 47])
def test_parity_short_roots(engine, oracle, words):
    """Roots shorter than the convolution's window and than a chunk."""
    check_against_oracle(engine, oracle, " ".join(NEWS.split()[:words]), QUERIES[1:3])


def test_alone_vs_packed(engine):
    assert_invariant(engine, {"text": NEWS * 2, "scoring": {"queries": [*QUERIES, LONG]}},
                     seed=4)


def test_runner_raw_tensors_equal(engine):
    """The runner's fp32 logprobs, torch.equal, for a target among 20 random documents at
    several offsets (roots of 1 to 300 tokens: below, on and across chunk boundaries)."""
    rng = random.Random(5)
    vocab = list(engine.presenter.encode(NEWS))

    def doc(n: int) -> DocTree:
        return DocTree([2] + [rng.choice(vocab) for _ in range(n)],
                       [Branch([rng.choice(vocab) for _ in range(rng.randint(0, 9))],
                               [[rng.choice(vocab) for _ in range(rng.randint(1, 4))]
                                for _ in range(rng.randint(1, 4))]) for _ in range(6)])

    for size, places in ((0, (5,)), (63, (1, 20)), (150, (0, 12))):
        target = doc(size).flatten(0)
        alone = engine.runner.run([target])[0]
        for before in places:
            others = [doc(rng.randint(0, 300)).flatten(0) for _ in range(20)]
            packed = engine.runner.run(others[:before] + [target] + others[before:])[before]
            assert all(torch.equal(a, b)
                       for a, b in zip(alone.logprobs, packed.logprobs, strict=True))


@pytest.mark.parametrize("seed", range(3))
def test_a_query_is_scored_alike_whatever_else_is_asked(engine, seed):
    rng = random.Random(seed)
    alone = target_scores(engine, [dict(TARGET)])
    others = [random_query(rng, i) for i in range(rng.randint(1, 12))]
    at = rng.randint(0, len(others))
    assert target_scores(engine, others[:at] + [dict(TARGET)] + others[at:]) == alone


def test_root_state_computed_once_per_document(engine, monkeypatch):
    """Per DeltaNet layer, each document's root goes through the recurrence once, over its
    root rows only, and every branch tile continues from that very state."""
    from spinf_worker.kernels import delta_tree

    roots, last, branch_rows = [], [], []
    real_root, real_branch = delta_tree.root_scan, delta_tree.branch_scan

    def root_scan(q, *args):
        out, state = real_root(q, *args)
        roots.append(q.shape[0])
        last[:] = [state]
        return out, state

    def branch_scan(q, k, v, g, beta, ok, state):
        assert state is last[0]
        branch_rows.append(q.shape[0])
        return real_branch(q, k, v, g, beta, ok, state)

    monkeypatch.setattr(delta_tree, "root_scan", root_scan)
    monkeypatch.setattr(delta_tree, "branch_scan", branch_scan)
    enc = engine.presenter.encode
    branches = [Branch(list(enc(q["template"].split("{?}")[0])), [list(enc(o)) for o in
                                                                  q["options"]])
                for q in QUERIES[:3]]
    docs = [DocTree([2, *enc(text)], branches).flatten(0) for text in (NEWS, NEWS * 2, "Rates")]
    engine.runner.run(docs)
    linear = sum(t == "linear_attention" for t in LAYERS)
    assert roots == [d.root for d in docs] * linear
    # each branch row once (tiles of BRANCH_TILE rows), never a root row
    tiles = sum(len(b.rows) for b in docs[0].block.path_buckets)
    assert sum(branch_rows) == linear * 3 * tiles


def test_qwen3_5_wrapper_config(engine, qwen_dir, tmp_path):
    """A ``qwen3_5`` directory (Qwen3_5ForConditionalGeneration's config and weight names, a
    vision tower beside) serves its text model with the same bits."""
    from spinf_worker.engine import Engine
    from spinf_worker.models.loader import load_checkpoint

    path = tmp_path / "wrapper"
    shutil.copytree(qwen_dir, path)
    text = json.loads((qwen_dir / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": {**text, "model_type": "qwen3_5_text"},
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 1},
        "tie_word_embeddings": False}))
    weights = load_file(qwen_dir / "model.safetensors")
    renamed = {name.replace("model.", "model.language_model.", 1): t
               for name, t in weights.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    renamed["mtp.fc.weight"] = torch.zeros(4, 4)
    (path / "model.safetensors").unlink()
    save_file(renamed, path / "model.safetensors")
    loaded = load_checkpoint(str(path))
    assert loaded.config["model_type"] == "qwen3_5_text" and "vision_config" not in loaded.config
    assert "model.layers.0.linear_attn.A_log" in loaded.weights
    assert not any("visual" in name or "mtp" in name for name in loaded.weights)
    wrapped = Engine.load(str(path), device="cpu")
    assert type(wrapped.model) is type(engine.model)
    assert score(wrapped, NEWS, QUERIES) == score(engine, NEWS, QUERIES)


def test_extraction_slots_refused(engine):
    with pytest.raises(InvalidRequestError) as err:
        engine.score({"text": NEWS, "scoring": {"queries": [
            QUERIES[0], {"id": "who", "template": "\n\nWho acted? {*}"}]}})
    assert err.value.status == 400 and err.value.code == "extraction_disabled"
    assert err.value.param == "scoring.queries.1.template"


def test_unsupported_variants(qwen_dir):
    from spinf_worker.models.registry import family_for

    cfg = json.loads((qwen_dir / "config.json").read_text())
    for model_type in ("qwen3_5_moe", "qwen3_next"):
        with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
            family_for({**cfg, "model_type": model_type})
    family = family_for(cfg)
    with pytest.raises(UnsupportedModelError, match="layer type 'sliding_attention'"):
        family.config({**cfg, "layer_types": ["sliding_attention"] * len(LAYERS)})
    with pytest.raises(UnsupportedModelError, match="RoPE type 'yarn'"):
        family.config({**cfg, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4,
                                                  "factor": 4.0}})
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
        family.config({**cfg, "num_experts": 8})


def test_manifest_and_api_check_without_slots(qwen_dir):
    """`spinf-serve models DIR` lists it as loadable without extract / generate, and the
    API's check (before queueing) refuses a generated slot with the worker's error."""
    from spinf_worker.decision_rules import check_request_slots
    from spinf_worker.protocol import ScoreRequest
    from spinf_worker.tools.model_cache import check_dir, manifest_of

    assert check_dir(qwen_dir) == ("Qwen3.5", None)
    assert manifest_of(qwen_dir)["capabilities"] == ["score"]
    request = ScoreRequest.parse({"text": NEWS, "scoring": {"queries": [
        QUERIES[1], {"id": "say", "template": "\n\nSay:{*}", "generate": True}]}})
    with pytest.raises(InvalidRequestError) as err:
        check_request_slots(["score"], "tiny", request)
    assert (err.value.code, err.value.param) == ("generation_disabled",
                                                 "scoring.queries.1.generate")
    check_request_slots(["score", "extract", "generate"], "tiny", request)


def test_larger_branch_tiles(engine, oracle, monkeypatch):
    """Branch rows in tiles of another fixed size (CUDA takes 256 at a time; here 96, so a
    bucket's last tile is padded): the same parity and bits alone vs packed and whatever else
    is asked."""
    from spinf_worker.kernels import delta_tree

    monkeypatch.setitem(delta_tree.TILE_ROWS, "cpu", 96)
    check_against_oracle(engine, oracle, NEWS, QUERIES)
    rng = random.Random(7)
    alone = target_scores(engine, [dict(TARGET)])
    others = [random_query(rng, i) for i in range(12)]
    assert target_scores(engine, others[:5] + [dict(TARGET)] + others[5:]) == alone
    request = {"text": NEWS, "scoring": {"queries": QUERIES[:3]}}
    alone = engine.score(request)
    for at in (0, 3):
        batch = [{"text": " ".join(NEWS.split()[:n]), "scoring": {"queries": QUERIES[k:]}}
                 for k, n in ((1, 5), (3, 40), (0, 70))]
        packed = engine.score_batch(batch[:at] + [request] + batch[at:])[at]
        assert packed.results[0].queries == alone.results[0].queries


def test_completions_refused(engine):
    """Completion prompts are laid out as shared blocks the recurrence does not walk: refused
    in one error, before anything is laid out."""
    from spinf_worker.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as err:
        engine.complete({"prompt": NEWS, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert (err.value.status, err.value.code) == (400, "completions_not_supported")
    assert "scores options only" in str(err.value)
