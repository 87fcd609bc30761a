"""Type stubs of the package ferry (see __init__.py)."""

from typing import List, Optional, Sequence, Tuple

from . import _native
from .errors import AddressNotRegistered as AddressNotRegistered
from .errors import Authentication as Authentication
from .errors import Backend as Backend
from .errors import BatchBusy as BatchBusy
from .errors import BatchFailed as BatchFailed
from .errors import BatchRegisterFailed as BatchRegisterFailed
from .errors import BatchTooLarge as BatchTooLarge
from .errors import Canceled as Canceled
from .errors import FerryError as FerryError
from .errors import InvalidArgument as InvalidArgument
from .errors import Io as Io
from .errors import MissingCapabilities as MissingCapabilities
from .errors import MissingSymbol as MissingSymbol
from .errors import PeerLost as PeerLost
from .errors import Protocol as Protocol
from .errors import QueueFull as QueueFull
from .errors import RegionNotRegistered as RegionNotRegistered
from .errors import RegionOverlap as RegionOverlap
from .errors import SegmentUnavailable as SegmentUnavailable
from .errors import Timeout as Timeout
from .errors import TransferFailed as TransferFailed
from .errors import Unavailable as Unavailable
from .errors import UnknownBatch as UnknownBatch
from .errors import UnknownSegment as UnknownSegment
from .errors import Unsupported as Unsupported

__version__: str
#: Backends compiled into this wheel (URL schemes).
BACKENDS: Tuple[str, ...]
__all__: List[str]

class Engine(_native.Engine):
    @classmethod
    def open(cls, url: str) -> "Engine": ...
    def write(self, segment: int, local_addr: int, remote_addr: int, length: int) -> None: ...
    def read(self, segment: int, local_addr: int, remote_addr: int, length: int) -> None: ...
    async def transfer_async(
        self, segment: int, op: str, local_addr: int, remote_addr: int, length: int
    ) -> None: ...
    async def batch_transfer_async(
        self,
        segment: int,
        op: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
        notify: Optional[Tuple[str, str]] = ...,
    ) -> List[_native.Result]: ...
    async def wait_async(self, batch: int) -> List[_native.Result]: ...
    async def next_notifications_async(
        self, poll_interval: float = ..., timeout: Optional[float] = ...
    ) -> List[Tuple[str, str]]: ...
