"""free_ports: loopback ports for a local group, out of the way of outgoing connections."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from lopa.params import InvalidParameter
from lopa.serving import ports as picking
from lopa.serving.ports import PORT_RANGE_ENV, free_ports


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.fixture(autouse=True)
def _no_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PORT_RANGE_ENV, raising=False)  # a parallel run sets one per test process


def test_ports_lie_below_the_ephemeral_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A port in the ephemeral range can become an outgoing connection's local port before its server
    # listens (a master failed to start so in CI): below the range only explicit binds take ports.
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    monkeypatch.setattr(picking, "_EPHEMERAL_RANGE", ranges)
    ports = free_ports(6)
    assert len(set(ports)) == 6
    assert all(32768 - picking._BELOW_EPHEMERAL <= p < 32768 for p in ports)
    assert all(_bindable(p) for p in ports)
    # Free until their servers bind them: a later call does not hand them out again.
    assert not set(free_ports(200)) & set(ports)


def test_without_room_below_the_range_the_kernel_chooses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("1024 65000\n")
    monkeypatch.setattr(picking, "_EPHEMERAL_RANGE", ranges)
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(p >= 1024 and _bindable(p) for p in ports)
    monkeypatch.setattr(picking, "_EPHEMERAL_RANGE", tmp_path / "missing")
    assert picking._ephemeral_low() == 32768


def test_a_port_range_confines_every_pick(monkeypatch: pytest.MonkeyPatch) -> None:
    low = free_ports(1)[0] // 100 * 100  # a hundred ports below the ephemeral range
    monkeypatch.setenv(PORT_RANGE_ENV, f"{low}-{low + 99}")
    ports = free_ports(40)
    assert len(set(ports)) == 40 and all(low <= p <= low + 99 and _bindable(p) for p in ports)
    # The range is all there is: past it the error says so, no port from elsewhere.
    with pytest.raises(InvalidParameter, match=rf"{PORT_RANGE_ENV}: 80 free ports needed, \d+ left in "
                                               rf"{low}-{low + 99}$"):
        free_ports(80)


@pytest.mark.parametrize("spec", ["30000", "30000-", "a-b", "30010-30000", "0-10", "60000-70000"])
def test_a_malformed_port_range_names_itself(monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, spec)
    with pytest.raises(InvalidParameter, match=rf"{PORT_RANGE_ENV}: must be LOW-HIGH .* got '{spec}'"):
        free_ports(1)
