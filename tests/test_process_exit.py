"""A command's process ends with its status once the command returns, its exit handlers run and its output whole."""

import subprocess
import sys

CHILD = """
import atexit, sys, weakref
from arctic_rl_core.process_exit import exit_now

class Job:
    pass

job = Job()
weakref.finalize(job, print, "finalizer ran")
atexit.register(print, "exit handler ran")
sys.stdout.write("unflushed line")  # no newline: still in the stream's buffer
exit_now(int(sys.argv[1]))
"""


def test_exit_now_runs_exit_handlers_and_finalizers_flushes_and_keeps_the_status():
    for status in (0, 3):
        proc = subprocess.run([sys.executable, "-c", CHILD, str(status)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == status, proc.stderr
        assert proc.stdout.startswith("unflushed line")
        assert "exit handler ran" in proc.stdout and "finalizer ran" in proc.stdout, proc.stdout


def test_the_command_lines_status_is_the_commands(tmp_path):
    listed = subprocess.run([sys.executable, "-m", "arctic_rl_core.cli", "plugins", "--json", "--strict"],
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and listed.stdout.strip().startswith("{"), listed.stderr
    refused = subprocess.run([sys.executable, "-m", "arctic_rl_core.cli", "train", str(tmp_path / "missing.yaml")],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "missing.yaml" in refused.stderr, (refused.returncode, refused.stderr[-2000:])
