"""S3Gen's voice front-end: reference audio -> speaker prompt (tokens, 24 kHz mel, x-vector).

Public API::

    from s3flow.model.voice import VoiceFrontend, VoicePrompt, VoiceLimits, validate_wav
    fe = VoiceFrontend.from_checkpoint("s3gen.safetensors")
    prompt = fe.embed(wav_float32_1d, sample_rate)
    # prompt.prompt_tokens (1, Np) int64, prompt.prompt_feat (1, T, 80) float32, prompt.embedding (1, 192) float32

Modules: ``resample`` (torchaudio's sinc-Hann resampler), ``kaldi_fbank`` (Kaldi fbank), ``mel`` (the 24 kHz
prompt mel and the tokenizer's log-mel), ``tokenizer`` (S3TokenizerV2), ``campplus`` (CAM++ x-vector), ``weights``
(checkpoint keys ``tokenizer.*`` / ``speaker_encoder.*``, seeded random weights), ``frontend`` (embed_ref's
rules and input validation).
"""
from s3flow.model.voice.frontend import SUPPORTED_SAMPLE_RATES, VoiceFrontend, VoiceLimits, VoicePrompt, embed_ref, validate_wav
from s3flow.model.voice.weights import VoiceConfig, load_voice_modules, random_voice_state

__all__ = ["VoiceFrontend", "VoicePrompt", "VoiceLimits", "VoiceConfig", "validate_wav", "embed_ref",
           "load_voice_modules", "random_voice_state", "SUPPORTED_SAMPLE_RATES"]
