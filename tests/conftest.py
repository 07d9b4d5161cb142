"""Shared fixtures: the real default model, and a tiny random Gemma 3 written by transformers
with a small Gemma-shaped tokenizer built here (so the tiny models never load the real one).

Tests that use the real default model are marked ``slow`` (``-m "not slow"`` leaves them out).
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
# SPINF_SHARED_DATA: the data directory when the checkout is not beside it
DATA = Path(os.environ.get("SPINF_SHARED_DATA", DATA))

# The bound of every client timeout and every wait in the tests: generous, so that a loaded
# machine makes the suite slower, never red. No test may depend on how fast the machine is.
WAIT_S = 120.0

# Fixtures that load the real default model (google/gemma-3-270m from the packaged GGUF).
REAL_MODEL_FIXTURES = frozenset({"default_checkpoint", "default_engine", "default_oracle",
                                 "default_cache", "default_ckpt", "gguf_file",
                                 "transformers_gguf"})


def pytest_collection_modifyitems(items):
    for item in items:
        if REAL_MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def shared_data(name: str) -> Path:
    """A file of the data directory beside the repository (../shared/data: news articles, an
    AG News sample). A test that needs it fails when it is absent; it never skips."""
    path = DATA / name
    if not path.is_file():
        pytest.fail(f"{path} is absent: this test needs the shared data directory "
                    f"{DATA} beside the repository", pytrace=False)
    return path



def triton_interpreted(module: str, check: str, timeout: float = WAIT_S,
                       env: dict[str, str] | None = None) -> None:
    """Run ``check`` (a function of the test module ``module``) in a process of its own under
    Triton's interpreter: TRITON_INTERPRET is read as triton's own functions and each kernel
    are decorated, at import, so it must be set before triton is imported at all (this
    process may have imported it compiled)."""
    env = {**os.environ, **(env or {}), "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", f"from {module} import {check}; {check}()"],
                          cwd=Path(__file__).parents[1], env=env, capture_output=True,
                          text=True, timeout=timeout)
    print(done.stdout)
    assert done.returncode == 0, done.stderr[-4000:]

@pytest.fixture(scope="session")
def default_checkpoint():
    from spinf_worker.models.loader import load_checkpoint

    return load_checkpoint(None)


@pytest.fixture(scope="session")
def default_engine(default_checkpoint):
    from spinf_worker.engine import Engine

    return Engine(default_checkpoint, device="cpu")


@pytest.fixture(scope="session")
def default_oracle(default_checkpoint):
    """transformers' own Gemma 3 on the same converted weights: the independent reference."""
    from transformers import Gemma3ForCausalLM

    model = Gemma3ForCausalLM.from_pretrained(default_checkpoint.path, dtype=torch.float32,
                                              attn_implementation="eager")
    return model.eval()


# The tiny tokenizer: Gemma's layout (control tokens first, then the 256 byte pieces for byte
# fallback, then the pieces) and Gemma's construction (gguf_convert.build_tokenizer, as for the
# packaged model), with pieces trained here on a little English. Digits are single pieces and
# every printable ASCII character is one, as in Gemma; anything else falls back to bytes.
TINY_CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
TINY_PAD, TINY_EOS, TINY_BOS, TINY_UNK = 0, 1, 2, 3
TINY_CORPUS = """\
The central bank raised its benchmark rate on Tuesday, citing inflation in services and a tight
labour market. Shares of regional lenders fell while the currency touched a two-month high, and
investors asked what comes next. Markets moved on the news as prices rose and oil, gold and
copper stocks were up or down.
The customer was charged twice for September and asked for a refund of the second charge.
I was charged twice, please refund me. Is the customer asking for a refund? Answer: yes or no.
Invoice number 4411: amount charged 12.50 dollars, paid on the first of the month.
The home team won the match by three points; the players and the coach thanked their supporters.
Scientists at the university published a study about the climate, the ocean and the weather.
The government announced a new policy for the election; the minister said the vote would be close.
Topic (business, sports, science or politics): Which month? Who acted? Does the article mention
rates? Summary: the company reported higher sales and profit this year, and its shares rose.
"""


def tiny_tokenizer(corpus: str = TINY_CORPUS, vocab_size: int = 1024):
    """A ``tokenizers`` BPE built like the packaged model's, with a vocabulary of ~750 (on
    ``TINY_CORPUS``; another corpus trains other pieces)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    from spinf_worker.models.gguf_convert import build_tokenizer

    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Replace(" ", "\u2581")
    trainer_tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n", "isolated"), pre_tokenizers.Punctuation("isolated"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")])
    alphabet = [chr(c) for c in range(0x21, 0x7F)] + ["\u2581", "\n", "\t"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet,
                                  limit_alphabet=len(alphabet), show_progress=False)
    trainer_tok.train_from_iterator([corpus], trainer)
    pieces = [p for p, _ in sorted(trainer_tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = TINY_CONTROL + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [3] * len(TINY_CONTROL) + [6] * 256 + [1] * len(pieces)   # control, byte, normal
    return build_tokenizer(tokens, types, unk_id=TINY_UNK)


def write_tiny_tokenizer(path: Path, corpus: str = TINY_CORPUS, vocab_size: int = 1024) -> Path:
    """tokenizer.json and tokenizer_config.json as a converted GGUF has them (a BOS
    post-processor that the loader drops, no chat template)."""
    from tokenizers import processors

    tokenizer = tiny_tokenizer(corpus, vocab_size)
    bos = TINY_CONTROL[TINY_BOS]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, TINY_BOS)])
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": bos, "eos_token": TINY_CONTROL[TINY_EOS],
        "pad_token": TINY_CONTROL[TINY_PAD], "unk_token": TINY_CONTROL[TINY_UNK],
        "add_bos_token": True, "add_eos_token": False, "model_max_length": 4096}, indent=2))
    return path


def tiny_vocab_size(tokenizer_dir: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


def write_tiny_model(path: Path, tokenizer_dir: Path, config, randomise: Callable, *,
                     tokenizer_files: tuple[str, ...] = ("tokenizer.json",)) -> Path:
    """transformers' causal LM of ``config``, its weights set by ``randomise(model)``, saved by
    transformers with the tiny tokenizer's ``tokenizer_files`` beside it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    randomise(model)
    model.save_pretrained(path)
    for name in tokenizer_files:
        (path / name).write_bytes((tokenizer_dir / name).read_bytes())
    return path


def write_tiny_gemma3(path: Path, tokenizer_dir: Path, *, sliding_window: int = 16,
                      seed: int = 0) -> Path:
    """A random 4-layer Gemma 3 on the tiny tokenizer's vocabulary, saved by transformers,
    with non-trivial norm weights so a norm bug cannot hide behind zeros."""
    from transformers import Gemma3TextConfig

    def norms_random(model) -> None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.3)

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=tiny_vocab_size(tokenizer_dir), hidden_size=32, intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        query_pre_attn_scalar=16, sliding_window=sliding_window, max_position_embeddings=4096,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        bos_token_id=TINY_BOS, eos_token_id=TINY_EOS, pad_token_id=TINY_PAD)
    return write_tiny_model(path, tokenizer_dir, cfg, norms_random,
                            tokenizer_files=("tokenizer.json", "tokenizer_config.json"))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return write_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"), tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_engine(tiny_dir):
    from spinf_worker.engine import Engine

    return Engine.load(str(tiny_dir), device="cpu")


@pytest.fixture(scope="session")
def tiny_oracle(tiny_dir):
    from transformers import Gemma3ForCausalLM

    return Gemma3ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32,
                                             attn_implementation="eager").eval()


# An oracle's answer for the same ids is the same: each is computed once per model and session
# (the parity tests ask for the same contexts again, one option or spelling after another).
_ORACLE_ANSWERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _oracle_answer(model, key: tuple, compute):
    answers = _ORACLE_ANSWERS.setdefault(model, {})
    if key not in answers:
        answers[key] = compute()
    return answers[key]


def _cache_argument(model) -> str:
    """The name of a forward's KV cache argument: ``cache`` in newer transformers."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _read_context(model, ids: tuple[int, ...]) -> tuple[torch.Tensor, object]:
    """log P(next token | ids) and the KV cache of ids, from one plain forward."""
    def compute() -> tuple[torch.Tensor, object]:
        with torch.no_grad():
            out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
        return torch.log_softmax(out.logits[0, -1].float(), dim=-1), cache

    return _oracle_answer(model, ("context", ids), compute)


def oracle_next_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log P(next token | ids) over the vocabulary, from one plain forward."""
    return _read_context(model, tuple(ids))[0].clone()


def oracle_logprob(model, ids: list[int], n_context: int) -> float:
    """Sum of log P(ids[j] | ids[:j]) for j >= n_context: the context read once (its forward
    serves every continuation asked of it), the rest read on a copy of its KV cache, as
    transformers' own generation does; logits only at the rows read."""
    def compute() -> float:
        if n_context >= len(ids):
            return 0.0
        following, cache = _read_context(model, tuple(ids[:n_context]))
        total = following[ids[n_context]].item()
        rest = ids[n_context:-1]      # the rows that read ids[n_context + 1:]
        if rest:
            with torch.no_grad():
                logits = model(torch.tensor([rest]), use_cache=True,
                               **{_cache_argument(model): copy.deepcopy(cache)}).logits[0]
            rows = torch.log_softmax(logits.float(), dim=-1)
            total += sum(rows[k, ids[n_context + 1 + k]].item() for k in range(len(rest)))
        return total

    return _oracle_answer(model, ("sum", tuple(ids), n_context), compute)


# The tiny multimodal Gemma 3: the tiny tokenizer plus Gemma 3's three image tokens (added
# after its vocabulary), a small SigLIP tower and projector, and a processor config of its
# own (mean, std and size differ from the defaults, so a processor that ignored it fails).
TINY_IMAGE_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
TINY_IMAGE_SIZE = 32
TINY_MM_TOKENS = 16


def write_tiny_gemma3_vision(path: Path, tokenizer_dir: Path, *, seed: int = 0) -> Path:
    from tokenizers import AddedToken, Tokenizer
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )
    from transformers.models.gemma3.image_processing_pil_gemma3 import (
        Gemma3ImageProcessorPil,
    )

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    base = tokenizer.get_vocab_size()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in TINY_IMAGE_TOKENS])
    boi, eoi, image = (tokenizer.token_to_id(t) for t in TINY_IMAGE_TOKENS)
    assert (boi, eoi, image) == (base, base + 1, base + 2)
    torch.manual_seed(seed)
    text = Gemma3TextConfig(
        vocab_size=base + 3, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=8, max_position_embeddings=4096,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        bos_token_id=TINY_BOS, eos_token_id=TINY_EOS, pad_token_id=TINY_PAD)
    vision = SiglipVisionConfig(hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                                num_attention_heads=2, image_size=TINY_IMAGE_SIZE,
                                patch_size=4, vision_use_head=False)
    cfg = Gemma3Config(text_config=text, vision_config=vision,
                       mm_tokens_per_image=TINY_MM_TOKENS, image_token_id=image,
                       boi_token_id=boi, eoi_token_id=eoi, bos_token_id=TINY_BOS,
                       eos_token_id=TINY_EOS, pad_token_id=TINY_PAD)
    model = Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
            elif "mm_input_projection" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    Gemma3ImageProcessorPil(size={"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE},
                            image_mean=[0.48, 0.46, 0.41],
                            image_std=[0.27, 0.26, 0.28]).save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_bytes(
        (tokenizer_dir / "tokenizer_config.json").read_bytes())
    return path


@pytest.fixture(scope="session")
def tiny_vision_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return write_tiny_gemma3_vision(tmp_path_factory.mktemp("tiny-gemma3-vision"),
                                    tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_vision_engine(tiny_vision_dir):
    from spinf_worker.engine import Engine

    return Engine.load(str(tiny_vision_dir), device="cpu")


@pytest.fixture(scope="session")
def tiny_vision_oracle(tiny_vision_dir):
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(
        tiny_vision_dir, dtype=torch.float32, attn_implementation="eager").eval()


# The tiny multimodal Gemma 4: the tiny tokenizer plus Gemma 4's image and audio tokens, a small
# vision encoder (clipped linears, standardised features, a 2-D RoPE) and embedder, a small
# audio conformer (default feature extractor) and embedder, bidirectional
# attention among an image's tokens on the sliding layers ("vision"), and the processor's
# smallest soft-token budget (70) at patch size 4.
TINY_GEMMA4_IMAGE_TOKENS = ["<|image>", "<image|>", "<|image|>"]
TINY_GEMMA4_AUDIO_TOKENS = ["<|audio>", "<audio|>", "<|audio|>"]
TINY_GEMMA4_PATCH = 4
TINY_GEMMA4_VIDEO_TOKEN = "<|video|>"


def write_tiny_gemma4_vision(path: Path, tokenizer_dir: Path, *, seed: int = 0,
                             bidirectional: str | None = "vision", video: bool = False) -> Path:
    from tokenizers import AddedToken, Tokenizer
    from transformers import (
        Gemma4AudioConfig,
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        Gemma4TextConfig,
        Gemma4VisionConfig,
    )
    from transformers.models.gemma4.image_processing_pil_gemma4 import (
        Gemma4ImageProcessorPil,
    )

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    base = tokenizer.get_vocab_size()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in TINY_GEMMA4_IMAGE_TOKENS + TINY_GEMMA4_AUDIO_TOKENS])
    boi, eoi, image = (tokenizer.token_to_id(t) for t in TINY_GEMMA4_IMAGE_TOKENS)
    boa, eoa, audio = (tokenizer.token_to_id(t) for t in TINY_GEMMA4_AUDIO_TOKENS)
    assert (boi, eoi, image, boa, eoa, audio) == tuple(range(base, base + 6))
    if video:     # a <|video|> token and a video processor at the tower's patch size
        tokenizer.add_special_tokens([AddedToken(TINY_GEMMA4_VIDEO_TOKEN, special=True,
                                                 normalized=False)])
    vocab = tokenizer.get_vocab_size()
    torch.manual_seed(seed)
    text = Gemma4TextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=16,
        sliding_window=8, max_position_embeddings=4096, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=vocab, final_logit_softcapping=30.0,
        use_bidirectional_attention=bidirectional,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        bos_token_id=TINY_BOS, eos_token_id=TINY_EOS, pad_token_id=TINY_PAD)
    vision = Gemma4VisionConfig(hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=12,
                                patch_size=TINY_GEMMA4_PATCH, pooling_kernel_size=3,
                                position_embedding_size=256, use_clipped_linears=True,
                                standardize=True)
    sound = Gemma4AudioConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                              subsampling_conv_channels=[128, 4], conv_kernel_size=5,
                              output_proj_dims=24, use_clipped_linears=True)
    cfg = Gemma4Config(text_config=text, vision_config=vision, audio_config=sound,
                       image_token_id=image, boi_token_id=boi, eoi_token_id=eoi,
                       audio_token_id=audio, boa_token_id=boa, eoa_token_index=eoa,
                       **({"video_token_id": base + 6} if video else {}),
                       bos_token_id=TINY_BOS, eos_token_id=TINY_EOS, pad_token_id=TINY_PAD)
    model = Gemma4ForConditionalGeneration(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if not p.is_floating_point() or "rotary" in name or "embed_scale" in name:
                continue
            if name.endswith(("input_min", "output_min")):
                p.fill_(-1.5 - torch.rand((), generator=gen).item())
            elif name.endswith(("input_max", "output_max")):
                p.fill_(1.5 + torch.rand((), generator=gen).item())
            elif "per_dim_scale" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif "norm" in name or "layer_scalar" in name or "std_scale" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif "_scale" in name or "inv_freq" in name:
                continue
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)
    Gemma4ImageProcessorPil(patch_size=TINY_GEMMA4_PATCH, max_soft_tokens=70,
                            pooling_kernel_size=3).save_pretrained(path)
    if video:    # transformers' Gemma4VideoProcessor needs torchvision: its config by hand
        (path / "video_preprocessor_config.json").write_text(json.dumps({
            "video_processor_type": "Gemma4VideoProcessor", "patch_size": TINY_GEMMA4_PATCH,
            "max_soft_tokens": 70, "pooling_kernel_size": 3}))
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_bytes(
        (tokenizer_dir / "tokenizer_config.json").read_bytes())
    return path


def tamed(path: Path) -> Path:
    """Gemma 4's text layers attend unscaled after their q/k norms, which the tiny
    checkpoint draws around 1: nearly one-hot attention, too brittle to compare precisions
    on (tests/gpu/test_gpu_families.py scales them too). A quarter of them here."""
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    for name, tensor in weights.items():
        if "language_model" in name and name.endswith(("q_norm.weight", "k_norm.weight")):
            weights[name] = tensor * 0.25
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def tiny_gemma4_video_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return write_tiny_gemma4_vision(tmp_path_factory.mktemp("tiny-gemma4-video"),
                                    tiny_tokenizer_dir, seed=3, video=True)


@pytest.fixture(scope="session")
def tiny_gemma4_video_engine(tiny_gemma4_video_dir):
    from spinf_worker.engine import Engine

    return Engine.load(str(tiny_gemma4_video_dir), device="cpu")


@pytest.fixture(scope="session")
def tiny_gemma4_video_oracle(tiny_gemma4_video_dir):
    from .media_oracle import gemma4_oracle

    return gemma4_oracle(tiny_gemma4_video_dir)


@pytest.fixture(scope="session")
def tiny_gemma4_vision_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return write_tiny_gemma4_vision(tmp_path_factory.mktemp("tiny-gemma4-vision"),
                                    tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_gemma4_vision_engine(tiny_gemma4_vision_dir):
    from spinf_worker.engine import Engine

    return Engine.load(str(tiny_gemma4_vision_dir), device="cpu")


@pytest.fixture(scope="session")
def tiny_gemma4_vision_oracle(tiny_gemma4_vision_dir):
    from .media_oracle import gemma4_oracle

    return gemma4_oracle(tiny_gemma4_vision_dir)
