"""Stream utterances to a running token2mel server and save the mel (.npy) and a picture (.png).

Examples::

    # one ~5 s utterance of seeded random tokens
    .venv/bin/python -m s3flow_client --url 127.0.0.1:8001 --seconds 5 --out-dir out/

    # four utterances at once, a bigger first chunk, 2 Euler steps
    .venv/bin/python -m s3flow_client --utterances 4 --first-chunk 20 --steps 2

    # real tokens from an .npz (speech_tokens, prompt_tokens, prompt_feat, embedding)
    .venv/bin/python -m s3flow_client --inputs utt.npz

    # audio: the token2wav ensemble; writes out/audio_0.wav (as it streams) and out/audio_0.png
    .venv/bin/python -m s3flow_client --model token2wav --seconds 5

    # a voice from a reference recording (any supported rate, mono): registered, then used by its id
    .venv/bin/python -m s3flow_client --voice ref.wav --seconds 5

    # the voice registry: register a reference or a Chatterbox conds.pt, list the ids held
    .venv/bin/python -m s3flow_client voices register ref.wav
    .venv/bin/python -m s3flow_client voices register conds.pt
    .venv/bin/python -m s3flow_client voices list

    # live: token ids piped in as a text-to-token model makes them; the wav grows as audio arrives
    my_t3 | .venv/bin/python -m s3flow_client --model token2wav --voice ref.wav --tokens-from -

    # several servers: an utterance whose server goes away resumes on the next
    .venv/bin/python -m s3flow_client --url 10.0.0.5:8001,10.0.0.6:8001 --seconds 5

Prints first-chunk latency, per-chunk latency and the real-time factor; exits non-zero on any error
(a server error, a frame gap or duplicate, or a frame count other than 2 per token).
"""
from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

import numpy as np

from . import StreamError, StreamingClient, chunk_schedule, save_mel_png
from .channel import Channel
from .demo import demo_utterance, load_truth, load_utterance


def add_channel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("connection (docs/security.md)")
    g.add_argument("--tls-ca", type=Path, help="TLS: PEM CA bundle the server's certificate chains to")
    g.add_argument("--tls-key", type=Path, help="mutual TLS: the client's PEM key")
    g.add_argument("--tls-cert", type=Path, help="mutual TLS: the client's PEM certificate chain")
    g.add_argument("--header", action="append", default=[], metavar="KEY=VALUE",
                   help="gRPC metadata sent with every call (repeatable)")


def channel_of(p: argparse.ArgumentParser, args) -> Channel:
    headers = {}
    for item in args.header:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"--header {item!r}: expected KEY=VALUE")
        headers[key.strip().lower()] = value
    try:
        return Channel(args.tls_ca, args.tls_key, args.tls_cert, headers)
    except ValueError as exc:
        p.error(str(exc))


def voices_main(argv) -> int:
    """``voices register FILE`` (a .wav reference or a Chatterbox conds.pt) / ``voices list``."""
    from .voices import list_voices, read_conds, read_reference, register_prompt, register_voice

    p = argparse.ArgumentParser(prog="python -m s3flow_client voices")
    p.add_argument("what", choices=["register", "list"])
    p.add_argument("file", nargs="?", type=Path, help="register: a mono .wav reference or a conds.pt")
    p.add_argument("--url", default="127.0.0.1:8001", help="gRPC address (default: %(default)s)")
    add_channel_args(p)
    args = p.parse_args(argv)
    channel = channel_of(p, args)
    try:
        if args.what == "list":
            for voice_id in list_voices(args.url, channel):
                print(voice_id)
            return 0
        if args.file is None:
            p.error("register needs a .wav or conds.pt file")
        if args.file.suffix in (".pt", ".pth"):
            voice = register_prompt(args.url, **read_conds(args.file), channel=channel)
        else:
            voice = register_voice(args.url, *read_reference(args.file), channel=channel)
    except Exception as exc:  # the server's INVALID_ARG names what is wrong with the reference
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{voice.voice_id}  ({voice.prompt_tokens.size} prompt tokens, {voice.prompt_mel.shape[0]} frames)")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["voices"]:
        return voices_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m s3flow_client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="127.0.0.1:8001",
                   help="gRPC address, or several separated by commas (failover) (default: %(default)s)")
    p.add_argument("--model", default="token2mel",
                   help="token2mel (mel) or token2wav (mel and 24 kHz audio) (default: %(default)s)")
    src = p.add_argument_group("input")
    src.add_argument("--inputs", type=Path, help=".npz with speech_tokens, prompt_tokens, prompt_feat, embedding")
    src.add_argument("--voice", type=Path, help="a mono .wav reference: registered (voice_encoder), then the "
                     "utterances start by its voice id")
    src.add_argument("--tokens-from", metavar="FILE", help="live: read speech token ids (whitespace separated) "
                     "from FILE ('-': standard input) as they come, stream them, write the wav as it grows; the "
                     "prompt comes from --inputs or --voice (else a random one)")
    src.add_argument("--seconds", type=float, default=5.0, help="random tokens: utterance length (default: 5)")
    src.add_argument("--utterances", type=int, default=1, help="utterances streamed at once (default: 1)")
    src.add_argument("--seed", type=int, default=0, help="noise seed; utterance i uses seed + i (default: 0)")
    opt = p.add_argument_group("synthesis options")
    opt.add_argument("--steps", type=int, help="Euler steps (default: the server's)")
    opt.add_argument("--guidance-rate", type=float, help="guidance w (default: the server's)")
    ch = p.add_argument_group("chunk schedule")
    ch.add_argument("--first-chunk", type=int, default=10, help="tokens in the first chunk (default: 10)")
    ch.add_argument("--growth", type=float, default=2.0, help="chunk growth factor (default: 2)")
    ch.add_argument("--max-chunk", type=int, default=100, help="largest chunk (default: 100)")
    p.add_argument("--out-dir", type=Path, default=Path("out"), help="(default: %(default)s)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each response (a hung server "
                   "is reported after this long; the stream as a whole has no bound)")
    p.add_argument("--no-progress", action="store_true")
    add_channel_args(p)
    args = p.parse_args(argv)
    channel = channel_of(p, args)

    if args.tokens_from:
        return live_main(args, channel)
    utts, truth = [], load_truth(args.inputs) if args.inputs else None
    voice = None
    if args.voice:
        from .voices import read_reference, register_voice
        try:
            voice = register_voice(args.url.split(",")[0], *read_reference(args.voice), channel=channel)
        except Exception as exc:
            print(f"error: registering {args.voice}: {exc}", file=sys.stderr)
            return 1
        print(f"voice {voice.voice_id} from {args.voice}: {voice.prompt_tokens.size} prompt tokens")
    for i in range(args.utterances):
        u = load_utterance(args.inputs) if args.inputs else demo_utterance(args.seconds, seed=i)
        if voice is not None:
            u = voice.utterance(u.speech_tokens)
        u.seed, u.n_timesteps, u.guidance_rate = args.seed + i, args.steps, args.guidance_rate
        u.chunks = chunk_schedule(len(u.speech_tokens), args.first_chunk, args.growth, args.max_chunk)
        utts.append(u)
    total_chunks = sum(len(u.chunks) for u in utts)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=total_chunks, unit="chunk", desc="streaming")
    client = StreamingClient(args.url, args.model, response_timeout_s=args.timeout, channel=channel)
    code = 0
    wavs = []
    if client.audio:  # each .wav grows as its samples arrive
        from .audio import WavWriter
        wavs = [WavWriter(args.out_dir / f"audio_{i}.wav") for i in range(len(utts))]
    try:
        results = client.synthesize(utts, progress=bar.update if bar else None,
                                    on_audio=(lambda i, samples: wavs[i].write(samples)) if wavs else None)
    except StreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        results, code = exc.results, 1
    finally:
        if bar:
            bar.close()
        for wav in wavs:
            wav.close()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for i, (u, r) in enumerate(zip(utts, results)):
        stem = args.out_dir / f"mel_{i}"
        same = truth is not None and truth.shape == r.mel.shape
        if r.mel.size:
            np.save(stem.with_suffix(".npy"), r.mel)
            save_mel_png(r.mel, stem.with_suffix(".png"), title=f"streamed, utterance {i}: {r.mel.shape[1]} frames, "
                         f"{len(u.chunks)} chunks, seed {u.seed}", truth=truth if same else None)
        lat = ", ".join(f"{x * 1000:.0f}" for x in r.chunk_latencies_s)
        print(f"utterance {i}: {len(u.speech_tokens)} tokens in chunks {u.chunks} -> {r.mel.shape[-1]} frames "
              f"({r.audio_s:.2f} s audio)" + (f"  ERROR: {r.error}" if r.error else ""))
        print(f"  first chunk {r.first_chunk_s * 1000:.0f} ms; per-chunk ms [{lat}]; "
              f"wall {r.wall_s:.2f} s; real-time factor {r.rtf:.2f}")
        if same:
            print(f"  mean abs error vs the ground truth mel in {args.inputs.name}: "
                  f"{np.abs(r.mel - truth).mean():.3f} (mel std {truth.std():.3f})")
        if r.mel.size:
            print(f"  wrote {stem.with_suffix('.npy')} and {stem.with_suffix('.png')}"
                  + (" (ground truth above the streamed mel)" if same else ""))
        if wavs:
            from .audio import save_audio_png
            png = args.out_dir / f"audio_{i}.png"
            save_audio_png(r.audio, r.mel, png, seams=np.cumsum(r.chunk_samples)[:-1],
                           title=f"utterance {i}: {r.audio.size} samples (24 kHz), {len(u.chunks)} chunks, seed {u.seed}")
            print(f"  first audio {r.first_audio_s * 1000:.0f} ms; samples per response {r.chunk_samples}; "
                  f"wrote {wavs[i].path} and {png}")
    return code


def read_tokens(path: str):
    """Token id batches from a file or standard input, one list per line as the line arrives."""
    f = sys.stdin if path == "-" else open(path)
    try:
        for line in f:
            ids = [int(t) for t in line.split()]
            if ids:
                yield ids
    finally:
        if f is not sys.stdin:
            f.close()


def live_main(args, channel: Channel) -> int:
    """``--tokens-from``: one live utterance fed from a file or a pipe."""
    from .audio import WavWriter
    from .live import LiveClient

    if args.voice:
        from .voices import read_reference, register_voice
        voice = register_voice(args.url.split(",")[0], *read_reference(args.voice), channel=channel)
        prompt = dict(voice_id=voice.voice_id, prompt_tokens=voice.prompt_tokens, prompt_mel=voice.prompt_mel,
                      speaker_embedding=voice.speaker_embedding)
    else:
        u = load_utterance(args.inputs) if args.inputs else demo_utterance(1.0, seed=args.seed)
        prompt = dict(prompt_tokens=u.prompt_tokens, prompt_mel=u.prompt_mel, speaker_embedding=u.speaker_embedding)
    audio = args.model.startswith("token2wav")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    wav = WavWriter(args.out_dir / "audio_0.wav") if audio else None
    mels = []
    with LiveClient(args.url, args.model, channel=channel, response_timeout_s=args.timeout) as client:
        stream = client.open(**prompt, seed=args.seed, n_timesteps=args.steps, guidance_rate=args.guidance_rate)

        def feed():
            try:
                for ids in read_tokens(args.tokens_from):
                    stream.push(ids)
            except ValueError as exc:   # not token ids: stop the utterance, say why
                print(f"error: --tokens-from {args.tokens_from}: {exc}", file=sys.stderr)
                stream.cancel()
                return
            stream.end()

        threading.Thread(target=feed, daemon=True).start()
        try:
            for piece in stream:
                mels.append(piece.mel)
                if wav is not None and piece.audio is not None and piece.audio.size:
                    wav.write(piece.audio)
        finally:
            if wav is not None:
                wav.close()
        r = stream.result()
    if r.error:
        print(f"error: {r.error}", file=sys.stderr)
        return 1
    np.save(args.out_dir / "mel_0.npy", r.mel)
    print(f"live utterance: {len(stream.sizes)} chunks {stream.sizes} -> {r.mel.shape[1]} frames "
          f"({r.audio_s:.2f} s); first chunk {r.first_chunk_s * 1000:.0f} ms"
          + (f", first audio {r.first_audio_s * 1000:.0f} ms, {r.stalls} stalls ({r.stall_s:.2f} s); wrote {wav.path}"
             if wav is not None else "") + f", {args.out_dir / 'mel_0.npy'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
