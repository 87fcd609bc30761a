"""Ferry's exceptions: one class per ``ferry::Error`` variant, same name.

Every exception carries the variant's fields as attributes (``addr``,
``peer``, ``missing``, ``min_version``…) and ``retryable`` (whether trying
again later may succeed). All derive from :class:`FerryError`; a few also
derive from the matching builtin (``InvalidArgument`` is a ``ValueError``,
``Timeout`` a ``TimeoutError``, ``Io`` an ``OSError``…) so that generic
handlers keep working.
"""

__all__ = [
    "FerryError",
    "Unsupported",
    "MissingCapabilities",
    "AddressNotRegistered",
    "RegionOverlap",
    "RegionNotRegistered",
    "BatchRegisterFailed",
    "InvalidArgument",
    "SegmentUnavailable",
    "UnknownSegment",
    "UnknownBatch",
    "BatchBusy",
    "BatchTooLarge",
    "BatchFailed",
    "PeerLost",
    "Timeout",
    "Protocol",
    "Authentication",
    "Io",
    "Unavailable",
    "MissingSymbol",
    "Backend",
    "TransferFailed",
    "Canceled",
    "QueueFull",
]


class FerryError(Exception):
    """Base class of every Ferry error. ``str(e)`` is Ferry's message;
    the variant's fields are attributes."""

    retryable = False

    def __init__(self, message="", **fields):
        super().__init__(message)
        self.message = message
        for key, value in fields.items():
            setattr(self, key, value)
        self.fields = dict(fields)

    def __reduce__(self):
        return (_rebuild, (type(self).__name__, self.message, self.fields))


def _rebuild(name, message, fields):
    return globals()[name](message, **fields)


class Unsupported(FerryError):
    """The backend does not offer the operation (``backend``, ``operation``,
    ``reason``, ``min_version``)."""


class MissingCapabilities(FerryError):
    """Strict mode or ``require=``: operations are missing. ``missing`` is a
    list of dicts ``{operation, reason, min_version}``."""


class AddressNotRegistered(FerryError, ValueError):
    """``[addr, addr+length)`` is not inside one registered region
    (``side`` = ``local``/``remote``, ``peer``)."""


class RegionOverlap(FerryError, ValueError):
    """A region overlaps one already registered (``addr``, ``length``,
    ``existing_addr``, ``existing_length``)."""


class RegionNotRegistered(FerryError, ValueError):
    """No region is registered at ``addr``."""


class BatchRegisterFailed(FerryError):
    """A batch register failed at ``index`` (``addr``); nothing stays
    registered. ``source`` is the cause (a FerryError)."""


class InvalidArgument(FerryError, ValueError):
    """A malformed argument (``reason``)."""


class SegmentUnavailable(FerryError, ConnectionError):
    """The peer segment ``name`` cannot be opened or reached (``reason``)."""


class UnknownSegment(FerryError, ValueError):
    """The segment handle ``segment`` is not open."""


class UnknownBatch(FerryError, ValueError):
    """The batch id ``batch`` is unknown (never submitted or released)."""


class BatchBusy(FerryError):
    """The batch ``batch`` still has requests in flight."""


class BatchTooLarge(FerryError, ValueError):
    """``length`` requests exceed the backend's limit ``max``."""


class BatchFailed(FerryError):
    """``failed`` of ``total`` requests failed; ``first`` (a FerryError) is
    the error of request ``first_index``."""


class PeerLost(FerryError, ConnectionError):
    """The peer ``peer`` went away (``reason``)."""


class Timeout(FerryError, TimeoutError):
    """``operation`` did not finish within ``after`` seconds (``peer``)."""


class Protocol(FerryError):
    """The peer ``peer`` broke the protocol (``reason``)."""


class Authentication(FerryError, PermissionError):
    """Authentication with ``peer`` failed (``reason``)."""


class Io(FerryError, OSError):
    """An OS I/O error while ``context`` (``kind``, ``message``)."""

    def __init__(self, message="", **fields):
        FerryError.__init__(self, message, **fields)

    def __str__(self):
        return self.message


class Unavailable(FerryError):
    """The backend cannot run here (``backend``, ``reason``)."""


class MissingSymbol(FerryError):
    """``library`` lacks the required ``symbol`` (``min_version``)."""


class Backend(FerryError):
    """The backend returned error ``code`` (``name``) during ``operation``."""


class TransferFailed(FerryError):
    """A transfer ended in the backend's failed ``status`` (``peer``,
    ``detail``)."""


class Canceled(FerryError):
    """The engine is shutting down or the request was canceled
    (``reason``)."""


class QueueFull(FerryError):
    """A bounded queue or table is full; nothing was done. Retryable once
    the consumer has caught up. ``queue`` is ``"batches"``,
    ``"notifications"`` or ``"control"``, ``what`` says whose, ``limit`` is
    the bound reached (an int) or ``None`` when the peer did not say."""
