"""Shared fixtures: the default model (converted once, cached), tiny random models, uvloop."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# Triton decides interpreter mode once, when it is first imported (transformers imports it
# early through torch._dynamo): without a GPU, run the kernel tests interpreted on CPU tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import asyncio  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# Test modules that need the machine to themselves. Under pytest-xdist (`make test` runs two
# workers) they form one work unit, run on one worker one after another, never beside each other.
WHOLE_MACHINE = (
    "test_cpu_avx2_build.py",  # reruns the kernel tests in a pytest subprocess: as long as the soak
    "test_ray_cluster.py",  # a local Ray cluster started with both CPUs (num_cpus=2)
    "test_soak.py",  # counts what 45 s of traffic made happen, and reads its RSS
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (pyproject's addopts): each module's tests go to one worker, so its
    module fixtures (servers, engines, models, a Ray cluster) are built once, not once per
    worker; and the WHOLE_MACHINE modules go as one unit. xdist's own groups (--dist loadgroup,
    the xdist_group mark) do nothing under pytest 9.2: it marks a test's group in its node id,
    which pytest 9.2 no longer lets a plugin change (pytest-xdist issue #1386)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class WholeMachineTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)  # the module's path
            return "whole machine" if Path(scope).name in WHOLE_MACHINE else scope

    return WholeMachineTogether(config, log)


def pytest_collection_modifyitems(config, items):
    """On a pytest-xdist worker, the WHOLE_MACHINE modules first (in file order): the longest
    unit then starts at once instead of last, when it would leave the other worker idle. xdist
    hands out the units in this order (--no-loadscope-reorder; its own order is by number of
    tests, not by length). A serial run keeps the file order."""
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: item.path.name not in WHOLE_MACHINE)  # stable


def pytest_asyncio_loop_factories(config, item):
    """Async tests run on uvloop, as the server does."""
    import uvloop

    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """The default SmolLM2-135M-Instruct, converted from the packaged GGUF once per machine."""
    from streamengine.models.loader import default_model_folder

    return default_model_folder()


def _save_tiny(config, folder: Path, tokenizer_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder


_TINY = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True,
)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm_dir) -> Path:
    """A 2-layer random Llama (GQA 4:2) with SmolLM2's tokenizer: fast, and real text in/out."""
    from transformers import LlamaConfig

    return _save_tiny(LlamaConfig(**_TINY), tmp_path_factory.mktemp("tiny_llama"), smollm_dir)


@pytest.fixture(scope="session")
def untied_llama_dir(tmp_path_factory, smollm_dir) -> Path:
    """The tiny Llama with its own LM head: its greedy text does not just repeat its last token."""
    from transformers import LlamaConfig

    return _save_tiny(LlamaConfig(**dict(_TINY, tie_word_embeddings=False)), tmp_path_factory.mktemp("untied"),
                      smollm_dir)


def make_adapter(base: Path, folder: Path, rank: int, targets: list[str], seed: int, alpha: int | None = None) -> Path:
    """A random PEFT LoRA adapter of `base` (B is not zero: init_lora_weights=False)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=targets, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # B's default init is large beside the tiny model's 0.02 weights
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.05)
    peft_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_lora_dirs(untied_llama_dir, tmp_path_factory) -> dict[str, Path]:
    """Two random LoRA adapters of the untied tiny Llama: "lora-a" (rank 8, every projection)
    and "lora-b" (rank 16, attention only)."""
    root = tmp_path_factory.mktemp("tiny_loras")
    specs = {"lora-a": (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
             "lora-b": (16, ["q_proj", "k_proj", "v_proj", "o_proj"])}
    return {name: make_adapter(untied_llama_dir, root / name, rank, targets, seed)
            for seed, (name, (rank, targets)) in enumerate(specs.items())}


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, smollm_dir) -> Path:
    """A 2-layer random Qwen2 (q/k/v biases, GQA 6:2, head_dim 16) with SmolLM2's tokenizer."""
    from transformers import Qwen2Config

    cfg = dict(_TINY, hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    return _save_tiny(Qwen2Config(**cfg), tmp_path_factory.mktemp("tiny_qwen2"), smollm_dir)


def slow_down_steps(monkeypatch, engine, delay: float = 0.02) -> None:
    """Makes every engine step take at least `delay` more seconds (in the worker thread), so
    a test about timeouts or drains does not depend on how fast the tiny model generates."""
    import time

    execute = engine.core.execute

    def slow_execute(step):
        time.sleep(delay)
        return execute(step)

    monkeypatch.setattr(engine.core, "execute", slow_execute)


def run_async(coro):
    """For sync tests that need one coroutine run to completion on a fresh loop."""
    return asyncio.run(coro)
