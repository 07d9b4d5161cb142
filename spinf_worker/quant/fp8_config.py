"""A config.json ``quantization_config`` of an fp8 checkpoint as published on the Hub
(llm-compressor's compressed-tensors: RedHatAI "FP8" / "FP8-dynamic") -> the layout the loader
reads as stored (quant/fp8_checkpoint.py); any other variant is an error naming it, in one
line. No torch: ``spinf-serve models`` checks checkpoints with it too.

Read: e4m3 weights, symmetric, one fp32 scale per output channel or per tensor
(``X.weight_scale``); activations e4m3 with one static scale per layer input
(``X.input_scale``, the fp8-static scheme) or dynamic (computed per token: the fp8 scheme; a
"dynamic per tensor" scale would take its max over the whole pass and so mix documents, so it
is served per token too). ``ignore``d modules are stored dense and stay so."""

from __future__ import annotations

from dataclasses import dataclass

from .gptq_config import unsupported

METHOD = "compressed-tensors"
FORMATS = ("float-quantized", "naive-quantized")
WEIGHT_STRATEGIES = ("channel", "tensor")


@dataclass(frozen=True)
class Fp8Format:
    weight_strategy: str          # channel | tensor (a tensor's scale is broadcast per channel)
    static: bool                  # activations by the stored input_scale, else per token
    ignore: tuple[str, ...] = ()  # modules the checkpoint keeps dense

    @property
    def scheme(self) -> str:
        """The engine's scheme that serves these weights as stored."""
        return "fp8-static" if self.static else "fp8"

    def describe(self) -> str:
        return (f"compressed-tensors fp8 weights per {self.weight_strategy}, activations "
                f"{'static per tensor' if self.static else 'dynamic per token'}")


def _name(args: dict) -> str:
    return f"{args.get('type')}{args.get('num_bits')}"


def _check_weights(args: dict | None) -> str:
    if not args:
        raise unsupported("compressed-tensors group without weights")
    if args.get("type") != "float" or args.get("num_bits") != 8:
        raise unsupported(f"compressed-tensors {_name(args)} weights (supported: float8)")
    strategy = args.get("strategy")
    if strategy not in WEIGHT_STRATEGIES:
        raise unsupported(f"compressed-tensors fp8 weight strategy {strategy!r} "
                          "(supported: channel, tensor)")
    if args.get("dynamic"):
        raise unsupported("compressed-tensors dynamic weight scales")
    if args.get("symmetric") is False:
        raise unsupported("compressed-tensors asymmetric fp8 weights (zero points)")
    for key in ("group_size", "block_structure", "actorder"):
        if args.get(key) is not None:
            raise unsupported(f"compressed-tensors fp8 weights with {key} {args[key]!r}")
    return strategy


def _check_inputs(args: dict | None) -> bool:
    """True: static per-tensor scales; False: dynamic."""
    if not args:
        raise unsupported("compressed-tensors fp8 weight-only (no input_activations); "
                          "supported: W8A8 with static or dynamic activation scales")
    if args.get("type") != "float" or args.get("num_bits") != 8:
        raise unsupported(f"compressed-tensors {_name(args)} activations (supported: float8)")
    if args.get("symmetric") is False:
        raise unsupported("compressed-tensors asymmetric fp8 activations (zero points)")
    dynamic, strategy = args.get("dynamic"), args.get("strategy")
    if dynamic is True and strategy in ("token", "tensor"):
        return False
    if dynamic is False and strategy == "tensor":
        return True
    raise unsupported(f"compressed-tensors fp8 activations with strategy {strategy!r}, "
                      f"dynamic {dynamic!r} (supported: static per tensor, dynamic per token)")


def fp8_format(qcfg: dict) -> Fp8Format:
    """A config.json ``quantization_config`` -> the fp8 layout it names; anything this loader
    cannot read as stored is an error naming it (one line)."""
    method = str(qcfg.get("quant_method", "")).lower()
    if method == "fp8":
        block = qcfg.get("weight_block_size")
        raise unsupported(f"transformers fp8 with block-wise scales (weight_block_size {block}, "
                          "weight_scale_inv); supported: compressed-tensors fp8 per channel "
                          "or per tensor")
    if method != METHOD:
        raise unsupported(f"quant_method {method or None!r} (supported: gptq int4, "
                          "compressed-tensors fp8)")
    sparsity = qcfg.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise unsupported(f"compressed-tensors sparsity {sparsity.get('sparsity_structure')} "
                          f"({sparsity.get('format')})")
    if qcfg.get("transform_config"):
        raise unsupported("compressed-tensors transforms (transform_config)")
    groups = list((qcfg.get("config_groups") or {}).values())
    if not groups:
        raise unsupported("compressed-tensors without config_groups")
    layouts = set()
    for group in groups:
        fmt = group.get("format") or qcfg.get("format")
        if fmt not in FORMATS:
            raise unsupported(f"compressed-tensors format {fmt!r} "
                              "(supported: float-quantized, naive-quantized)")
        if group.get("output_activations"):
            raise unsupported("compressed-tensors output activation quantisation")
        layouts.add((_check_weights(group.get("weights")),
                     _check_inputs(group.get("input_activations"))))
    if len({static for _, static in layouts}) > 1:
        raise unsupported("compressed-tensors groups mixing static and dynamic activations")
    strategies = {strategy for strategy, _ in layouts}
    return Fp8Format("channel" if "channel" in strategies else "tensor", layouts.pop()[1],
                     tuple(qcfg.get("ignore") or ()))
