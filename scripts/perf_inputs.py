#!/usr/bin/env python3
"""Write perf_analyzer's ``--input-data`` JSON for ``token2mel`` / ``token2wav`` from real utterances.

perf_analyzer (and genai-perf, which drives it) send random tensors unless given data; random token ids
fall outside the vocabulary and random requests carry the speaker prompt on every step, so the server
refuses them. This writes the JSON in perf_analyzer's *sequence* layout (its docs/input_data.md): ``data``
is a list of streams, one utterance each, every stream a list of steps played back in order on one
correlation id. Step 0 (sent with sequence START) carries the prompt tensors (``prompt_tokens``,
``prompt_mel`` frames-major, ``speaker_embedding``, ``seed`` and, if asked, ``n_timesteps`` /
``guidance_rate``) and the first speech-token chunk; the later steps carry only ``speech_tokens``; the last
step is sent with END. Every tensor is ``{"content": [...row-major...], "shape": [...]}`` without the
batch dimension (perf_analyzer adds it: ``-b 1``). Names, dtypes and dims are those of the generated model
config (``s3flow.repository.generator``); every step also passes the server's own validator
(``s3flow.protocol.parse_request``) before the file is written.

Every stream has exactly ``--sequence-length`` steps (the client's growing chunk schedule, the tail merged
into the last step), because perf_analyzer plays step ``k % steps`` of a stream as step ``k`` of a sequence:
run it with the same ``--sequence-length`` and ``--sequence-length-variation 0``, or a sequence would wrap
round to the START step (prompt on a non-START request: refused) or end early. The command lines are in
docs/operations.md.

Examples (from the repository root)::

    # the trained small model's 64 held-out sentences, 4 chunks each
    .venv/bin/python scripts/perf_inputs.py --output out/perf_inputs.json

    # 16 seeded utterances of 10 s (for full-size random weights), 6 chunks, 2 Euler steps per chunk
    .venv/bin/python scripts/perf_inputs.py --seeded 16 --seconds 10 --sequence-length 6 --n-timesteps 2 \\
        --output out/perf_inputs_10s.json

    # play a file back against a running server the way perf_analyzer would (plain tritonclient, gRPC stream)
    .venv/bin/python scripts/perf_inputs.py --replay out/perf_inputs.json --url 127.0.0.1:8001 --concurrency 4

The writer exits non-zero when a step fails the checks; ``--replay`` exits non-zero on any refused request
or any stream that does not get all its frames (2 per speech token, offsets without gap).
"""
from __future__ import annotations

import argparse
import json
import queue
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from s3flow_contract.tensors import REQUEST, request_arrays
from s3flow_contract.tensors import TOKEN_MEL_RATIO
from s3flow.protocol import START_ONLY, RequestRules, parse_request
from s3flow.repository.model_config import read_config

HELDOUT = ROOT / "checkpoints" / "trained" / "heldout.npz"
#: Triton's wire type -> numpy dtype, for the request's tensors (s3flow_contract.tensors)
NP_DTYPES = {t.wire_type: t.np_dtype for t in REQUEST}


# ------------------------------------------------------------------------------------------ model inputs
@dataclass(frozen=True)
class ModelInput:
    """One input of the served model as its config states it (dims without the batch dimension)."""
    name: str
    datatype: str       # Triton's name: INT64, INT32, FP32
    dims: tuple         # -1: any length
    optional: bool


def model_inputs(config=None, n_feats: int = 80) -> dict[str, ModelInput]:
    """The inputs of ``token2mel`` (``token2wav`` takes the same) from its ``ModelConfig`` (a served one, or
    ``s3flow.repository.model_config.read_config`` of a ``config.pbtxt``), or from the config
    ``s3flow.repository.generator`` generates when none is given."""
    from tritonclient.grpc import model_config_pb2

    if config is None:
        from s3flow.repository.settings import RepositorySettings
        from s3flow.repository.configs import ensemble_config
        config = ensemble_config(n_feats, RepositorySettings())
    return {i.name: ModelInput(i.name, model_config_pb2.DataType.Name(i.data_type).removeprefix("TYPE_"),
                               tuple(i.dims), i.optional) for i in config.input}


# ------------------------------------------------------------------------------------------ utterances
@dataclass
class Source:
    """One utterance to play: speech_tokens (N,), prompt_tokens (Np,), prompt_mel (2 Np, n_feats)
    frames-major, speaker_embedding (192,), the noise seed."""
    speech_tokens: np.ndarray
    prompt_tokens: np.ndarray
    prompt_mel: np.ndarray
    speaker_embedding: np.ndarray
    seed: int = 0


def heldout_sources(path: Path = HELDOUT, limit: Optional[int] = None) -> list[Source]:
    """The trained model's held-out sentences (heldout.npz: padded rows with their lengths; prompt_mel there
    is channels-major)."""
    with np.load(path, allow_pickle=False) as d:
        n, npr = d["speech_token_len"], d["prompt_token_len"]
        rows = range(len(n) if limit is None else min(limit, len(n)))
        return [Source(d["speech_tokens"][k, :n[k]].astype(np.int64), d["prompt_tokens"][k, :npr[k]].astype(np.int64),
                       np.ascontiguousarray(d["prompt_mel"][k, :, :TOKEN_MEL_RATIO * npr[k]].T).astype(np.float32),
                       d["xvector"][k].astype(np.float32), seed=k) for k in rows]


def seeded_sources(count: int, seconds: float, n_feats: int = 80) -> list[Source]:
    """Seeded stand-in utterances (``s3flow_client.demo.demo_utterance``: in-vocabulary ids, a 1 s prompt)."""
    from s3flow_client.demo import demo_utterance

    out = []
    for k in range(count):
        u = demo_utterance(seconds, seed=k, n_feats=n_feats, noise_seed=k)
        out.append(Source(u.speech_tokens, u.prompt_tokens, u.prompt_mel, u.speaker_embedding, seed=k))
    return out


def fixed_schedule(n_tokens: int, steps: int) -> list[int]:
    """``steps`` chunk sizes (each >= 1) summing to n_tokens: the client's growing schedule
    (``s3flow_client.chunk_schedule``) with its tail merged into the last chunk, or its largest chunks split
    when it has fewer."""
    from s3flow_client import chunk_schedule

    if n_tokens < steps:
        raise ValueError(f"an utterance of {n_tokens} tokens cannot fill {steps} steps")
    sizes = chunk_schedule(n_tokens)
    if len(sizes) > steps:
        sizes = sizes[:steps - 1] + [sum(sizes[steps - 1:])]
    while len(sizes) < steps:
        k = int(np.argmax(sizes))
        sizes[k:k + 1] = [sizes[k] - sizes[k] // 2, sizes[k] // 2]
    return sizes


# ------------------------------------------------------------------------------------------ the JSON
def _tensor(value: np.ndarray) -> dict:
    flat = value.reshape(-1)
    # float32 as its shortest decimal that reads back to the same float32 (a third of float64's digits)
    content = [float(str(v)) for v in flat] if flat.dtype == np.float32 else flat.tolist()
    return {"content": content, "shape": list(value.shape)}


def stream_steps(src: Source, steps: int, n_timesteps: Optional[int] = None,
                 guidance_rate: Optional[float] = None) -> list[dict]:
    """One utterance as perf_analyzer steps (tensors without the batch dimension)."""
    sizes, lo, out = fixed_schedule(len(src.speech_tokens), steps), 0, []
    for k, size in enumerate(sizes):
        start = {} if k else dict(prompt_tokens=src.prompt_tokens, prompt_mel=src.prompt_mel,
                                  speaker_embedding=src.speaker_embedding, seed=src.seed,
                                  n_timesteps=n_timesteps, guidance_rate=guidance_rate)
        arrays = request_arrays(src.speech_tokens[lo:lo + size], start=k == 0, **start)
        out.append({name: _tensor(a[0]) for name, a in arrays.items()})   # perf_analyzer adds the batch dim
        lo += size
    return out


def input_data(sources: Iterable[Source], steps: int, **options) -> dict:
    """perf_analyzer's sequence-mode document: ``{"data": [stream, ...]}``, a stream a list of steps."""
    return {"data": [stream_steps(s, steps, **options) for s in sources]}


def step_arrays(step: dict, inputs: dict[str, ModelInput]) -> dict[str, np.ndarray]:
    """A step's tensors as numpy arrays with the batch dimension, dtypes from the model config."""
    out = {}
    for name, t in step.items():
        content, shape = (t, None) if isinstance(t, list) else (t["content"], t.get("shape"))
        arr = np.asarray(content, dtype=NP_DTYPES[inputs[name].datatype])
        out[name] = arr.reshape([1] + list(shape if shape is not None else inputs[name].dims))
    return out


def check_input_data(doc: dict, inputs: dict[str, ModelInput], rules: RequestRules = RequestRules(),
                     n_feats: int = 80) -> list[str]:
    """The rules perf_analyzer's loader applies (docs/input_data.md; src/data_loader.cc) and then the
    server's: returns the problems found, [] when the document is good.

    perf_analyzer: ``data`` is a non-empty list; in sequence mode every entry is a non-empty list of step
    objects; a step names only model inputs, gives every non-optional one, and each tensor is a flat array
    or an object with ``content`` (a flat array) and ``shape`` (integers) whose rank is the model's, whose
    fixed dims match, and whose element count equals the content's; integer dtypes get integers.
    Server: each step parses with ``s3flow.protocol.parse_request`` as START (step 0), END (last step) or a
    middle chunk, so START-only tensors appear on step 0 only.
    """
    problems = []
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list) or not data:
        return ['the document needs a non-empty "data" list']
    if not all(isinstance(s, list) and s for s in data):
        return ["sequence mode: every entry of data must be a non-empty list of steps (a stream)"]
    for i, stream in enumerate(data):
        for k, step in enumerate(stream):
            where = f"stream {i} step {k}"
            if not isinstance(step, dict):
                problems.append(f"{where}: a step must be an object")
                continue
            unknown = set(step) - set(inputs) - {"model"}
            if unknown:
                problems.append(f"{where}: not model inputs: {sorted(unknown)}")
            for name, spec in inputs.items():
                if name not in step:
                    if not spec.optional:
                        problems.append(f"{where}: missing required input {name}")
                    continue
                t = step[name]
                if isinstance(t, dict):
                    if "content" not in t or not isinstance(t["content"], list):
                        problems.append(f"{where}: {name} needs a content array")
                        continue
                    content, shape = t["content"], t.get("shape", list(spec.dims))
                elif isinstance(t, list):
                    content, shape = t, list(spec.dims)
                else:
                    problems.append(f"{where}: {name} must be an array or an object with content")
                    continue
                if not all(isinstance(d, int) and d >= 0 for d in shape):
                    problems.append(f"{where}: {name} shape {shape} must be fully defined non-negative integers")
                    continue
                if len(shape) != len(spec.dims) or any(m != -1 and d != m for d, m in zip(shape, spec.dims)):
                    problems.append(f"{where}: {name} shape {shape} does not fit the model's dims {list(spec.dims)}")
                if int(np.prod(shape)) != len(content):
                    problems.append(f"{where}: {name} has {len(content)} values for shape {shape}")
                if spec.datatype.startswith("INT") and not all(isinstance(v, int) and not isinstance(v, bool)
                                                               for v in content):
                    problems.append(f"{where}: {name} is {spec.datatype} but holds non-integers")
            if problems:
                continue
            try:
                parse_request(step_arrays(step, inputs), start=k == 0, end=k == len(stream) - 1,
                              rules=rules, n_feats=n_feats)
            except ValueError as err:
                problems.append(f"{where}: the server would refuse it: {err}")
        if stream and isinstance(stream[0], dict) and not set(START_ONLY) & set(stream[0]):
            problems.append(f"stream {i}: step 0 carries no prompt")
    lengths = {len(s) for s in data}
    if len(lengths) != 1:
        problems.append(f"streams have different step counts {sorted(lengths)}: one --sequence-length cannot "
                        "play them all without wrapping or cutting")
    return problems


# ------------------------------------------------------------------------------------------ replay
@dataclass
class ReplayResult:
    """What a replay saw: refused requests, and per stream the frames received and expected."""
    errors: list[str] = field(default_factory=list)
    frames: dict[int, int] = field(default_factory=dict)
    expected: dict[int, int] = field(default_factory=dict)
    order_problems: list[str] = field(default_factory=list)
    requests: int = 0
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.errors and not self.order_problems and self.frames == self.expected


def replay(doc: dict, url: str, model: str = "token2mel", concurrency: int = 1, first_sequence_id: int = 1,
           inputs: Optional[dict[str, ModelInput]] = None, timeout_s: float = 600.0) -> ReplayResult:
    """Play every stream of ``doc`` once, as perf_analyzer's sequence mode does: one gRPC stream, one
    correlation id per utterance (``first_sequence_id`` + stream index), START on its first step and END on
    its last, at most ``concurrency`` utterances in flight, each sending its next step when the previous
    one is answered. Checks frame offsets and counts as responses arrive."""
    import tritonclient.grpc as grpcclient

    inputs = inputs or model_inputs()
    data = doc["data"]
    res = ReplayResult(expected={first_sequence_id + i: TOKEN_MEL_RATIO * sum(
        len(step["speech_tokens"]["content"]) for step in stream) for i, stream in enumerate(data)})
    res.frames = {sid: 0 for sid in res.expected}
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    next_step, done = {}, set()

    def send(i: int) -> None:
        sid, k = first_sequence_id + i, next_step[i]
        tensors = []
        for name, arr in step_arrays(data[i][k], inputs).items():
            t = grpcclient.InferInput(name, list(arr.shape), inputs[name].datatype)
            t.set_data_from_numpy(arr)
            tensors.append(t)
        client.async_stream_infer(model, tensors, request_id=f"{sid}:{k}", sequence_id=sid,
                                  sequence_start=k == 0, sequence_end=k == len(data[i]) - 1)
        res.requests += 1

    t0 = time.monotonic()
    waiting, in_flight = list(range(len(data)))[::-1], 0
    try:
        while waiting or in_flight:
            while waiting and in_flight < concurrency:
                i = waiting.pop()
                next_step[i] = 0
                send(i)
                in_flight += 1
            result, error = answers.get(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
            if error is not None:  # the request id is not on an error: count it and stop that stream
                res.errors.append(str(error))
                in_flight -= 1
                continue
            sid_text, k_text = result.get_response().id.split(":")
            sid, k = int(sid_text), int(k_text)
            i = sid - first_sequence_id
            mel, offset = result.as_numpy("mel"), int(result.as_numpy("frame_offset").reshape(-1)[0])
            if offset != res.frames[sid]:
                res.order_problems.append(f"sequence {sid} step {k}: offset {offset}, {res.frames[sid]} received")
            res.frames[sid] += mel.shape[-1]
            if k + 1 < len(data[i]):
                next_step[i] = k + 1
                send(i)
            else:
                in_flight -= 1
                done.add(i)
        # a refused request stops its stream: close the sequences left open (an empty END chunk), or they
        # hold the server's sequence slots until its idle timeout
        for i in sorted(set(next_step) - done):
            [(name, empty)] = request_arrays([]).items()
            t = grpcclient.InferInput(name, list(empty.shape), inputs[name].datatype)
            t.set_data_from_numpy(empty)
            client.async_stream_infer(model, [t], request_id=f"{first_sequence_id + i}:end",
                                      sequence_id=first_sequence_id + i, sequence_end=True)
            answers.get(timeout=30)
    except queue.Empty:
        res.errors.append(f"no answer within {timeout_s} s")
    finally:
        client.stop_stream()
        client.close()
    res.wall_s = time.monotonic() - t0
    return res


# ------------------------------------------------------------------------------------------ command line
def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("utterances (default: the trained model's held-out set)")
    src.add_argument("--heldout", type=Path, default=HELDOUT, help="held-out .npz (default: %(default)s)")
    src.add_argument("--limit", type=int, default=None, help="first N held-out sentences only (default: all)")
    src.add_argument("--seeded", type=int, default=0, metavar="N",
                     help="N seeded stand-in utterances instead (default: 0 = use --heldout)")
    src.add_argument("--seconds", type=float, default=5.0, help="--seeded: utterance length (default: %(default)s)")
    out = p.add_argument_group("steps")
    out.add_argument("--sequence-length", type=int, default=4,
                     help="steps per stream; pass the same to perf_analyzer (default: %(default)s)")
    out.add_argument("--n-timesteps", type=int, default=None, help="Euler steps sent on START (default: server's)")
    out.add_argument("--guidance-rate", type=float, default=None, help="guidance w sent on START (default: server's)")
    out.add_argument("--n-feats", type=int, default=80, help="mel channels of the served model (default: 80)")
    out.add_argument("--config", type=Path, default=None,
                     help="the served model's config.pbtxt to check against (default: the generated one)")
    out.add_argument("--output", type=Path, default=Path("out/perf_inputs.json"), help="(default: %(default)s)")
    rep = p.add_argument_group("replay a written file instead")
    rep.add_argument("--replay", type=Path, default=None, metavar="JSON", help="play this file back and check it")
    rep.add_argument("--url", default="127.0.0.1:8001", help="gRPC address (default: %(default)s)")
    rep.add_argument("--model", default="token2mel", help="token2mel or token2wav (default: %(default)s)")
    rep.add_argument("--concurrency", type=int, default=1, help="utterances in flight (default: %(default)s)")
    args = p.parse_args(argv)

    inputs = model_inputs(read_config(args.config) if args.config else None, n_feats=args.n_feats)
    if args.replay is not None:
        doc = json.loads(args.replay.read_text())
        res = replay(doc, args.url, args.model, concurrency=args.concurrency, inputs=inputs)
        short = {sid: (res.frames[sid], n) for sid, n in res.expected.items() if res.frames[sid] != n}
        print(f"{len(doc['data'])} streams, {res.requests} requests in {res.wall_s:.1f} s at concurrency "
              f"{args.concurrency}: {len(res.errors)} refused, {len(short)} streams short of frames")
        for line in res.errors[:10] + res.order_problems[:10] + [f"sequence {s}: {g} of {n} frames"
                                                                  for s, (g, n) in list(short.items())[:10]]:
            print("  " + line)
        return 0 if res.ok else 1

    sources = (seeded_sources(args.seeded, args.seconds, args.n_feats) if args.seeded
               else heldout_sources(args.heldout, args.limit))
    try:
        doc = input_data(sources, args.sequence_length, n_timesteps=args.n_timesteps,
                         guidance_rate=args.guidance_rate)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    problems = check_input_data(doc, inputs, n_feats=args.n_feats)
    if problems:
        print("error: the generated data breaks the rules:\n  " + "\n  ".join(problems[:20]), file=sys.stderr)
        return 1
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(doc))
    tokens = [len(s.speech_tokens) for s in sources]
    print(f"wrote {args.output}: {len(sources)} streams x {args.sequence_length} steps, {min(tokens)}-{max(tokens)} "
          f"speech tokens per stream ({args.output.stat().st_size / 1e6:.1f} MB); perf_analyzer: "
          f"--input-data {args.output} --sequence-length {args.sequence_length} --sequence-length-variation 0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
