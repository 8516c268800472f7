"""The package reads as layers: a module imports only from its own layer or lower ones (s3flow/__init__.py),
every module outside the model ports stays under 400 lines, and the served package never imports training."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "python_backend" / "s3flow"
#: lowest first; a module's layer is its first package below s3flow (a top-level module is its own name)
LAYERS = {"contract": 0, "protocol": 0, "model": 1, "runtime": 2, "engine": 3, "serving": 4}
#: torch ports of upstream modules: as long as the code they port
MODEL_PORTS = {"model/estimator.py", "model/encoder.py", "model/vocoder.py", "model/voice/campplus.py",
               "model/voice/tokenizer.py"}
MAX_LINES = 400


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE)


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path):
    """Every s3flow module the file imports, at any depth (lazy imports inside functions count too)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import (use s3flow.<layer>....)"
            if node.module == "s3flow":  # from s3flow import contract, serving, ...: each is a module
                yield from (f"s3flow.{a.name}" for a in node.names)
            else:
                yield node.module


def _name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def test_every_module_has_a_layer():
    for path in _modules():
        assert _layer(_name(path)) in LAYERS, f"{path} is outside every layer {sorted(LAYERS)}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_a_higher_layer(path):
    own = LAYERS[_layer(_name(path))]
    for module in _imports(path):
        if module.startswith("s3flow_training"):
            pytest.fail(f"{path.name} imports {module}: training is outside the served package")
        if module.split(".")[0] != "s3flow" or module == "s3flow":
            continue
        assert LAYERS[_layer(module)] <= own, f"{_name(path)} (layer {own}) imports {module} (a higher layer)"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_outside_the_model_ports_stay_short(path):
    rel = str(path.relative_to(PACKAGE))
    if rel in MODEL_PORTS:
        return
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{rel} has {lines} lines (at most {MAX_LINES} outside the model ports)"


OTHER_CODE = [p for folder in ("client", "scripts", "training")
              for p in sorted((PACKAGE.parents[1] / folder).rglob("*.py"))]


@pytest.mark.parametrize("path", OTHER_CODE, ids=lambda p: str(p.relative_to(PACKAGE.parents[1])))
def test_client_scripts_and_training_stay_short(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.name} has {lines} lines (at most {MAX_LINES})"


def test_the_python_models_load_neither_tritonclient_nor_protobuf():
    """Every Triton stub imports its model module: the configs' protobuf tooling (s3flow.serving.model_config)
    stays out of it (load time and memory per stub process)."""
    import subprocess
    import sys
    models = sorted(p.stem for p in (PACKAGE / "serving" / "triton_models").glob("*.py") if p.stem != "__init__")
    code = ("import sys\n" + "".join(f"import s3flow.serving.triton_models.{m}\n" for m in models)
            + "print(sorted({m.split('.')[0] for m in sys.modules} & {'tritonclient', 'google', 'grpc'}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", f"a python model imports {run.stdout.strip()}"
