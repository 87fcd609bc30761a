"""Buffer-protocol objects as registrable memory.

The buffer protocol is part of CPython's stable ABI only from 3.11; this wheel
supports 3.9, so the export is taken here, with ctypes: ``from_buffer`` holds a
buffer export for as long as the returned holder lives, which keeps the
exporter from resizing or freeing the memory (a ``bytearray`` cannot grow, a
``memoryview`` cannot be released) while the region is registered.
"""

import ctypes


def buffer_info(obj):
    """``(address, nbytes, holder)`` for an object with the buffer protocol,
    ``None`` for one without it.

    Raises ``ValueError`` for read-only or non-contiguous memory (registered
    memory must be writable: peers write into it).
    """
    try:
        view = memoryview(obj)
    except TypeError:
        return None
    if view.readonly:
        raise ValueError(
            f"{type(obj).__name__} exposes read-only memory; registered memory "
            "must be writable (peers may write into it)"
        )
    if not view.c_contiguous:
        raise ValueError(
            f"{type(obj).__name__} exposes non-contiguous memory; register a "
            "C-contiguous buffer"
        )
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    holder = (ctypes.c_char * view.nbytes).from_buffer(view)
    return ctypes.addressof(holder), view.nbytes, holder
