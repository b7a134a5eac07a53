"""bench/distributed.py: its traffic counters count what they claim, and the script runs
end to end at a tiny scale (one process against a tensor group of ``demo-32k``; its
figures are not judged here, only that each was measured and each row reported)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT))

from bench import traffic

pytestmark = pytest.mark.slow  # a benchmark run

SS = """\
ESTAB 0      0      127.0.0.1:44793 127.0.0.1:52262 users:(("python",pid=28802,fd=6))
\t bbr wscale:10,10 rto:1128 mss:32768 bytes_received:277015 segs_out:2165
ESTAB 0      0      127.0.0.1:34768 127.0.0.1:40316 users:(("python",pid=28801,fd=6))
\t bbr wscale:10,10 rto:204 bytes_sent:2560 bytes_acked:2560 segs_out:5
ESTAB 512    0      127.0.0.1:40316 127.0.0.1:34768 users:(("python",pid=28802,fd=3))
\t bbr wscale:10,10 bytes_acked:1 bytes_received:2560 segs_out:7
ESTAB 0      0      127.0.0.1:52262 127.0.0.1:44793 users:(("python",pid=28801,fd=4))
\t bbr wscale:10,10 bytes_sent:277015 bytes_acked:277016 bytes_received:12
ESTAB 0      0      127.0.0.1:41000 127.0.0.1:8080 users:(("curl",pid=999,fd=3))
\t bbr bytes_received:5000
ESTAB 0      0      127.0.0.1:8080 127.0.0.1:41000 users:(("python",pid=28802,fd=9))
\t bbr bytes_received:300
"""

NET_DEV = """\
Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs
  eth0:    999      9    0    0    0     0          0         0      999       9    0
    lo: 2331747490 10670328    0    0    0     0          0         0 2331747490 10670328 0
"""


def test_bytes_between_the_group_count_each_socket_pair_once() -> None:
    table = traffic.socket_table(SS)
    assert len(table) == 6
    assert table[2] == ("127.0.0.1:40316", "127.0.0.1:34768", {28802}, 2560)
    assert table[1][3] == 0  # nothing received: no counter on the line
    # Both ranks' sockets to each other; the HTTP client (pid 999) is not the group's.
    assert traffic.between(table, [28801, 28802]) == 277015 + 2560 + 12
    assert traffic.between(table, [28802]) == 0  # no socket whose both ends are its own
    assert traffic.loopback_bytes(NET_DEV) == 2331747490


def test_rank_bytes_reads_the_kernels_counters_of_real_sockets() -> None:
    if shutil.which("ss") is None:
        pytest.skip("no ss on this machine")
    with socket.create_server(("127.0.0.1", 0)) as server:
        near = socket.create_connection(server.getsockname())
        far, _ = server.accept()
        with near, far:
            before = traffic.rank_bytes([os.getpid()])
            assert before is not None
            near.sendall(b"x" * 100_000)
            got = 0
            while got < 100_000:
                got += len(far.recv(65536))
            far.sendall(b"y" * 10)
            assert near.recv(10) == b"y" * 10
            assert traffic.rank_bytes([os.getpid()]) == before + 100_010
    assert traffic.loopback_bytes() is not None


def test_pause_stops_the_whole_tree_and_resume_starts_it_again() -> None:
    shell = subprocess.Popen(["sh", "-c", "sleep 60 & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(tree := traffic.process_tree(shell.pid)) < 2:
            assert time.monotonic() < deadline, tree
            time.sleep(0.02)

        def states() -> set[str]:
            return {Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
                    for p in tree}

        traffic.pause(tree)
        time.sleep(0.1)
        assert states() == {"T"}
        traffic.resume(tree)
        time.sleep(0.1)
        assert "T" not in states()
    finally:
        traffic.signal_all(traffic.process_tree(shell.pid), signal.SIGKILL)
        shell.wait(10)


def test_distributed_bench_runs_one_process_against_a_tensor_group() -> None:
    proc = subprocess.run(
        [sys.executable, "bench/distributed.py", "--model", "demo-32k", "--strategies",
         "tensor", "--rounds", "1", "--max-tokens", "4", "--streams", "2",
         "--idle-seconds", "0.5", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("one_single_tps", "one_agg_tps", "tensor_single_tps", "tensor_agg_tps",
                "tensor_single_x", "tensor_agg_x"):
        assert result[f"distributed_{key}"]["median"] > 0, key
    # Every token crossed between the ranks: the step's collectives and its plan.
    for kind in ("single", "agg"):
        per_token = result[f"distributed_tensor_{kind}_bytes_per_token"]["median"]
        per_position = result[f"distributed_tensor_{kind}_bytes_per_position"]["median"]
        assert per_token > 100, kind
        assert 0 < per_position < per_token, kind  # the prompt's positions crossed too
    skipped = result["distributed_pipeline_single_x"]
    assert skipped["median"] is None and "--strategies tensor" in skipped["reason"]
    assert result["distributed_setup"]["strategies"] == ["tensor"]
    idle = result["distributed_idle_cpu_pct"]
    assert set(idle) == {"one", "tensor"}
    assert all(isinstance(v, int | float) and v >= 0 for v in idle.values()), idle
    rows = {row["id"]: row for row in result["rows"]}
    tensor = rows["distributed_tensor_single_tps"]
    assert tensor["target"] == "report" and tensor["check"]["pass"] is None
    assert tensor["values"]["afmd"]["median"] == result["distributed_tensor_single_x"]["median"]
    assert tensor["check"]["detail"].startswith("in turns ")
    assert rows["distributed_tensor_aggregate_tps_c2"]["values"]["afmd"]["median"] > 0
    assert rows["distributed_pipeline_bytes_per_token"]["values"]["afmd"]["median"] is None
