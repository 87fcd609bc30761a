"""Type stubs of the extension module ferry._native (see ferry.Engine)."""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

__version__: str
BACKENDS: List[str]

def cuda_driver_present() -> bool: ...
def _parse_url(url: str) -> Tuple[str, str, str, List[Tuple[str, Optional[str]]]]:
    """Ferry's own URL parser (one set of rules: a repeated key is refused):
    (scheme, authority, path, query pairs in URL order; a bare key has None)."""
    ...

Memory = Any  # an int address, or an object exposing writable memory
Result = Optional[BaseException]  # None, or the exception of one request

class Engine:
    def __init__(self, url: str) -> None: ...
    @property
    def segment_name(self) -> str: ...
    @property
    def backend(self) -> str: ...
    def report(self) -> Dict[str, Any]: ...
    def metrics(self) -> Dict[str, Any]: ...
    def wheel_engine(self) -> Any: ...
    def register(
        self, target: Memory, length: Optional[int] = ..., location: Optional[str] = ...
    ) -> Tuple[int, int]: ...
    def unregister(self, target: Memory) -> None: ...
    def batch_register(
        self,
        targets: Sequence[Memory],
        lengths: Optional[Sequence[Optional[int]]] = ...,
        location: Optional[str] = ...,
    ) -> List[Tuple[int, int]]: ...
    def batch_unregister(self, targets: Sequence[Memory]) -> None: ...
    def registered(self) -> List[Tuple[int, int]]: ...
    def open_segment(self, name: str) -> int: ...
    def close_segment(self, segment: int) -> None: ...
    def transfer(
        self, segment: int, op: str, local_addr: int, remote_addr: int, length: int
    ) -> None: ...
    def batch_transfer(
        self,
        segment: int,
        op: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
        notify: Optional[Tuple[str, str]] = ...,
    ) -> List[Result]: ...
    def submit(
        self,
        segment: int,
        op: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
        notify: Optional[Tuple[str, str]] = ...,
    ) -> int: ...
    def status(self, batch: int) -> List[Tuple[str, Union[int, None, BaseException]]]: ...
    def wait(self, batch: int) -> List[Result]: ...
    def release_batch(self, batch: int) -> None: ...
    def take_notifications(self) -> List[Tuple[str, str]]: ...
    def next_notification(
        self, name: Optional[str] = ..., timeout: Optional[float] = ...
    ) -> Optional[Tuple[str, str]]: ...
    def _transfer_cb(
        self,
        segment: int,
        op: str,
        local_addr: int,
        remote_addr: int,
        length: int,
        callback: Callable[[Optional[BaseException], Any], None],
    ) -> None: ...
    def _batch_transfer_cb(
        self,
        segment: int,
        op: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
        notify: Optional[Tuple[str, str]],
        callback: Callable[[Optional[BaseException], Any], None],
    ) -> None: ...
    def _wait_cb(
        self, batch: int, callback: Callable[[Optional[BaseException], Any], None]
    ) -> None: ...
    def _bench_loop(
        self,
        segment: int,
        op: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
        iterations: int,
        span: int,
        stride: Optional[int] = ...,
    ) -> float: ...
