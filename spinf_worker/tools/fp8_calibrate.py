"""``spinf-serve quantize fp8-static``: static fp8 activation scales calibrated offline.

The model runs unquantised (fp32 on the CPU, bf16 on CUDA, module by module: the fused CUDA
forward hands some inputs to its kernels without a Linear call) over calibration documents
through the engine, so the rows are the ones scoring reads: with ``--queries`` each text is
a request asking those questions (root, prefix-tree branches, floors), without it each text
is a completion prompt (BOS + its tokens). A forward pre-hook on every linear layer of the
body keeps the largest |x| of its input over the pass's real rows (padding rows left out);
the scale is quant/fp8_static.py's rule. Writes the scales file and a recipe:

    DIR/fp8-static-scales.safetensors   one 0-dim fp32 scale per linear input
    DIR/recipe-fp8-static.json          the rule, the data, each layer's amax and scale
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from . import ToolError

RECIPE_FILE = "recipe-fp8-static.json"


class AmaxRecorder:
    """Forward pre-hooks keeping each body linear layer's largest |input| over real rows.
    ``engine.runner.launch`` is wrapped so each pass says which of its rows are real."""

    def __init__(self, engine):
        model = engine.model
        self.amax: dict[str, object] = {}
        self.rows = 0             # real rows seen (each pass's, summed)
        self._real = None         # the current pass's real row ranges; None: every row
        body = set(model.body_linears())
        self._hooks = [module.register_forward_pre_hook(self._hook(name))
                       for name, module in model.named_modules() if module in body]
        self._runner = engine.runner
        self._launch = engine.runner.launch
        engine.runner.launch = self._launch_pass

    def _launch_pass(self, docs, keep_roots=()):
        ranges, start = [], 0
        for doc in docs:
            ranges.append((start, start + doc.tokens))   # a document's padding rows follow
            start += doc.length
        self._real = ranges
        self.rows += sum(b - a for a, b in ranges)
        try:
            return self._launch(docs, keep_roots)
        finally:
            self._real = None

    def _hook(self, name: str):
        import torch

        def hook(module, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            if self._real is not None:
                x = torch.cat([x[a:min(b, x.shape[0])] for a, b in self._real])
            if x.numel():
                m = x.detach().float().abs().amax()
                self.amax[name] = m if name not in self.amax else torch.maximum(self.amax[name], m)
        return hook

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._runner.launch = self._launch


def record_amax(engine, requests: list, chunk: int = 8) -> tuple[dict, int]:
    """(module name -> fp32 amax of its input, real rows seen) over ``requests`` scored by
    ``engine`` (score or completion bodies), ``chunk`` at a time."""
    from .news_job import checked

    recorder = AmaxRecorder(engine)
    try:
        for i in range(0, len(requests), chunk):
            checked(engine.score_batch(requests[i:i + chunk]))
    finally:
        recorder.close()
    lacking = [m for m in _linear_names(engine.model) if m not in recorder.amax]
    if lacking:
        raise ToolError(f"the calibration reached only {len(recorder.amax)} of the model's "
                        f"linear layers (no input for {lacking[:3]}): media towers need media "
                        "in the data")
    return {k: v.cpu() for k, v in recorder.amax.items()}, recorder.rows


def _linear_names(model) -> list[str]:
    body = set(model.body_linears())
    return [name for name, module in model.named_modules() if module in body]


def calibration_requests(texts: list[str], queries: dict | None) -> list:
    """Score requests asking ``queries`` (a scoring block), else completion prompts."""
    from ..completions import CompletionRequest

    if queries is not None:
        return [{"text": t, "scoring": queries} for t in texts]
    return [CompletionRequest.parse({"prompt": t, "max_tokens": 0}) for t in texts]


def read_data(path: Path, *, skip: int, limit: int | None, text_field: str | None
              ) -> tuple[list[str], str]:
    """(texts, the file's sha256): the JSONL's texts after the first ``skip``."""
    from ..calibrate import read_texts

    try:
        data = read_texts(path, text_field=text_field,
                          limit=None if limit is None else skip + limit)
    except OSError as err:
        raise ToolError(f"cannot read {path}: {err.strerror or err}") from None
    except ValueError as err:
        raise ToolError(str(err)) from None
    texts = data.texts[skip:]
    if not texts:
        raise ToolError(f"{path}: no texts to calibrate on (after skipping {skip})")
    return texts, data.sha256


def cut(engine, texts: list[str], doc_tokens: int | None) -> list[str]:
    """Each text cut to its first ``doc_tokens`` tokens (the news job's cut)."""
    if doc_tokens is None:
        return texts
    tok = engine.checkpoint.tokenizer
    return [tok.decode(tok.encode(t, add_special_tokens=False).ids[:doc_tokens]) for t in texts]


def run(args: argparse.Namespace) -> int:
    import torch

    from ..engine import Engine, EngineSettings
    from ..quant.fp8_static import RULE, SCALES_FILE, save_scales, scale_of

    if args.scheme != "fp8-static":    # argparse's choices already say so; kept for callers
        raise ToolError(f"unknown scheme {args.scheme!r} (fp8-static)")
    if args.skip < 0:
        raise ToolError(f"--skip must be 0 or more, not {args.skip}")
    queries = None
    if args.queries:
        try:
            queries = json.loads(Path(args.queries).read_text())
        except OSError as err:
            raise ToolError(f"cannot read {args.queries}: {err.strerror or err}") from None
        except ValueError as err:
            raise ToolError(f"{args.queries} is not JSON: {err}") from None
        if not isinstance(queries, dict) or not isinstance(queries.get("queries"), list):
            raise ToolError(f"{args.queries}: expected a scoring block {{\"queries\": [...]}}")
    texts, data_sha = read_data(Path(args.data), skip=args.skip, limit=args.max_docs,
                                text_field=args.text_field)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ToolError(f"--out {out} is a file, not a directory")
    if (args.device or "").startswith("cuda") and not torch.cuda.is_available():
        raise ToolError(f"--device {args.device}: no CUDA device on this machine")
    if args.threads:
        torch.set_num_threads(args.threads)
    # the unquantised model, module by module (every linear input goes through a Linear)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    settings = EngineSettings(scheme="bf16" if device.startswith("cuda") else "fp32",
                              fuse=False, cuda_graphs=False)
    try:
        engine = Engine.load(args.model_arg, device=device, settings=settings)
    except (ValueError, RuntimeError) as err:
        raise ToolError(f"cannot load the model: {str(err).splitlines()[0]}") from None
    texts = cut(engine, texts, args.doc_tokens)
    amax, rows = record_amax(engine, calibration_requests(texts, queries))
    scales = {name: scale_of(a) for name, a in amax.items()}
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": engine.checkpoint.name, "weights_digest": engine.checkpoint.weights_digest,
            "rule": RULE, "reference": engine.scheme}
    save_scales(out / SCALES_FILE, scales, meta)
    recipe = {
        "model": engine.checkpoint.name,
        "weights_digest": engine.checkpoint.weights_digest,
        "scheme": "fp8-static",
        "date": datetime.date.today().isoformat(),
        "weights": "float8 e4m3, one fp32 scale per output channel (amax / 448), at load",
        "activations": "float8 e4m3, one static fp32 scale per linear layer's input",
        "rule": RULE,
        "quantised": "every linear layer of the decoder body (q|k|v, o, gate|up, down)",
        "kept": ["embed_tokens (also the tied LM head)", "all RMSNorm weights"],
        "calibration": {
            "reference": f"{engine.scheme} on {engine.device.type}",
            "data": Path(args.data).name, "data_sha256": data_sha,
            "skip": args.skip, "documents": len(texts), "doc_tokens": args.doc_tokens,
            "queries": Path(args.queries).name if args.queries else None,
            "rows": rows,
            "rows_are": ("each request's real rows: content, question branches and floors"
                         if queries is not None else "each text as a prompt: BOS + tokens"),
        },
        "scales_file": SCALES_FILE,
        "flag": f"--quant fp8-static --fp8-scales {SCALES_FILE}",
        "layers": {name: {"amax": float(amax[name]), "scale": float(scales[name])}
                   for name in _linear_names(engine.model)},
    }
    (out / RECIPE_FILE).write_text(json.dumps(recipe, indent=2) + "\n")
    print(f"{len(scales)} input scales from {len(texts)} documents ({rows} rows): "
          f"{out / SCALES_FILE}, {out / RECIPE_FILE}")
    return 0
