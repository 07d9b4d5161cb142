"""GPU benchmark of images on the CUDA engine: 24 product listings, each ~150 words and one
896 x 896 image (generated here with numpy and Pillow), each asked the 56 news questions
(benchmarks/news_questions.json) in one request, on a Gemma-3-12B-shaped multimodal stack
with random weights (the text stack of benchmarks/gpu_bench.py's 12B, the SigLIP tower of
Gemma 3 4B/12B/27B: 27 layers, hidden 1152, 896 px, patch 14, 256 soft tokens), bf16 and fp8
(the towers stay bf16).

    python benchmarks/media_gpu.py --tokenizer DIR_WITH_tokenizer.json [--out OUT_DIR]

Figures: questions/s and tokens/s of the whole call (the images decoded and preprocessed on
the host, the towers and the text stack on the device); the vision tower and projector alone
on the 24 images, and their share of a timed call (each tower run synchronised and timed
inside it); document 5 alone against packed among the others (and in reverse order), bit for
bit. One flat JSON per run in benchmarks/results/.

``--tiny``: a tiny config of the same layout (a 2-layer text stack and SigLIP tower, 112 px),
on the GPU if there is one, else the CPU in fp32, to check the script end to end:

    python benchmarks/media_gpu.py --tiny --docs 4
"""

from __future__ import annotations

import argparse
import base64
import gc
import io
import json
import random
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
from gpu_bench import random_checkpoint

from spinf_worker.engine import Engine, EngineSettings
from spinf_worker.models.loader import Checkpoint
from spinf_worker.tools.news_job import bits, checked, doc_layouts, questions_answered, tokens_read

ROOT = Path(__file__).resolve().parents[1]
IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
# Gemma 3 12B: the text stack (as gpu_bench.GEMMA_12B; the multimodal vocabulary holds the
# image soft token) and the SigLIP tower of the 4B / 12B / 27B checkpoints.
GEMMA3_12B_TEXT = dict(model_type="gemma3_text", vocab_size=262208, hidden_size=3840,
                       intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=256, sliding_window=1024,
                       query_pre_attn_scalar=256, rope_theta=1_000_000.0,
                       rope_local_base_freq=10_000.0, max_position_embeddings=131072,
                       rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=2,
                       eos_token_id=1, pad_token_id=0)
SIGLIP_896 = dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304,
                  num_hidden_layers=27, num_attention_heads=16, image_size=896, patch_size=14,
                  num_channels=3, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
                  vision_use_head=False)
TINY_TEXT = dict(GEMMA3_12B_TEXT, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=64,
                 query_pre_attn_scalar=32)
TINY_SIGLIP = dict(SIGLIP_896, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=2, image_size=112)
IMAGE_SIDE = 896

PRODUCTS = ["kettle", "desk lamp", "backpack", "coffee grinder", "office chair", "blender",
            "rain jacket", "bookshelf", "headphones", "water bottle", "toaster", "bike helmet"]
ADJECTIVES = ["compact", "sturdy", "lightweight", "stainless", "matte black", "hand-finished",
              "quiet", "adjustable", "foldable", "energy-saving", "water-resistant", "classic"]
FEATURES = ["a two-year warranty", "free returns within thirty days", "a detachable cord",
            "recycled packaging", "a soft-touch handle", "three speed settings",
            "a magnetic lid", "replaceable filters", "an auto shut-off switch",
            "a scratch-resistant finish", "a padded strap", "a spare set of screws"]


def listing_text(rng: random.Random, words: int = 150) -> tuple[str, str]:
    """A product listing's title and ~``words`` words of description."""
    product = rng.choice(PRODUCTS)
    title = f"{rng.choice(ADJECTIVES).capitalize()} {product}, model {rng.randint(100, 999)}"
    sentences = []
    while sum(len(s.split()) for s in sentences) < words:
        sentences.append(rng.choice([
            f"This {rng.choice(ADJECTIVES)} {product} comes with {rng.choice(FEATURES)}.",
            f"It weighs {rng.uniform(0.3, 9.0):.1f} kg and measures {rng.randint(10, 90)} by "
            f"{rng.randint(10, 90)} cm.",
            f"Customers mention {rng.choice(FEATURES)} and the {rng.choice(ADJECTIVES)} design.",
            f"Price: {rng.randint(9, 400)}.{rng.randint(0, 99):02d} dollars, shipping in "
            f"{rng.randint(1, 9)} business days.",
            f"The seller has {rng.randint(20, 5000)} reviews with an average of "
            f"{rng.uniform(3.0, 5.0):.1f} stars.",
        ]))
    return title, " ".join(sentences)


def listing_image(seed: int, side: int = IMAGE_SIDE) -> str:
    """A ``side`` x ``side`` JPEG data URL: a colour gradient, a few shapes, some noise."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    ramp = np.linspace(0.0, 1.0, side, dtype=np.float32)
    colours = rng.uniform(0, 255, size=(2, 3)).astype(np.float32)
    pixels = colours[0] + (colours[1] - colours[0]) * ramp[:, None, None]
    pixels = np.broadcast_to(pixels, (side, side, 3)) + rng.normal(0, 12, (side, side, 3))
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x0, y0 = (int(v) for v in rng.integers(0, side * 3 // 4, 2))
        x1, y1 = x0 + int(rng.integers(40, side // 3)), y0 + int(rng.integers(40, side // 3))
        fill = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=fill)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def build_requests(n_docs: int, questions: dict) -> list[dict]:
    rng = random.Random(0)
    scoring = {**questions, "case_insensitive": False}
    out = []
    for i in range(n_docs):
        title, text = listing_text(rng)
        out.append({"messages": [{"role": "user", "content": [
            {"type": "text", "text": f"Listing {i + 1}: {title}\n"},
            {"type": "image_url", "image_url": {"url": listing_image(i)}},
            {"type": "text", "text": "\n" + text}]}], "scoring": scoring})
    return out


def media_tokenizer(path: Path | None):
    """The given tokenizer (default: the default model's) with Gemma 3's image tokens as
    special tokens (kept where it has them; the 270M's lacks the soft token)."""
    from tokenizers import AddedToken, Tokenizer

    if path is None:
        from spinf_worker.models.loader import load_checkpoint

        tokenizer = load_checkpoint(None, load_format="dummy").tokenizer
    else:
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        tokenizer.post_processor = None
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in IMAGE_TOKENS])
    return tokenizer


def checkpoint(tokenizer, tiny: bool) -> Checkpoint:
    boi, eoi, image = (tokenizer.token_to_id(t) for t in IMAGE_TOKENS)
    config = dict(TINY_TEXT if tiny else GEMMA3_12B_TEXT,
                  vision_config=TINY_SIGLIP if tiny else SIGLIP_896,
                  mm_tokens_per_image=16 if tiny else 256, image_token_id=image,
                  boi_token_id=boi, eoi_token_id=eoi, preprocessor_config=None)
    config["vocab_size"] = max(config["vocab_size"], tokenizer.get_vocab_size())
    config["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                             for i in range(config["num_hidden_layers"])]
    return random_checkpoint(config, tokenizer)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeat: int = 3) -> float:
    """Median wall seconds of ``fn``, the device synchronised around it."""
    times = []
    for _ in range(repeat):
        synchronize()
        t = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def tower_share(engine: Engine, requests: list[dict]) -> tuple[float, float]:
    """One call with every tower run synchronised and timed: (tower seconds, call seconds)."""
    model = engine.model
    encode = model.encode_images
    spent = []

    def timed_encode(pixels):
        synchronize()
        t = time.perf_counter()
        out = encode(pixels)
        synchronize()
        spent.append(time.perf_counter() - t)
        return out

    model.encode_images = timed_encode
    try:
        synchronize()
        t = time.perf_counter()
        checked(engine.score_batch(requests))
        synchronize()
        total = time.perf_counter() - t
    finally:
        del model.encode_images
    return sum(spent), total


def run(name: str, ckpt: Checkpoint, scheme: str, device: str, requests: list[dict],
        repeat: int) -> dict:
    cuda = device == "cuda"
    if cuda:
        gc.collect()              # the previous scheme's engine
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    engine = Engine(ckpt, device=device, settings=EngineSettings(scheme=scheme))
    t0 = time.perf_counter()
    first = checked(engine.score_batch(requests))   # compiles kernels, fills the floor cache
    warm = time.perf_counter() - t0
    engine.score_batch(requests)                      # later calls' pass sizes compile here
    seconds = timed(lambda: engine.score_batch(requests), repeat)
    responses = checked(engine.score_batch(requests))
    flats = doc_layouts(engine, requests)
    # the towers alone on the call's images (as decoded and preprocessed for the engine)
    pixels = [image.pixels.to(engine.device) for f in flats for image in f.media]
    with torch.inference_mode():
        engine.model.encode_images(pixels)
        tower_alone = timed(lambda: engine.model.encode_images(pixels), repeat)
    with torch.inference_mode():
        tower_in_call, call = tower_share(engine, requests)
    k = min(5, len(requests) - 1)
    alone = engine.score_batch([requests[k]])[0]
    reverse = engine.score_batch(requests[::-1])[len(requests) - 1 - k]
    identical = bits(alone) == bits(responses[k]) == bits(reverse) == bits(first[k])
    questions, tokens = questions_answered(responses), tokens_read(responses)
    key = f"{name}_{scheme}"
    row = {
        f"{key}_questions_per_s": round(questions / seconds, 1),
        f"{key}_tokens_per_s": round(tokens / seconds),
        f"{key}_seconds": round(seconds, 4),
        f"{key}_first_call_seconds": round(warm, 2),
        f"{key}_tokens_read": tokens,
        f"{key}_image_tokens_per_doc": sum(i.end - i.start for f in flats for i in f.media)
        // len(flats),
        f"{key}_tower_alone_seconds": round(tower_alone, 4),
        f"{key}_tower_ms_per_image": round(tower_alone / len(pixels) * 1e3, 2),
        f"{key}_tower_share_of_call": round(tower_in_call / call, 3),
        f"{key}_timed_call_seconds": round(call, 4),
        f"{key}_bit_identical": identical,
        f"{key}_cuda_graphs": engine.runner.graphs is not None,
    }
    if cuda:
        row[f"{key}_peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="dir with tokenizer.json (default: the default model's)")
    parser.add_argument("--questions", type=Path,
                        default=ROOT / "benchmarks" / "news_questions.json")
    parser.add_argument("--docs", type=int, default=24)
    parser.add_argument("--schemes", default=None, help="default: bf16,fp8 (CPU: fp32)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny config of the same layout (CPU without a GPU)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--commit", default=None, help="when the checkout has no .git")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        parser.error("no GPU: run the tiny config (--tiny)")
    schemes = (args.schemes or ("bf16,fp8" if device == "cuda" else "fp32")).split(",")
    tokenizer = media_tokenizer(args.tokenizer)
    questions = json.loads(args.questions.read_text())
    requests = build_requests(args.docs, questions)
    ckpt = checkpoint(tokenizer, args.tiny)
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                           capture_output=True, text=True,
                                           cwd=ROOT).stdout.strip() or "unknown"
    name = "tiny" if args.tiny else "12b_mm"
    row = {"date": time.strftime("%Y-%m-%d"), "commit": commit,
           "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "torch": torch.__version__, "docs": len(requests),
           "questions_per_doc": len(questions["queries"]), "image_px": IMAGE_SIDE,
           "case_insensitive": False}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{row['date']}-media-{name}-{commit}.json"
    if path.is_file():    # schemes run one call each (--schemes) fill one file
        row = {**json.loads(path.read_text()), **row}
    for scheme in schemes:
        figures = run(name, ckpt, scheme, device, requests, args.repeat)
        row.update(figures)
        path.write_text(json.dumps(row, indent=1))   # after every scheme: a cut run keeps them
        print(json.dumps(figures), flush=True)
    print("\n| key | value |\n| --- | --- |")
    for k, v in row.items():
        print(f"| {k} | {v} |")
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
