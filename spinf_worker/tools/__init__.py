"""Operator tools behind ``spinf-serve parity | bench | models | quantize``: a parity check
against recorded references, the news-job benchmark on any model and device, the model cache,
fp8-static's offline calibration.

Torch is imported only by the functions that load an engine, so the listing of cached
models (and this package's import) stays light.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ..errors import SpinfError

if TYPE_CHECKING:
    from ..engine import Engine


class ToolError(SpinfError):
    """A bad path, file or option given to a tool: the CLI prints its message as one line."""

    status = 400
    code = "invalid_input"


def load_engine(args: argparse.Namespace) -> Engine:
    """The engine the shared model flags name (--model, --device, --quant, --load-format; and
    --threads where the command has it); a device or scheme this machine cannot run is a
    ToolError, not a traceback."""
    import torch

    from ..engine import Engine, EngineSettings

    if (args.device or "").startswith("cuda") and not torch.cuda.is_available():
        raise ToolError(f"--device {args.device}: no CUDA device on this machine")
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    settings = EngineSettings(scheme=args.quant or "auto",
                              fp8_scales=getattr(args, "fp8_scales", None))
    try:
        return Engine.load(args.model, device=args.device, settings=settings,
                           load_format=args.load_format or "auto")
    except (ValueError, RuntimeError) as err:   # unknown device string, scheme off its device
        raise ToolError(f"cannot load the model: {str(err).splitlines()[0]}") from None
