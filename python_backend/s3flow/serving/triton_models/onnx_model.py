"""A stateless python-backend model that runs one ONNX file with ONNX Runtime (CPU hosts).

It serves the ``estimator`` and the ``flow_encoder`` where no TensorRT / ONNX Runtime backend exists
(the pytriton wheel's server). Inputs and outputs are the config's, by name; the file is
``<version>/model.onnx``. Config parameters: ``intra_op_threads`` (default 0: the cores this process may use
divided among the model's instances, ``s3flow.runtime.ort.auto_threads``), ``allow_spinning``
(default true), ``graph_optimization`` (all | extended | basic | disable; default all), ``graph_rewrite``
(default true: ``s3flow.runtime.ort.rewrite_for_cpu`` at load, the file is not changed), ``fuse_attention``
(auto | true | false; auto: only in 1-thread sessions, see ``OrtSettings``), ``arena_shrinkage`` (default
true: after each run ONNX Runtime's CPU arena gives back what that run needed beyond its resting size, so one
long utterance does not leave the process gigabytes larger for good; measured cost 0-2 % per run on the small
model, less on the full-size one).
"""
from __future__ import annotations

import json
import os

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils

from s3flow.runtime.ort import OrtModel, OrtSettings, auto_threads
from s3flow.serving.heap import trim_heap

#: Requests whose inputs and outputs hold more bytes than this are followed by trim_heap (about 1,600
#: frames of one (2, 80, T) tensor).
TRIM_AFTER_BYTES = 1 << 20


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name = args["model_name"]
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
        if not os.path.isfile(path):
            raise pb_utils.TritonModelException(f"{self.name}: ONNX file not found at {path}")
        try:  # session settings live in s3flow.runtime.ort, shared with the in-process path
            instances = sum(int(g.get("count", 1)) for g in config.get("instance_group", [])) or 1
            threads = int(params.get("intra_op_threads", "0") or 0) or auto_threads(instances)
            settings = OrtSettings(threads=threads,
                                   spinning=params.get("allow_spinning", "true").lower() != "false",
                                   optimization=params.get("graph_optimization", "all") or "all",
                                   rewrite=params.get("graph_rewrite", "true").lower() != "false",
                                   fuse_attention={"true": True, "false": False}.get(
                                       params.get("fuse_attention", "auto").lower()))
            # plain run(), no IO binding: on CPU, binding per call measured no faster (tests/test_flops.py
            # covers both ways of OrtModel.run)
            self.session = OrtModel(path, settings, io_binding=False).session
        except ValueError as exc:
            raise pb_utils.TritonModelException(f"{self.name}: bad config parameter: {exc}") from None
        self.inputs = [i["name"] for i in config["input"]]
        self.outputs = [o["name"] for o in config["output"]]
        onnx_in = {i.name for i in self.session.get_inputs()}
        onnx_out = {o.name for o in self.session.get_outputs()}
        if set(self.inputs) - onnx_in or set(self.outputs) - onnx_out:
            raise pb_utils.TritonModelException(
                f"{self.name}: config tensors {self.inputs} -> {self.outputs} do not match the ONNX file's "
                f"{sorted(onnx_in)} -> {sorted(onnx_out)}")
        self.optional = {i["name"] for i in config["input"] if i.get("optional")}
        self.run_options = ort.RunOptions()
        if params.get("arena_shrinkage", "true").lower() != "false":
            self.run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")

    def execute(self, requests):
        responses, size = [], 0
        for request in requests:
            try:
                feeds = {}
                for name in self.inputs:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    if tensor is None:
                        if name in self.optional:
                            continue
                        raise ValueError(f"{self.name}: missing input {name}")
                    feeds[name] = tensor.as_numpy()
                    size += feeds[name].nbytes
                values = self.session.run(self.outputs, feeds, run_options=self.run_options)
                tensors = [pb_utils.Tensor(n, np.ascontiguousarray(v)) for n, v in zip(self.outputs, values)]
                size += sum(v.nbytes for v in values)
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as exc:  # one bad request must not fail the others
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(f"{self.name}: {exc}")))
        if size > TRIM_AFTER_BYTES:
            trim_heap()
        return responses

    def finalize(self):
        self.session = None
