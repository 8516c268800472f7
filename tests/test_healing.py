"""A python stub killed under a running server (issue 53): Triton 2.51 neither restarts it nor stops answering
ready, so the launcher (or the drain supervisor) reloads its model (s3flow.server.healing). Against a real
tritonserver: the stubs of the estimator, the solver, the encoder, admission and the vocoder are SIGKILLed in turn
(both ensembles served before); each time a new utterance is served again within 15 s, and the server still stops
with nothing of it left running. An utterance in flight when the solver's, the estimator's or the vocoder's stub
dies completes, every frame once, on the same server or, given two addresses, on either."""
from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from s3flow.engine.settings import SolverSettings
from s3flow.model.checkpoint import load_flow
from s3flow.model.flow import FlowConfig
from s3flow.model.random_checkpoint import write_random_checkpoint
from s3flow.model.vocoder import VocoderConfig, random_vocoder
from s3flow.repository.generator import write_repository
from s3flow.repository.settings import RepositorySettings
from s3flow.server.healing import stubs
from s3flow.server.processes import is_running, tree_pids
from s3flow.server.triton_server import TritonServer
from s3flow_client import StreamingClient
from s3flow_client.demo import demo_utterance
from s3flow_client.stream import StreamError

pytestmark = pytest.mark.server

HEALED_WITHIN_S = 15.0
#: Triton never finishes unloading a dead stub's instance: a healed server's stop waits for its exit timeout
EXIT_TIMEOUT = ["--exit-timeout-secs=5"]


def served(server, model: str = "token2mel") -> bool:
    """One new 1 s utterance through ``model``, no retry: whether it came back whole."""
    u = demo_utterance(1.0, seed=3)
    try:
        [r] = StreamingClient(server.grpc_url, model, timeout_s=20, max_retries=0, max_resumes=0).synthesize([u])
    except StreamError:
        return False
    whole = r.error is None and r.mel.shape[1] == 2 * len(u.speech_tokens)
    return whole and (model != "token2wav" or r.audio.size == 480 * r.mel.shape[1])


def kill_stub(server, model: str) -> int:
    [pid] = [pid for pid, m in stubs(server.pid).items() if m == model]
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.parametrize("supervised", [False, True], ids=["launcher", "drain supervisor, as shipped"])
def test_a_killed_stub_is_reloaded_and_the_server_serves_again_within_seconds(tmp_path, supervised):
    """By the launcher's own watch, and by the drain supervisor the container's entrypoint runs, there with the
    repository API behind the admin key as the fleet runs it (no client may load or unload a model)."""
    flow = load_flow(write_random_checkpoint(tmp_path / "ckpt.safetensors", FlowConfig.small(), seed=2))
    write_repository(tmp_path / "repo", flow, RepositorySettings(solver=SolverSettings.of(max_steps=20), ort_threads=1),
                     vocoder=random_vocoder(VocoderConfig.small(), seed=2))
    server = TritonServer(tmp_path / "repo", log_file=tmp_path / "server.log", heal=True, extra_args=EXIT_TIMEOUT,
                          drain_s=5.0 if supervised else None,
                          admin_key="sandbox-admin-key-0123456789" if supervised else None)
    with server:
        assert served(server) and served(server, "token2wav"), server.log_tail()
        assert set(stubs(server.pid).values()) >= {"cfm_solver", "estimator", "flow_encoder", "admission", "vocoder"}
        # every stub as shipped (the supervisor); the launcher runs the same watch: a stateless and a stateful one
        for model in (("estimator", "cfm_solver", "flow_encoder", "admission", "vocoder") if supervised
                      else ("estimator", "vocoder")):
            ensemble = "token2wav" if model == "vocoder" else "token2mel"
            dead = kill_stub(server, model)
            t0 = time.monotonic()
            while not served(server, ensemble):
                assert time.monotonic() - t0 < HEALED_WITHIN_S, f"{model}: not served again: " + server.log_tail()
                time.sleep(0.5)
            assert not is_running(dead)
            if not supervised:
                assert model in [m for m, _ in server.healer.heals], server.healer.heals
        if supervised:
            from s3flow.server.drain import HEAL_BOUND_S, healing_marker, live, ready
            assert ready(f"http://{server.http_url}", str(server.drain_file)), "healed: ready again"
            marker = Path(healing_marker(str(server.drain_file)))
            marker.write_text("estimator")   # as the supervisor leaves it while it reloads a model
            assert not ready(f"http://{server.http_url}", str(server.drain_file)), "not ready while healing"
            assert live(f"http://{server.http_url}", str(server.drain_file)), "live while healing within its bound"
            old = time.time() - HEAL_BOUND_S - 1   # a model dead, its reload failing, for longer than the bound
            os.utime(marker, (old, old))
            assert not live(f"http://{server.http_url}", str(server.drain_file)), "a server that cannot heal is live"
            marker.unlink()
            assert live(f"http://{server.http_url}", str(server.drain_file))
            log = (tmp_path / "server.log").read_text()
            assert "model 'estimator' reloaded" in log and "model 'cfm_solver' reloaded" in log, server.log_tail()
        family = tree_pids(server.pid)
    assert not any(is_running(pid) for pid in family), "a process of the server outlived it"


@pytest.mark.parametrize("models,two", [(("cfm_solver", "flow_encoder", "admission", "vocoder"), False),
                                        (("estimator", "vocoder"), True)],
                         ids=["one server", "two servers"])
def test_an_utterance_in_flight_when_a_stub_dies_completes_with_every_frame(tmp_path, models, two):
    """The targets' utterance in flight: for each of ``models`` in turn, a new utterance streamed by the project's
    client (retries and resumes on; ``token2wav`` for the vocoder), the model's stub SIGKILLed after its first
    answers; the utterance completes, every frame once and in order: on the same server once it has healed
    ("Stub process ... is not healthy" is a ``resume`` in the contract's table of Triton's errors, and the solver's
    stream resumes from its snapshot), or, given a second server's address, on whichever the client resumes it;
    and the server it was killed on serves a new utterance again within the bound."""
    import threading

    flow = load_flow(write_random_checkpoint(tmp_path / "ckpt.safetensors", FlowConfig.small(), seed=2))
    write_repository(tmp_path / "repo", flow, RepositorySettings(solver=SolverSettings.of(max_steps=20), ort_threads=1),
                     vocoder=random_vocoder(VocoderConfig.small(), seed=2))
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(TritonServer(tmp_path / "repo", log_file=tmp_path / "server.log", heal=True,
                                                  extra_args=EXIT_TIMEOUT, background_stop=True))
        urls = [server.grpc_url]
        if two:
            urls.append(stack.enter_context(TritonServer(tmp_path / "repo", log_file=tmp_path / "b.log",
                                                                   background_stop=True)).grpc_url)
        for k, model in enumerate(models):
            ensemble = "token2wav" if model == "vocoder" else "token2mel"
            u = demo_utterance(4.0, seed=9 + k)
            u.n_timesteps = 4
            n = len(u.speech_tokens)
            u.chunks = [10] * (n // 10) + ([n % 10] if n % 10 else [])
            answered, killed = [], threading.Event()

            def progress(_, model=model, answered=answered, killed=killed):
                answered.append(1)
                if len(answered) == 3 and not killed.is_set():
                    killed.set()
                    kill_stub(server, model)

            [r] = StreamingClient(urls, ensemble, timeout_s=120, max_retries=8,
                                  max_resumes=8).synthesize([u], progress=progress)
            assert killed.is_set(), f"{model}: the stub was never killed: the utterance ended too soon"
            assert r.error is None and r.mel.shape[1] == 2 * n, (model, r.error, server.log_tail())
            assert np.isfinite(r.mel).all()
            if ensemble == "token2wav":
                assert r.audio.size == 480 * r.mel.shape[1] and np.isfinite(r.audio).all()
            assert r.retries or r.resumes, f"{model}: it went through the heal, not around it"
            t0 = time.monotonic()   # and the server it was killed on serves a new utterance again (healed)
            while not served(server, ensemble):
                assert time.monotonic() - t0 < HEALED_WITHIN_S, f"{model}: not served again: " + server.log_tail()
                time.sleep(0.5)
