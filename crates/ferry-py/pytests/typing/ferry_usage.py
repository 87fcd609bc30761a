"""Type-checked, never run (pytests/test_typing.py): Ferry's own API —
``ferry.Engine`` (sync and asyncio), ``ferry.errors``, and what
``ferry.mooncake`` adds to Mooncake's API."""

import asyncio
import ctypes
from typing import Any, Dict, List, Optional, Tuple

import ferry
import ferry.mooncake
from ferry import BatchFailed, Engine, FerryError, Timeout
from ferry.mooncake import KNOWN_PROTOCOLS, TransferEngine, default_url


def native(url: str, peer_name: str) -> Tuple[int, List[Optional[BaseException]]]:
    version: str = ferry.__version__
    backends: Tuple[str, ...] = ferry.BACKENDS
    engine = Engine.open(url)
    name: str = engine.segment_name
    backend: str = engine.backend
    report: Dict[str, Any] = engine.report()
    metrics: Dict[str, Any] = engine.metrics()
    wheel: Any = engine.wheel_engine()  # the Mooncake wheel's engine on mooncake-py://
    buf = bytearray(1 << 20)
    addr, length = engine.register(buf)
    other = ctypes.create_string_buffer(4096)
    regions = engine.batch_register([ctypes.addressof(other)], [4096], "cpu:0")
    seg = engine.open_segment(peer_name)
    engine.write(seg, addr, 0, 4096)
    engine.read(seg, addr, 0, 4096)
    engine.transfer(seg, "write", addr, 0, 4096)
    results = engine.batch_transfer(seg, "write", [addr], [0], [4096], ("kv", "done"))
    batch = engine.submit(seg, "read", [addr], [0], [4096])
    states = engine.status(batch)
    results += engine.wait(batch)
    notes: List[Tuple[str, str]] = engine.take_notifications()
    note: Optional[Tuple[str, str]] = engine.next_notification("kv", timeout=0.5)
    note = engine.next_notification()
    try:
        engine.release_batch(batch)
    except Timeout as e:
        retry: bool = e.retryable
        after: Any = e.after
        del retry, after
    except FerryError as e:
        fields: Dict[str, Any] = e.fields
        message: str = e.message
        del fields, message
    engine.batch_unregister([ctypes.addressof(other)])
    engine.unregister(buf)
    engine.close_segment(seg)
    listed: List[Tuple[int, int]] = engine.registered()
    del version, backends, name, backend, report, metrics, wheel, length, regions, states
    del notes, note, listed
    return addr, results


async def asynchronous(engine: Engine, seg: int, addr: int) -> int:
    await engine.transfer_async(seg, "write", addr, 0, 4096)
    results = await engine.batch_transfer_async(seg, "read", [addr], [0], [4096])
    batch = engine.submit(seg, "write", [addr], [0], [4096])
    results += await engine.wait_async(batch)
    notes = await engine.next_notifications_async(0.001, timeout=1.0)
    failed = [r for r in results if isinstance(r, BatchFailed)]
    return len(notes) + len(failed)


def additions(url: Optional[str]) -> int:
    te = TransferEngine(url or default_url())
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", KNOWN_PROTOCOLS[0], "") != 0:
        error: Optional[BaseException] = te.last_error()
        raise RuntimeError(f"initialize: {error}")
    support: Dict[str, Dict[str, Any]] = te.ferry_support()
    metrics: Dict[str, Any] = te.ferry_metrics()
    engine: Engine = te.ferry_engine()
    ferry.mooncake.install()
    ferry.mooncake.uninstall()
    del support, metrics
    return asyncio.run(asynchronous(engine, 0, 0))
