"""The converted copy of a GGUF file is keyed by the file's bytes: the same file at another
path (a reinstall, a second virtual environment) reuses the copy instead of writing another
half-gigabyte folder, and a different file gets its own."""

from __future__ import annotations

import os
import shutil

from streamengine.config import default_cache_dir
from streamengine.models import loader


def test_same_bytes_elsewhere_reuse_the_copy(tmp_path, monkeypatch):
    original = loader.resolve_default_model()
    cache = default_cache_dir()
    folder = loader._converted_gguf(original, cache)

    def no_conversion(*args, **kwargs):
        raise AssertionError("the copy was converted again")

    # Reuse means no conversion at all (whatever else other test workers put in the cache).
    monkeypatch.setattr(loader.AutoModelForCausalLM, "from_pretrained", no_conversion)
    elsewhere = tmp_path / "venv2" / original.name
    elsewhere.parent.mkdir()
    shutil.copyfile(original, elsewhere)
    assert loader._converted_gguf(elsewhere, cache) == folder


def test_key_follows_the_bytes(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF" + bytes(100))
    b.write_bytes(b"GGUF" + bytes(100))
    key = loader._content_key(a, tmp_path)
    assert loader._content_key(b, tmp_path) == key  # same bytes, other path
    b.write_bytes(b"GGUF" + bytes(99) + b"\x01")
    os.utime(b, ns=(1, 1))  # a new mtime: the remembered key no longer applies
    assert loader._content_key(b, tmp_path) != key
