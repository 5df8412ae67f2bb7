"""The payload MAC's Triton row sums (pdkernels.triton_mac) against the torch reference (pdkernels.poly_mac), exactly:
lengths that are not a multiple of a row or of a program's rows, the empty payload, extreme bytes, and the byte views
of fp8 / int8 / bf16 payloads; then whole tags through the dispatch, Triton against the reference.

On a CUDA machine the kernel runs on the device; here under ``TRITON_INTERPRET=1`` (exact: int64 only), set only for
this module's tests. Grids stay small (~2.5 ms per program instance in the interpreter). ~10 s here.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator

import pytest
import torch

import pdkernels
from tests.triton_route import triton_route
from pdkernels import poly_mac
from pdkernels.poly_mac import P, ROW

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.fixture(scope="module", autouse=True)
def triton_path() -> Iterator[None]:
    with triton_route("pdkernels.triton_mac"):
        yield


def _triton():  # type: ignore[no-untyped-def]
    return importlib.import_module("pdkernels.triton_mac")


def _points(seed: int) -> tuple[poly_mac.Points, poly_mac.Points]:
    g = torch.Generator().manual_seed(seed)
    pts = [int(x) % P for x in torch.randint(0, 2**62, (2,), generator=g)]
    return poly_mac.Points(pts, DEVICE), poly_mac.Points(pts, "cpu")


def _reference_sums(x: torch.Tensor, host: poly_mac.Points) -> torch.Tensor:
    return poly_mac.row_sums_reference(x.cpu(), host)


# several programs (MAC_ROWS rows each) and their ragged last one; the padded first row; one byte; none
LENGTHS = [0, 1, 5, ROW - 1, ROW, ROW + 1, 4 * ROW + 3, 9 * ROW + 77]


@pytest.mark.parametrize("n", LENGTHS)
def test_row_sums_equal_the_reference(n: int) -> None:
    dev, host = _points(n)
    g = torch.Generator().manual_seed(n)
    for x in (torch.randint(-128, 128, (n,), generator=g, dtype=torch.int8),
              torch.full((n,), -128, dtype=torch.int8), torch.full((n,), 127, dtype=torch.int8)):
        got = _triton().row_sums(x.to(DEVICE), dev.halves)
        assert got.shape == (poly_mac.num_rows(n), 2)
        assert torch.equal(got.cpu(), _reference_sums(x, host))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8, torch.bfloat16, torch.float32])
def test_byte_views_of_each_payload_dtype(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    t = (torch.randn(2, 3, 16, 2, 24, generator=g) * 4).to(dtype)  # 4608 elements: not a multiple of ROW bytes
    x = t.reshape(-1).view(torch.uint8).view(torch.int8)
    dev, host = _points(int(dtype.itemsize))
    got = _triton().row_sums(x.to(DEVICE), dev.halves)
    assert torch.equal(got.cpu(), _reference_sums(x, host))


@pytest.mark.parametrize("n", [0, 3, 2 * ROW + 9])
def test_whole_tags_through_the_dispatch(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from kv_transfer.wire.payload_mac import PartKey, payload_tag

    g = torch.Generator().manual_seed(100 + n)
    payload = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    key = PartKey((12345678901234567 % P, P - 2), (5, P - 1))
    on_triton = payload_tag(payload.to(DEVICE), key)
    monkeypatch.setattr(pdkernels, "uses_triton", lambda t: False)  # the reference path, on the CPU
    assert on_triton == payload_tag(payload, key)
