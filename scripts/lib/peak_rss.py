"""Runs a command as a child and writes the child's peak resident memory (KiB) to PREFIX.RANK,
RANK being the process's rank under mpirun (0 without it); exits with the command's status.
The benchmarks that measure memory per rank run each rank's llmtrain through it.

Usage: peak_rss.py PREFIX COMMAND [ARGS...]
"""
import os
import resource
import subprocess
import sys

status = subprocess.call(sys.argv[2:])
kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
with open(f"{sys.argv[1]}.{os.environ.get('OMPI_COMM_WORLD_RANK', '0')}", "w") as f:
    f.write(f"{kib}\n")
sys.exit(status)
