"""What the five python-backend models share: reading the config, checking it against the contract, the
sequence controls, error responses and the per-request loop. They run inside the Triton stub
(``pb_utils``: ``s3flow.serving.responses``); importable outside it.

A model subclasses :class:`TritonModel` and writes ``setup`` (its own parameters, files and state) and
either ``respond`` (one request -> one response; the base's ``execute`` loops, so one bad request never
fails the others) or its own ``execute`` (the solver: one batch at a time). Every load-time failure is a
``pb_utils.TritonModelException`` naming the model and the bad value::

    class TritonPythonModel(TritonModel):
        def setup(self, args):
            self.check_contract(contract.VOCODER_INPUTS, contract.VOCODER_OUTPUTS, self.params.int("n_feats"))
            self.gain = self.params.float("gain", 1.0)

        def respond(self, request):
            mel = input_arrays(request, contract.VOCODER_INPUTS)["mel"]      # (1, n_feats, F)
            return ok_response({"audio": mel.sum(1) * self.gain})           # (1, F)
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

import numpy as np

from s3flow_contract.answers import Answer, Disposition
from s3flow_contract.tensors import CONTROLS, FEATS, Tensor, names
from s3flow.protocol import RequestError, UnknownSequence
from s3flow.serving.config_params import Params, check_tensors
from s3flow.serving.parent_watch import watch_parent
from s3flow.serving.responses import INTERNAL, INVALID_ARG, error_response, pb_utils



@dataclass(frozen=True)
class Controls:
    """Triton's sequence controls of one request (``contract.CONTROLS``; absent ones read 0)."""
    start: bool
    end: bool
    ready: bool
    corr_id: int


def input_array(request, name: str) -> Optional[np.ndarray]:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def input_arrays(request, tensors: Iterable[Tensor]) -> dict[str, np.ndarray]:
    """The request's arrays of ``tensors`` that it carries, by name."""
    out = {}
    for name in names(tensors):
        value = input_array(request, name)
        if value is not None:
            out[name] = value
    return out


def read_controls(request) -> Controls:
    values = {}
    for name in CONTROLS:
        value = input_array(request, name)
        values[name] = value.reshape(-1)[0] if value is not None else 0
    return Controls(start=bool(values["START"]), end=bool(values["END"]), ready=bool(values["READY"]),
                    corr_id=int(values["CORRID"]))


def ok_response(arrays: Mapping[str, np.ndarray]):
    """An InferenceResponse of numpy arrays, by output name."""
    return pb_utils.InferenceResponse(
        output_tensors=[pb_utils.Tensor(k, np.ascontiguousarray(v)) for k, v in arrays.items()])


def empty_response():
    """The answer to an empty slot of the direct strategy (READY 0)."""
    return pb_utils.InferenceResponse(output_tensors=[])


def config_feats(config: Mapping, tensors: Iterable[Tensor]) -> Optional[int]:
    """The mel bins a config declares: the dim at ``FEATS``'s place of the first contract tensor that has
    one (None when the config has no such tensor: the contract check then names what is missing)."""
    declared = {e["name"]: e.get("dims", []) for e in (*config.get("input", []), *config.get("output", []))}
    for t in tensors:
        if FEATS in t.dims and t.name in declared and len(declared[t.name]) == len(t.dims):
            return int(declared[t.name][t.dims.index(FEATS)])
    return None


class TritonModel:
    """Base of the python models. After ``initialize``: ``name``, ``config`` (Triton's JSON form, parsed),
    ``params`` (:class:`Params`), ``args``, ``logger``."""

    #: sequence-batched models need ``sequence_batching`` with every control and ``max_batch_size`` >= 1
    sequence_batching = False
    #: exceptions that mean "the request is bad" (INVALID_ARG, disposition fail); any other is INTERNAL, with
    #: ``failure_disposition`` (fail: sending it again fails the same way; the vocoder says resume: its stream
    #: state is gone, the utterance must be replayed)
    request_errors: tuple = (RequestError,)
    failure_disposition = Disposition.FAIL

    # -- load --------------------------------------------------------------------------------------
    def initialize(self, args):
        self.args = args
        self.name = args["model_name"]
        self.logger = pb_utils.Logger
        watch_parent()   # the stub goes when its server dies, however it died
        try:
            self.config = json.loads(args["model_config"])
            self.params = Params(self.config, self.name)
            if self.sequence_batching:
                self._check_sequence_batching()
            self.setup(args)
        except pb_utils.TritonModelException:
            raise
        except (KeyError, ValueError, OSError, RuntimeError) as exc:
            raise self.load_error(f"missing {exc}" if isinstance(exc, KeyError) else str(exc)) from None

    def setup(self, args) -> None:
        """The model's own load: parameters, files, state (``ValueError``/``OSError`` fail the load)."""
        raise NotImplementedError

    def load_error(self, message: str):
        """A TritonModelException whose message starts with the model's name."""
        prefix = f"{self.name}: "
        return pb_utils.TritonModelException(message if message.startswith(prefix) else prefix + message)

    def check_contract(self, inputs: Iterable[Tensor], outputs: Iterable[Tensor],
                       n_feats: Optional[int] = None) -> None:
        """Fail the load unless the config declares exactly these tensors (names, dtypes, dims); ``n_feats``
        defaults to what the config declares (then only its consistency is checked)."""
        inputs, outputs = tuple(inputs), tuple(outputs)
        if n_feats is None:
            n_feats = config_feats(self.config, inputs + outputs) or 0
        try:
            check_tensors(self.config, inputs, outputs, n_feats)
        except ValueError as exc:
            raise self.load_error(str(exc)) from None

    def _check_sequence_batching(self) -> None:
        if "sequence_batching" not in self.config:
            raise self.load_error("needs sequence_batching in its config")
        controls = {c["name"] for c in self.config["sequence_batching"].get("control_input", [])}
        if set(CONTROLS) - controls:
            raise self.load_error(f"sequence_batching must declare control inputs {CONTROLS}, "
                                  f"has {sorted(controls)}")
        if self.config.get("max_batch_size", 0) < 1:
            raise self.load_error(f"max_batch_size must be >= 1, got {self.config.get('max_batch_size', 0)}")

    @property
    def version_dir(self) -> str:
        """``<repository>/<name>/<version>``: where the model's files are."""
        return os.path.join(self.args["model_repository"], self.args["model_version"])

    @property
    def queue_delay_s(self) -> float:
        """The sequence batcher's ``max_queue_delay_microseconds`` (oldest strategy), in seconds; 0 without."""
        oldest = self.config.get("sequence_batching", {}).get("oldest", {})
        return float(oldest.get("max_queue_delay_microseconds", 0)) / 1e6

    @property
    def instance_kind(self) -> str:
        return self.args.get("model_instance_kind", "CPU")

    @property
    def device_id(self) -> int:
        return int(self.args.get("model_instance_device_id", 0))

    # -- requests ----------------------------------------------------------------------------------
    def execute(self, requests):
        return [self.answer(request) for request in requests]

    def respond(self, request):
        """One request's response; raise a ``request_errors`` exception for a bad request."""
        raise NotImplementedError

    def answer(self, request):
        """``respond``, with any failure turned into this request's error response."""
        try:
            return self.respond(request)
        except UnknownSequence as exc:   # this server does not hold the sequence: replay it
            return self.error(f"{self.name}: {exc}", INVALID_ARG, Answer(Disposition.RESUME, self.sequence_of(request)))
        except self.request_errors as exc:
            return self.error(f"{self.name}: {exc}", INVALID_ARG, Answer(Disposition.FAIL, self.sequence_of(request)))
        except Exception as exc:  # one bad request must not fail the others
            return self.error(f"{self.name}: {type(exc).__name__}: {exc}", INTERNAL,
                              Answer(self.failure_disposition, self.sequence_of(request)))

    def sequence_of(self, request) -> Optional[int]:
        """The request's correlation id (sequence-batched models), else None."""
        return read_controls(request).corr_id if self.sequence_batching else None

    @staticmethod
    def error(message: str, code: str, answer: Answer):
        """An error response: ``code`` names a ``pb_utils.TritonError`` code (INVALID_ARG, UNAVAILABLE, ...),
        ``answer`` its disposition (``s3flow_contract.answers``)."""
        return error_response(message, getattr(pb_utils.TritonError, code), answer)
