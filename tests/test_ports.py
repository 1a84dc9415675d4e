"""The test servers' port helper: ports outside the kernel's ephemeral range (a port-0 one
was once taken by the Ray cluster `kvray serve` starts before Serve's proxy bound it)."""

from __future__ import annotations

import socket

import pytest

from tests.helpers import ports

pytestmark = pytest.mark.unit


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    low = ports.ephemeral_low()
    for _ in range(20):
        port = ports.free_port()
        if low - ports.LOW >= 100:
            assert ports.LOW <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_port_falls_back_to_a_kernel_port_without_a_gap(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_low", lambda: ports.LOW + 10)
    port = ports.free_port()
    assert port > 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_ephemeral_low_reads_the_kernels_range(tmp_path):
    path = tmp_path / "range"
    path.write_text("40000\t60999\n")
    assert ports.ephemeral_low(str(path)) == 40000
    assert ports.ephemeral_low(str(tmp_path / "missing")) == 32768
