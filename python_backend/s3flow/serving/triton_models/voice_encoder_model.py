"""The ``voice_encoder`` python-backend model: reference audio (or a ready prompt) in, voice id + prompt out.

Triton glue only: the request handling is ``s3flow.serving.voice_service.VoiceService`` (front-end + registry),
tested without a server; the tensors are ``contract.VOICE_ENCODER_INPUTS`` / ``_OUTPUTS``. Config parameters:
``n_feats``, ``max_prompt_tokens``, ``voice_dir`` (empty: a folder for this server run, removed at unload),
``max_voices``, ``max_voice_bytes``, ``torch_threads``; the front-end's weights are
``<version>/voice.safetensors`` (tokenizer.* and speaker_encoder.*).
"""
from __future__ import annotations

import os
import shutil

import torch

from s3flow_contract.tensors import VOICE_ENCODER_INPUTS, VOICE_ENCODER_OUTPUTS
from s3flow.model.voice import VoiceFrontend
from s3flow.protocol import RequestRules, tenant_of
from s3flow.serving.triton_models.base import TritonModel, input_arrays, ok_response
from s3flow.serving.voice_registry import VoiceRegistry
from s3flow.serving.voice_service import VoiceService


class TritonPythonModel(TritonModel):
    def setup(self, args):
        p = self.params
        self.owns_folder = False
        n_feats = p.int("n_feats", 80)
        self.check_contract(VOICE_ENCODER_INPUTS, VOICE_ENCODER_OUTPUTS, n_feats)
        torch.set_num_threads(p.int("torch_threads", 1))
        frontend = VoiceFrontend.from_checkpoint(os.path.join(self.version_dir, "voice.safetensors"))
        registry = VoiceRegistry.from_params(p)
        self.folder, self.owns_folder = registry.folder, not p.str("voice_dir", "")
        rules = RequestRules(max_prompt_tokens=p.int("max_prompt_tokens", 500))
        self.service = VoiceService(frontend, registry, rules, n_feats=n_feats)

    def respond(self, request):
        return ok_response(self.service.handle(input_arrays(request, VOICE_ENCODER_INPUTS),
                                               tenant_of(request.parameters())))

    def finalize(self):
        if self.owns_folder:  # voices of this server run survive nothing
            shutil.rmtree(self.folder, ignore_errors=True)
