"""The ``voice_encoder`` python-backend model: reference audio (or a ready prompt) in, voice id + prompt out.

Triton glue only: the request handling is ``s3flow.serving.voice_service.VoiceService`` (front-end + registry),
tested without a server. Config parameters: ``n_feats``, ``max_prompt_tokens``, ``voice_dir`` (empty: a
folder for this server run, removed at unload), ``max_voices``, ``max_voice_bytes``, ``torch_threads``; the
front-end's weights are ``<version>/voice.safetensors`` (tokenizer.* and speaker_encoder.*).
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from s3flow.protocol import Limits, RequestError
from s3flow.model.voice import VoiceFrontend
from s3flow.serving.voice_registry import VoiceRegistry, default_dir
from s3flow.serving.voice_service import VoiceService
from s3flow.serving.responses import error_response

INPUTS = ("wav", "sample_rate", "prompt_tokens", "prompt_mel", "speaker_embedding", "list_voices")


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name = args["model_name"]
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        torch.set_num_threads(int(params.get("torch_threads", "1") or 1))
        weights = os.path.join(args["model_repository"], args["model_version"], "voice.safetensors")
        try:
            frontend = VoiceFrontend.from_checkpoint(weights)
            self.folder = params.get("voice_dir", "") or str(default_dir())
            self.owns_folder = not params.get("voice_dir", "")
            registry = VoiceRegistry(self.folder, int(params.get("max_voices", "1000")),
                                     int(params.get("max_voice_bytes", str(256 << 20))))
            limits = Limits(max_prompt_tokens=int(params.get("max_prompt_tokens", "500")))
            self.service = VoiceService(frontend, registry, limits, n_feats=int(params.get("n_feats", "80")))
        except (OSError, ValueError, KeyError) as exc:
            raise pb_utils.TritonModelException(f"{self.name}: {exc}") from None

    def execute(self, requests):
        responses = []
        for request in requests:
            inputs = {}
            for name in INPUTS:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            try:
                out = self.service.handle(inputs)
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor(k, np.ascontiguousarray(v)) for k, v in out.items()]))
            except RequestError as exc:
                responses.append(error_response(f"{self.name}: {exc}", pb_utils.TritonError.INVALID_ARG))
            except Exception as exc:  # one failing request must not fail the others
                responses.append(error_response(f"{self.name}: {type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL))
        return responses

    def finalize(self):
        if self.owns_folder:  # voices of this server run survive nothing
            shutil.rmtree(self.folder, ignore_errors=True)
