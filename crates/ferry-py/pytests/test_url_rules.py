"""One URL parser with one set of rules, from Python too.

``ferry.Engine(url)`` opens every scheme through Ferry's scheme registry
(``inproc://`` and ``mooncake-py://`` included), and ``ferry.mooncake``
combines its base URL with ``initialize``'s arguments through the same
parser (``ferry._native._parse_url``): a key given twice is refused naming
it, where ``urllib.parse.parse_qsl`` kept the last one silently."""

import logging

import pytest

import ferry
from ferry import errors
from ferry._native import _parse_url
from ferry.mooncake import TransferEngine


def test_the_native_parser_splits_and_decodes():
    scheme, authority, path, params = _parse_url(
        "TCP://127.0.0.1:0?secret=a%20b+c&strict&connections=2"
    )
    assert (scheme, authority, path) == ("tcp", "127.0.0.1:0", "")
    assert params == [("secret", "a b c"), ("strict", None), ("connections", "2")]


@pytest.mark.parametrize(
    "url",
    [
        "tcp://h:1?connections=1&connections=2",
        "tcp://h:1?connections=1&c%6Fnnections=2",
        "mooncake-py://?protocol=tcp&protocol=rdma",
    ],
)
def test_a_key_given_twice_is_refused_naming_it(url):
    key = "protocol" if "protocol" in url else "connections"
    with pytest.raises(errors.InvalidArgument, match=f"`{key}` given twice"):
        _parse_url(url)
    # The engine refuses it the same way, whatever the scheme.
    with pytest.raises(errors.InvalidArgument, match=f"`{key}` given twice"):
        ferry.Engine(url)


@pytest.mark.parametrize(
    "url",
    ["tcp://h:1?x=%G1", "tcp://h:1?a=1#frag", "tcp://u:p@h:1", "no-scheme"],
)
def test_malformed_urls_are_refused(url):
    with pytest.raises(errors.InvalidArgument):
        _parse_url(url)


def test_mooncake_base_url_with_a_repeated_key_fails_initialize(caplog):
    # parse_qsl used to keep `protocol=rdma` here and go on.
    te = TransferEngine("mooncake-py://?protocol=tcp&protocol=rdma")
    with caplog.at_level(logging.WARNING, logger="ferry.mooncake"):
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1
    assert isinstance(te.last_error(), errors.InvalidArgument)
    assert "`protocol` given twice" in str(te.last_error())
    te = TransferEngine("tcp://?insecure=1&insecure=1")
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1
    assert "`insecure` given twice" in str(te.last_error())


def test_mooncake_base_url_parameters_reach_the_engine():
    # Decoded once and encoded back as Ferry's parser reads it: a bare key
    # stays bare (`strict` is true), a space survives.
    te = TransferEngine("tcp://?strict&connections=2")
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, te.last_error()
    assert te.ferry_engine().report()["strict"] is True
    te = TransferEngine("tcp://?allow_protocol_fallback")
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0, te.last_error()


def test_inproc_opens_through_the_registry():
    e = ferry.Engine("inproc://?caps=none&strict=1")
    assert e.backend == "inproc"
    assert e.report()["strict"] is True
    with pytest.raises(errors.InvalidArgument, match="`colour`"):
        ferry.Engine("inproc://?colour=blue")
