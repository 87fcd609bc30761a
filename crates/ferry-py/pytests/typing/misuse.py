"""Type-checked, never run (pytests/test_typing.py): wrong calls that the
stubs must reject, each line with the error code mypy must report there
(``# expect: <code>``). If the stubs were missing or said ``Any``, mypy
would report none of them."""

from ferry import Engine
from ferry.mooncake import TransferEngine, TransferNotify


def wrong(te: TransferEngine, engine: Engine) -> None:
    te.register_memory("0x7f00", 4096)  # expect: arg-type
    te.transfer_sync_write("peer", 1, 2)  # expect: call-arg
    port: str = te.get_rpc_port()  # expect: assignment
    te.batch_transfer_sync_write("peer", [1], ["2"], [3])  # expect: list-item
    te.transfer_sync("peer", 1, 2, 3, 1, "note")  # expect: arg-type
    te.no_such_method()  # expect: attr-defined
    engine.transfer(0, "write", 1, 2)  # expect: call-arg
    TransferNotify(1, 2)  # expect: arg-type
    del port
