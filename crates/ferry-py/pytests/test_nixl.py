"""The NIXL backend from Python: the wheel includes it (``ferry.BACKENDS``)
and two engines over the real libnixl_capi.so (the pinned nixl-cu12 wheel,
UCX, DRAM) move bytes and a notification through the native API."""

import os

import ferry
from conftest import address, pattern, unavailable


def _url():
    if "nixl" not in ferry.BACKENDS:
        unavailable("nixl", f"this wheel was built without it (BACKENDS={ferry.BACKENDS})")
    lib = os.environ.get("FERRY_TEST_NIXL_LIB")
    if not lib:
        unavailable("nixl", "FERRY_TEST_NIXL_LIB is not set (the pinned nixl-cu12 wheel could not be installed)")
    return f"nixl://?backends=UCX&lib={lib}"


def test_nixl_engines_move_bytes():
    url = _url()
    a = ferry.Engine.open(url)
    b = ferry.Engine.open(url)
    assert a.backend == "nixl"
    src = bytearray(pattern(256 * 1024))
    dst = bytearray(512 * 1024)
    sa, _ = a.register(src)
    da, _ = b.register(dst)
    seg = a.open_segment(b.segment_name)
    a.write(seg, sa, da + 4096, len(src))
    assert bytes(dst[4096 : 4096 + len(src)]) == bytes(src)
    assert dst[:4096] == bytearray(4096)
    back = bytearray(len(src))
    a.register(back)
    a.read(seg, address(back), da + 4096, len(src))
    assert back == src
    a.close_segment(seg)
