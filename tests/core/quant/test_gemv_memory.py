"""The GEMV kernels over edge shapes: every output written once, no read past a row, any thread split.

Shapes the decode path meets rarely: batches past one tile of 8 rows (9..17: a full tile then a partial one),
in_features that leave a tail after the 32-wide vector loop (float32 and int8), every int4 group size, 1..67
outputs, non-contiguous inputs through the wrappers, and one thread task per output row (grain 1) against all rows
on one thread. An output slot the kernel never wrote (``torch::empty``) or a row read from the wrong place shows as a
mismatch against the dequantized reference. (Reads and writes out of bounds need AddressSanitizer to be seen: these
shapes, and more, were run under an ASan build of the same source when a CI run showed one inf output.)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from labkit.core.quant import gemv
from labkit.core.quant.weights import dequantize_weight, quantize_weight


@pytest.fixture(scope="module", params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


BATCHES = [1, 2, 7, 8, 9, 16, 17]  # one tile, a full tile, a full and a partial one (kMaxTile = 8)
OUTPUTS = [1, 35, 67]


@pytest.mark.parametrize("method,n_in", [("f32", 1), ("f32", 31), ("f32", 33), ("f32", 100), ("int8", 17),
                                         ("int8", 95), ("int4", 32), ("int4", 64), ("int4", 128), ("int4", 384)])
def test_every_output_matches_the_reference(threads: int, method: str, n_in: int) -> None:
    module = gemv.load_gemv(warn=False)
    assert module is not None, "labkit's GEMV kernels did not build"
    gen = torch.Generator().manual_seed(n_in)
    for batch, out in itertools.product(BATCHES, OUTPUTS):
        w = torch.randn(out, n_in, generator=gen)
        x = torch.randn(batch, 2 * n_in, generator=gen)[:, ::2]  # (B, in), non-contiguous: the wrapper copies
        for grain in (1, out):  # a task per row (both threads busy), and every row on one thread
            if method == "f32":
                got, ref = module.gemv_f32(x.contiguous(), w, grain), x @ w.T
            elif method == "int8":
                q, s = quantize_weight(w, "int8")
                got = module.gemv_int8(x.contiguous(), q.contiguous(), s.contiguous(), grain)
                ref = x @ dequantize_weight(q, s, "int8").T
            else:
                group = min(n_in, 128) if n_in != 384 else 32  # 32, 64, 128 and many groups of 32
                q, s = quantize_weight(w, "int4", group)
                got = module.gemv_int4(x.contiguous(), q.contiguous(), s.contiguous(), group, grain)
                ref = x @ dequantize_weight(q, s, "int4", group).T
            assert got.shape == (batch, out)
            where = f"B={batch} out={out} grain={grain}"
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4, msg=lambda m, where=where: f"{where}: {m}")
    # the wrappers take the non-contiguous input as it is
    if method == "int4":
        torch.testing.assert_close(gemv.gemv_int4(x, q, s, group), x @ dequantize_weight(q, s, "int4", group).T,
                                   rtol=1e-4, atol=1e-4)
    elif method == "int8":
        torch.testing.assert_close(gemv.gemv_int8(x, q, s), x @ dequantize_weight(q, s, "int8").T, rtol=1e-4,
                                   atol=1e-4)
    else:
        torch.testing.assert_close(gemv.gemv_f32(x, w), x @ w.T, rtol=1e-4, atol=1e-4)
