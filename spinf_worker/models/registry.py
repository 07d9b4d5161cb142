"""Which stack runs a checkpoint: its config.json's ``model_type`` (or, failing that, its
``architectures``) -> a family (config class + model class)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedModelError


@dataclass(frozen=True)
class Family:
    name: str
    module: str          # spinf_worker.models.<module>
    config_class: str
    model_class: str
    # the slot decoder (engine/decode.py) can step it from a pass's kept K/V; a stack with
    # recurrent layers cannot (no state is kept per slot): served without extract / generate,
    # and without completions (their prompts' shared blocks are laid out for attention only)
    slots: bool = True

    def classes(self):
        import importlib

        mod = importlib.import_module(f"spinf_worker.models.{self.module}")
        return getattr(mod, self.config_class), getattr(mod, self.model_class)

    def config(self, hf_config: dict):
        """The family's dataclass config; a variant this stack cannot run is an error here."""
        config_class, _ = self.classes()
        try:
            return config_class.from_hf(hf_config)
        except (ValueError, KeyError) as exc:
            detail = f"missing config key {exc}" if isinstance(exc, KeyError) else str(exc)
            raise UnsupportedModelError(f"{self.name} checkpoint not supported: {detail}",
                                        param="model") from exc

    def build(self, config):
        _, model_class = self.classes()
        return model_class(config)


GEMMA3 = Family("Gemma 3", "gemma3", "Gemma3Config", "Gemma3Model")
GEMMA3_VISION = Family("Gemma 3 multimodal", "gemma3_vision", "Gemma3VisionConfig",
                       "Gemma3VisionModel")
GEMMA4 = Family("Gemma 4", "gemma4", "Gemma4Config", "Gemma4Model")
GEMMA4_VISION = Family("Gemma 4 multimodal", "gemma4_vision", "Gemma4VisionConfig",
                       "Gemma4VisionModel")
LLAMA = Family("Llama", "llama", "LlamaConfig", "LlamaModel")
QWEN3 = Family("Qwen3", "qwen3", "Qwen3Config", "Qwen3Model")
QWEN3_5 = Family("Qwen3.5", "qwen3_5", "Qwen3_5Config", "Qwen3_5Model", slots=False)

MODEL_TYPES = {
    "gemma3": GEMMA3, "gemma3_text": GEMMA3,
    "gemma4": GEMMA4, "gemma4_text": GEMMA4,
    "llama": LLAMA,                     # Llama 2 / 3.x, SmolLM / SmolLM2
    "qwen3": QWEN3,
    # dense hybrid (Gated DeltaNet + full attention); a qwen3_5 wrapper is served text-only
    "qwen3_5": QWEN3_5, "qwen3_5_text": QWEN3_5,
}
# hybrids whose MLPs are mixtures of experts: no stack here
MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
ARCHITECTURES = {
    "Gemma3ForCausalLM": GEMMA3, "Gemma3ForConditionalGeneration": GEMMA3,
    "Gemma4ForCausalLM": GEMMA4, "Gemma4ForConditionalGeneration": GEMMA4,
    "LlamaForCausalLM": LLAMA,
    "Qwen3ForCausalLM": QWEN3,
    "Qwen3_5ForCausalLM": QWEN3_5, "Qwen3_5ForConditionalGeneration": QWEN3_5,
}


def family_for(config: dict) -> Family:
    """The family of an HF config dict (the wrapper's or the text model's); a Gemma 3 with
    a vision tower (``vision_config``, the loader's text_config keeps it) is the multimodal
    stack (the same for a Gemma 4)."""
    text = config.get("text_config") or {}
    if config.get("vision_config") and config.get("model_type") in ("gemma3", "gemma3_text"):
        return GEMMA3_VISION
    if config.get("vision_config") and config.get("model_type") in ("gemma4", "gemma4_text"):
        return GEMMA4_VISION
    for model_type in (text.get("model_type"), config.get("model_type")):
        if model_type in MOE_TYPES:
            raise UnsupportedModelError(
                f"architecture {model_type!r} is not supported: its mixture-of-experts layers "
                "have no stack here (Qwen3.5 runs dense only)", param="model")
        if model_type in MODEL_TYPES:
            return MODEL_TYPES[model_type]
    for arch in config.get("architectures") or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    seen = config.get("model_type") or ", ".join(config.get("architectures") or []) or "unknown"
    supported = sorted({f.name for f in MODEL_TYPES.values()})
    raise UnsupportedModelError(
        f"architecture {seen!r} is not supported; supported families: {', '.join(supported)} "
        f"(model_type {', '.join(sorted(MODEL_TYPES))})", param="model")
