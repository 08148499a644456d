"""free_ports: loopback ports for a local group, out of the way of outgoing connections."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from lopa.serving import launcher
from lopa.serving.launcher import free_ports


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_ports_lie_below_the_ephemeral_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A port in the ephemeral range can become an outgoing connection's local port before its server
    # listens (a master failed to start so in CI): below the range only explicit binds take ports.
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    monkeypatch.setattr(launcher, "_EPHEMERAL_RANGE", ranges)
    ports = free_ports(6)
    assert len(set(ports)) == 6
    assert all(32768 - launcher._BELOW_EPHEMERAL <= p < 32768 for p in ports)
    assert all(_bindable(p) for p in ports)
    # Free until their servers bind them: a later call does not hand them out again.
    assert not set(free_ports(200)) & set(ports)


def test_without_room_below_the_range_the_kernel_chooses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("1024 65000\n")
    monkeypatch.setattr(launcher, "_EPHEMERAL_RANGE", ranges)
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(p >= 1024 and _bindable(p) for p in ports)
    monkeypatch.setattr(launcher, "_EPHEMERAL_RANGE", tmp_path / "missing")
    assert launcher._ephemeral_low() == 32768
