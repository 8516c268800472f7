"""The tree reads as layers: a module of the server package imports only from its own layer or lower ones
(s3flow/__init__.py), the served package never imports training or the tools, the client and the wire contract
install and import without torch and without the server package, and the python models load without tritonclient
or protobuf. (A long module is a smell to look at, not a rule: nothing here counts lines.)"""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "python_backend" / "s3flow"
ROOT = PACKAGE.parents[1]
#: lowest first; a module's layer is its first package below s3flow (a top-level module is its own name):
#: inside Triton (serving) sits on the engine; writing the repository and running the server sit beside each
#: other on top
LAYERS = {"protocol": 0, "model": 1, "runtime": 2, "engine": 3, "serving": 4, "repository": 5, "server": 5}


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
            if node.level and PACKAGE not in path.parents:
                continue   # the client's own modules (from .stream import ...): within its package
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


def _code(folder: str):
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", _code("python_backend") + _code("client") + _code("contract"),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_libraries_never_import_the_tools_or_training(path):
    for module in _imports(path):
        top = module.split(".")[0]
        assert top not in ("s3flow_tools", "s3flow_training"), f"{path.relative_to(ROOT)} imports {module}"


@pytest.mark.parametrize("path", _code("client") + _code("contract"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_client_and_the_contract_never_import_the_server_package(path):
    """Not even lazily (torch may be imported inside a function for an optional format, e.g. a conds.pt; the
    fresh-interpreter test below holds the client to loading without it)."""
    for module in _imports(path):
        assert module.split(".")[0] != "s3flow", f"{path.relative_to(ROOT)} imports {module}"


def test_the_client_imports_without_torch_or_the_server_package():
    """In a fresh interpreter where torch and s3flow cannot be imported, the whole client and the contract load."""
    import subprocess
    import sys
    code = ("import sys, importlib.abc\n"
            "class Block(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('torch', 's3flow', 'onnxruntime'):\n"
            "            raise ImportError(f'{name} is blocked')\n"
            "sys.meta_path.insert(0, Block())\n"
            "import s3flow_contract.tensors, s3flow_contract.answers\n"
            "import s3flow_client, s3flow_client.stream, s3flow_client.voices, s3flow_client.audio, "
            "s3flow_client.demo, s3flow_client.__main__\n"
            "print('ok')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_the_python_models_load_neither_tritonclient_nor_protobuf():
    """Every Triton stub imports its model module: the configs' protobuf tooling (s3flow.repository.model_config)
    stays out of it (load time and memory per stub process)."""
    import subprocess
    import sys
    models = sorted(p.stem for p in (PACKAGE / "serving" / "triton_models").glob("*.py") if p.stem != "__init__")
    code = ("import sys\n" + "".join(f"import s3flow.serving.triton_models.{m}\n" for m in models)
            + "print(sorted({m.split('.')[0] for m in sys.modules} & {'tritonclient', 'google', 'grpc'}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", f"a python model imports {run.stdout.strip()}"
