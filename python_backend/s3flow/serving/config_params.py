"""Reading a served config the way the python models get it (Triton's JSON form, or a ``ModelConfig``): its
``parameters`` by key (each value parsed by ``s3flow.protocol``) and the load-time check against the tensor
contract. No protobuf or tritonclient import: every python model's stub loads this.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional

from s3flow_contract.tensors import Tensor
from s3flow.protocol import parameter_bool, parameter_number


class Params:
    """Typed reading of a config's ``parameters`` (Triton's JSON form or a ModelConfig): a value given, its
    default, or an error when it is required; the values parsed by ``s3flow.protocol`` (``parameter_number``,
    ``parameter_bool``: an integer is any whole number, a boolean ``true`` or ``false`` in any case). Every error
    names the model and the key."""

    def __init__(self, config, model: str = ""):
        if isinstance(config, Mapping):     # Triton's JSON form, as a python model gets it
            self.raw = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
            self.model = model or config.get("name", "model")
        else:                               # a ModelConfig (s3flow.repository.model_config)
            self.raw = {k: v.string_value for k, v in config.parameters.items()}
            self.model = model or config.name

    def _get(self, key, default):
        value = self.raw.get(key, "")
        if value == "":
            if default is None:
                raise ValueError(f"{self.model}: config parameter {key} is required")
            return None
        return value

    def str(self, key: str, default: Optional[str] = None) -> str:
        value = self._get(key, default)
        return default if value is None else value

    def _read(self, key, default, parse):
        value = self._get(key, default)
        if value is None:
            return default
        try:
            return parse(key, value)
        except ValueError as exc:
            raise ValueError(f"{self.model}: {exc}") from None

    def int(self, key: str, default: Optional[int] = None) -> int:
        return self._read(key, default, lambda k, v: parameter_number(k, v, integer=True))

    def float(self, key: str, default: Optional[float] = None) -> float:
        return self._read(key, default, lambda k, v: parameter_number(k, v, integer=False))

    def bool(self, key: str, default: Optional[bool] = None) -> bool:
        return self._read(key, default, parameter_bool)


def _declared(entries) -> dict:
    out = {}
    for e in entries:
        dims = tuple(int(d) for d in e.get("dims", []))
        out[e["name"]] = (e.get("data_type", ""), dims)
    return out


def check_tensors(config: Mapping, inputs: Iterable[Tensor], outputs: Iterable[Tensor], n_feats: int) -> None:
    """Raise ValueError unless the served config (Triton's JSON form) declares exactly the contract's inputs
    and outputs with its dtypes and dims; the message names the model and the first difference."""
    model = config.get("name", "model")
    for kind, entries, tensors in (("input", config.get("input", []), inputs),
                                   ("output", config.get("output", []), outputs)):
        have = _declared(entries)
        want = {t.name: (t.config_type, t.shape(n_feats)) for t in tensors}
        if set(have) != set(want):
            raise ValueError(f"{model}: config {kind}s {sorted(have)} differ from the contract's {sorted(want)}")
        for name, (dtype, dims) in want.items():
            if have[name] != (dtype, dims):
                raise ValueError(f"{model}: {kind} {name} is {have[name][0]} {list(have[name][1])} in the config, "
                                 f"the contract says {dtype} {list(dims)}")
