"""Running from a checkout of this repository: keep the checkout's root off sys.path.

The repository's kernels/ folder is installed as `streamengine.kernels`. With the checkout's
root on sys.path it is also found as a top-level `kernels` and shadows the Hugging Face package
of that name, which transformers (5.25 and later) imports when it loads a model. The root gets
there by `python -m` run from it, by `python -m pytest` there, and in every Ray worker (Ray
gives workers the driver's working directory). Nothing is imported from the root itself: the
editable install finds `streamengine` and its parts without it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def drop_checkout_root() -> None:
    """Removes the checkout's root from sys.path; a no-op for an installed wheel."""
    if not (ROOT / "kernels" / "cpu_build.py").is_file():
        return
    sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != ROOT]
