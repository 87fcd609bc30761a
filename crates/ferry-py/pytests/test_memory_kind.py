"""Memory kind at registration: the CUDA driver is asked at run time.

No GPU exists on the test machines, so the driver is a test double:
``fake_libcuda`` below, a C library built here with ``cc`` that exports
``cuInit`` and ``cuPointerGetAttribute`` with the CUDA driver's signatures
and calls the address range in ``FAKE_CUDA_DEVICE_RANGE`` (``addr:len``)
device memory of GPU 3 (anything else: ``CUDA_ERROR_INVALID_VALUE``, as the
real driver answers for memory it never saw). Ferry opens it through
``FERRY_CUDA_LIB`` with the same dlopen path as ``libcuda.so.1``.
"""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

FAKE_LIBCUDA = r"""
#include <stdint.h>
#include <stdlib.h>
#include <stdio.h>
int cuInit(unsigned int flags) { return flags == 0 ? 0 : 1; }
int cuPointerGetAttribute(void *data, int attribute, uint64_t ptr) {
    const char *range = getenv("FAKE_CUDA_DEVICE_RANGE");
    unsigned long long base = 0, len = 0;
    if (!range || sscanf(range, "%llu:%llu", &base, &len) != 2) return 1;
    if (ptr < base || ptr >= base + len) return 1; /* CUDA_ERROR_INVALID_VALUE */
    if (attribute == 2) { *(unsigned int *)data = 2; return 0; } /* MEMORY_TYPE: DEVICE */
    if (attribute == 9) { *(int *)data = 3; return 0; }          /* DEVICE_ORDINAL */
    return 1;
}
"""

CHILD = textwrap.dedent(
    """
    import ctypes, os, sys
    import ferry
    from ferry import _native
    from ferry.mooncake import TransferEngine
    want_driver = sys.argv[1] == "fake"
    assert _native.cuda_driver_present() is want_driver
    dev = ctypes.create_string_buffer(8192)
    host = ctypes.create_string_buffer(8192)
    os.environ["FAKE_CUDA_DEVICE_RANGE"] = f"{ctypes.addressof(dev)}:8192"
    e = ferry.Engine("tcp://127.0.0.1:0")
    e.register(ctypes.addressof(host), 8192)
    if not want_driver:
        e.register(ctypes.addressof(dev), 8192)  # no driver: taken as host memory
        print("ok")
        sys.exit(0)
    try:
        e.register(ctypes.addressof(dev), 8192)
        raise SystemExit("a device pointer was registered on tcp://")
    except ferry.InvalidArgument as err:
        msg = str(err)
        assert "CUDA device memory of GPU 3" in msg and "mooncake-py://" in msg, msg
    try:
        e.batch_register([ctypes.addressof(host) + 4096, ctypes.addressof(dev)], [16, 16])
        raise SystemExit("a device pointer was batch-registered on tcp://")
    except ferry.BatchRegisterFailed as err:
        assert err.index == 1, err
    # All or nothing: the host region of the failed batch is not registered.
    assert e.registered() == [(ctypes.addressof(host), 8192)]
    te = TransferEngine("tcp://")
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert te.register_memory(ctypes.addressof(dev), 8192, "*") == -1
    assert "CUDA device memory" in str(te.last_error())
    print("ok")
    """
)


def run_child(tmp_path, mode):
    env = dict(os.environ)
    if mode == "fake":
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            pytest.skip("no C compiler (cc) to build the CUDA driver test double")
        src = tmp_path / "fake_libcuda.c"
        src.write_text(FAKE_LIBCUDA)
        lib = tmp_path / "libfakecuda.so"
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
        env["FERRY_CUDA_LIB"] = str(lib)
    else:
        env["FERRY_CUDA_LIB"] = str(tmp_path / "no-such-libcuda.so.1")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-4000:]


def test_device_pointer_refused_on_a_host_only_backend(tmp_path):
    run_child(tmp_path, "fake")


def test_without_a_driver_every_pointer_is_host_memory(tmp_path):
    run_child(tmp_path, "absent")
