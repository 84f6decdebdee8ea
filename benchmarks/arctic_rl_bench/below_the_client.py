"""`python below_the_client.py NICE COMMAND...`: run COMMAND, and every process it starts, below the client.

The bench starts each server through this script in a new session (`start_new_session`). The script lowers its own
priority, and its session's where the kernel groups processes by session (`sched_autogroup`: there a nice value
orders only processes of one session), then becomes the server by exec. It is a process of its own, not a
`preexec_fn`: a `preexec_fn` makes Python fork a copy of the client, which Linux refuses (ENOMEM) once one of the
client's mappings is larger than its memory, where a plain start copies nothing (vfork)."""

import os
import sys


def main() -> None:
    nice, command = int(sys.argv[1]), sys.argv[2:]
    os.nice(nice)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:  # no autogroups here (another kernel, or turned off): the processes' nice values order them
        pass
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
