"""How far the fp8 scheme's per-token activation rounding moves the options of the tamed tiny
Gemma 4 (tests/gpu/test_gpu_media.py's checkpoint), for audio, image and text-only documents
(CPU; a few minutes). Per document, the largest |Δlogprob| of its five options:

- ``acts``: the CPU's fp8 path against transformers holding the same fp8 weights, unrounded
  inputs (media_oracle.served_weights): the activations' rounding alone (the CPU path equals
  the oracle rounding them too within 1e-5: tests/test_media_gemma4_fp8.py);
- ``acts-plmp``: the oracle rounding every fp8 layer's inputs but per_layer_model_projection's,
  against the unrounded one: the other layers' rounding without that one's;
- ``media``: the oracle rounding the inputs of the media's soft-token rows only (every fp8
  layer), against the unrounded one: what rounding the audio's or image's rows adds;
- ``bf16``: transformers in bf16 rounding the inputs (the GPU's activations, roughly) against
  the GPU test's fp8 oracle (bf16 weights, then fp8; unrounded inputs), and that gap over the
  test's fp8 bound (``/bound``, over 1 fails).

    python benchmarks/fp8_media_rounding.py
"""

from __future__ import annotations

import copy
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spinf_worker.engine import Engine  # noqa: E402
from spinf_worker.engine.engine import EngineSettings  # noqa: E402
from tests import media_oracle  # noqa: E402
from tests.conftest import (  # noqa: E402
    TINY_BOS,
    TINY_GEMMA4_AUDIO_TOKENS,
    TINY_GEMMA4_IMAGE_TOKENS,
    tamed,
    write_tiny_gemma4_vision,
    write_tiny_tokenizer,
)
from tests.test_media_gemma3 import QUERIES, media_request, option_logprobs  # noqa: E402
from tests.test_media_gemma4 import oracle_scores as image_oracle  # noqa: E402
from tests.test_media_gemma4_audio import audio_request, tone, wav_b64  # noqa: E402
from tests.test_media_gemma4_audio import oracle_scores as audio_oracle  # noqa: E402
from tests.test_media_requests import image_url  # noqa: E402

BOUND, SHARE = 0.4, 0.03      # tests/gpu/test_gpu_media.py's TOLERANCE["fp8"]
TEXTS = ["Voice message: Thanks.", "Product photo: A red kettle.",
         "The market closed higher today as banks rallied.",
         "Rain is expected over the weekend in the north.",
         "She scored twice in the final minutes of the match.",
         "Listing: a used bicycle, blue, in good condition, and the seller said it was hardly ridden."]


def round_inputs_but(model, skip: str = "", rows: set[int] | None = None):
    """Round the inputs of the fp8 layers (a served_weights copy's) but ``skip``'s; ``rows``:
    only the rows of these token ids."""
    model = copy.deepcopy(model)
    ids: list[torch.Tensor] = []     # the sequence of the forward under way

    def read_ids(module, args, kwargs):
        ids[:] = [kwargs["input_ids"][0]]

    model.register_forward_pre_hook(read_ids, with_kwargs=True)

    def per_token(module, args):
        x = args[0]
        rounded = media_oracle.rounded_per_token(x)
        if rows is not None:
            keep = torch.tensor([int(i) in rows for i in ids[0]])[None, :, None]
            rounded = torch.where(keep, rounded, x)
        return (rounded, *args[1:])

    for name, m in model.model.language_model.named_modules():
        if isinstance(m, torch.nn.Linear) and not (skip and skip in name):
            m.register_forward_pre_hook(per_token)
    return model


def documents(engine):
    tok = engine.checkpoint.tokenizer
    boa, boi = TINY_GEMMA4_AUDIO_TOKENS[0], TINY_GEMMA4_IMAGE_TOKENS[0]
    soft = tok.token_to_id(TINY_GEMMA4_IMAGE_TOKENS[2])
    for seed, seconds in [(3, 1.3), (4, 0.6), (5, 0.9), (6, 1.7), (7, 0.4), (8, 1.1)]:
        s = tone(seed, seconds)
        yield "audio", f"tone({seed}, {seconds})", audio_request(wav_b64(s)), (
            lambda o, s=s: audio_oracle(o, engine, [s], [], f"Voice message:{boa} Thanks.",
                                        QUERIES))
    for seed, size in [(7, (45, 30)), (7, (20, 64)), (3, (40, 40)), (5, (64, 16)),
                       (9, (50, 30)), (11, (30, 60))]:
        u = image_url(seed, size)
        yield "image", f"image_url({seed}, {size})", media_request(u), (
            lambda o, u=u: image_oracle(o, engine, [u], f"Product photo:{boi} A red kettle.",
                                        QUERIES))
    for t in TEXTS:
        request = {"messages": [{"role": "user", "content": [{"type": "text", "text": t}]}],
                   "scoring": {"queries": QUERIES, "case_insensitive": False}}
        root = [TINY_BOS, *tok.encode(t, add_special_tokens=False).ids]
        yield "text", repr(t[:24]), request, (
            lambda o, root=root: media_oracle.option_logprobs(
                o, tok, root, QUERIES, media_oracle.marked("mm_token_type_ids", soft)))


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    for name in ("tokenizer", "gemma4"):
        (tmp / name).mkdir()
    path = tamed(write_tiny_gemma4_vision(tmp / "gemma4",
                                          write_tiny_tokenizer(tmp / "tokenizer")))
    engine = Engine.load(str(path), device="cpu", settings=EngineSettings(scheme="fp8"))
    oracle = media_oracle.gemma4_oracle(path)
    weights = media_oracle.served_weights(oracle, "fp8", torch.float32)
    but_plmp = round_inputs_but(weights, "per_layer_model_projection")
    tok = engine.checkpoint.tokenizer
    media = round_inputs_but(weights, rows={tok.token_to_id(TINY_GEMMA4_AUDIO_TOKENS[2]),
                                            tok.token_to_id(TINY_GEMMA4_IMAGE_TOKENS[2])})
    gpu_test = media_oracle.served_weights(oracle, "fp8")
    bf16 = round_inputs_but(gpu_test).to(torch.bfloat16)
    worst: dict[str, list[float]] = {}
    print(f"{'':5} {'document':26} {'acts':>6} {'acts-plmp':>9} {'media':>6} {'bf16':>6} "
          f"{'/bound':>6}")
    for kind, label, request, read in documents(engine):
        ours = option_logprobs(engine.score(request))
        unrounded, test = read(weights), read(gpu_test)
        plmp, emulated, soft = read(but_plmp), read(bf16), read(media)
        row = [max(abs(ours[k] - unrounded[k]) for k in ours),
               max(abs(plmp[k] - unrounded[k]) for k in ours),
               max(abs(soft[k] - unrounded[k]) for k in ours),
               max(abs(emulated[k] - test[k]) for k in ours),
               max(abs(emulated[k] - test[k]) / (BOUND + SHARE * abs(test[k])) for k in ours)]
        worst[kind] = [max(a, b) for a, b in zip(worst.get(kind, row), row, strict=True)]
        print(f"{kind:5} {label:26} {row[0]:6.3f} {row[1]:9.3f} {row[2]:6.3f} {row[3]:6.3f} "
              f"{row[4]:6.2f}", flush=True)
    for kind, row in worst.items():
        print(f"{kind:5} {'largest':26} {row[0]:6.3f} {row[1]:9.3f} {row[2]:6.3f} {row[3]:6.3f} "
              f"{row[4]:6.2f}")


if __name__ == "__main__":
    main()
