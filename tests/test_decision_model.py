"""A checkpoint's manifest (spinf-manifest.json) and a decision model served as it is: read at
load (a bad file is one line), listed by `spinf-serve models`, and a decision model's options
read out over its codes only, equal to transformers' logits over those codes at the same
prompt (transformers as the oracle only)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from spinf_worker import cli
from spinf_worker.errors import InvalidRequestError
from spinf_worker.manifest import MANIFEST_FILE, ManifestError

CODES = ["A", "B", "C", "D", "E"]
DECIDER = {"id": "test/tiny-decider", "name": "tiny decider", "aliases": ["decider"],
           "base_model": "test/tiny-gemma3", "revision": "5" * 40, "family": "gemma3_text",
           "capabilities": ["score"], "media": [], "limits": {"max_content_tokens": 512},
           "decision": {"codes": CODES, "temperature": 0.7,
                        "prompt": {"content": "Item:\n{content}\n",
                                   "question": "Q: {question}\nCode:"}}}


def with_manifest(src: Path, dst: Path, manifest: dict | str) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    text = manifest if isinstance(manifest, str) else json.dumps(manifest)
    (dst / MANIFEST_FILE).write_text(text)
    return dst


@pytest.fixture(scope="module")
def decider_dir(tiny_dir, tmp_path_factory) -> Path:
    return with_manifest(tiny_dir, tmp_path_factory.mktemp("decider"), DECIDER)


@pytest.fixture(scope="module")
def decider(decider_dir):
    from spinf_worker.engine import Engine

    return Engine.load(str(decider_dir), device="cpu")


def test_manifest_is_read_and_decides_the_served_name(decider):
    m = decider.manifest
    assert decider.model_name == "test/tiny-decider"
    assert m.names >= {"test/tiny-decider", "tiny-decider", "decider", "spinf-12b"}
    entry = m.catalog_entry()
    assert entry["capabilities"] == ["score"] and entry["media"] == []
    assert entry["limits"]["max_content_tokens"] == 512
    assert decider.settings.max_content_tokens == 512


def test_without_a_manifest_it_is_inferred_as_before(tiny_engine):
    m = tiny_engine.manifest
    assert m.id == tiny_engine.checkpoint.name and m.decision is None
    assert m.family == tiny_engine.checkpoint.config["model_type"]
    assert "extract" in m.capabilities and "complete" in m.capabilities


@pytest.mark.parametrize("bad, field", [
    ("{not json", "not JSON"),
    ({"capabilities": ["score", "extract"], "decision": {"codes": ["A", "B"]}}, "capabilities"),
    ({"revision": "main"}, "revision"),
    ({"decision": {"codes": ["A"]}}, "decision.codes"),
    ({"decision": {"codes": ["A", "B"], "prompt": {"question": "no slot"}},
      "capabilities": ["score"]}, "decision.prompt"),
    ({"limits": {"context": 0}}, "limits.context"),
    ({"colour": "red"}, "colour"),
])
def test_a_bad_manifest_is_one_line(tiny_dir, tmp_path, capsys, bad, field):
    from spinf_worker.models.loader import load_checkpoint

    path = with_manifest(tiny_dir, tmp_path / "bad", bad)
    with pytest.raises(ManifestError) as err:
        load_checkpoint(str(path))
    assert "\n" not in err.value.message and field in err.value.message
    assert MANIFEST_FILE in err.value.message
    assert cli.main(["models", str(path)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.strip().splitlines()) == 1 and field in out.err


def test_a_code_of_several_tokens_is_refused_at_load(tiny_dir, tmp_path):
    from spinf_worker.engine import Engine

    path = with_manifest(tiny_dir, tmp_path / "long", {
        **DECIDER, "decision": {"codes": ["A", "central bank"]}})
    with pytest.raises(ManifestError, match="central bank"):
        Engine.load(str(path), device="cpu")


def test_models_command_lists_the_manifest(decider_dir, tiny_dir, capsys):
    assert cli.main(["models", "--json", str(decider_dir), str(tiny_dir)]) == 0
    listed = json.loads(capsys.readouterr().out)["models"]
    assert [m["id"] for m in listed] == ["test/tiny-decider", str(tiny_dir)]
    assert listed[0]["aliases"][:1] == ["decider"] and listed[0]["capabilities"] == ["score"]
    assert listed[0]["base_model"] == "test/tiny-gemma3"
    assert listed[1]["family"] == "gemma3_text" and "extract" in listed[1]["capabilities"]
    assert cli.main(["models", str(decider_dir)]) == 0
    assert "capabilities  score" in capsys.readouterr().out


# ---- a decision model's readout against transformers ------------------------------------------


QUESTIONS = [("risk", "Which risk class is this"), ("sector", "Sector code for the item")]
CONTENT = "The central bank raised its benchmark rate on Tuesday."


def oracle_codes(oracle, tokenizer, bos: int, content: str, question: str) -> torch.Tensor:
    """log-softmax over the codes' logits / T at the prompt the decider's format writes."""
    prompt = DECIDER["decision"]["prompt"]
    enc = lambda t: tokenizer.encode(t, add_special_tokens=False).ids  # noqa: E731
    ids = ([bos, *enc(prompt["content"].replace("{content}", content))]
           + enc(prompt["question"].replace("{question}", question)))
    with torch.no_grad():
        logits = oracle(torch.tensor([ids])).logits[0, -1].double()
    codes = [enc(c)[0] for c in CODES]
    return torch.log_softmax(logits[codes] / DECIDER["decision"]["temperature"], dim=-1)


@pytest.mark.parametrize("case_insensitive", [False, True])
def test_decision_scores_equal_transformers_over_the_codes(decider, tiny_oracle, decider_dir,
                                                           case_insensitive):
    ckpt = decider.checkpoint
    response = decider.score({
        "model": "decider", "messages": [{"role": "user", "content": CONTENT}],
        "scoring": {"case_insensitive": case_insensitive,
                    "queries": [{"id": qid, "template": text + "{?}", "options": CODES}
                                for qid, text in QUESTIONS]}})
    (result,) = response.results
    worst = 0.0
    for (qid, text), q in zip(QUESTIONS, result.queries, strict=True):
        assert q.id == qid
        want = oracle_codes(tiny_oracle, ckpt.tokenizer, ckpt.bos_token_id, CONTENT, text)
        (combo,) = q.combinations
        got = torch.tensor([o.logprob for o in combo.options], dtype=torch.float64)
        worst = max(worst, (got - want).abs().max().item())
        assert abs(combo.residual) < 1e-4          # the codes hold all the mass
        assert all(o.floor_p is not None for o in combo.options)
    assert worst <= 1e-4


def test_a_decision_model_refuses_what_it_does_not_do(decider):
    base = {"messages": [{"role": "user", "content": CONTENT}]}
    cases = [
        ({"id": "x", "template": "Name:{*}"}, "extraction_disabled", "template"),
        ({"id": "x", "template": "Amount:{$}"}, "extraction_disabled", "template"),
        ({"id": "x", "template": "Say:{*}", "generate": True}, "generation_disabled",
         "generate"),
        ({"id": "x", "template": "Q{?}", "options": ["A", "Z"]}, "invalid_field",
         "options.1"),
    ]
    for query, code, param in cases:
        with pytest.raises(InvalidRequestError) as err:
            decider.score({**base, "scoring": {"queries": [query]}})
        assert err.value.code == code and err.value.status == 400
        assert err.value.param.endswith(param)
    with pytest.raises(InvalidRequestError) as err:
        decider.complete({"prompt": "The bank", "max_tokens": 1})
    assert err.value.code == "completions_not_supported"
