"""Type stubs of ferry.mooncake (see mooncake.py).

The types are Mooncake's (``mooncake.engine`` 0.3.13.post1, as its pybind11
signatures state them), widened where Ferry accepts more: a sequence where
Mooncake takes a list, an int or ``"read"``/``"write"`` where it takes a
``TransferOpcode``. The CUDA-stream methods and the module-level names the
installed wheel provides are declared here although they exist only where
Mooncake's own module has them (``hasattr`` tells).
"""

import enum
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type, Union

from . import Engine

__all__: List[str]

logger: logging.Logger

class TransferOpcode(enum.IntEnum):
    Read = 0
    Write = 1

Read: TransferOpcode
Write: TransferOpcode

class TransferNotify:
    name: str
    msg: str
    def __init__(self, name: str = ..., msg: str = ...) -> None: ...

#: Transports Mooncake's ``initialize`` knows.
KNOWN_PROTOCOLS: Tuple[str, ...]

#: Where ``ferry.mooncake`` takes an opcode: Mooncake's enum, its int
#: value, or ``"read"``/``"write"``.
_Opcode = Union[TransferOpcode, int, str]

def default_url() -> str: ...

class TransferEngine:
    TransferOpcode: Type[TransferOpcode]
    def __init__(self, url: Optional[str] = ...) -> None: ...
    # -- Ferry's additions
    def last_error(self) -> Optional[BaseException]: ...
    def ferry_support(self) -> Dict[str, Dict[str, Any]]: ...
    def ferry_metrics(self) -> Dict[str, Any]: ...
    def ferry_engine(self) -> Engine: ...
    # -- set-up
    def initialize(
        self, local_hostname: str, metadata_server: str, protocol: str, device_name: str
    ) -> int: ...
    def initialize_ext(
        self,
        local_hostname: str,
        metadata_server: str,
        protocol: str,
        device_name: str,
        metadata_type: str,
    ) -> int: ...
    def get_rpc_port(self) -> int: ...
    # The wheel's C++ engine object on mooncake-py://, the ferry.Engine
    # elsewhere (Mooncake: an opaque ``mooncake::TransferEngine``).
    def get_engine(self) -> Any: ...
    def get_engine_ptr(self) -> int: ...
    def get_local_topology(self, device_name: Optional[str] = ...) -> str: ...
    def warmup_efa_segment(self, segment_name: str) -> int: ...
    def send_probe(self, peer_server_name: str) -> int: ...
    # -- memory
    def register_memory(self, buffer_addr: int, capacity: int, location: str = ...) -> int: ...
    def unregister_memory(self, buffer_addr: int) -> int: ...
    def batch_register_memory(
        self, buffer_addresses: Sequence[int], capacities: Sequence[int], location: str = ...
    ) -> int: ...
    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int: ...
    def allocate_managed_buffer(self, length: int) -> int: ...
    def free_managed_buffer(self, buffer_addr: int, length: int) -> int: ...
    def write_bytes_to_buffer(
        self, dest_address: int, src: Union[str, bytes, bytearray, memoryview], length: int
    ) -> int: ...
    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes: ...
    def get_first_buffer_address(self, segment_name: str) -> int: ...
    # -- transfers
    def transfer_sync_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = ...,
    ) -> int: ...
    def transfer_sync_read(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = ...,
    ) -> int: ...
    def transfer_sync(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        opcode: _Opcode,
        notify: Optional[TransferNotify] = ...,
        transport_hint: str = ...,
    ) -> int: ...
    def batch_transfer_sync_write(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = ...,
    ) -> int: ...
    def batch_transfer_sync_read(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = ...,
    ) -> int: ...
    def batch_transfer_sync(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        opcode: _Opcode,
        notify: Optional[TransferNotify] = ...,
        transport_hint: str = ...,
    ) -> int: ...
    def batch_transfer_async_write(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = ...,
    ) -> int: ...
    def batch_transfer_async_read(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = ...,
    ) -> int: ...
    def batch_transfer_async(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        opcode: _Opcode,
        transport_hint: str = ...,
    ) -> int: ...
    def transfer_submit_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = ...,
    ) -> int: ...
    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int: ...
    def transfer_check_status(self, batch_id: int) -> int: ...
    def get_notifies(self) -> List[TransferNotify]: ...
    # -- CUDA streams: only on mooncake-py:// over a CUDA build of the wheel
    # (AttributeError elsewhere, as on Mooncake's non-CUDA class); they
    # return what the wheel's method returns.
    def transfer_write_on_cuda(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        stream_ptr: int = ...,
        transport_hint: str = ...,
    ) -> int: ...
    def transfer_read_on_cuda(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        stream_ptr: int = ...,
        transport_hint: str = ...,
    ) -> int: ...
    def batch_transfer_write_on_cuda(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        stream_ptr: int = ...,
        transport_hint: str = ...,
    ) -> int: ...
    def batch_transfer_read_on_cuda(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        stream_ptr: int = ...,
        transport_hint: str = ...,
    ) -> int: ...

def install() -> None: ...
def uninstall() -> None: ...

# -- the rest of ``mooncake.engine``: mirrored from the installed wheel
# (its own objects); without a wheel the SUPPORT_* flags are False and the
# other names are absent (AttributeError).
SUPPORT_CUDA: bool
SUPPORT_EFA: bool
SUPPORT_HIP: bool
SUPPORT_INTRA_NVLINK: bool
SUPPORT_MNNVL: bool
SUPPORT_MUSA: bool
InnerTransferEngine: Any
SharedSegment: Any
RpcInterface: Any
CoroRPCInterface: Any
ReceivedData: Any
ReceivedTensor: Any

def create_rpc_client(local_rank: int = ..., world_size: int = ...) -> Any: ...
def create_rpc_server(local_rank: int = ..., world_size: int = ...) -> Any: ...
