"""The C++ kernels' build key: a header a kernel includes with quotes is part of its hash, so changing a shared header
rebuilds every kernel that includes it instead of loading a stale build."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from pdkernels import native_build
from pdkernels.native_build import NativeLibrary, build_dir, source_bytes

CSRC = Path(native_build.__file__).parent / "csrc"


def _lib(source: Path) -> NativeLibrary:
    return NativeLibrary(name="probe", source=source, cflags=("-O2",), switch="PDCLUSTER_PROBE", signatures={})


def test_a_quoted_header_changes_the_build_key_and_a_system_header_does_not(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCLUSTER_EXT_CACHE", str(tmp_path / "ext"))
    (tmp_path / "inner.h").write_text("#pragma once\ninline int inner() { return 1; }\n")
    (tmp_path / "outer.h").write_text('#pragma once\n#include "inner.h"\n#include <cstdint>\n')
    src = tmp_path / "k.cpp"
    src.write_text('#include <cstring>\n#include "outer.h"\n  #  include "inner.h"\nint f() { return inner(); }\n')
    before = build_dir(_lib(src))
    assert source_bytes(src).count(b"inline int inner") == 1  # each header once, however often it is included
    (tmp_path / "inner.h").write_text("#pragma once\ninline int inner() { return 2; }\n")  # two levels down
    after = build_dir(_lib(src))
    assert after != before
    assert after.parent == before.parent == tmp_path / "ext"
    # the same source and headers at another path (another checkout) builds in a folder of its own
    (tmp_path / "copy").mkdir()
    for name in ("inner.h", "outer.h", "k.cpp"):
        (tmp_path / "copy" / name).write_bytes((tmp_path / name).read_bytes())
    assert build_dir(_lib(tmp_path / "copy" / "k.cpp")) not in (after, before)


def test_a_missing_quoted_header_is_an_error_not_a_silent_key(tmp_path: Path) -> None:
    src = tmp_path / "k.cpp"
    src.write_text('#include "gone.h"\n')
    with pytest.raises(FileNotFoundError):
        source_bytes(src)


@pytest.mark.parametrize("source", ["cpu_attention.cpp", "cpu_layer_ops.cpp"])
def test_the_kernels_share_one_bf16_header_and_hash_it(source: str) -> None:
    text = (CSRC / source).read_text()
    assert '#include "bf16_scalar.h"' in text
    assert "inline float bf16_to_float" not in text  # defined once, in the header
    assert (CSRC / "bf16_scalar.h").read_bytes() in source_bytes(CSRC / source)


def test_the_shared_conversions_round_as_torch_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The header's float -> bfloat16 (built here into a probe library) equals torch's cast on ties, NaN, inf and
    ordinary values: the two kernels that used to carry their own copies now share this one."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("PDCLUSTER_EXT_CACHE", str(tmp_path / "ext"))
    src = tmp_path / "probe.cpp"
    src.write_text(f'#include "{CSRC / "bf16_scalar.h"}"\n'
                   'extern "C" void round_all(const float* x, uint16_t* y, int64_t n) {\n'
                   '  for (int64_t i = 0; i < n; ++i) y[i] = pdk::float_to_bf16(x[i]);\n}\n'
                   'extern "C" float back(uint16_t h) { return pdk::bf16_to_float(h); }\n')
    lib = NativeLibrary(name="bf16_probe", source=src, cflags=("-O2",), switch="PDCLUSTER_BF16_PROBE",
                        signatures={"round_all": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None),
                                    "back": ([ctypes.c_uint16], ctypes.c_float)})
    dll, why = native_build.load(lib)
    if dll is None:
        pytest.skip(f"no C++ build here: {why}")
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4096, generator=g) * 100,
                   torch.tensor([1.00390625, 1.01171875, -1.00390625, float("inf"), float("-inf"), float("nan"),
                                 0.0, -0.0, 3.4e38, 1e-40])])
    y = torch.empty(x.numel(), dtype=torch.int16)
    dll.round_all(x.data_ptr(), y.data_ptr(), x.numel())
    want = x.to(torch.bfloat16)
    got = y.view(torch.bfloat16)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()].float(), want[~want.isnan()].float())
    assert dll.back(int(want[0].view(torch.int16).item()) & 0xFFFF) == want[0].float().item()


def test_a_build_left_half_done_by_a_dead_process_does_not_stall_the_next(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's ``cpp_extension`` marks a build in progress with a ``lock`` file and waits while it exists; a process
    killed mid-build leaves it behind. The next build must go ahead (under our flock, which dies with its holder)."""
    monkeypatch.setenv("PDCLUSTER_EXT_CACHE", str(tmp_path / "ext"))
    src = tmp_path / "k.cpp"
    src.write_text('extern "C" int seven() { return 7; }\n')
    lib = NativeLibrary(name="stale_probe", source=src, cflags=("-O2",), switch="PDCLUSTER_STALE_PROBE",
                        signatures={"seven": ([], ctypes.c_int)})
    where = build_dir(lib)
    where.mkdir(parents=True)
    (where / "lock").write_text("")  # what a build killed half-way leaves
    dll, why = native_build.load(lib)
    if dll is None and "build failed" not in why:
        pytest.skip(f"no C++ build here: {why}")
    assert dll is not None, why
    assert dll.seven() == 7
    assert not (where / "lock").exists()
