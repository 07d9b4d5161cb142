"""The media towers on the CPU: one pass's four images (or audio clips) read by each commit's
code, random weights at the real towers' widths (fewer layers: every layer costs the same).

    python benchmarks/cpu_towers.py --revs e53d813 HEAD --layers 2

Each revision is a ``git archive`` snapshot run in its own process. A revision whose towers
take a list of media (models/media_rows.py) reads the four in one run; an older one, one
tower call per medium, as its runner did. Figures: the median over ``--rounds`` (revisions
in turn, a fresh process each) of the best of ``--repeat`` timed runs after a warm-up run,
seconds for one pass's four media, wall and CPU; and whether each medium's features are
bit-identical to it read alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(kind: str, layers: int):
    """(tower, embedder or projector, four media) of one kind, random weights."""
    import torch

    g = torch.Generator().manual_seed(0)
    if kind == "gemma3-siglip-896":       # SigLIP-So400m at 896 px: 4,096 patches an image
        from spinf_worker.models.gemma3_vision import (
            Gemma3VisionConfig,
            MultiModalProjector,
            SiglipConfig,
            SiglipVisionTower,
        )

        v = SiglipConfig(hidden_size=1152, intermediate_size=4304, num_layers=layers,
                         num_heads=16, image_size=896, patch_size=14)
        tower = SiglipVisionTower(v)
        head = MultiModalProjector(Gemma3VisionConfig(vision=v, hidden_size=3840))
        media = [torch.randn(3, 896, 896, generator=g) for _ in range(4)]
    elif kind.startswith("gemma4-vision"):     # 768 wide, patch 16, 3 x 3 pooling
        from spinf_worker.models.gemma4_vision import (
            Gemma4VisionTower,
            Gemma4VisionTowerConfig,
            MultimodalEmbedder,
        )

        v = Gemma4VisionTowerConfig(num_layers=layers)
        tower = Gemma4VisionTower(v)
        head = MultimodalEmbedder(v.hidden_size, 2560, v.rms_norm_eps)
        # 280 soft tokens at most (four aspect ratios), or 70 (video frames' budget)
        grids = ([(42, 60), (54, 45), (30, 84), (48, 51)] if kind == "gemma4-vision-280"
                 else [(24, 27), (27, 24), (21, 30), (30, 21)])
        media = [torch.rand(h, w, 3 * 16 * 16, generator=g) for h, w in grids]
    else:                                  # the conformer: 1024 wide, 8 heads
        from spinf_worker.models.gemma4_audio import (
            AudioEmbedder,
            Gemma4AudioTower,
            Gemma4AudioTowerConfig,
        )

        a = Gemma4AudioTowerConfig(num_layers=layers)
        tower = Gemma4AudioTower(a)
        head = AudioEmbedder(a.output_proj_dims, 2560, a.rms_norm_eps)
        media = []
        for seconds in (5, 10, 20, 30):
            frames = seconds * 100
            media.append((torch.randn(frames, 128, generator=g),
                          torch.ones(frames, dtype=torch.bool)))
    for module in (tower, head):
        for p in module.parameters():
            p.data.normal_(0, 0.02, generator=g)
    return tower, head, media


def measure(kinds: list[str], layers: int, repeat: int, check: bool) -> dict:
    import torch

    try:
        import spinf_worker.models.media_rows  # noqa: F401
        batched = True
    except ImportError:
        batched = False

    def one(tower, head, m):
        return head(tower(*m) if isinstance(m, tuple) else tower(m))

    def run(tower, head, media):
        if batched:
            return head(tower(media))
        return [one(tower, head, m) for m in media]

    out = {"batched": batched, "threads": torch.get_num_threads(),
           "load_average": os.getloadavg()[0], "kinds": {}}
    for kind in kinds:
        tower, head, media = build(kind, layers)
        with torch.inference_mode():
            # warm-up over the same media: the library's first calls, the allocator's pages
            together = run(tower, head, media)
            wall, cpu = [], []
            for _ in range(repeat):
                start, start_cpu = time.perf_counter(), time.process_time()
                run(tower, head, media)
                wall.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
            k = out["kinds"][kind] = {"seconds": min(wall), "cpu_seconds": min(cpu)}
            if check:
                k["bit_identical_alone"] = all(
                    torch.equal(run(tower, head, [m])[0], t)
                    for m, t in zip(media, together, strict=True))
    return out


def snapshot(rev: str, into: Path) -> str:
    commit = subprocess.check_output(["git", "rev-parse", "--short", rev], cwd=ROOT,
                                     text=True).strip()
    archive = subprocess.run(["git", "archive", commit, "spinf_worker"], cwd=ROOT,
                             check=True, capture_output=True).stdout
    (into / commit).mkdir()
    subprocess.run(["tar", "-x", "-C", str(into / commit)], input=archive, check=True)
    return commit


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--revs", nargs="+", default=["HEAD"])
    ap.add_argument("--kinds", nargs="+", default=["gemma3-siglip-896", "gemma4-vision-280",
                                                   "gemma4-vision-70", "gemma4-audio"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2, help="timed runs per process (the "
                    "best counts), after a warm-up run")
    ap.add_argument("--rounds", type=int, default=2, help="revisions run in turn, each "
                    "round in a fresh process (the machine's load moves between them)")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.kinds, args.layers, args.repeat, args.check)))
        return
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        commits = [snapshot(rev, Path(tmp)) for rev in args.revs]
        for r in range(args.rounds):
            for commit in commits:
                env = {**os.environ, "PYTHONPATH": str(Path(tmp) / commit)}
                cmd = [sys.executable, __file__, "--measure", "--layers", str(args.layers),
                       "--repeat", str(args.repeat), "--kinds", *args.kinds] + (["--check"] if r == 0 else [])
                proc = subprocess.run(cmd, env=env, check=True, capture_output=True,
                                      text=True, cwd=tmp)
                runs.setdefault(commit, []).append(json.loads(proc.stdout.splitlines()[-1]))
                print(commit, runs[commit][-1], flush=True)
    base = commits[0]
    for commit in commits:
        for kind in args.kinds:
            wall = statistics.median(run["kinds"][kind]["seconds"] for run in runs[commit])
            cpu = statistics.median(run["kinds"][kind]["cpu_seconds"] for run in runs[commit])
            first = statistics.median(run["kinds"][kind]["seconds"] for run in runs[base])
            print(f"{commit} {kind}: median {wall:.2f} s (CPU {cpu:.2f} s), x{first / wall:.2f}"
                  f", bit-identical alone: {runs[commit][0]['kinds'][kind]['bit_identical_alone']}")


if __name__ == "__main__":
    main()
