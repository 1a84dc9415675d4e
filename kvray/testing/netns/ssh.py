"""sshd on the namespace nodes, for ``ray up`` with the ``local`` provider.

A throwaway host key and client key are made for each run; root may log in with the key
only, and every session gets the environment the cluster passes (sshd's ``SetEnv``).
"""

from __future__ import annotations

import contextlib
import socket
import time
from pathlib import Path

from kvray.testing.netns.host import sh


def make_keys(keys: Path) -> None:
    """The run's host key and client key in ``keys``, the client key authorised."""
    keys.mkdir(mode=0o700, exist_ok=True)
    for name in ("host_ed25519", "id_ed25519"):
        if not (keys / name).exists():
            sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"kvray-{name}",
               "-f", str(keys / name))
    (keys / "authorized_keys").write_text((keys / "id_ed25519.pub").read_text())


def sshd_config(ip: str, keys: Path, env: dict[str, str]) -> str:
    """An sshd_config listening on ``ip``:22, with ``env`` set in every session."""
    return "\n".join([
        f"ListenAddress {ip}:22", f"HostKey {keys / 'host_ed25519'}",
        f"AuthorizedKeysFile {keys / 'authorized_keys'}",
        "PermitRootLogin prohibit-password", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
        "PidFile /tmp/sshd.pid", "MaxStartups 100", "MaxSessions 100",
        "SetEnv " + " ".join(f"{k}={v}" for k, v in env.items()), ""])


def wait_for_sshd(ip: str, deadline: float, log: Path, what: str) -> None:
    """Until ``ip``:22 accepts connections; past ``deadline`` (monotonic), raise with the
    sshd ``log``."""
    while True:
        with contextlib.suppress(OSError), socket.create_connection((ip, 22), 1):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"sshd on {what} did not start: {log.read_text()}")
        time.sleep(0.1)
