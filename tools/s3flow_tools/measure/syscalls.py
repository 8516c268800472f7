"""What a chunk costs the server in system calls on the records its processes share (issue 49's count).

Example::

    .venv/bin/python -m s3flow_tools.measure.syscalls            # -> results/syscalls.md (~1 min; needs strace)

The trained small teacher and vocoder behind ``token2wav`` as ``make demo`` builds them (admission on), one warm
utterance, then ``strace -f -y`` attached to tritonserver and every stub while ``--utterances`` demo utterances of
4 s stream one after another: every system call that names a record (``/dev/shm/s3flow-<record>-<pid>``, by path or
by a file descriptor's; the drain file and its folder's inotify watch) and every liveness check of a record's writer
(``kill(pid, 0)``), counted by call and record, per chunk answered. The records and why they cross between processes:
``s3flow.serving.records``.
"""
from __future__ import annotations

import collections
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from s3flow.repository import cli as build_repository
from s3flow.server.processes import tree_pids
from s3flow.server.triton_server import TritonServer
from s3flow_client import StreamingClient, chunk_schedule
from s3flow_client.demo import demo_utterance
from s3flow_tools.bench.report import machine
from s3flow_tools.measure.command import command
from s3flow_tools.measure.corpus import TRAINED

ROOT = Path(__file__).resolve().parents[3]
CALLS = "openat,open,rename,renameat,renameat2,flock,unlink,unlinkat,stat,newfstatat,statx,access,mkdir,getdents64," \
        "ftruncate,mmap,read,kill"
RECORD = re.compile(r"s3flow-(\w+)-\d+")
#: a process's liveness looked at (kill(pid, 0)): a record's writer's (``s3flow.serving.records``), unless the pid
#: is tritonserver's (each python stub looks at its server every 300 ms: Triton's, not the records')
ALIVE = re.compile(r"kill\((\d+), 0\)")


def count(trace: str, server_pid: int = 0) -> collections.Counter:
    """(call, record) -> how many, over the lines of an ``strace -f -y`` output that name a record (a file descriptor
    is shown with its path: a record's shared-memory file, the drain folder's inotify watch), and the writers'
    liveness checks the readers make (kill with signal 0, to another pid than ``server_pid``'s)."""
    kinds = collections.Counter()
    for line in trace.splitlines():
        record, alive = RECORD.search(line), ALIVE.search(line)
        writer = alive is not None and int(alive.group(1)) != server_pid
        name = record.group(1) if record else ("drain" if "drain" in line or "inotify" in line else
                                               "a writer alive?" if writer else None)
        call = re.match(r"\d+\s+(\w+)\(", line)
        if name is not None and call is not None:
            kinds[(call.group(1), name)] += 1
    return kinds


def main(argv=None) -> int:
    p = command(__file__, __doc__)
    p.add_argument("--utterances", type=int, default=3, help="(default: %(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "syscalls.md", help="(default: %(default)s)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        repo, out = Path(tmp) / "repo", Path(tmp) / "strace.txt"
        if build_repository.main(["--checkpoint", str(TRAINED / "teacher.safetensors"), "--vocoder-checkpoint",
                                  str(TRAINED / "vocoder.safetensors"), "--output", str(repo), "--no-voice"]) != 0:
            raise SystemExit("building the repository failed")
        with TritonServer(repo, log_file=Path(tmp) / "server.log") as server:
            client = StreamingClient(server.grpc_url, "token2wav", timeout_s=120)
            client.synthesize([demo_utterance(3.0, seed=1)])   # warm
            time.sleep(2.0)
            tracer = subprocess.Popen(["strace", "-f", "-y", "-qq", "-e", f"trace={CALLS}", "-o", str(out)]
                                      + [a for pid in tree_pids(server.pid) for a in ("-p", str(pid))])
            time.sleep(2.0)   # attached
            chunks = 0
            for k in range(args.utterances):
                u = demo_utterance(4.0, seed=10 + k)
                [r] = client.synthesize([u])
                if r.error is not None:
                    raise SystemExit(r.error)
                chunks += len(chunk_schedule(len(u.speech_tokens)))
            time.sleep(0.5)
            tracer.terminate()
            tracer.wait()
            server_pid = server.pid
        kinds = count(out.read_text(), server_pid)
    total = sum(kinds.values())
    lines = ["# System calls on the shared records, per chunk (issue 49)", "",
             f"Made by `python -m s3flow_tools.measure.syscalls` on {', '.join(f'{k} {v}' for k, v in machine().items())}: "
             f"`token2wav`, trained small teacher and vocoder, admission on, {args.utterances} demo utterances of 4 s "
             f"one after another ({chunks} chunks), `strace -f -y` on tritonserver and every stub."
             " Not counted: each python stub's look at its server every 300 ms (`kill(server, 0)`, Triton's own).", "",
             f"**{total / chunks:.1f} system calls per chunk** on the records ({total} in all).", "",
             "| call | record | per chunk |", "| --- | --- | ---: |"]
    lines += [f"| {call} | {record} | {n / chunks:.1f} |" for (call, record), n in kinds.most_common()]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
