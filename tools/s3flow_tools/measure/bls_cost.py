"""What a BLS call costs by what crosses it: the number of tensors against their bytes (issues 49, 50).

The solver calls the estimator over BLS ten times a chunk (guided, 10 steps), and with the prompt kept
(``keep_solved 1``) every call carries the stream's prompt cache, the same bytes each time. Whether to cut the
tensors a call carries (one packed tensor instead of eight) or the bytes (the cache kept where the estimator runs)
is decided here, on a server with nothing but two python models:

* ``echo``: up to eight FP32 inputs in; one output of as many floats as came in, and one of one float;
* ``caller``: ``calls`` BLS calls to ``echo`` in its ``execute``, the bytes split over ``tensors`` inputs (torch
  tensors handed over by DLPack, as ``s3flow.serving.triton_models.bls`` does), each output read back by DLPack;
  it answers the mean seconds per call.

Each size is measured with 1 and 8 input tensors, ``--rounds`` times alternating; the table holds the medians and
a least-squares fit ``call = fixed + per MB x (MB in + MB out) + per tensor x tensors``.

Example::

    .venv/bin/python -m s3flow_tools.measure.bls_cost                      # -> results/bls_cost.md (~1 min)
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Optional

import numpy as np

from s3flow.server.triton_server import TritonServer
from s3flow_tools.bench.report import log, machine
from s3flow_tools.measure.command import command

ROOT = Path(__file__).resolve().parents[3]
SIZES_KB = (3, 320, 1200, 4800)
TENSORS = (1, 8)

ECHO_CONFIG = """name: "echo"
backend: "python"
max_batch_size: 0
input [
{inputs}
]
output [
  {{ name: "o0" dims: [-1] data_type: TYPE_FP32 }},
  {{ name: "o1" dims: [-1] data_type: TYPE_FP32 }}
]
instance_group [{{ kind: KIND_CPU count: 1 }}]
"""

ECHO = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            arrays = [pb_utils.get_input_tensor_by_name(r, f"a{k}") for k in range(8)]
            total = sum(a.as_numpy().size for a in arrays if a is not None)
            out.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("o0", np.zeros(total, np.float32)), pb_utils.Tensor("o1", np.zeros(1, np.float32))]))
        return out
'''

CALLER_CONFIG = """name: "caller"
backend: "python"
max_batch_size: 0
input [ { name: "plan" dims: [3] data_type: TYPE_INT64 } ]
output [ { name: "seconds" dims: [1] data_type: TYPE_FP64 } ]
instance_group [{ kind: KIND_CPU count: 1 }]
"""

CALLER = '''
import time

import numpy as np
import torch
from torch.utils import dlpack
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            tensors, calls, floats = (int(v) for v in pb_utils.get_input_tensor_by_name(r, "plan").as_numpy())
            inputs = [torch.zeros(floats // tensors) for _ in range(tensors)]
            t0 = time.perf_counter()
            for _ in range(calls):
                request = pb_utils.InferenceRequest(
                    model_name="echo", requested_output_names=["o0", "o1"],
                    inputs=[pb_utils.Tensor.from_dlpack(f"a{k}", dlpack.to_dlpack(t)) for k, t in enumerate(inputs)])
                response = request.exec()
                if response.has_error():
                    raise pb_utils.TritonModelException(response.error().message())
                for name in ("o0", "o1"):
                    dlpack.from_dlpack(pb_utils.get_output_tensor_by_name(response, name).to_dlpack())
            seconds = (time.perf_counter() - t0) / calls
            out.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("seconds", np.array([seconds]))]))
        return out
'''


def write_repository(folder: Path) -> Path:
    inputs = ",\n".join(f'  {{ name: "a{k}" dims: [-1] data_type: TYPE_FP32 optional: true }}' for k in range(8))
    for name, config, code in (("echo", ECHO_CONFIG.format(inputs=inputs), ECHO), ("caller", CALLER_CONFIG, CALLER)):
        (folder / name / "1").mkdir(parents=True)
        (folder / name / "config.pbtxt").write_text(config)
        (folder / name / "1" / "model.py").write_text(textwrap.dedent(code))
    return folder


def measure(rounds: int, calls: int) -> dict:
    """{(kB, tensors): [seconds per call, one per round]}."""
    import tritonclient.grpc as grpcclient

    found: dict = {}
    with tempfile.TemporaryDirectory(prefix="s3flow-bls-cost-") as tmp:
        repo = write_repository(Path(tmp) / "repo")
        with TritonServer(repo, log_file=Path(tmp) / "server.log") as server:
            client = grpcclient.InferenceServerClient(server.grpc_url)
            for k in range(rounds + 1):   # the first round warms up
                for kb in SIZES_KB:
                    for tensors in TENSORS:
                        plan = grpcclient.InferInput("plan", [3], "INT64")
                        plan.set_data_from_numpy(np.array([tensors, calls, kb * 1000 // 4], np.int64))
                        seconds = float(client.infer("caller", [plan]).as_numpy("seconds")[0])
                        if k:
                            found.setdefault((kb, tensors), []).append(seconds)
                log(f"round {k} of {rounds} done")
    return found


def fit(found: dict) -> tuple[float, float, float]:
    """(fixed s, s per MB crossing (in + out), s per input tensor) by least squares over the medians."""
    rows, y = [], []
    for (kb, tensors), seconds in found.items():
        rows.append([1.0, 2 * kb / 1000, tensors])
        y.append(statistics.median(seconds))
    (fixed, per_mb, per_tensor), *_ = np.linalg.lstsq(np.array(rows), np.array(y), rcond=None)
    return float(fixed), float(per_mb), float(per_tensor)


def write(found: dict, args, path: Path) -> str:
    m = machine()
    fixed, per_mb, per_tensor = fit(found)
    lines = ["# What a BLS call costs by what crosses it", "",
             f"Made by `python -m s3flow_tools.measure.bls_cost --rounds {args.rounds} --calls {args.calls}` on "
             f"{m.get('cpu')} ({m.get('cores')} cores; shared, noisy): a python model calls another {args.calls} "
             "times per request over BLS, the bytes split over 1 or 8 FP32 input tensors, as many bytes back in one "
             "output (the module docstring). Medians of the rounds, ms per call.", "",
             "| kB in (and out) | 1 input tensor | 8 input tensors | 8 against 1 |", "| ---: | ---: | ---: | ---: |"]
    for kb in SIZES_KB:
        one, eight = (statistics.median(found[(kb, t)]) * 1e3 for t in TENSORS)
        lines.append(f"| {kb} | {one:.3f} | {eight:.3f} | {eight / one:.2f} |")
    lines += ["", f"Least squares over the cells: a call costs **{fixed * 1e3:.2f} ms fixed + {per_mb * 1e3:.2f} ms "
              f"per MB crossing** (in and out added) **+ {per_tensor * 1e3:.3f} ms per input tensor**.", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path.read_text()


def main(argv: Optional[list] = None) -> int:
    p = command(__file__, __doc__)
    p.add_argument("--rounds", type=int, default=3, help="rounds over every cell, alternating (default: 3)")
    p.add_argument("--calls", type=int, default=200, help="BLS calls per cell and round (default: 200)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bls_cost.md")
    args = p.parse_args(argv)
    print(write(measure(args.rounds, args.calls), args, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
