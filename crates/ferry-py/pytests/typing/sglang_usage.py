"""Type-checked, never run (pytests/test_typing.py): every method of
``TransferEngine`` called the way SGLang's wrapper calls Mooncake's
(``sglang/srt/distributed/device_communicators/mooncake_transfer_engine.py``,
0.5.23: positional arguments, addresses as ints, lists of ints, the int
return checked) plus the calls of Mooncake's API that wrapper does not make.

The test checks it as written (against ``ferry.mooncake``) and with the
import below pointed at ``mooncake.engine`` (the real wheel).
"""

import ctypes
import logging
from typing import Dict, List, Optional, Union

from ferry.mooncake import (
    SUPPORT_CUDA,
    SUPPORT_EFA,
    SUPPORT_HIP,
    SUPPORT_INTRA_NVLINK,
    SUPPORT_MNNVL,
    SUPPORT_MUSA,
    CoroRPCInterface,
    InnerTransferEngine,
    Read,
    ReceivedData,
    ReceivedTensor,
    RpcInterface,
    SharedSegment,
    TransferEngine,
    TransferNotify,
    TransferOpcode,
    Write,
    create_rpc_client,
    create_rpc_server,
)

logger = logging.getLogger(__name__)


class MooncakeTransferEngine:
    """SGLang's wrapper, reduced to its calls of the engine."""

    def __init__(self, hostname: str, ib_device: Optional[str] = None) -> None:
        self.engine = TransferEngine()
        self.hostname = hostname
        self.ib_device = ib_device
        self.initialize(hostname=self.hostname, device_name=self.ib_device)
        self.session_id = f"{self.hostname}:{self.engine.get_rpc_port()}"

    def register(self, ptr: int, length: int) -> None:
        ret_value = self.engine.register_memory(ptr, length)
        if ret_value != 0:
            raise RuntimeError(f"register_memory returned {ret_value}")

    def deregister(self, ptr: int) -> None:
        ret_value = self.engine.unregister_memory(ptr)
        if ret_value != 0:
            raise RuntimeError(f"unregister_memory returned {ret_value}")

    def batch_register(self, ptrs: List[int], lengths: List[int]) -> int:
        try:
            ret_value = self.engine.batch_register_memory(ptrs, lengths)
        except Exception:
            ret_value = -1
            if not hasattr(self.engine, "batch_register_memory"):
                raise RuntimeError("no batch_register_memory on this engine")
        if ret_value != 0:
            logger.debug("batch_register_memory returned %s", ret_value)
        return ret_value

    def batch_deregister(self, ptrs: List[int]) -> int:
        try:
            ret_value = self.engine.batch_unregister_memory(ptrs)
        except Exception:
            ret_value = -1
        return ret_value

    def initialize(self, hostname: str, device_name: Optional[str]) -> None:
        ret_value = self.engine.initialize(
            hostname,
            "P2PHANDSHAKE",
            "tcp",
            device_name if device_name is not None else "",
        )
        if ret_value != 0:
            raise RuntimeError(f"initialize returned {ret_value}")

    def transfer_sync(
        self, session_id: str, buffer: int, peer_buffer_address: int, length: int
    ) -> int:
        try:
            ret = self.engine.transfer_sync_write(session_id, buffer, peer_buffer_address, length)
        except Exception:
            ret = -1
        if ret < 0:
            logger.debug("transfer_sync_write returned %s", ret)
        return ret

    def batch_transfer_sync(
        self,
        session_id: str,
        buffers: List[int],
        peer_buffer_addresses: List[int],
        lengths: List[int],
    ) -> int:
        try:
            ret = self.engine.batch_transfer_sync_write(
                session_id, buffers, peer_buffer_addresses, lengths
            )
        except Exception:
            ret = -1
        return ret

    def get_session_id(self) -> str:
        return self.session_id

    def send_probe(self, peer_session_id: str) -> int:
        return self.engine.send_probe(peer_session_id)

    def get_engine(self) -> object:
        return self.engine.get_engine()


def the_rest_of_the_api(te: TransferEngine, peer: str, remote: int) -> int:
    """Every other method, with the types Mooncake's binding declares."""
    buf = ctypes.create_string_buffer(1 << 20)
    addr = ctypes.addressof(buf)
    rc = te.initialize_ext("127.0.0.1", "P2PHANDSHAKE", "tcp", "", "p2p")
    rc |= te.register_memory(addr, 1 << 20, "cpu:0")
    ptr: int = te.get_engine_ptr()
    topology: str = te.get_local_topology()
    topology = te.get_local_topology("mlx5_0")
    rc |= te.warmup_efa_segment(peer)
    managed = te.allocate_managed_buffer(4096)
    rc |= te.write_bytes_to_buffer(managed, b"hello", 5)
    data: bytes = te.read_bytes_from_buffer(managed, 5)
    rc |= te.free_managed_buffer(managed, 4096)
    first: int = te.get_first_buffer_address(peer)
    rc |= te.transfer_sync_read(peer, addr, remote, 4096)
    rc |= te.transfer_sync(peer, addr, remote, 4096, TransferOpcode.Write)
    rc |= te.transfer_sync(peer, addr, remote, 4096, Write, TransferNotify("kv", "done"))
    rc |= te.batch_transfer_sync_read(peer, [addr], [remote], [4096])
    rc |= te.batch_transfer_sync(peer, [addr], [remote], [4096], Read, None, "")
    ids: List[int] = [
        te.batch_transfer_async_write(peer, [addr], [remote], [4096]),
        te.batch_transfer_async_read(peer, [addr], [remote], [4096]),
        te.batch_transfer_async(peer, [addr], [remote], [4096], TransferOpcode.Read),
    ]
    rc |= te.get_batch_transfer_status(ids)
    one = te.transfer_submit_write(peer, addr, remote, 4096)
    state: int = te.transfer_check_status(one)
    notes: Dict[str, str] = {n.name: n.msg for n in te.get_notifies()}
    if hasattr(te, "transfer_write_on_cuda"):
        stream = 0
        rc |= te.transfer_write_on_cuda(peer, addr, remote, 4096, stream)
        rc |= te.transfer_read_on_cuda(peer, addr, remote, 4096, stream)
        rc |= te.batch_transfer_write_on_cuda(peer, [addr], [remote], [4096], stream)
        rc |= te.batch_transfer_read_on_cuda(peer, [addr], [remote], [4096], stream)
    opcode: TransferOpcode = te.TransferOpcode.Read
    rc |= te.batch_unregister_memory([addr])
    del ptr, topology, data, first, state, notes, opcode
    return rc


def module_names() -> List[object]:
    """The module-level names of ``mooncake.engine``."""
    flags: List[Union[bool, int]] = [
        SUPPORT_CUDA,
        SUPPORT_EFA,
        SUPPORT_HIP,
        SUPPORT_INTRA_NVLINK,
        SUPPORT_MNNVL,
        SUPPORT_MUSA,
    ]
    helpers: List[object] = [
        InnerTransferEngine,
        SharedSegment,
        RpcInterface,
        CoroRPCInterface,
        ReceivedData,
        ReceivedTensor,
        create_rpc_client(0, 1),
        create_rpc_server(),
    ]
    return [*flags, *helpers]
