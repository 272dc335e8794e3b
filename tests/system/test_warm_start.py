"""A daemon starts what its first load would otherwise wait for (runtime/warm_start.py, issue 42's
cold first token): the engine workers' fork server is up, with the loader's modules imported, before
any model is asked for; nothing is loaded and no worker runs until then."""

from __future__ import annotations

import time

import psutil

from daemon_util import cli_env, free_port, serving, stop_quietly, wait_published


def test_the_fork_server_is_up_with_the_loader_imported_before_the_first_load(tmp_path):
    home = tmp_path / "home"
    env = cli_env(home, free_port())
    try:
        with serving(env) as proc:
            wait_published(home, proc)
            deadline = time.monotonic() + 30
            while not (servers := [c for c in psutil.Process(proc.pid).children()
                                   if "multiprocessing.forkserver" in " ".join(c.cmdline())]):
                assert time.monotonic() < deadline, "no fork server beside an idle daemon"
                time.sleep(0.1)
            (server,) = servers
            preload = " ".join(server.cmdline())
            assert "localserve.runtime.registry" in preload and "localserve.engine.local" in preload, preload
            assert server.children() == []  # no model asked for: no engine worker
            stop_quietly(env, proc)
    finally:
        stop_quietly(env)
