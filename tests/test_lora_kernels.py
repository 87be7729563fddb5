"""The batched multi-LoRA kernels: C++ (kernels/cpu_lora.py, csrc/cpu_lora.cpp) and Triton
(kernels/lora_triton.py), each against the PyTorch reference and a dense per-row float64
formula built here, on random batches: several row counts (1 row, groups small enough for the
C++ dot-product path and large enough for its axpy path, 300 rows), rows of mixed adapters and
of none (slot -1), ranks 3/8/16/64 and 0 in a stack padded to R = 64, x a row-strided view and
y a column slice of a wider output. The stacks' entries past each adapter's rank are NaN, so
reading any of them would show. Columns of the wide output outside y, and rows with slot -1,
must come back bit-identical.

The C++ tests skip only where the library cannot be built at all (not x86-64 with AVX-512 or
AVX2, or no g++); where it should build, a failed build fails them. The Triton tests run in the
interpreter on CPU (TRITON_INTERPRET=1 before triton is imported), natively on CUDA; if triton
was already imported in compiled mode, a subprocess reruns them.
"""

from __future__ import annotations

import os

import torch

NATIVE = torch.cuda.is_available()
if not NATIVE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from streamengine import kernels as K  # noqa: E402

# Submodules the package has imported (lora_triton shares cpu_lora's checks). Taken from it
# rather than imported by name: ruff's isort sorts `streamengine.kernels` (mapped by
# package-dir) and `streamengine` into different sections depending on the checkout.
cpu_build, cpu_lora = K.cpu_build, K.cpu_lora
DEVICE = torch.device("cuda" if NATIVE else "cpu")
TRITON_HERE = K.triton_available()
CPP_BUILDS = cpu_build.selected_instruction_set() is not None and bool(
    os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++"))
needs_cpp = pytest.mark.skipif(not CPP_BUILDS, reason="no C++ kernels here (they need x86-64 with AVX-512 or AVX2, and g++)")
needs_triton = pytest.mark.skipif(not TRITON_HERE, reason="triton was imported in compiled mode without CUDA; "
                                  "test_triton_tests_in_an_interpreter_subprocess reruns these")
TOL = dict(rtol=2e-5, atol=2e-5)  # outputs of magnitude ~1, sums of up to 576 float32 products


@dataclass(slots=True)
class Case:
    x: torch.Tensor  # [T, in], a row-strided view
    wide: torch.Tensor  # [T, 7 + out + 9]: the fused output y is a column slice of
    slot: torch.Tensor
    A: torch.Tensor  # [S, R, in], NaN past each rank
    B: torch.Tensor  # [S, out, R], NaN past each rank
    rank: torch.Tensor
    scale: torch.Tensor

    @property
    def y(self) -> torch.Tensor:
        return self.wide[:, 7:-9]

    def args(self, wide: torch.Tensor | None = None) -> tuple:
        y = self.y if wide is None else wide[:, 7:-9]
        return self.x, y, self.slot, self.A, self.B, self.rank, self.scale


def make_case(rows: int, ranks: tuple[int, ...], in_f: int, out_f: int, seed: int = 0, slots: list[int] | None = None,
              dtype: torch.dtype = torch.float32, device: torch.device = DEVICE) -> Case:
    gen = torch.Generator().manual_seed(seed)
    S, R = len(ranks), max(64, *ranks)
    x = torch.randn(rows, in_f + 5, generator=gen)[:, 2:2 + in_f]
    wide = torch.randn(rows, 7 + out_f + 9, generator=gen)
    slot = torch.tensor(slots) if slots is not None else torch.randint(-1, S, (rows,), generator=gen)
    A = torch.randn(S, R, in_f, generator=gen) * in_f**-0.5
    B = torch.randn(S, out_f, R, generator=gen) * max(1, max(ranks)) ** -0.5
    for s, r in enumerate(ranks):
        A[s, r:] = float("nan")
        B[s, :, r:] = float("nan")
    scale = torch.rand(S, generator=gen) + 0.5
    rank = torch.tensor(ranks, dtype=torch.int32)
    return Case(*(t.to(device) for t in (x.to(dtype), wide.to(dtype), slot.to(torch.int32), A.to(dtype),
                                          B.to(dtype), rank, scale)))


def dense(case: Case) -> torch.Tensor:
    """The wide output after the update, row by row in float64 from the formula itself."""
    out = case.wide.double().cpu().clone()
    x, A, B = (t.double().cpu() for t in (case.x, case.A, case.B))
    for t, s in enumerate(case.slot.tolist()):
        if s < 0:
            continue
        r = int(case.rank[s])
        out[t, 7:-9] += float(case.scale[s]) * (B[s, :, :r] @ (A[s, :r] @ x[t]))
    return out


def check_untouched(before: torch.Tensor, after: torch.Tensor, slot: torch.Tensor) -> None:
    """Columns outside y, and rows without an adapter, are bit-identical."""
    assert torch.equal(after[:, :7], before[:, :7]) and torch.equal(after[:, -9:], before[:, -9:])
    idle = slot.cpu() < 0
    assert torch.equal(after[idle], before[idle])


ROWS = [1, 2, 3, 7, 64, 300]
RANKS = [(16,), (8, 16, 64), (3, 0, 16, 64, 8)]
SIZES = [(576, 1536), (100, 70)]


# ---------------------------------------------------------------------------------------------
# Reference and C++


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_reference_matches_the_dense_formula(rows: int) -> None:
    case = make_case(rows, (3, 0, 16, 64, 8), 100, 70, seed=rows, device=torch.device("cpu"))
    wide = case.wide.clone()
    K.ref_lora_shrink_expand(*case.args(wide))
    torch.testing.assert_close(wide, dense(case).float(), **TOL)
    check_untouched(case.wide, wide, case.slot)


@needs_cpp
@pytest.mark.parametrize("in_f,out_f", SIZES)
@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("rows", ROWS)
def test_cpp_matches_reference_and_dense(rows: int, ranks: tuple[int, ...], in_f: int, out_f: int) -> None:
    assert cpu_lora.supported(), "the C++ library should build here"
    case = make_case(rows, ranks, in_f, out_f, seed=rows * 7 + len(ranks), device=torch.device("cpu"))
    got, ref = case.wide.clone(), case.wide.clone()
    cpu_lora.lora_shrink_expand(*case.args(got))
    K.ref_lora_shrink_expand(*case.args(ref))
    torch.testing.assert_close(got, ref, **TOL)
    torch.testing.assert_close(got, dense(case).float(), **TOL)
    check_untouched(case.wide, got, case.slot)


@needs_cpp
@pytest.mark.parametrize("in_f,out_f", [(576, 1536), (576, 576), (100, 70)])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_cpp_reads_bfloat16_stacks_kept_rank_major(rows: int, in_f: int, out_f: int) -> None:
    """The engine's CPU stacks: A and B in bfloat16, B a transposed view of a rank-major tensor
    (passed without a copy); the result is the formula on the bfloat16 weights widened. Widths
    whose column share per thread ends inside a tile, or inside a block."""
    case = make_case(rows, (8, 16, 64), in_f, out_f, seed=rows, device=torch.device("cpu"))
    A = case.A.bfloat16()
    B = case.B.bfloat16().transpose(1, 2).contiguous().transpose(1, 2)  # [S, out, R] view of [S, R, out]
    widened = Case(case.x, case.wide, case.slot, A.float(), B.float(), case.rank, case.scale)
    got = case.wide.clone()
    cpu_lora.lora_shrink_expand(case.x, got[:, 7:-9], case.slot, A, B, case.rank, case.scale)
    torch.testing.assert_close(got, dense(widened).float(), **TOL)
    check_untouched(case.wide, got, case.slot)


@needs_cpp
@pytest.mark.parametrize("slots", [
    [0] * 40,  # one adapter: every block of B transposed once, axpys for all rows
    [1, 0] * 20,  # two interleaved
    [2, -1, 2, 0, 0, 1, 2],  # groups of 1 to 3 rows: the dot-product path and its threshold
    [-1, -1, -1],  # no adapter at all
])
def test_cpp_row_groupings(slots: list[int]) -> None:
    case = make_case(len(slots), (16, 8, 64), 576, 1536, seed=5, slots=slots, device=torch.device("cpu"))
    got = case.wide.clone()
    cpu_lora.lora_shrink_expand(*case.args(got))
    torch.testing.assert_close(got, dense(case).float(), **TOL)
    check_untouched(case.wide, got, case.slot)


@needs_cpp
def test_cpp_takes_int64_indices_and_contiguous_operands() -> None:
    case = make_case(9, (16, 8), 64, 48, seed=2, device=torch.device("cpu"))
    x, y = case.x.contiguous(), case.y.contiguous()
    expected = y.double() + (dense(case)[:, 7:-9] - case.y.double())
    cpu_lora.lora_shrink_expand(x, y, case.slot.long(), case.A, case.B, case.rank.long(), case.scale)
    torch.testing.assert_close(y, expected.float(), **TOL)


def test_fallback_runs_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the library (or on tensors it does not take) the wrapper runs the reference."""
    monkeypatch.setattr(cpu_lora, "load_library", lambda: None)
    case = make_case(7, (8, 16, 64), 100, 70, seed=3, device=torch.device("cpu"))
    got = case.wide.clone()
    cpu_lora.lora_shrink_expand(*case.args(got))
    torch.testing.assert_close(got, dense(case).float(), **TOL)
    with pytest.raises(ValueError, match="slots must be in"):
        cpu_lora.lora_shrink_expand(case.x, got[:, 7:-9], torch.full((7,), 3, dtype=torch.int32), *case.args()[3:])


@pytest.mark.parametrize("use_cpp", [True, False])
def test_bad_arguments_raise_and_leave_y_alone(monkeypatch: pytest.MonkeyPatch, use_cpp: bool) -> None:
    if use_cpp and not CPP_BUILDS:
        pytest.skip("no C++ kernels here")
    if not use_cpp:
        monkeypatch.setattr(cpu_lora, "load_library", lambda: None)
    case = make_case(5, (8, 16), 32, 24, seed=4, device=torch.device("cpu"))
    x, y, slot, A, B, rank, scale = case.args()
    before = case.wide.clone()
    bad = [
        (dict(slot=torch.tensor([0, 1, 2, -1, 0], dtype=torch.int32)), "slots must be in"),
        (dict(slot=torch.tensor([0, 1, -2, -1, 0], dtype=torch.int32)), "slots must be in"),
        (dict(rank=torch.tensor([8, 65], dtype=torch.int32)), "ranks must be in"),
        (dict(B=B[:, :20]), "B must be"),
        (dict(A=A[:, :, :16]), "A must be"),
        (dict(slot=slot[:4]), "slot must be"),
        (dict(x=x.double()), "x must be torch.float32"),
        (dict(scale=scale[None]), "scale must have 1 dims"),
        (dict(rank=rank.float()), "rank must be int32 or int64"),
    ]
    for change, message in bad:
        kwargs = dict(x=x, y=y, slot=slot, A=A, B=B, rank=rank, scale=scale) | change
        with pytest.raises(ValueError, match=message):
            cpu_lora.lora_shrink_expand(**kwargs)
        assert torch.equal(case.wide, before)


def test_nothing_to_do() -> None:
    for rows, ranks, slots in ((0, (16,), []), (4, (16,), [-1] * 4), (3, (0, 0), [0, 1, 0])):
        case = make_case(rows, ranks, 32, 24, slots=slots, device=torch.device("cpu"))
        before = case.wide.clone()
        cpu_lora.lora_shrink_expand(*case.args())
        assert torch.equal(case.wide, before)


# ---------------------------------------------------------------------------------------------
# Triton (interpreted on CPU: small shapes)


@needs_triton
@pytest.mark.parametrize("rows,ranks,in_f,out_f", [
    (1, (16,), 40, 24),
    (7, (8, 16, 64), 150, 200),  # in over two K tiles, out over two output tiles
    (40, (3, 0, 16, 64, 8), 33, 17),
])
def test_triton_matches_reference_and_dense(rows: int, ranks: tuple[int, ...], in_f: int, out_f: int) -> None:
    case = make_case(rows, ranks, in_f, out_f, seed=rows)
    got = case.wide.clone()
    K.lora_shrink_expand(*case.args(got))
    ref = case.wide.clone()
    K.ref_lora_shrink_expand(*case.args(ref))
    torch.testing.assert_close(got, ref, **TOL)
    torch.testing.assert_close(got.cpu(), dense(case).float(), **TOL)
    check_untouched(case.wide.cpu(), got.cpu(), case.slot)


@needs_triton
def test_triton_bfloat16_sums_in_float32() -> None:
    case = make_case(6, (16, 8), 64, 48, seed=9, dtype=torch.bfloat16)
    got = case.wide.clone()
    K.lora_shrink_expand(*case.args(got))
    # fp32 sums, then one rounding of y to bfloat16 (relative 2^-8)
    torch.testing.assert_close(got.float().cpu(), dense(case).float(), rtol=1e-2, atol=1e-2)
    check_untouched(case.wide.cpu(), got.cpu(), case.slot)


@needs_triton
def test_triton_rejects_what_it_cannot_address() -> None:
    case = make_case(4, (16,), 32, 24)
    x, y, slot, A, B, rank, scale = case.args()
    with pytest.raises(ValueError, match="unit stride"):
        K.lora_shrink_expand(x.t().contiguous().t(), y, slot, A, B, rank, scale)
    with pytest.raises(ValueError, match="B must be"):
        K.lora_shrink_expand(x, y, slot, A, B.transpose(1, 2), rank, scale)


@pytest.mark.skipif(TRITON_HERE, reason="the Triton tests run in this process")
def test_triton_tests_in_an_interpreter_subprocess() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "triton and not subprocess", __file__]
    proc = subprocess.run(cmd, env=env, cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=600)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0 and " passed" in summary and "skipped" not in summary, proc.stdout[-4000:]


COMPILE_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from streamengine.kernels.lora_triton import _lora_expand_kernel, _lora_shrink_kernel

    def build(fn, pointers, consts):
        sig = {name: "i32" for name in fn.arg_names}
        sig.update({name: "i64" for name in fn.arg_names if name.startswith("stride_")})
        sig.update(pointers)
        sig.update({name: "constexpr" for name in consts})
        idx = {(fn.arg_names.index(name),): value for name, value in consts.items()}
        src = ASTSource(fn=fn, signature=sig, constexprs=idx)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})

    for dtype, index, r_p in (("fp32", "i32", 16), ("bf16", "i64", 64)):
        build(_lora_shrink_kernel, {"h_ptr": "*fp32", "x_ptr": f"*{dtype}", "slot_ptr": f"*{index}",
                                    "a_ptr": f"*{dtype}", "rank_ptr": f"*{index}", "scale_ptr": "*fp32"},
              dict(R_P=r_p, BLOCK_K=128))
        build(_lora_expand_kernel, {"y_ptr": f"*{dtype}", "h_ptr": "*fp32", "slot_ptr": f"*{index}",
                                    "b_ptr": f"*{dtype}", "rank_ptr": f"*{index}"}, dict(R_P=r_p, BLOCK_O=128))
    print("COMPILE-OK")
    """
)


@pytest.mark.slow
@pytest.mark.skipif(NATIVE, reason="on CUDA the Triton tests above compile natively")
def test_triton_kernels_compile_for_sm90() -> None:
    """The interpreter accepts code the Triton compiler rejects: build both kernels to a cubin
    for an H100-class target (Triton's bundled ptxas, no GPU needed). Not a run."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", COMPILE_SCRIPT], env=env,
                          cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "COMPILE-OK" in proc.stdout, proc.stdout + proc.stderr[-6000:]
