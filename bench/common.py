"""Helpers shared by the benchmark scripts (run as scripts: bench/ is not a package).

Imports are lazy: bench/serving.py's client side and bench/memory.py run without torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = [
    "default_model_folder", "load_bench_model", "mode_defaults", "model_folder", "pyplot", "quiet_transformers",
    "save_figure", "software",
    "write_report",
]


def default_model_folder() -> Path:
    from streamengine.models.loader import default_model_folder as folder

    return folder()


def model_folder(model: str | None) -> Path:
    """`--model` as a Hugging Face folder (default: the converted SmolLM2), checked."""
    folder = Path(model) if model else default_model_folder()
    if not (folder / "config.json").exists():
        raise SystemExit(f"--model must be a Hugging Face model folder with config.json: {folder}")
    return folder


def load_bench_model(args):
    """`args.model` (default: the converted SmolLM2) loaded in float32 on `args.device`, with
    `args.threads` torch threads and transformers quiet; sets `args.folder`."""
    import torch

    from streamengine.models import load_model

    torch.set_num_threads(args.threads)
    quiet_transformers()
    args.folder = model_folder(args.model)
    return load_model(str(args.folder), "float32", args.device)


def quiet_transformers() -> None:
    """No loading bars or warnings between a benchmark's progress bars and its table."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=UserWarning)
    logging.getLogger("streamengine").setLevel(logging.WARNING)


def software() -> dict:
    """Versions and machine facts recorded beside every result."""
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "amx": amx_active(),
        "load_avg": os.getloadavg(),
    }


def cpu_model() -> str | None:
    """The CPU's model name (/proc/cpuinfo), or None where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def amx_active() -> bool | None:
    """Whether the packed GEMM's batches run on AMX tiles (kernels/csrc/cpu_amx_gemm.cpp); None
    where this process has not loaded the CPU kernels (a GPU or peer-only run): asking would
    build them."""
    from streamengine.kernels import cpu_quant_linear

    if cpu_quant_linear.load_library.cache_info().currsize == 0:
        return None
    return cpu_quant_linear.amx_active()


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display on these machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 120) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def write_report(report: dict, json_path: Path, png_path: Path | None, plot: Callable[[dict, Path], None]) -> None:
    """Writes the report's JSON and, unless `png_path` is None, its plot; says where on stderr."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2, default=list) + "\n")
    print(f"wrote {json_path}", file=sys.stderr)
    if png_path is not None:
        plot(report, png_path)
        print(f"wrote {png_path}", file=sys.stderr)


def mode_defaults(
    p: argparse.ArgumentParser, args: argparse.Namespace, quick: dict, full: dict, name: str,
    results_dir: Path, systems: Sequence[str],
) -> None:
    """The options a run left unset take the --quick or full mode's values; --json and --png
    default to results/<name>[_quick] (the plot beside the JSON); --systems (comma-separated) must name known systems."""
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    suffix = "_quick" if args.quick else ""
    args.json = args.json or results_dir / f"{name}{suffix}.json"
    args.png = args.png or args.json.with_suffix(".png")  # beside the JSON, never over a committed plot
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not args.systems or any(s not in systems for s in args.systems):
        p.error(f"--systems must name some of {', '.join(systems)}")
