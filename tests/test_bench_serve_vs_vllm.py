"""`arctic-rl bench serve --vs-vllm` starts both servers below its own client."""

import os
import subprocess
import sys

from arctic_rl_bench.serve_vs_vllm import SERVER_NICE, below_the_client

REPORT = ("import os; group = '/proc/self/autogroup'; "
          "print(os.nice(0), open(group).read().strip() if os.path.exists(group) else '', sep='|')")


def test_a_server_and_what_it_starts_run_below_the_client():
    # The server's first process reports itself, then starts a process that reports too.
    command = [sys.executable, "-c", f"import subprocess, sys; exec({REPORT!r}); "
               f"subprocess.run([sys.executable, '-c', {REPORT!r}])"]
    first, started = subprocess.run(below_the_client(command), capture_output=True, text=True, start_new_session=True,
                                    timeout=60, check=True).stdout.splitlines()
    ours = os.nice(0)
    nice, group = first.split("|")
    assert int(nice) == min(ours + SERVER_NICE, 19)  # 19 is the lowest priority there is
    if group:  # the kernel groups processes by session: the server's session is below the client's too
        assert group.endswith(f"nice {SERVER_NICE}"), group
        # Its own, not the client's. A process whose session the kernel never grouped (in the init session's
        # root group, as in some containers) reads an empty file: the server's group differs from it too.
        client_group = open("/proc/self/autogroup").read().split()
        assert group.split()[0] != (client_group[0] if client_group else "")
    assert started == first  # what the server starts inherits both
