"""The live client (s3flow_client.live, s3flow_client.chunking): tokens pushed as they are made.

Without a server: the live chunker's decisions and the stall count. Against real tritonservers (small config,
seeded weights, 2 Euler steps): pushes of odd sizes from another thread give exactly the batch client's output
for the chunk sizes the live client chose; an END with no tokens (at once, or after every token was sent);
cancel frees the server's sequence at once; a server killed mid-utterance, and the utterance completes on the
second address equal to an undisturbed run; the CLI reads tokens from a pipe.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from s3flow.engine.settings import SolverSettings
from s3flow.model.checkpoint import load_flow
from s3flow.model.random_checkpoint import write_random_checkpoint
from s3flow.model.flow import FlowConfig
from s3flow.repository.generator import write_repository
from s3flow.repository.settings import RepositorySettings
from s3flow.server.drain import live_sequences
from s3flow.server.triton_server import TritonServer
from s3flow_client import LiveChunks, LiveClient, StreamingClient
from s3flow_client.chunking import PlannedChunks, Situation
from s3flow_client.demo import demo_utterance
from s3flow_client.live import Piece, stalls, synthesize_live


# ------------------------------------------------------------------------------------------ no server
def test_the_first_chunk_waits_for_its_tokens_and_the_end_sends_the_rest():
    c = LiveChunks(first=10)
    assert c.decide(Situation(available=9, ended=False, index=0)).size is None
    assert c.decide(Situation(available=12, ended=False, index=0)).size == 10
    assert c.decide(Situation(available=3, ended=True, index=0)).size == 3
    assert c.decide(Situation(available=0, ended=True, index=4)).size == 0      # an END with no tokens


def test_a_short_lead_sends_what_exists_and_a_long_one_waits_for_a_bigger_chunk():
    c = LiveChunks(first=10, growth=2.0, largest=100, least=4, margin_s=0.3)
    short = Situation(available=12, ended=False, index=2, lead_s=0.4, latency_s=0.2, token_rate=25.0)
    assert c.decide(short).size == 12                                  # 40 wanted, but the player would run dry
    long_ = Situation(available=12, ended=False, index=2, lead_s=3.0, latency_s=0.2, token_rate=25.0)
    d = c.decide(long_)
    assert d.size is None and d.recheck_s == pytest.approx(2.5)        # 28 tokens more come in 1.1 s < 2.5 s
    slow = Situation(available=12, ended=False, index=2, lead_s=3.0, latency_s=0.2, token_rate=5.0)
    assert c.decide(slow).size == 12                                   # 28 tokens at 5/s: 5.6 s, too late
    assert c.decide(Situation(available=3, ended=False, index=2, lead_s=0.0)).size is None  # a crumb: wait
    assert c.decide(Situation(available=80, ended=False, index=3)).size == 80
    assert [c.target(i) for i in range(6)] == [10, 20, 40, 80, 100, 100]


def test_planned_chunks_take_their_sizes_and_wait_for_missing_tokens():
    p = PlannedChunks([10, 20])
    assert p.decide(Situation(available=30, ended=True, index=0)).size == 10
    assert p.decide(Situation(available=5, ended=False, index=1)).size is None


def test_stalls_count_the_times_a_real_time_player_runs_dry():
    piece = lambda at, n: Piece(np.zeros((80, 0)), 0, np.zeros(n, np.float32), 0, at)  # noqa: E731
    # 1 s of audio at t=0, the next second at t=1.5: dry for 0.5 s without a buffer, not with a 0.5 s one
    pieces = [piece(0.0, 24000), piece(1.5, 24000), piece(2.0, 24000)]
    assert stalls(pieces, 0.0, 24000.0) == (1, pytest.approx(0.5))
    assert stalls(pieces, 0.5, 24000.0) == (0, 0.0)
    assert stalls([piece(0.0, 0), piece(0.2, 12000)], 0.0, 24000.0) == (0, 0.0)   # an empty first response


# ------------------------------------------------------------------------------------------ servers
@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    flow = load_flow(write_random_checkpoint(root / "ckpt.safetensors", FlowConfig.small(), seed=8))
    write_repository(root / "repo", flow, RepositorySettings(solver=SolverSettings.of(max_steps=4, idle_timeout_s=5.0),
                                                             ort_threads=1))
    return root / "repo"


@pytest.fixture(scope="module")
def server(repo):
    with TritonServer(repo, log_file=repo.parent / "server.log", background_stop=True) as srv:
        yield srv


def prompt_of(u):
    return dict(prompt_tokens=u.prompt_tokens, prompt_mel=u.prompt_mel, speaker_embedding=u.speaker_embedding)


def batch_of(server, u, sizes):
    u.chunks, u.n_timesteps = list(sizes), 2
    [r] = StreamingClient(server.grpc_url, timeout_s=60).synthesize([u])
    return r


@pytest.mark.server
def test_odd_pushes_from_another_thread_equal_the_batch_client_with_the_chosen_chunks(server):
    u = demo_utterance(3.0, seed=21)
    pushes = [1, 7, 3, 50, 2, 11, 1]
    assert sum(pushes) == len(u.speech_tokens) == 75
    with LiveClient(server.grpc_url, "token2mel", response_timeout_s=30) as client:
        stream = client.open(**prompt_of(u), seed=3, n_timesteps=2)

        def feed():
            k = 0
            for n in pushes:
                stream.push(u.speech_tokens[k:k + n])
                k += n
                time.sleep(0.05)
            stream.end()

        feeder = threading.Thread(target=feed)
        feeder.start()
        pieces = list(stream)
        feeder.join()
        r = stream.result(timeout=30)
    assert r.error is None and r.mel.shape == (80, 150)
    assert sum(stream.sizes) == 75 and stream.sizes[0] == 10
    assert [p.frame_offset for p in pieces] == list(np.cumsum([0] + [p.mel.shape[1] for p in pieces])[:-1])
    u.seed = 3
    want = batch_of(server, u, stream.sizes)
    assert np.abs(r.mel - want.mel).max() <= 1e-5


@pytest.mark.server
@pytest.mark.parametrize("when", ["before any token", "after every token was sent"])
def test_an_end_with_no_tokens(server, when):
    u = demo_utterance(1.0, seed=22)
    with LiveClient(server.grpc_url, "token2mel", response_timeout_s=30) as client:
        stream = client.open(**prompt_of(u), n_timesteps=2)
        if when != "before any token":
            stream.push(u.speech_tokens[:10])   # the first chunk takes all ten
            next(iter(stream))                 # its answer came: nothing is left unsent
        stream.end()
        list(stream)
        r = stream.result(timeout=30)
    assert r.error is None
    assert r.mel.shape[-1] == (0 if when == "before any token" else 20)


@pytest.mark.server
def test_cancel_frees_the_servers_sequence_at_once(server):
    u = demo_utterance(2.0, seed=23)
    metrics = f"http://{server.host}:{server.metrics_port}/metrics"
    with LiveClient(server.grpc_url, "token2mel", response_timeout_s=30) as client:
        stream = client.open(**prompt_of(u), n_timesteps=2)
        stream.push(u.speech_tokens[:15])
        next(iter(stream))
        assert live_sequences(metrics) == 1
        stream.cancel()
        r = stream.result(timeout=30)
        deadline = time.monotonic() + 3.0   # the idle timeout is 5 s: freed by the END, not by the reaper
        while live_sequences(metrics) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live_sequences(metrics) == 0
    assert "cancelled by the client" in r.error


@pytest.mark.server
def test_a_server_killed_mid_utterance_resumes_on_the_next_address(repo, server, tmp_path):
    u = demo_utterance(3.0, seed=24)
    with TritonServer(repo, log_file=tmp_path / "a.log") as a:
        with LiveClient([a.grpc_url, server.grpc_url], "token2mel", response_timeout_s=30) as client:
            stream = client.open(**prompt_of(u), seed=5, n_timesteps=2)
            stream.push(u.speech_tokens[:30])
            it = iter(stream)
            next(it)
            os.killpg(a.pid, signal.SIGKILL)
            stream.push(u.speech_tokens[30:])
            stream.end()
            list(it)
            r = stream.result(timeout=60)
    assert r.error is None and r.resumes and r.mel.shape == (80, 150)
    u.seed = 5
    want = batch_of(server, u, stream.sizes)
    assert np.abs(r.mel - want.mel).max() <= 1e-3


@pytest.mark.server
def test_tokens_at_real_time_stream_every_frame(server):
    utts = [demo_utterance(2.0, seed=30 + k) for k in range(2)]
    for k, u in enumerate(utts):
        u.seed, u.n_timesteps = k, 2
    with LiveClient(server.grpc_url, "token2mel", response_timeout_s=30) as client:
        results = synthesize_live(client, utts, token_rate=25.0, burst=2)
    assert [r.mel.shape for r in results] == [(80, 100)] * 2


@pytest.mark.server
def test_the_cli_reads_tokens_from_a_pipe(server, tmp_path):
    u = demo_utterance(1.0, seed=25)
    lines = "\n".join(" ".join(str(t) for t in u.speech_tokens[k:k + 6]) for k in range(0, 25, 6)) + "\n"
    out = subprocess.run([sys.executable, "-m", "s3flow_client", "--url", server.grpc_url, "--model", "token2mel",
                          "--tokens-from", "-", "--steps", "2", "--out-dir", str(tmp_path)], input=lines,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "-> 50 frames" in out.stdout and np.load(tmp_path / "mel_0.npy").shape == (80, 50)
    bad = subprocess.run([sys.executable, "-m", "s3flow_client", "--url", server.grpc_url, "--model", "token2mel",
                          "--tokens-from", "-", "--out-dir", str(tmp_path)], input="12 x7\n",
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "--tokens-from -: invalid literal" in bad.stderr


@pytest.mark.server
def test_closing_the_client_fails_an_utterance_never_ended_and_frees_it(server):
    u = demo_utterance(1.0, seed=26)
    metrics = f"http://{server.host}:{server.metrics_port}/metrics"
    client = LiveClient(server.grpc_url, "token2mel", response_timeout_s=30)
    stream = client.open(**prompt_of(u), n_timesteps=2)
    stream.push(u.speech_tokens[:12])
    next(iter(stream))
    t0 = time.monotonic()
    client.close()
    assert time.monotonic() - t0 < 10
    assert "the client closed before end()" in stream.result(timeout=1).error
    deadline = time.monotonic() + 3.0
    while live_sequences(metrics) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_sequences(metrics) == 0


def test_a_push_after_end_is_refused_in_the_callers_thread_and_an_empty_utterance_ends_cleanly():
    """No server is needed: an utterance ended before any token opens no sequence."""
    u = demo_utterance(1.0, seed=27)
    client = LiveClient("127.0.0.1:1", "token2mel")
    stream = client.open(**prompt_of(u))
    stream.end()
    with pytest.raises(ValueError, match="push after end"):
        stream.push(u.speech_tokens[:3])
    assert list(stream) == []
    client.close()
    r = stream.result(timeout=5)
    assert r.error is None and r.mel.shape[-1] == 0
