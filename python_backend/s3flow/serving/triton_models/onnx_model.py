"""A stateless python-backend model that runs one ONNX file with ONNX Runtime (CPU hosts).

It serves the ``estimator`` and the ``flow_encoder`` where no TensorRT / ONNX Runtime backend exists
(the pytriton wheel's server); which one the file is (and, for the estimator, whether it is meanflow and whether
it is the cached graph, ``s3flow.runtime.onnx_export``) is read from its graph, and the config must declare that model's contract tensors. The file is
``<version>/model.onnx``. Config parameters: ``intra_op_threads`` (default 0: the cores this process may use
divided among the model's instances, ``s3flow.runtime.ort.auto_threads``), ``allow_spinning``
(default true), ``graph_optimization`` (all | extended | basic | disable; default all), ``graph_rewrite``
(default true: ``s3flow.runtime.ort_rewrite.rewrite_for_cpu`` at load, the file is not changed), ``fuse_attention``
(auto | true | false; auto: only in 1-thread sessions, see ``OrtSettings``), ``arena_shrinkage`` (default
true: after each run ONNX Runtime's CPU arena gives back what that run needed beyond its resting size, so one
long utterance does not leave the process gigabytes larger for good; measured cost 0-2 % per run on the small
model, less on the full-size one), ``plain_graph`` and ``read_graph`` (beside a cached estimator, files of the
version folder: a call with an empty ``past``, whose rows read no cache and keep nothing, runs the plain graph,
and a call that keeps nothing (every row's keep 0) the read-only cached graph, each answering an empty ``kept``:
the cached graph's extra nodes made a one request 1.18-1.23x slower, and a read-only call is 531 nodes shorter).
"""
from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort

from s3flow_contract.tensors import (CACHE_INPUTS, CACHE_OUTPUTS, ESTIMATOR_OUTPUTS, MEANFLOW_INPUT, names,
                                     stateless_tensors)
from s3flow.protocol import RequestError
from s3flow.runtime.ort import OrtModel, OrtSettings, auto_threads
from s3flow.serving.heap import trim_heap
from s3flow.serving.triton_models.base import TritonModel, input_arrays, ok_response

#: Batches whose inputs and outputs hold more bytes than this are followed by trim_heap (about 1,600
#: frames of one (2, 80, T) tensor).
TRIM_AFTER_BYTES = 1 << 20


class TritonPythonModel(TritonModel):
    def setup(self, args):
        p = self.params
        # session settings live in s3flow.runtime.ort, shared with the in-process path
        instances = sum(int(g.get("count", 1)) for g in self.config.get("instance_group", [])) or 1
        fuse = p.str("fuse_attention", "auto")
        settings = OrtSettings(threads=p.int("intra_op_threads", 0) or auto_threads(instances),
                               spinning=p.bool("allow_spinning", True),
                               optimization=p.str("graph_optimization", "all"),
                               rewrite=p.bool("graph_rewrite", True),
                               fuse_attention=None if fuse.lower() == "auto" else p.bool("fuse_attention"))
        self.session = self._graph("model.onnx", "the model", settings)
        onnx_in = {i.name for i in self.session.get_inputs()}
        onnx_out = {o.name for o in self.session.get_outputs()}
        kind = "estimator" if set(names(ESTIMATOR_OUTPUTS)) <= onnx_out else "flow_encoder"
        cached = set(names(CACHE_OUTPUTS)) <= onnx_out
        self.inputs, self.outputs = stateless_tensors(kind, meanflow=MEANFLOW_INPUT.name in onnx_in, cached=cached)
        self.check_contract(self.inputs, self.outputs)
        if set(names(self.inputs)) - onnx_in or set(names(self.outputs)) - onnx_out:
            raise self.load_error(
                f"config tensors {list(names(self.inputs))} -> {list(names(self.outputs))} do not match the "
                f"ONNX file's {sorted(onnx_in)} -> {sorted(onnx_out)}")
        self.out_names = list(names(self.outputs))
        self.required = [t.name for t in self.inputs if not t.optional]
        # beside the cached graph: the plain one (a call whose past is empty) and the read-only one (a call that
        # keeps nothing), each answering the velocity alone
        self.plain, self.read = (self._graph(p.str(name, ""), f"the graph named by {name}", settings) if cached
                                 else None for name in ("plain_graph", "read_graph"))
        self.velocity = [n for n in self.out_names if n not in names(CACHE_OUTPUTS)]
        self.run_options = ort.RunOptions()
        if p.bool("arena_shrinkage", True):
            self.run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")

    def execute(self, requests):
        self._bytes = 0
        responses = super().execute(requests)
        if self._bytes > TRIM_AFTER_BYTES:
            trim_heap()
        return responses

    def respond(self, request):
        feeds = input_arrays(request, self.inputs)
        missing = [name for name in self.required if name not in feeds]
        if missing:
            raise RequestError(f"missing inputs {missing}")
        past = feeds.get(CACHE_INPUTS[0].name)
        graph = self._graph_for(past, len(feeds[self.inputs[0].name]))
        if graph is self.session:
            values = self.session.run(self.out_names, feeds, run_options=self.run_options)
        else:
            if graph is self.plain:
                del feeds[CACHE_INPUTS[0].name]
            values = graph.run(self.velocity, feeds, run_options=self.run_options)
            values = values + [np.zeros(0, np.float32) for _ in CACHE_OUTPUTS]
        self._bytes += sum(v.nbytes for v in feeds.values()) + sum(v.nbytes for v in values)
        return ok_response(dict(zip(self.out_names, values)))

    def _graph(self, file: str, what: str, settings: OrtSettings):
        """The session of ``file`` in the version folder (None: no file named). Plain run(), no IO binding: on CPU,
        binding per call measured no faster (tests/test_flops.py covers both ways of OrtModel.run)."""
        if not file:
            return None
        path = os.path.join(self.version_dir, file)
        if not os.path.isfile(path):
            raise self.load_error(f"{what}'s ONNX file is not at {path}")
        return OrtModel(path, settings, io_binding=False).session

    def _graph_for(self, past, rows: int):
        """The smallest graph a call needs: the plain one where ``past`` is empty (its rows read and keep
        nothing), the read-only one where every row's keep (``past``'s last ``rows`` values) is 0, else the
        cached one."""
        if past is None:
            return self.session
        if past.size == 0 and self.plain is not None:
            return self.plain
        if self.read is not None and past.size > rows and not past[-rows:].any():
            return self.read
        return self.session

    def finalize(self):
        self.session = self.plain = self.read = None
