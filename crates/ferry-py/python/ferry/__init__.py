"""Ferry for Python: move bytes between processes' memories.

Two APIs over one Rust engine (``ferry::Engine``):

- :class:`ferry.Engine`, the native API: ``Engine.open(url)`` for any backend
  the wheel was built with (``tcp://``, ``mooncake://``), registration by
  address or by any object exposing writable memory, segments, single and
  batch transfers, async batches, notifications, the capability report;
  blocking calls release the GIL and the waiting calls have ``*_async``
  variants for asyncio;
- :class:`ferry.mooncake.TransferEngine`, a drop-in for
  ``mooncake.engine.TransferEngine`` as SGLang and vLLM call it.

Errors are the classes of :mod:`ferry.errors`, one per ``ferry::Error``
variant.
"""

import asyncio

from . import _native
from .errors import *  # noqa: F401,F403
from .errors import FerryError, __all__ as _error_names

__version__ = _native.__version__

#: Backends compiled into this wheel (URL schemes).
BACKENDS = tuple(_native.BACKENDS)

__all__ = ["Engine", "BACKENDS", "FerryError"] + list(_error_names)


def _callback_future():
    """An asyncio future of the running loop and the callback that settles
    it from any thread: ``callback(error, value)``."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(err, value):
        if fut.cancelled():
            return
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(value)

    def callback(err, value):
        loop.call_soon_threadsafe(settle, err, value)

    return fut, callback


class Engine(_native.Engine):
    """A Ferry engine (see the module docs). ``Engine(url)`` or
    ``Engine.open(url)``; the URL picks the backend::

        tcp://127.0.0.1:0
        mooncake://?lib=/path/libtransfer_engine.so&metadata=P2PHANDSHAKE&protocol=tcp

    plus Ferry's own parameters: ``strict=1`` (no emulation),
    ``require=batch_transfer,notify`` (fail to open when missing),
    ``coalesce=0|1``, ``max_concurrency=N``.
    """

    __slots__ = ()

    @classmethod
    def open(cls, url):
        """Opens an engine (blocks, GIL released, until it is started)."""
        return cls(url)

    def write(self, segment, local_addr, remote_addr, length):
        """``transfer(segment, "write", …)``."""
        return self.transfer(segment, "write", local_addr, remote_addr, length)

    def read(self, segment, local_addr, remote_addr, length):
        """``transfer(segment, "read", …)``."""
        return self.transfer(segment, "read", local_addr, remote_addr, length)

    async def transfer_async(self, segment, op, local_addr, remote_addr, length):
        """``transfer`` for asyncio: the loop keeps running meanwhile."""
        fut, cb = _callback_future()
        self._transfer_cb(segment, op, local_addr, remote_addr, length, cb)
        return await fut

    async def batch_transfer_async(
        self, segment, op, local_addrs, remote_addrs, lengths, notify=None
    ):
        """``batch_transfer`` for asyncio; returns the per-request results."""
        fut, cb = _callback_future()
        self._batch_transfer_cb(
            segment, op, local_addrs, remote_addrs, lengths, notify, cb
        )
        return await fut

    async def wait_async(self, batch):
        """``wait`` for asyncio; returns the per-request results."""
        fut, cb = _callback_future()
        self._wait_cb(batch, cb)
        return await fut

    async def next_notifications_async(self, poll_interval=0.001, timeout=None):
        """Waits (asynchronously, polling) until at least one notification
        has arrived and returns them all; ``asyncio.TimeoutError`` after
        ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            notes = self.take_notifications()
            if notes:
                return notes
            if deadline is not None and loop.time() >= deadline:
                raise asyncio.TimeoutError("no notification arrived")
            await asyncio.sleep(poll_interval)
