"""server/slots.py: who owns each end of a real TCP connection, and which claims that supersedes."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import pytest

from localserve.server.slots import Client, SlotClaims, connection_owners

CONNECT_AND_WAIT = ("import socket, sys\n"
                    "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
                    "print(s.getsockname()[1], flush=True)\n"
                    "sys.stdin.read()\n")


@pytest.fixture
def connections():
    """A listening socket here, one connection to it from this process and one from a child."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        mine = socket.create_connection(("127.0.0.1", port))
        child = subprocess.Popen([sys.executable, "-c", CONNECT_AND_WAIT, str(port)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        theirs_port = int(child.stdout.readline())
        accepted = [listener.accept()[0] for _ in range(2)]
        try:
            local = ("127.0.0.1", port)
            yield (Client("ua", ("127.0.0.1", mine.getsockname()[1]), local),
                   Client("ua", ("127.0.0.1", theirs_port), local), child.pid)
        finally:
            child.communicate("")
            mine.close()
            for s in accepted:
                s.close()


def test_the_os_names_the_process_at_the_clients_end(connections) -> None:
    mine, theirs, child_pid = connections
    owners = connection_owners([mine, theirs, Client("ua", None, None)])
    if not owners:
        pytest.skip("this OS does not name sockets' owners to this user (macOS without root)")
    assert owners == {mine: os.getpid(), theirs: child_pid}


def test_a_claim_is_superseded_by_the_same_process_only(connections) -> None:
    mine, theirs, _ = connections
    if not connection_owners([mine]):
        pytest.skip("this OS does not name sockets' owners to this user (macOS without root)")
    # Another request of this process: a connection of its own, the same process at its end.
    again = Client("ua", mine.peer, mine.local)
    claims = SlotClaims()

    async def run() -> None:
        async with claims.claim("m", 0, mine) as first:
            async with claims.claim("m", 0, theirs):  # another process, the same User-Agent
                assert not first.superseded.is_set()
            async with claims.claim("m", 1, again):  # another slot
                assert not first.superseded.is_set()
            async with claims.claim("m", 0, Client("other", mine.peer, mine.local)):  # another User-Agent
                assert not first.superseded.is_set()
            # The same client: it ends the first (which here lets go only after the release wait).
            async with claims.claim("m", 0, again) as newer:
                assert first.superseded.is_set() and not newer.superseded.is_set()

    asyncio.run(run())
