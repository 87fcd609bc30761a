"""A drop-in for ``mooncake.engine.TransferEngine``.

Replace ``from mooncake.engine import TransferEngine`` with
``from ferry.mooncake import TransferEngine``: the method names, argument
order and return conventions are Mooncake's Python API (as SGLang and vLLM
call it), and every method exists on every backend and every Mooncake build:

- synchronous calls return ``0`` on success and a negative int on failure;
- asynchronous submits return a batch id, ``0`` on failure;
- ``get_batch_transfer_status`` waits and returns ``0`` / ``-1``;
- ``transfer_check_status`` returns ``1`` (done), ``0`` (pending),
  ``-1`` (failed), ``-2`` (timed out).

Where the engine underneath lacks an operation natively (a batch register
on a build without ``registerLocalMemoryBatch``, say), Ferry's capability
adapter emulates it with the same semantics; :meth:`TransferEngine.ferry_support`
and the log line at ``initialize`` say which methods are native, emulated
or unsupported on this engine. Wrong argument *types* raise ``TypeError`` as
Mooncake's pybind11 binding does; everything else (unregistered addresses,
unreachable peers, lists of different lengths) is a negative return, and the
Ferry exception behind it is kept for :meth:`TransferEngine.last_error`.

The backend comes from the constructor's ``url`` or the ``FERRY_URL``
environment variable. Without either, the default is ``mooncake-py://``
when the Mooncake wheel is installed (``mooncake.engine`` can be found):
the wheel's own engine moves the bytes, with its transports (RDMA, TCP) and
its wire protocol, so this node keeps talking to plain Mooncake nodes, and
Ferry adds the methods that wheel lacks. With no wheel installed the default
is ``tcp://`` (Ferry's TCP transport: every node of the cluster must then
run Ferry; it does not interoperate with Mooncake nodes).
``mooncake://?lib=/path/libtransfer_engine.so`` runs over a Mooncake C-API
library.

Failures are loud: a failed call returns Mooncake's negative value, logs
the reason at WARNING on the ``ferry.mooncake`` logger, and keeps it for
:meth:`TransferEngine.last_error`. ``initialize`` refuses a transport the
backend cannot honour (``protocol="rdma"`` on ``tcp://``) unless the
fallback is asked for (``allow_protocol_fallback=1`` in the URL or
``FERRY_ALLOW_PROTOCOL_FALLBACK=1``), an unknown protocol, a device that
does not exist and a metadata server the backend cannot use.
``MC_FORCE_TCP`` (set to any value) means the TCP transport only, as in
Mooncake.

No code edit in the serving stack: :func:`install` (or
``FERRY_MOONCAKE_SHIM=1`` in the environment, read at interpreter start-up)
makes ``from mooncake.engine import TransferEngine`` give Ferry's class over
the installed wheel.
"""

import ctypes
import enum
import importlib.abc
import importlib.util
import json
import logging
import os
import sys
import threading
import urllib.parse

from . import Engine, _native
from . import errors as _errors
from ._native import _parse_url
from .errors import AddressNotRegistered, FerryError

__all__ = [
    "TransferEngine",
    "TransferOpcode",
    "TransferNotify",
    "Read",
    "Write",
    "install",
    "uninstall",
    "default_url",
]

logger = logging.getLogger("ferry.mooncake")


class TransferOpcode(enum.IntEnum):
    """Mooncake's ``TransferOpcode``: ``Read`` = 0, ``Write`` = 1."""

    Read = 0
    Write = 1


Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferNotify:
    """Mooncake's ``TransferNotify``: a notification ``name`` and ``msg``."""

    __slots__ = ("name", "msg")

    def __init__(self, name="", msg=""):
        self.name = name
        self.msg = msg

    def __repr__(self):
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"

    def __eq__(self, other):
        return (
            isinstance(other, TransferNotify)
            and self.name == other.name
            and self.msg == other.msg
        )


# Which Ferry operation carries each method (for ferry_support()).
_METHOD_OPERATION = {
    "register_memory": "register",
    "unregister_memory": "unregister",
    "batch_register_memory": "batch_register",
    "batch_unregister_memory": "batch_unregister",
    "transfer_sync_write": "transfer",
    "transfer_sync_read": "transfer",
    "transfer_sync": "transfer",
    "batch_transfer_sync_write": "batch_transfer",
    "batch_transfer_sync_read": "batch_transfer",
    "batch_transfer_sync": "batch_transfer",
    "batch_transfer_async_write": "async_batch",
    "batch_transfer_async_read": "async_batch",
    "batch_transfer_async": "async_batch",
    "transfer_submit_write": "async_batch",
    "transfer_check_status": "async_batch",
    "get_batch_transfer_status": "batch_wait",
    "get_notifies": "notify",
    "allocate_managed_buffer": "register",
    "free_managed_buffer": "unregister",
}


def _split_host_port(hostname):
    """``host[:port]`` (also ``[v6]:port``) → ``(host, port or 0)``."""
    if hostname.startswith("["):
        host, _, rest = hostname[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif hostname.count(":") == 1:
        host, port = hostname.split(":")
    else:
        host, port = hostname, ""
    try:
        return host, int(port) if port else 0
    except ValueError:
        return hostname, 0


def _etcd_endpoints(metadata_server, metadata_type):
    """The etcd endpoints ``h:p,h2:p2`` when ``initialize`` asks for
    Mooncake's etcd mode (``etcd://h:p[,h2:p2]``, ``;`` also separates;
    a bare ``h:p`` as Mooncake takes it, or ``metadata_type="etcd"``),
    else ``None``."""
    server = (metadata_server or "").strip()
    if not server or server == "P2PHANDSHAKE" or metadata_type == "p2p":
        return None
    scheme, sep, rest = server.partition("://")
    if sep:
        if scheme.lower() != "etcd":
            return None
    elif metadata_type not in ("", None, "etcd"):
        return None
    else:
        rest = server
    return ",".join(e.strip() for e in rest.replace(";", ",").split(",") if e.strip())


def _etcd_mode(local_hostname, base_path, params, endpoints):
    """``tcp://`` in etcd mode: adds the discovery parameters to ``params``
    and returns where to listen, ``(host, port)``.

    The segment name is ``local_hostname``, as in Mooncake. A name without
    ``:`` (``prefill-0``, ``10.0.0.7``) is published as a logical name: the
    engine listens on the URL's ``host[:port]`` (``tcp://10.0.0.7:0``) or,
    without one, on ``local_hostname`` itself with a free port. A
    ``host:port`` name is an address: the engine listens there and
    publishes its ``host:port`` segment name, which peers open directly."""
    if not _native._ETCD:
        raise _errors.Unavailable(
            "this ferry wheel was built without etcd support (the cargo feature `etcd` of "
            "ferry-py), so ferry.mooncake cannot use Mooncake's etcd mode on tcp://; build "
            "the wheel with `maturin build --features etcd` (needs protoc), or use "
            "mooncake-py:// (the Mooncake wheel's own etcd client)",
            backend="etcd",
            reason="built without the etcd feature",
        )
    if not endpoints:
        raise ValueError("etcd metadata server without an endpoint (etcd://host:port)")
    params.append(("metadata", f"etcd://{endpoints}"))
    host, port = _split_host_port(local_hostname or "")
    if ":" in (local_hostname or ""):
        return host, port
    if not local_hostname:
        raise ValueError("etcd mode needs local_hostname: the segment name peers open")
    params.append(("segment_name", local_hostname))
    if base_path:
        return _split_host_port(base_path)
    return local_hostname, 0


def _is_loopback(host):
    """Whether ``host`` (a name or an address) is a loopback address."""
    import ipaddress
    import socket

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def _bracket(host):
    return f"[{host}]" if ":" in host else host


#: Transports Mooncake's ``initialize`` knows (its ``protocol`` argument).
KNOWN_PROTOCOLS = (
    "tcp",
    "rdma",
    "nvmeof",
    "nvlink",
    "nvlink_intra",
    "hip",
    "cxl",
    "efa",
    "ascend",
    "barex",
    "ubshmem",
)

_TRUE = ("1", "true", "yes", "on")


def _wheel_present():
    """Whether ``mooncake.engine`` can be found (without importing it)."""
    try:
        return importlib.util.find_spec("mooncake.engine") is not None
    except Exception:  # a broken mooncake package counts as absent
        return False


def default_url():
    """The backend URL used when neither the constructor nor ``FERRY_URL``
    names one: ``mooncake-py://`` if the Mooncake wheel is installed, else
    ``tcp://``."""
    return "mooncake-py://" if _wheel_present() else "tcp://"


def _force_tcp():
    """``MC_FORCE_TCP`` set (to any value): Mooncake's TCP transport only."""
    return os.environ.get("MC_FORCE_TCP") is not None


def _device_exists(name):
    return os.path.exists(os.path.join("/sys/class/infiniband", name)) or os.path.exists(
        os.path.join("/sys/class/net", name)
    )


def _wheel_class():
    """The installed wheel's ``TransferEngine`` class (the one the shim
    saved, when it is active), or ``None`` without a wheel."""
    if not _wheel_present():
        return None
    try:
        import mooncake.engine as wheel
    except Exception:  # a wheel that does not import has no methods
        return None
    cls = getattr(wheel, "TransferEngine", None)
    return getattr(cls, "_ferry_wheel_class", None) or cls


def _scheme(url):
    return url.partition("://")[0]


def _query(pairs):
    """The query of ``(key, value)`` pairs as Ferry's parser reads it back:
    ``+`` for a space, everything else percent-encoded; a ``None`` value is
    a bare key (``strict``)."""
    return "&".join(
        urllib.parse.quote_plus(k) if v is None else urllib.parse.urlencode([(k, v)])
        for k, v in pairs
    )


class _CudaStreamMethod:
    """One of Mooncake's CUDA-stream methods, there exactly where Mooncake's
    own class has it, so that ``hasattr`` tells the truth: on an engine
    whose backend is ``mooncake-py://`` and whose wheel's class has the
    method (a CUDA build, ``SUPPORT_CUDA``, >= 0.3.9). Everywhere else,
    and without a wheel, ``AttributeError``, as on a non-CUDA build."""

    def __init__(self, func):
        self._func = func
        self.__doc__ = func.__doc__
        self.__name__ = func.__name__

    def __set_name__(self, owner, name):
        self._name = name

    def _present(self, owner, instance):
        if instance is None:
            url = os.environ.get("FERRY_URL") or owner._default_url()
            wheel_cls = getattr(owner, "_ferry_wheel_class", None) or _wheel_class()
            return _scheme(url) == "mooncake-py" and hasattr(wheel_cls, self._name)
        engine = instance.__dict__.get("_engine")
        if engine is not None:
            try:
                wheel = engine.wheel_engine()
            except (FerryError, RuntimeError):  # a closed engine has none
                return False
            return wheel is not None and hasattr(wheel, self._name)
        wheel_cls = getattr(owner, "_ferry_wheel_class", None) or _wheel_class()
        return _scheme(instance._base_url) == "mooncake-py" and hasattr(wheel_cls, self._name)

    def __get__(self, instance, owner=None):
        owner = owner if owner is not None else type(instance)
        if not self._present(owner, instance):
            raise AttributeError(
                f"{owner.__name__!r} object has no attribute {self._name!r} (Mooncake's "
                "CUDA-stream methods exist only on mooncake-py:// over a CUDA build of the "
                "Mooncake wheel, as on Mooncake's own class)"
            )
        if instance is None:
            return self._func
        return self._func.__get__(instance, owner)


def _synchronize_cuda_stream(stream):
    """``cudaStreamSynchronize(stream)`` through the CUDA runtime of this
    process. Raises ``OSError`` when it cannot be done (no CUDA runtime, or
    an error): the unregister that needed it is then refused, not done
    while a queued transfer may still touch the region."""
    global _CUDART
    if _CUDART is None:
        for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"):
            try:
                _CUDART = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            raise OSError(
                "a CUDA-stream transfer was queued but the CUDA runtime (libcudart) cannot "
                "be loaded to wait for its stream: the region stays registered"
            )
    rc = _CUDART.cudaStreamSynchronize(ctypes.c_void_p(stream))
    if rc != 0:
        raise OSError(f"cudaStreamSynchronize({stream:#x}) failed with CUDA error {rc}")


_CUDART = None


class TransferEngine:
    """``mooncake.engine.TransferEngine`` on Ferry (see the module docs).

    ``TransferEngine(url=None)``: ``url`` (or ``FERRY_URL``) names the
    backend and its own parameters, e.g. ``tcp://?secret=s3cret`` or
    ``mooncake://?lib=/opt/mooncake/libtransfer_engine.so``;
    ``initialize`` adds the host, metadata server, protocol and device.
    """

    TransferOpcode = TransferOpcode

    def __init__(self, url=None):
        self._base_url = url or os.environ.get("FERRY_URL") or self._default_url()
        self._engine = None
        self._lock = threading.Lock()
        self._segments = {}
        self._batches = {}
        self._next_batch = 1
        self._managed = {}
        self._last_error = None
        # CUDA-stream transfers queued since the last unregister (their
        # streams), and the lock that orders them with unregister.
        self._cuda_lock = threading.RLock()
        self._cuda_streams = set()

    @staticmethod
    def _default_url():
        return default_url()

    def last_error(self):
        """The exception behind the last failed call (negative return), or
        ``None``. Its reason was also logged at WARNING on ``ferry.mooncake``."""
        return self._last_error

    # -- set-up -------------------------------------------------------------

    def initialize(self, local_hostname, metadata_server, protocol, device_name):
        """Starts the engine. ``0`` on success, ``-1`` on failure."""
        return self.initialize_ext(
            local_hostname, metadata_server, protocol, device_name, ""
        )

    def initialize_ext(
        self, local_hostname, metadata_server, protocol, device_name, metadata_type
    ):
        """``initialize`` with Mooncake's explicit metadata type (``etcd``,
        ``redis``, ``http``, ``p2p``)."""
        try:
            url = self._url(
                local_hostname, metadata_server, protocol, device_name, metadata_type
            )
            self._engine = Engine.open(url)
        except FerryError as e:
            return self._fail("initialize", e, -1)
        except ValueError as e:
            return self._fail("initialize", e, -1)
        self._log_support()
        return 0

    def _url(self, local_hostname, metadata_server, protocol, device_name, metadata_type):
        # Ferry's one URL parser (the engine's): a key given twice, a
        # malformed escape or a fragment is refused here as it would be
        # there (FerryError), never silently resolved.
        scheme, base_path, path, params = _parse_url(self._base_url)
        base_path += path
        host, port = _split_host_port(local_hostname or "")
        protocol = protocol or "tcp"
        if protocol not in KNOWN_PROTOCOLS:
            raise ValueError(
                f"unknown protocol {protocol!r} (Mooncake knows: {', '.join(KNOWN_PROTOCOLS)})"
            )
        if scheme == "mooncake-py":
            own = dict(params)
            own.setdefault("host", local_hostname or "127.0.0.1")
            own.setdefault("metadata", metadata_server or "P2PHANDSHAKE")
            own.setdefault("protocol", protocol)
            if device_name:
                own.setdefault("device", device_name)
            if metadata_type:
                own.setdefault("metadata_type", metadata_type)
            return "mooncake-py://?" + _query(own.items())
        if scheme == "tcp":
            # Ferry's TCP transport moves the bytes; the segment name is
            # host:port, the port Ferry's own. Anything it cannot honour is
            # refused unless the caller opted in to the fallback.
            fallback = [v for k, v in params if k == "allow_protocol_fallback"]
            params = [(k, v) for k, v in params if k != "allow_protocol_fallback"]
            # A bare `allow_protocol_fallback` (no value) is `true`.
            allowed = (
                bool(fallback) and (fallback[0] is None or fallback[0].lower() in _TRUE)
            ) or os.environ.get("FERRY_ALLOW_PROTOCOL_FALLBACK", "").lower() in _TRUE
            if protocol != "tcp" and not _force_tcp():
                if not allowed:
                    raise ValueError(
                        f"protocol {protocol!r} cannot be honoured: Ferry's tcp:// backend moves "
                        "bytes over TCP only. Use mooncake-py:// (the installed Mooncake wheel) "
                        "or mooncake:// for RDMA, or opt in to TCP with allow_protocol_fallback=1 "
                        "in the URL or FERRY_ALLOW_PROTOCOL_FALLBACK=1 (or MC_FORCE_TCP)"
                    )
                logger.warning(
                    "protocol %r requested: falling back to Ferry's TCP transport "
                    "(allow_protocol_fallback)",
                    protocol,
                )
            for dev in filter(None, (d.strip() for d in (device_name or "").split(","))):
                if not _device_exists(dev):
                    raise ValueError(
                        f"device {dev!r} does not exist (neither /sys/class/infiniband/{dev} "
                        f"nor /sys/class/net/{dev})"
                    )
            etcd = _etcd_endpoints(metadata_server, metadata_type)
            if etcd is None and metadata_server not in ("", None, "P2PHANDSHAKE") and (
                metadata_type != "p2p"
            ):
                raise ValueError(
                    f"metadata server {metadata_server!r} cannot be used by Ferry's tcp:// backend "
                    "(P2PHANDSHAKE or etcd only); use mooncake-py:// or mooncake:// with a "
                    "redis or http metadata server"
                )
            if etcd is not None:
                host, port = _etcd_mode(local_hostname, base_path, params, etcd)
            host = host or (base_path.rsplit(":", 1)[0] if base_path else "127.0.0.1")
            keys = {k.lower() for k, _ in params}
            # The engine takes the secret from FERRY_SECRET or
            # FERRY_SECRET_FILE itself (ferry::secret: the way every Ferry
            # program takes it); the URL is left without it.
            secured = (
                "secret" in keys
                or "secret_file" in keys
                or os.environ.get("FERRY_SECRET")
                or os.environ.get("FERRY_SECRET_FILE")
            )
            if not secured and "insecure" not in keys and not _is_loopback(host):
                # What Mooncake does silently; Ferry's engine refuses it
                # unless told, so the drop-in says it once and goes on.
                logger.warning(
                    "listening on %s without a secret: any host that can reach this port can "
                    "read and write every registered byte; set FERRY_SECRET or FERRY_SECRET_FILE "
                    "(the same secret on every node) to authenticate peers",
                    host,
                )
                params.append(("insecure", "1"))
            query = _query(params)
            return f"tcp://{_bracket(host)}:{port}" + (f"?{query}" if query else "")
        if scheme == "mooncake":
            metadata = metadata_server or "P2PHANDSHAKE"
            if (
                metadata_type
                and metadata != "P2PHANDSHAKE"
                and metadata_type != "p2p"
                and "://" not in metadata
            ):
                metadata = f"{metadata_type}://{metadata}"
            own = dict(params)
            own.setdefault("metadata", metadata)
            own.setdefault("protocol", protocol or "tcp")
            if host:
                own.setdefault("host", host)
            if port and metadata != "P2PHANDSHAKE":
                # With a metadata server Mooncake publishes local_hostname
                # ("host:port") as the segment name and listens on its port;
                # P2P builds pick their own port and name.
                own.setdefault("port", str(port))
                own.setdefault("name", f"{_bracket(host)}:{port}")
            if device_name:
                own.setdefault("device", device_name)
            return "mooncake://?" + _query(own.items())
        # Any other scheme (verbs://…) is passed through as given.
        return self._base_url

    def _log_support(self):
        support = self.ferry_support()
        emulated = sorted(m for m, s in support.items() if s["support"] == "emulated")
        unsupported = sorted(
            m for m, s in support.items() if s["support"] == "unsupported"
        )
        logger.info(
            "ferry.mooncake on %s (%s): emulated: %s; unsupported: %s",
            self._engine.backend,
            self._engine.segment_name,
            ", ".join(emulated) or "none",
            ", ".join(unsupported) or "none",
        )

    def ferry_support(self):
        """For every method: ``{"support": "native" | "emulated" |
        "unsupported", "operation", "via", "reason", "min_version"}`` on
        this engine (from Ferry's capability report)."""
        report = self._require().report()
        out = {}
        for method, op in _METHOD_OPERATION.items():
            entry = report["operations"].get(op) or {
                "support": "native",
                "via": None,
                "reason": None,
                "min_version": None,
            }
            out[method] = dict(entry, operation=op)
        # The guarantees, as the capability report states them: "yes"/"no"
        # (e.g. peer_validation "no" where Ferry cannot know the peer's
        # registered ranges and the transport does not check them).
        for name, entry in report["guarantees"].items():
            out[name] = dict(
                entry,
                operation=name,
                guarantee="yes" if entry["support"] != "unsupported" else "no",
            )
        return out

    def ferry_metrics(self):
        """Ferry's metrics of this engine as a dict (what
        :meth:`ferry.Engine.metrics` returns: bytes and requests per peer
        and outcome, batches in flight, registered bytes, notifications,
        emulated operations), for a serving stack to export."""
        return self._require().metrics()

    def get_rpc_port(self):
        """The port of this engine's segment name (``host:port``)."""
        name = self._require().segment_name
        try:
            return int(name.rsplit(":", 1)[1])
        except (IndexError, ValueError):
            return -1

    def get_engine(self):
        """On ``mooncake-py://``: what the wheel's own ``get_engine()``
        returns (the C++ ``mooncake::TransferEngine`` that ``mooncake.store``
        and ``mooncake.pg`` take), or the wheel's engine object where the
        wheel has no ``get_engine``. On Ferry's own backends: the
        :class:`ferry.Engine` (no C++ object exists)."""
        engine = self._require()
        wheel = engine.wheel_engine()
        if wheel is None:
            return engine
        getter = getattr(wheel, "get_engine", None)
        return getter() if getter is not None else wheel

    def get_engine_ptr(self):
        """The wheel's ``get_engine_ptr()`` on ``mooncake-py://`` (the C++
        engine's address); ``0`` (logged, :meth:`last_error`) where there is
        none: Ferry's own backends, or a wheel without it."""
        engine = self._require()
        wheel = engine.wheel_engine()
        getter = None if wheel is None else getattr(wheel, "get_engine_ptr", None)
        if getter is None:
            why = (
                f"the {engine.backend} backend has no Mooncake C++ engine"
                if wheel is None
                else "the installed Mooncake wheel has no get_engine_ptr"
            )
            return self._fail("get_engine_ptr", RuntimeError(why), 0)
        return getter()

    def ferry_engine(self):
        """The :class:`ferry.Engine` underneath, on every backend."""
        return self._require()

    def get_local_topology(self, device_name=None):
        """Mooncake's topology JSON; Ferry has none to report: ``"{}"``."""
        return json.dumps({})

    def warmup_efa_segment(self, segment_name):
        """No EFA transport here: nothing to warm up, ``0``."""
        return 0

    def send_probe(self, peer_server_name):
        """``0`` if the peer's segment can be opened, else ``-1``."""
        try:
            self._segment(peer_server_name)
            return 0
        except FerryError as e:
            with self._lock:
                self._segments.pop(peer_server_name, None)
            return self._fail("send_probe", e, -1)

    # -- memory ---------------------------------------------------------------

    def register_memory(self, buffer_addr, capacity, location="*"):
        """Registers ``capacity`` bytes at ``buffer_addr``: ``0`` / ``-1``."""
        try:
            self._require().register(buffer_addr, capacity, location)
            return 0
        except (FerryError, ValueError) as e:
            return self._fail("register_memory", e, -1)

    def unregister_memory(self, buffer_addr):
        """Unregisters the region at ``buffer_addr`` (waits for transfers
        using it): ``0`` / ``-1``."""
        try:
            with self._cuda_lock:
                self._drain_cuda_streams()
                self._require().unregister(buffer_addr)
            return 0
        except (FerryError, ValueError, OSError) as e:
            return self._fail("unregister_memory", e, -1)

    def batch_register_memory(self, buffer_addresses, capacities, location="*"):
        """Registers every region, all or nothing: ``0`` / ``-1``."""
        try:
            addrs = list(buffer_addresses)
            caps = list(capacities)
            if len(addrs) != len(caps):
                raise ValueError(
                    f"{len(addrs)} addresses but {len(caps)} capacities"
                )
            self._require().batch_register(addrs, caps, location)
            return 0
        except (FerryError, ValueError) as e:
            return self._fail("batch_register_memory", e, -1)

    def batch_unregister_memory(self, buffer_addresses):
        """Unregisters every region: ``0`` / ``-1`` (every one attempted)."""
        try:
            with self._cuda_lock:
                self._drain_cuda_streams()
                self._require().batch_unregister(list(buffer_addresses))
            return 0
        except (FerryError, ValueError, OSError) as e:
            return self._fail("batch_unregister_memory", e, -1)

    def allocate_managed_buffer(self, length):
        """Allocates and registers ``length`` zeroed bytes; their address,
        ``0`` on failure."""
        try:
            buf = bytearray(length)
            addr, _ = self._require().register(buf)
        except (FerryError, ValueError, MemoryError) as e:
            return self._fail("allocate_managed_buffer", e, 0)
        with self._lock:
            self._managed[addr] = buf
        return addr

    def free_managed_buffer(self, buffer_addr, length):
        """Unregisters and frees a buffer from ``allocate_managed_buffer``:
        ``0`` / ``-1``."""
        with self._lock:
            known = buffer_addr in self._managed
        if not known:
            return self._fail(
                "free_managed_buffer",
                ValueError(f"{buffer_addr:#x} was not allocated by allocate_managed_buffer"),
                -1,
            )
        try:
            with self._cuda_lock:
                self._drain_cuda_streams()
                self._require().unregister(buffer_addr)
        except (FerryError, OSError) as e:
            return self._fail("free_managed_buffer", e, -1)
        with self._lock:
            self._managed.pop(buffer_addr, None)
        return 0

    def _check_local(self, addr, length):
        for start, size in self._require().registered():
            if start <= addr and addr + length <= start + size:
                return
        raise AddressNotRegistered(
            f"local address range {addr:#x}+{length} is not inside a region "
            "registered with this engine",
            side="local",
            addr=addr,
            length=length,
            peer=None,
            retryable=False,
        )

    def write_bytes_to_buffer(self, dest_address, src, length):
        """Copies ``length`` bytes of ``src`` (bytes or str) into this
        engine's registered memory at ``dest_address``: ``0`` / ``-1``."""
        data = src.encode() if isinstance(src, str) else bytes(src)
        if length < 0 or length > len(data):
            return self._fail(
                "write_bytes_to_buffer",
                ValueError(f"length {length} exceeds the {len(data)} bytes given"),
                -1,
            )
        try:
            self._check_local(dest_address, length)
        except FerryError as e:
            return self._fail("write_bytes_to_buffer", e, -1)
        ctypes.memmove(dest_address, data, length)
        return 0

    def read_bytes_from_buffer(self, source_address, length):
        """``length`` bytes of this engine's registered memory at
        ``source_address``. Raises ``AddressNotRegistered`` outside it
        (Mooncake would read whatever is there)."""
        self._check_local(source_address, length)
        return ctypes.string_at(source_address, length)

    def get_first_buffer_address(self, segment_name):
        """The first region registered by the engine called
        ``segment_name`` — known for this engine only (Ferry does not publish
        peers' region tables); ``0`` otherwise, as Mooncake returns for a
        segment without buffers."""
        engine = self._require()
        if segment_name == engine.segment_name:
            regions = engine.registered()
            return regions[0][0] if regions else 0
        return 0

    # -- transfers ----------------------------------------------------------------

    def _sync_one(name, op, opcode, doc):
        # The common case inline (an open session, no notification): one
        # Python frame per call instead of five; the same 0 / -1 and error.
        def method(
            self, target_hostname, buffer, peer_buffer_address, length, transport_hint=""
        ):
            engine = self._engine
            seg = self._segments.get(target_hostname)
            if engine is not None and seg is not None:
                try:
                    engine.transfer(seg, op, buffer, peer_buffer_address, length)
                    return 0
                except (FerryError, ValueError) as e:
                    return self._fail("transfer_sync", e, -1)
            return self.transfer_sync(
                target_hostname, buffer, peer_buffer_address, length, opcode
            )

        method.__name__ = name
        method.__qualname__ = f"TransferEngine.{name}"
        method.__doc__ = doc
        return method

    transfer_sync_write = _sync_one(
        "transfer_sync_write",
        "write",
        Write,
        "Writes ``length`` bytes to the peer and waits: ``0`` / ``-1``.",
    )
    transfer_sync_read = _sync_one(
        "transfer_sync_read",
        "read",
        Read,
        "Reads ``length`` bytes from the peer and waits: ``0`` / ``-1``.",
    )
    del _sync_one

    def transfer_sync(
        self,
        target_hostname,
        buffer,
        peer_buffer_address,
        length,
        opcode,
        notify=None,
        transport_hint="",
    ):
        """One transfer, waited on; with ``notify`` (a ``TransferNotify``)
        the peer gets it after the bytes landed. ``0`` / ``-1``."""
        op = _op(opcode)
        try:
            engine = self._require()
            seg = self._segment(target_hostname)
            if notify is None:
                engine.transfer(seg, op, buffer, peer_buffer_address, length)
                return 0
            results = engine.batch_transfer(
                seg,
                op,
                [buffer],
                [peer_buffer_address],
                [length],
                (notify.name, notify.msg),
            )
            return self._batch_result("transfer_sync", results)
        except (FerryError, ValueError) as e:
            return self._fail("transfer_sync", e, -1)

    def batch_transfer_sync_write(
        self, target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""
    ):
        """Writes a batch and waits: ``0`` if every request succeeded, else
        ``-1``."""
        # One request into an open session (vLLM's threads send one KV
        # block per call): inline, as in `transfer_sync_write`.
        engine = self._engine
        seg = self._segments.get(target_hostname)
        if (
            engine is not None
            and seg is not None
            and type(buffers) is list
            and type(peer_buffer_addresses) is list
            and type(lengths) is list
            and len(buffers) == len(peer_buffer_addresses) == len(lengths) == 1
        ):
            try:
                engine.transfer(seg, "write", buffers[0], peer_buffer_addresses[0], lengths[0])
                return 0
            except (FerryError, ValueError) as e:
                return self._fail("batch_transfer_sync", e, -1)
        return self.batch_transfer_sync(
            target_hostname, buffers, peer_buffer_addresses, lengths, Write
        )

    def batch_transfer_sync_read(
        self, target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""
    ):
        """Reads a batch and waits: ``0`` / ``-1``."""
        return self.batch_transfer_sync(
            target_hostname, buffers, peer_buffer_addresses, lengths, Read
        )

    def batch_transfer_sync(
        self,
        target_hostname,
        buffers,
        peer_buffer_addresses,
        lengths,
        opcode,
        notify=None,
        transport_hint="",
    ):
        """A batch, waited on; ``notify`` as in ``transfer_sync``.
        ``0`` / ``-1``."""
        op = _op(opcode)
        try:
            engine = self._require()
            seg = self._segment(target_hostname)
            if (
                notify is None
                and type(buffers) is list
                and type(peer_buffer_addresses) is list
                and type(lengths) is list
                and len(buffers) == len(peer_buffer_addresses) == len(lengths) == 1
            ):
                # One request (vLLM's threads send one KV block per call):
                # the same 0 / -1 and the same error as a batch of one,
                # without building and reading back the batch's report.
                engine.transfer(seg, op, buffers[0], peer_buffer_addresses[0], lengths[0])
                return 0
            note = None if notify is None else (notify.name, notify.msg)
            results = engine.batch_transfer(
                seg, op, buffers, peer_buffer_addresses, lengths, note
            )
            return self._batch_result("batch_transfer_sync", results)
        except (FerryError, ValueError) as e:
            return self._fail("batch_transfer_sync", e, -1)

    def batch_transfer_async_write(
        self, target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""
    ):
        """Starts a batch of writes: its id, ``0`` on failure."""
        return self.batch_transfer_async(
            target_hostname, buffers, peer_buffer_addresses, lengths, Write
        )

    def batch_transfer_async_read(
        self, target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""
    ):
        """Starts a batch of reads: its id, ``0`` on failure."""
        return self.batch_transfer_async(
            target_hostname, buffers, peer_buffer_addresses, lengths, Read
        )

    def batch_transfer_async(
        self,
        target_hostname,
        buffers,
        peer_buffer_addresses,
        lengths,
        opcode,
        transport_hint="",
    ):
        """Starts a batch: its id (for ``get_batch_transfer_status`` or
        ``transfer_check_status``), ``0`` on failure."""
        op = _op(opcode)
        try:
            engine = self._require()
            seg = self._segment(target_hostname)
            native = engine.submit(seg, op, buffers, peer_buffer_addresses, lengths)
        except (FerryError, ValueError) as e:
            return self._fail("batch_transfer_async", e, 0)
        with self._lock:
            batch_id = self._next_batch
            self._next_batch += 1
            self._batches[batch_id] = native
        return batch_id

    def transfer_submit_write(
        self, target_hostname, buffer, peer_buffer_address, length, transport_hint=""
    ):
        """Starts one write: its batch id (for ``transfer_check_status``),
        ``0`` on failure."""
        return self.batch_transfer_async(
            target_hostname, [buffer], [peer_buffer_address], [length], Write
        )

    def get_batch_transfer_status(self, batch_ids):
        """Waits for every batch and releases them: ``0`` if all succeeded,
        ``-1`` if any failed or an id is unknown."""
        status = 0
        for batch_id in list(batch_ids):
            with self._lock:
                native = self._batches.pop(batch_id, None)
            if native is None:
                self._fail(
                    "get_batch_transfer_status",
                    ValueError(f"unknown batch id {batch_id}"),
                    -1,
                )
                status = -1
                continue
            try:
                results = self._require().wait(native)
            except FerryError as e:
                status = self._fail("get_batch_transfer_status", e, -1)
                continue
            if self._batch_result("get_batch_transfer_status", results) != 0:
                status = -1
        return status

    def transfer_check_status(self, batch_id):
        """Never waits: ``1`` completed, ``0`` pending, ``-1`` failed (or
        unknown id), ``-2`` timed out. A finished batch is released."""
        with self._lock:
            native = self._batches.get(batch_id)
        if native is None:
            return self._fail(
                "transfer_check_status", ValueError(f"unknown batch id {batch_id}"), -1
            )
        engine = self._require()
        try:
            states = engine.status(native)
        except FerryError as e:
            return self._fail("transfer_check_status", e, -1)
        if any(state == "pending" for state, _ in states):
            return 0
        with self._lock:
            self._batches.pop(batch_id, None)
        try:
            engine.release_batch(native)
        except FerryError as e:
            logger.debug("release of batch %s: %s", batch_id, e)
        errors = [detail for state, detail in states if state == "failed"]
        if not errors:
            return 1
        from .errors import Timeout

        code = -2 if any(isinstance(e, Timeout) for e in errors) else -1
        return self._fail("transfer_check_status", errors[0], code)

    def get_notifies(self):
        """The notifications received so far (``TransferNotify`` list);
        empty if the engine cannot receive them."""
        try:
            notes = self._require().take_notifications()
        except FerryError as e:
            self._fail("get_notifies", e, -1)
            return []
        return [TransferNotify(name, msg) for name, msg in notes]

    # -- CUDA-stream transfers (Mooncake >= 0.3.9, CUDA builds) --------------------
    # Present exactly where Mooncake's own class has them (see _CudaStreamMethod):
    # on mooncake-py:// over a wheel whose class has them, forwarded to it.

    def _on_cuda(self, method, target_hostname, buffers, peer_buffer_addresses, lengths,
                 stream_ptr, transport_hint, single):
        engine = self._require()
        wheel = engine.wheel_engine()
        call = None if wheel is None else getattr(wheel, method, None)
        if call is None:
            raise AttributeError(
                f"{method}: the {engine.backend} backend has no CUDA-stream transfers "
                "(only mooncake-py:// over a CUDA build of the Mooncake wheel)"
            )
        addrs = [buffers] if single else list(buffers)
        lens = [lengths] if single else list(lengths)
        # The transfer runs later, on the stream: the stream is recorded
        # under the lock that unregister takes to synchronize it first, so
        # no byte of an unregistered region changes afterwards.
        with self._cuda_lock:
            try:
                for addr, length in zip(addrs, lens):
                    self._check_local(addr, length)
            except FerryError as e:
                # These methods return nothing (Mooncake's): the refusal is
                # raised, and logged and kept as every failure is.
                self._fail(method, e, None)
                raise
            self._cuda_streams.add(int(stream_ptr))
            return call(
                target_hostname, buffers, peer_buffer_addresses, lengths,
                stream_ptr, transport_hint,
            )

    @_CudaStreamMethod
    def transfer_write_on_cuda(
        self, target_hostname, buffer, peer_buffer_address, length, stream_ptr=0,
        transport_hint="",
    ):
        """Mooncake's: queues a write on the CUDA stream ``stream_ptr`` (the
        wheel's engine runs it when the stream reaches it; later work on the
        stream waits for it). Forwarded to the wheel; what it returns."""
        return self._on_cuda(
            "transfer_write_on_cuda", target_hostname, buffer, peer_buffer_address,
            length, stream_ptr, transport_hint, True,
        )

    @_CudaStreamMethod
    def transfer_read_on_cuda(
        self, target_hostname, buffer, peer_buffer_address, length, stream_ptr=0,
        transport_hint="",
    ):
        """Mooncake's: queues a read on the CUDA stream ``stream_ptr``."""
        return self._on_cuda(
            "transfer_read_on_cuda", target_hostname, buffer, peer_buffer_address,
            length, stream_ptr, transport_hint, True,
        )

    @_CudaStreamMethod
    def batch_transfer_write_on_cuda(
        self, target_hostname, buffers, peer_buffer_addresses, lengths, stream_ptr=0,
        transport_hint="",
    ):
        """Mooncake's: queues a batch of writes on the CUDA stream ``stream_ptr``."""
        return self._on_cuda(
            "batch_transfer_write_on_cuda", target_hostname, buffers,
            peer_buffer_addresses, lengths, stream_ptr, transport_hint, False,
        )

    @_CudaStreamMethod
    def batch_transfer_read_on_cuda(
        self, target_hostname, buffers, peer_buffer_addresses, lengths, stream_ptr=0,
        transport_hint="",
    ):
        """Mooncake's: queues a batch of reads on the CUDA stream ``stream_ptr``."""
        return self._on_cuda(
            "batch_transfer_read_on_cuda", target_hostname, buffers,
            peer_buffer_addresses, lengths, stream_ptr, transport_hint, False,
        )

    def _drain_cuda_streams(self):
        """Waits for every CUDA stream a transfer was queued on (called
        with ``_cuda_lock`` held, before an unregister)."""
        while self._cuda_streams:
            stream = next(iter(self._cuda_streams))
            _synchronize_cuda_stream(stream)
            self._cuda_streams.discard(stream)

    # -- helpers ----------------------------------------------------------------

    def _require(self):
        if self._engine is None:
            raise RuntimeError(
                "TransferEngine is not initialized: call initialize() first"
            )
        return self._engine

    def _segment(self, name):
        # A dict read is atomic (also on free-threaded builds): the lock
        # only orders the insertion, and a call per transfer pays no lock.
        seg = self._segments.get(name)
        if seg is None:
            seg = self._require().open_segment(name)
            with self._lock:
                self._segments[name] = seg
        return seg

    def _batch_result(self, method, results):
        for err in results:
            if err is not None:
                return self._fail(method, err, -1)
        return 0

    def _fail(self, method, error, code):
        # Kept and logged without its traceback: its frames hold this
        # engine, which would otherwise live on (its registered memory, its
        # etcd lease) after its last reference went, as long as the error
        # or a log record of it does.
        error = error.with_traceback(None)
        self._last_error = error
        logger.warning("%s failed: %s", method, error)
        return code


# Mooncake's opcodes (IntEnum members hash as their ints) and Ferry's
# names: one dict lookup per call.
_OPS = {0: "read", 1: "write", "read": "read", "write": "write"}


def _op(opcode):
    try:
        op = _OPS.get(opcode)
    except TypeError:  # unhashable
        op = None
    if op is not None:
        return op
    if isinstance(opcode, str):
        return opcode
    try:
        return "read" if TransferOpcode(int(opcode)) == TransferOpcode.Read else "write"
    except (TypeError, ValueError):
        raise TypeError(f"opcode must be TransferOpcode.Read or .Write, got {opcode!r}")


# -- the shim: `from mooncake.engine import TransferEngine` → Ferry ----------

_ENV_SHIM = "FERRY_MOONCAKE_SHIM"


def _shim_class(original):
    """Ferry's TransferEngine with ``mooncake-py://`` as its default and the
    wheel's class kept for Ferry's backend (``_ferry_wheel_class``)."""

    class MooncakeShimTransferEngine(TransferEngine):
        """``ferry.mooncake.TransferEngine`` standing in for
        ``mooncake.engine.TransferEngine`` (see :func:`ferry.mooncake.install`)."""

        _ferry_wheel_class = original

        @staticmethod
        def _default_url():
            return "mooncake-py://"

    MooncakeShimTransferEngine.__name__ = "TransferEngine"
    MooncakeShimTransferEngine.__qualname__ = "TransferEngine"
    return MooncakeShimTransferEngine


def _patch(module):
    current = getattr(module, "TransferEngine", None)
    if current is None or getattr(current, "_ferry_wheel_class", None) is not None:
        return
    module.TransferEngine = _shim_class(current)
    logger.info(
        "ferry.mooncake shim: mooncake.engine.TransferEngine is Ferry's, over the wheel's %s",
        current,
    )


class _ShimFinder:
    """A meta-path finder that patches ``mooncake.engine`` once it is loaded."""

    def find_spec(self, name, path=None, target=None):
        if name != "mooncake.engine":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    """Loads ``mooncake.engine`` with the wheel's loader, then patches it."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _patch(module)


_FINDER = _ShimFinder()


def install():
    """Makes ``from mooncake.engine import TransferEngine`` return Ferry's
    class running over the installed wheel (``mooncake-py://``, unless
    ``FERRY_URL`` names another backend), so a serving stack gets the batch
    methods its wheel lacks without a code edit. Works whether or not
    ``mooncake.engine`` is already imported; idempotent. ``ferry.mooncake``
    itself is unaffected. Also done at interpreter start-up when
    ``FERRY_MOONCAKE_SHIM=1`` (the wheel's ``ferry-mooncake-shim.pth``)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    module = sys.modules.get("mooncake.engine")
    if module is not None:
        _patch(module)


def uninstall():
    """Undoes :func:`install`: the wheel's class is ``mooncake.engine``'s
    again (engines already made stay Ferry's)."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    module = sys.modules.get("mooncake.engine")
    current = getattr(module, "TransferEngine", None) if module is not None else None
    original = getattr(current, "_ferry_wheel_class", None)
    if original is not None:
        module.TransferEngine = original


def _install_from_env():
    """Called by the ``.pth`` start-up hook: :func:`install` when
    ``FERRY_MOONCAKE_SHIM`` is true."""
    if os.environ.get(_ENV_SHIM, "").lower() in _TRUE:
        install()


# -- the rest of `mooncake.engine`: its module-level names ----------------------

#: Mooncake's build flags and their values on a build without them (what
#: ``ferry.mooncake`` answers where no wheel is installed).
_NON_CUDA_FLAGS = {
    "SUPPORT_CUDA": False,
    "SUPPORT_EFA": False,
    "SUPPORT_HIP": False,
    "SUPPORT_INTRA_NVLINK": False,
    "SUPPORT_MNNVL": False,
    "SUPPORT_MUSA": False,
}


def _wheel_module():
    """``mooncake.engine`` (imported on first use), or ``None`` without a
    wheel. A wheel that is installed but does not import raises."""
    if not _wheel_present():
        return None
    import mooncake.engine as wheel

    return wheel


def __getattr__(name):
    """Every other public name of the installed wheel's ``mooncake.engine``
    (``SUPPORT_CUDA`` and the other flags, ``InnerTransferEngine``,
    ``SharedSegment``, the RPC helpers ``RpcInterface``,
    ``create_rpc_client``, …), the wheel's own object; without a wheel, the
    ``SUPPORT_*`` flags are ``False`` (a build without them) and the names
    only a wheel has are absent."""
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    wheel = _wheel_module()
    if wheel is not None:
        try:
            return getattr(wheel, name)
        except AttributeError:
            pass
    elif name in _NON_CUDA_FLAGS:
        return _NON_CUDA_FLAGS[name]
    raise AttributeError(
        f"module {__name__!r} has no attribute {name!r}"
        + (
            " (nor has the installed mooncake.engine)"
            if wheel is not None
            else " (no Mooncake wheel is installed to provide it)"
        )
    )


def __dir__():
    wheel = _wheel_module()
    extra = (
        [n for n in dir(wheel) if not n.startswith("_")] if wheel is not None else _NON_CUDA_FLAGS
    )
    return sorted(set(globals()) | set(extra))
