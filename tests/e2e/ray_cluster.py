"""Local Ray clusters for the Ray-executor modules, started as ``ray start`` does.

Each node is its own ``ray start`` (the first ``--head``, the others
``--address`` of the head): its own raylet and resources, each offering
``hpu_per_node`` ``HPU`` slots (the CPU platform's ``ray_device_key``). Every
node's processes share the session its ``ray start`` opened, so they end with
that process group. The engine core connects through ``RAY_ADDRESS``; a
``ray.init()`` in the test process instead would be inherited by the engine-core
child process and hang vLLM's placement group. (``ray.cluster_utils.Cluster``
was tried for two nodes: the engine core's ``ray.init`` never finished
connecting to it on this host; cause not found.)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_group(pgid: int) -> None:
    """End a node's processes: they share the session ``ray start`` opened."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def _ray_start(args: list[str], common: list[str]) -> int:
    """``ray start ARGS`` in a session of its own; returns its process group."""
    ray_bin = Path(sys.executable).with_name("ray")
    start = subprocess.Popen(
        [str(ray_bin), "start", *args, *common],
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the node's processes join this group
    )
    try:
        out, _ = start.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        stop_group(start.pid)
        raise
    if start.returncode != 0:
        stop_group(start.pid)
        pytest.fail(f"ray start {' '.join(args)} failed:\n{out}")
    return start.pid


@contextlib.contextmanager
def ray_cluster(nodes: int, hpu_per_node: int, cpus_per_node: int) -> Iterator[str]:
    """A head and ``nodes - 1`` worker nodes; yields the head's address with
    ``RAY_ADDRESS`` pointing at it, and stops every node on exit. The session
    directory is a short one under /tmp, not pytest's: Ray's sockets live
    there and a Unix socket path holds at most 107 bytes (pytest-xdist's
    worker directories made them longer)."""
    temp_dir = Path(tempfile.mkdtemp(prefix="hpu-mm-ray-"))
    common = [
        "--node-ip-address=127.0.0.1",
        f"--num-cpus={cpus_per_node}",
        f'--resources={{"HPU": {hpu_per_node}}}',
        "--disable-usage-stats",
    ]
    port = free_port()
    address = f"127.0.0.1:{port}"
    head = [
        "--head",
        f"--port={port}",
        f"--ray-client-server-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}",
        "--include-dashboard=false",
    ]
    groups = [_ray_start(head, [*common, f"--temp-dir={temp_dir}"])]
    mp = pytest.MonkeyPatch()
    try:
        for _ in range(nodes - 1):
            worker = [
                f"--address={address}",
                f"--dashboard-agent-listen-port={free_port()}",
            ]
            groups.append(_ray_start(worker, common))
        mp.setenv("RAY_ADDRESS", address)
        mp.setenv("RAY_AUTH_MODE", "disabled")
        yield address
    finally:
        mp.undo()
        for pgid in reversed(groups):
            stop_group(pgid)
        shutil.rmtree(temp_dir, ignore_errors=True)
