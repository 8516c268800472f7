"""A streaming client process SIGKILLed mid-utterance: what a crashed client leaves on a server (issue 31).

Example::

    killed = kill_mid_stream("127.0.0.1:8001", "token2wav", seed=3)   # monotonic time of the kill
"""
from __future__ import annotations

import subprocess
import sys
import time

_CLIENT = """
import sys
from s3flow_client import StreamingClient
from s3flow_client.demo import demo_utterance
seconds, chunk, steps = float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
u = demo_utterance(seconds, seed=int(sys.argv[3]))
n = len(u.speech_tokens)
u.chunks, u.n_timesteps = [chunk] * (n // chunk) + ([n % chunk] if n % chunk else []), steps
StreamingClient(sys.argv[1], sys.argv[2], timeout_s=60).synthesize([u], progress=lambda _: print("chunk", flush=True))
"""


def kill_mid_stream(url: str, model: str = "token2mel", seed: int = 0, seconds: float = 3.0, chunk: int = 10,
                    answers: int = 2, steps: int = 4, after_s: float = 0.0) -> float:
    """Start a client process streaming a ``seconds`` utterance in chunks of ``chunk`` tokens (``steps`` Euler
    steps) to ``model`` at ``url``; SIGKILL it ``after_s`` after ``answers`` chunks are answered (the next one on
    its way: with ``after_s`` 0 the kill races its send; a few tens of ms lands it while the server solves it).
    Returns the monotonic time of the kill. RuntimeError when the client ends on its own first."""
    proc = subprocess.Popen([sys.executable, "-c", _CLIENT, url, model, str(seed), str(seconds), str(chunk),
                             str(steps)], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(answers):
            if proc.stdout.readline().strip() != "chunk":
                raise RuntimeError("the client ended before it was killed")
        time.sleep(after_s)
    finally:
        proc.kill()
        proc.wait(10)
    return time.monotonic()
