"""Helpers shared by the benchmark scripts (run as scripts: bench/ is not a package)."""

from __future__ import annotations

import logging
import os
import platform
import warnings

import torch

from streamengine.models.loader import default_model_folder

__all__ = ["default_model_folder", "quiet_transformers", "software"]


def quiet_transformers() -> None:
    """No loading bars or warnings between a benchmark's progress bars and its table."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=UserWarning)
    logging.getLogger("streamengine").setLevel(logging.WARNING)


def software() -> dict:
    """Versions and machine facts recorded beside every result."""
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "load_avg": os.getloadavg(),
    }
