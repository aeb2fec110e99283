"""labkit's C++ kernels without AVX-512: the plain loops a learner's laptop compiles (most Intel client CPUs, every
AMD before Zen 4, and anything built for a generic x86-64 lack AVX-512). This machine compiles with -march=native
(AVX-512), so the builds the rest of the tests load never run those loops; here the same sources are built for
x86-64-v2 (SSE4.2: no AVX at all) and every kernel is checked against its reference and against the AVX-512 build."""

from __future__ import annotations

import hashlib
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from paged_tables import shuffled_tables
from test_quant_formats import int8_activations_reference, int16_activations_reference, weights

from labkit.core.attention import cpp_decode
from labkit.core.quant import dequantize_int4, dequantize_int8, gemv, quantize_int4, quantize_int8

FLAGS = ["-O2", "-fopenmp", "-march=x86-64-v2"]  # no AVX, AVX2 or AVX-512: every #else branch


def build_portable(source: Path, prefix: str) -> ModuleType:
    from torch.utils import cpp_extension

    flags = hashlib.sha256(" ".join(FLAGS).encode()).hexdigest()[:8]
    name = f"{cpp_decode.build_name(source, prefix + '_portable')}_{flags}"  # the source and its headers, hashed
    build_dir = cpp_decode.extensions_root() / name  # kept: a second run imports it
    existing = cpp_decode.import_built(name, build_dir)
    if existing is not None:
        return existing
    build_dir.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(name, [str(source)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                              build_directory=str(build_dir), verbose=False)


@pytest.fixture(scope="module")
def portable() -> tuple[ModuleType, ModuleType]:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        pytest.skip("the portable build is checked on x86-64 Linux (-march=x86-64-v2)")
    if gemv.load_gemv(warn=False) is None:  # no compiler or ninja (it says which): nothing to build here either
        pytest.skip(f"no C++ kernel here: {gemv.load_result().missing}")
    assert cpp_decode.find_ninja() is None
    return (build_portable(gemv.SOURCE, "labkit_gemv"), build_portable(cpp_decode.SOURCE, "labkit_paged_decode"))


def uses_zmm(module: ModuleType) -> bool:
    """Whether the module's machine code names a 512-bit register (AVX-512), by its disassembly."""
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(module.__file__)], capture_output=True,
                             text=True, check=True).stdout
    return "%zmm" in listing


def test_portable_build_has_no_avx512_code(portable: tuple[ModuleType, ModuleType]) -> None:
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed")
    assert not any(uses_zmm(module) for module in portable)
    if "avx512f" in Path("/proc/cpuinfo").read_text():  # the check can tell: the -march=native build uses them
        assert uses_zmm(gemv.load_gemv())  # type: ignore[arg-type]


@pytest.mark.parametrize("batch", [1, 3, 9])
def test_portable_gemv_kernels_match_their_references(portable: tuple[ModuleType, ModuleType], batch: int) -> None:
    module = portable[0]
    w = weights(70, 576, seed=batch)
    x = torch.randn(batch, 576, generator=torch.Generator().manual_seed(batch))
    tol = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(module.gemv_f32(x, w, 8), x @ w.T, **tol)
    q, s = quantize_int8(w)
    torch.testing.assert_close(module.gemv_int8(x, q, s, 8), x @ dequantize_int8(q, s).T, **tol)
    for group in (32, 64):
        p, s4 = quantize_int4(w, group)
        torch.testing.assert_close(module.gemv_int4(x, p, s4, group, 8), x @ dequantize_int4(p, s4, group).T, **tol)
        torch.testing.assert_close(module.gemv_int4_a8(x, p, s4, group, 8),
                                   int8_activations_reference(x, p, s4, group), rtol=1e-5, atol=1e-5)
        assert torch.equal(module.gemv_int4_a8(x, p, s4, group, 1), module.gemv_int4_a8(x, p, s4, group, 10**6))
        torch.testing.assert_close(module.gemv_int4_a16(x, p, s4, group, 8),
                                   int16_activations_reference(x, dequantize_int4(p, s4, group)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(module.gemv_int8_a16(x, q, s, 8), int16_activations_reference(x, dequantize_int8(q, s)),
                               rtol=1e-5, atol=1e-5)
    x50 = x[:, :50].contiguous()  # int8's inputs need not fill a group of 32
    q50, s50 = quantize_int8(w[:, :50].contiguous())
    torch.testing.assert_close(module.gemv_int8_a16(x50, q50, s50, 8),
                               int16_activations_reference(x50, dequantize_int8(q50, s50)), rtol=1e-5, atol=1e-5)


def test_portable_layer_ops_match_the_avx512_build(portable: tuple[ModuleType, ModuleType]) -> None:
    module, native = portable[0], gemv.load_gemv()
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 576, generator=gen), torch.rand(576, generator=gen)
    torch.testing.assert_close(module.rms_norm_f32(x, w, 1e-5), native.rms_norm_f32(x, w, 1e-5))
    gu = torch.randn(3, 2 * 1536, generator=gen)
    torch.testing.assert_close(module.silu_mul_f32(gu), native.silu_mul_f32(gu))
    qkv, cos, sin = torch.randn(2, 15 * 64, generator=gen), torch.randn(2, 64, generator=gen), torch.randn(2, 64)
    torch.testing.assert_close(module.rope_f32(qkv, cos, sin, 12), native.rope_f32(qkv, cos, sin, 12))


@pytest.mark.parametrize("d,block_size", [(64, 16), (48, 8), (128, 32)])
def test_portable_paged_decode_matches_the_avx512_build(portable: tuple[ModuleType, ModuleType], d: int,
                                                        block_size: int) -> None:
    module, native = portable[1], cpp_decode.load_extension()
    gen = torch.Generator().manual_seed(d)
    n_kv, group, lens = 3, 3, [1, 17, 200]
    blocks = sum(-(-c // block_size) for c in lens)
    k_pool = torch.randn(blocks, block_size, n_kv, d, generator=gen)
    v_pool = torch.randn(blocks, block_size, n_kv, d, generator=gen)
    tables = shuffled_tables(blocks, block_size, lens, gen)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), n_kv * group, d, generator=gen)
    for splits in (1, 2):
        torch.testing.assert_close(module.paged_decode(q, k_pool, v_pool, padded, ctx, d ** -0.5, 1, splits),
                                   native.paged_decode(q, k_pool, v_pool, padded, ctx, d ** -0.5, 1, splits),
                                   rtol=2e-5, atol=2e-5)


def test_the_decode_steps_source_builds_without_avx512(portable: tuple[ModuleType, ModuleType]) -> None:
    """decode_plan=True's step compiles both kernels' sources as one translation unit: their plain-loop branches must
    not clash there either (both once had a constant named kLanes, which only this build would have found)."""
    from labkit.core.engine import decode_plan

    module = build_portable(decode_plan.STEP_SOURCE, "labkit_decode_step")
    step = module.DecodeStep(4, 2, 16)
    assert step.num_layers == 0
    with pytest.raises(RuntimeError, match="multiple of n_kv_heads"):
        module.DecodeStep(4, 3, 16)
    if shutil.which("objdump") is not None:
        assert not uses_zmm(module)
