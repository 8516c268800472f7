"""A resume costs one chunk, measured: server A killed 10 s, 60 s and 9 minutes into a stream, resumed on server B.

Examples::

    .venv/bin/python -m s3flow_tools.measure.resume                      # -> results/failover.md's resume section
    .venv/bin/python -m s3flow_tools.measure.resume --at 10 60 --out /tmp/resume.md

``token2wav`` with the small model trained here (teacher, 10 guided steps, and the vocoder), two tritonservers on
127.0.0.1 holding one snapshot key. For each kill point T, one utterance of T + 20 s (the held-out sentences' tokens
one after another, in the demo utterance's voice; the client's chunk plan: 10, 20, 40, then 100 tokens) streams to A
with B as the client's second address; once T seconds of audio are delivered, A is SIGKILLed. Side by side, in one
run: the client resuming from the snapshot (the default) and replaying every answered chunk (``snapshots=False``),
and the same utterance undisturbed on B. Reported per run: chunks replayed and frames solved again on B; the gap
from the kill to the next new audio (what a listener's buffer must cover) against the latency of the chunk that was in
flight when A died, in the undisturbed run; the largest difference from the undisturbed run (mel, audio).

Targets (issue 35): after 9 of 10 minutes, first audio after the failover within 2x the chunk's own latency, and
the work replayed independent of the stream's age. Exits non-zero when a resumed stream is not whole, differs from
the undisturbed run by more than the tolerances, or a snapshot resume replayed a chunk.
"""
from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from s3flow_contract.tensors import FRAMES_PER_SECOND, TOKENS_PER_SECOND
from s3flow.server.triton_server import TritonServer
from s3flow_client import StreamingClient, Utterance
from s3flow_client.demo import load_utterance
from s3flow_tools.bench.report import log, machine, markdown
from s3flow_tools.measure.command import command
from s3flow_tools.measure.corpus import TRAINED

ROOT = Path(__file__).resolve().parents[3]
MEL_TOL, AUDIO_TOL = 1e-4, 1e-4     # several utterances never share B here; batches of one: the same solves


def long_utterance(seconds: float) -> Utterance:
    """``seconds`` of the held-out sentences' tokens end to end, spoken with the demo utterance's prompt."""
    u = load_utterance(TRAINED / "demo_utt.npz", noise_seed=11)
    with np.load(TRAINED / "heldout.npz") as d:
        sentences = [d["speech_tokens"][i, :n] for i, n in enumerate(d["speech_token_len"])]
    need = round(TOKENS_PER_SECOND * seconds)
    tokens = np.concatenate([sentences[i % len(sentences)] for i in range(need // 50 + 2)])[:need]
    u.speech_tokens = tokens.astype(np.int64)
    first = [10, 20, 40]
    rest = need - sum(first)
    u.chunks = first + [100] * (rest // 100) + ([rest % 100] if rest % 100 else [])
    return u


def build(work: Path) -> Path:
    from s3flow.repository import cli as build_repository
    repo = work / "repo"
    code = build_repository.main(["--output", str(repo), "--size", "small", "--checkpoint",
                                  str(TRAINED / "teacher.safetensors"), "--vocoder-checkpoint",
                                  str(TRAINED / "vocoder.safetensors")])
    if code != 0:
        raise SystemExit("building the repository failed")
    return repo


def run_killed(repo: Path, env: dict, b: TritonServer, u: Utterance, kill_at_s: float, snapshots: bool,
               work: Path) -> dict:
    """Stream ``u`` to A (B second); SIGKILL A once ``kill_at_s`` of audio was delivered. Returns the result, the
    gap from the kill to the next new audio, and the chunk that was in flight (answered next)."""
    marks: dict = {"samples": 0, "answered": 0}
    with TritonServer(repo, log_file=work / f"a-{kill_at_s:g}-{snapshots}.log", env=env) as a:
        lock = threading.Lock()

        def on_audio(_, samples):
            with lock:
                now = time.perf_counter()
                marks["samples"] += samples.size
                if "kill" not in marks and marks["samples"] >= 24000 * kill_at_s:
                    # (called for chunk k's answer before progress counts it: chunk k + 1 goes to A next)
                    marks["kill"], marks["in_flight"] = now, marks["answered"] + 1
                    os.killpg(a.pid, signal.SIGKILL)
                elif "kill" in marks and "after" not in marks and samples.size:
                    marks["after"] = now

        client = StreamingClient([a.grpc_url, b.grpc_url], model="token2wav", snapshots=snapshots, timeout_s=3600)
        def progress(_):
            with lock:
                marks["answered"] += 1

        [r] = client.synthesize([u], on_audio=on_audio, progress=progress)
    return {"result": r, "gap_s": marks.get("after", float("nan")) - marks["kill"], "chunk": marks["in_flight"]}


def main(argv=None) -> int:
    p = command(__file__, __doc__)
    p.add_argument("--at", type=float, nargs="+", default=[10.0, 60.0, 540.0],
                   help="seconds of audio at which A is killed (default: %(default)s)")
    p.add_argument("--after", type=float, default=20.0, help="seconds of audio after the kill (default: %(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "failover.md", help="the results file; its "
                   "'Resume' section is replaced (default: %(default)s)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="resume-"))
    repo = build(work)
    key = work / "snapshot.key"
    key.write_bytes(os.urandom(32).hex().encode())
    env = {"S3FLOW_SNAPSHOT_KEY_FILE": str(key)}
    rows, ok = [], True
    with TritonServer(repo, log_file=work / "b.log", env=env) as b:
        for at in args.at:
            u = long_utterance(at + args.after)
            log(f"{at:g} s: undisturbed on B ({len(u.speech_tokens)} tokens, {len(u.chunks)} chunks)")
            [want] = StreamingClient(b.grpc_url, model="token2wav", timeout_s=3600).synthesize([u])
            for snapshots in (True, False):
                log(f"{at:g} s: killed, resumed {'from the snapshot' if snapshots else 'by replay'}")
                got = run_killed(repo, env, b, u, at, snapshots, work)
                r, normal = got["result"], want.chunk_latencies_s[got["chunk"]]
                mel_diff = float(np.abs(r.mel - want.mel).max()) if r.mel.shape == want.mel.shape else float("inf")
                audio_diff = (float(np.abs(r.audio - want.audio).max()) if r.audio.shape == want.audio.shape
                              else float("inf"))
                whole = r.error is None and len(r.resumes) == 1
                good = whole and mel_diff <= MEL_TOL and audio_diff <= AUDIO_TOL and (
                    not snapshots or r.replayed_chunks == 0)
                ok &= good
                rows.append([f"{at:g} s", "snapshot" if snapshots else "replay",
                             "yes" if good else f"NO ({r.error or r.resumes})", str(r.replayed_chunks),
                             f"{r.replayed_frames / FRAMES_PER_SECOND:.1f}", f"{1e3 * got['gap_s']:.0f}",
                             f"{got['chunk'] + 1} ({u.chunks[got['chunk']]} tokens)", f"{1e3 * normal:.0f}",
                             f"{got['gap_s'] / normal:.2f}",
                             f"{mel_diff:.1e}", f"{audio_diff:.1e}"])
                log(" | ".join(rows[-1]))
    section = markdown(["killed at (audio)", "resume", "whole, equal", "chunks replayed",
                        "audio re-solved (s)", "gap to the next new audio (ms)", "chunk in flight",
                        "its latency undisturbed (ms)", "gap / latency", "max mel diff", "max audio diff"], rows)
    host = ", ".join(f"{k} {v}" for k, v in machine().items())
    text = (f"## Resume from a snapshot (issue 35)\n\nMade by `python -m s3flow_tools.measure.resume` on {host}. "
            f"`token2wav`, "
            f"the small trained teacher (10 guided steps) and vocoder, two servers on one host holding one snapshot "
            f"key; one utterance of the kill point + {args.after:g} s (held-out tokens end to end, chunks of 10, 20, "
            f"40, then 100 tokens) streams to A, B second; A is SIGKILLed once that much audio was delivered. "
            f"*snapshot*: the client's default (the START on B carries the last snapshot and the next chunk); "
            f"*replay*: `snapshots=False`, every answered chunk sent again. *gap*: from the kill to the next new "
            f"audio (what a listener's buffer must cover), against the latency of the chunk that was in flight in "
            f"the undisturbed run (send to answer). Differences against the same utterance undisturbed on B.\n\n{section}\n")
    old = args.out.read_text() if args.out.exists() else ""
    head = old.split("## Resume from a snapshot (issue 35)")[0].rstrip() + "\n\n" if old else ""
    args.out.write_text(head + text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
