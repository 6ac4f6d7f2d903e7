"""Free TCP ports for the servers the tests start (rendezvous stores, the S3 server).

A port that the kernel picks for ``bind(port 0)`` lies in its ephemeral range, the range it also
draws connections' source ports from: between the test closing its probe socket and the server
binding the port, any outgoing connection on the machine (a rank's, a store client's, the server's own
components') may take it. Ports below that range are handed out only on request, so a port checked
free here stays free until the server asks for it, unless another test picks the same one.
"""

from __future__ import annotations

import random
import socket


def ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int = 1) -> list[int]:
    """COUNT distinct ports free now on every address, each from below the ephemeral range: probed on
    the wildcard address, since a port held on any one address (a store on 127.0.0.1, a server on a
    test bridge's address) refuses another server's bind of it on all of them."""
    high = ephemeral_low()
    low = max(1024, high - 20000)
    held: list[socket.socket] = []
    try:
        while len(held) < count:
            s = socket.socket()
            try:
                s.bind(("", random.randrange(low, high)))
            except OSError:
                s.close()
                continue
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]
