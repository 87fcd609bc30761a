"""Secure by default beyond loopback, without code changes in the serving
stack: ``ferry.mooncake`` on ``tcp://`` reads ``FERRY_SECRET``; without one
on an address other hosts can reach it logs one WARNING naming the exposure
and goes on (Ferry's engine itself would refuse to start)."""

import logging

import pytest

import ferry
from ferry.mooncake import TransferEngine
from conftest import address, pattern


def _warnings(caplog):
    return [
        r for r in caplog.records
        if r.name == "ferry.mooncake" and r.levelno == logging.WARNING and "without a secret" in r.getMessage()
    ]


def test_no_secret_beyond_loopback_warns_once_and_serves(caplog, monkeypatch):
    monkeypatch.delenv("FERRY_SECRET", raising=False)
    caplog.set_level(logging.WARNING, logger="ferry.mooncake")
    te = TransferEngine("tcp://")
    assert te.initialize("0.0.0.0", "P2PHANDSHAKE", "tcp", "") == 0, te.last_error()
    warned = _warnings(caplog)
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert "read and write every registered byte" in warned[0].getMessage()
    assert "FERRY_SECRET" in warned[0].getMessage()
    # Loopback: no warning.
    caplog.clear()
    lo = TransferEngine("tcp://")
    assert lo.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, lo.last_error()
    assert not _warnings(caplog)


def test_ferry_secret_authenticates_peers(caplog, monkeypatch):
    monkeypatch.setenv("FERRY_SECRET", "s3cret-for-the-test")
    caplog.set_level(logging.WARNING, logger="ferry.mooncake")
    target = TransferEngine("tcp://")
    assert target.initialize("0.0.0.0", "P2PHANDSHAKE", "tcp", "") == 0, target.last_error()
    initiator = TransferEngine("tcp://")
    assert initiator.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, initiator.last_error()
    assert not _warnings(caplog), "a secret was set: nothing is exposed"
    src = bytearray(pattern(4096))
    dst = bytearray(4096)
    assert initiator.register_memory(address(src), len(src)) == 0
    assert target.register_memory(address(dst), len(dst)) == 0
    peer = f"127.0.0.1:{target.get_rpc_port()}"
    assert initiator.transfer_sync_write(peer, address(src), address(dst), len(src)) == 0, initiator.last_error()
    assert dst == src
    # A peer without the secret is refused.
    monkeypatch.delenv("FERRY_SECRET")
    stranger = TransferEngine("tcp://")
    assert stranger.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, stranger.last_error()
    other = bytearray(4096)
    assert stranger.register_memory(address(other), len(other)) == 0
    assert stranger.transfer_sync_write(peer, address(other), address(dst), len(other)) < 0
    assert dst == src


def test_the_native_engine_takes_the_secret_the_way_every_program_does(tmp_path, monkeypatch):
    """Issue 43 (item 6): ``ferry.Engine`` takes the secret as ``ferry
    serve`` does: ``FERRY_SECRET``, ``FERRY_SECRET_FILE`` or
    ``secret_file=``; given two ways it is refused, naming the ways and
    never the value."""
    path = tmp_path / "secret"
    path.write_text("from-the-file\n")
    monkeypatch.delenv("FERRY_SECRET", raising=False)
    monkeypatch.setenv("FERRY_SECRET_FILE", str(path))
    target = ferry.Engine("tcp://127.0.0.1:0")
    monkeypatch.delenv("FERRY_SECRET_FILE")
    # The same secret by the URL's file parameter: the peer proves it.
    friend = ferry.Engine(f"tcp://127.0.0.1:0?secret_file={path}")
    friend.open_segment(target.segment_name)
    # By FERRY_SECRET: the same.
    monkeypatch.setenv("FERRY_SECRET", "from-the-file")
    ferry.Engine("tcp://127.0.0.1:0").open_segment(target.segment_name)
    # Two ways: refused before anything is opened.
    with pytest.raises(ferry.InvalidArgument) as err:
        ferry.Engine("tcp://127.0.0.1:0?secret=from-the-file")
    assert "two ways" in str(err.value) and "FERRY_SECRET" in str(err.value)
    assert "from-the-file" not in str(err.value)
    # No secret: the target refuses the peer.
    monkeypatch.delenv("FERRY_SECRET")
    with pytest.raises(ferry.Authentication):
        ferry.Engine("tcp://127.0.0.1:0").open_segment(target.segment_name)
