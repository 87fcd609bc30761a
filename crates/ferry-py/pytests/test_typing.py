"""The type stubs of the installed package (``ferry/*.pyi`` and ``py.typed``
in the wheel), checked by mypy (pinned in tests/pytest.rs, installed into
the test venv) on the files in ``pytests/typing/``:

- ``sglang_usage.py``: every method of ``ferry.mooncake.TransferEngine``
  called as SGLang's wrapper calls Mooncake's, and the module's other
  names; ``ferry_usage.py``: Ferry's own API. ``mypy --strict`` reports
  nothing on either;
- ``misuse.py``: wrong calls, each of which mypy must reject (the stubs
  are really read, not ``Any``);
- in the Mooncake wheels' venvs (``FERRY_TEST_WHEEL``): ``sglang_usage.py``
  with its import pointed at the real ``mooncake.engine`` reports nothing
  that it does not report against ``ferry.mooncake``. The wheel ships no
  stubs and no ``py.typed``: mypy says ``import-untyped`` and types the
  whole module ``Any`` (under ``--strict`` also ``no-any-return`` where an
  ``Any`` result is returned as ``int``).

Without mypy these skip, or fail when ``FERRY_REQUIRE_BACKENDS`` lists
``mypy``.
"""

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

import ferry
import ferry._native
import ferry.errors
import ferry.mooncake
from conftest import unavailable

HERE = Path(__file__).resolve().parent / "typing"
PACKAGE = Path(ferry.__file__).resolve().parent
WHEEL = os.environ.get("FERRY_TEST_WHEEL")
#: The public modules of the package and their stubs.
MODULES = {
    "ferry": "__init__.pyi",
    "ferry._native": "_native.pyi",
    "ferry.errors": "errors.pyi",
    "ferry.mooncake": "mooncake.pyi",
    "ferry.bench": "bench.pyi",
}
#: Names ``ferry.mooncake`` mirrors from the installed wheel (see its
#: ``__getattr__``).
MIRRORED = {
    "SUPPORT_CUDA",
    "SUPPORT_EFA",
    "SUPPORT_HIP",
    "SUPPORT_INTRA_NVLINK",
    "SUPPORT_MNNVL",
    "SUPPORT_MUSA",
    "InnerTransferEngine",
    "SharedSegment",
    "RpcInterface",
    "CoroRPCInterface",
    "ReceivedData",
    "ReceivedTensor",
    "create_rpc_client",
    "create_rpc_server",
}


def stub(name):
    return ast.parse((PACKAGE / MODULES[name]).read_text())


def stub_names(tree):
    """Top-level names a stub declares."""
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.ImportFrom):
            # Only explicit re-exports (`from .errors import X as X`).
            out.update(a.name for a in node.names if a.asname == a.name)
    return out


def stub_class(tree, name):
    """Names a class of a stub declares."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return stub_names(node)
    raise AssertionError(f"the stub has no class {name}")


def public(names):
    return {n for n in names if not n.startswith("_")}


def test_stubs_and_py_typed_are_installed():
    assert (PACKAGE / "py.typed").is_file(), f"no py.typed in {PACKAGE}"
    for module, pyi in MODULES.items():
        assert (PACKAGE / pyi).is_file(), f"{module}: no {pyi} in {PACKAGE}"
    # Every public module of the package has its stub.
    modules = {p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("_")}
    assert {m + ".pyi" for m in modules} <= set(MODULES.values())


def test_the_stubs_declare_every_public_name():
    import ferry.bench

    # Module level: what the module defines (its own public names).
    for name, module in [
        ("ferry", ferry),
        ("ferry.errors", ferry.errors),
        ("ferry.bench", ferry.bench),
        ("ferry._native", ferry._native),
    ]:
        modules = {n for n, v in vars(module).items() if isinstance(v, types.ModuleType)}
        missing = public(vars(module)) - modules - stub_names(stub(name))
        assert not missing, f"{name}: not in its stub: {sorted(missing)}"
    mooncake = public(vars(ferry.mooncake)) | MIRRORED
    mooncake -= {n for n, v in vars(ferry.mooncake).items() if isinstance(v, types.ModuleType)}
    mooncake -= {"Engine", "AddressNotRegistered", "FerryError"}  # its imports
    assert mooncake == public(stub_names(stub("ferry.mooncake")))
    assert set(ferry.mooncake.__all__) <= stub_names(stub("ferry.mooncake"))
    # Classes: every public attribute, and nothing the class lacks.
    classes = [
        ("ferry.mooncake", ferry.mooncake.TransferEngine),
        ("ferry._native", ferry._native.Engine),
        ("ferry", ferry.Engine),
    ]
    for module, cls in classes:
        declared = public(stub_class(stub(module), cls.__name__))
        assert declared == public(vars(cls)), (module, cls.__name__)
    assert public(dir(ferry.Engine)) <= public(stub_class(stub("ferry"), "Engine")) | public(
        stub_class(stub("ferry._native"), "Engine")
    )


def test_sglang_usage_calls_every_method():
    tree = ast.parse((HERE / "sglang_usage.py").read_text())
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    methods = public(vars(ferry.mooncake.TransferEngine))
    # Ferry's additions are ferry_usage.py's.
    methods -= {"ferry_support", "ferry_metrics", "ferry_engine", "last_error"}
    assert not methods - used, f"not called: {sorted(methods - used)}"
    imported = {
        a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
    }
    assert MIRRORED <= imported


def test_ferry_usage_calls_every_method():
    tree = ast.parse((HERE / "ferry_usage.py").read_text())
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    used |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    methods = public(dir(ferry.Engine)) | {
        "ferry_support", "ferry_metrics", "ferry_engine", "last_error", "install",
        "uninstall", "default_url", "KNOWN_PROTOCOLS",
    }
    assert not methods - used, f"not used: {sorted(methods - used)}"


def mypy(tmp_path, file, source=None):
    """``mypy --strict`` on a copy of ``typing/<file>`` (or ``source``):
    its diagnostics as ``(line, code)`` pairs, and its output."""
    if importlib.util.find_spec("mypy") is None:
        unavailable("mypy", "it is not installed in this venv (tests/pytest.rs installs it)")
    work = tmp_path / "check"
    work.mkdir(exist_ok=True)
    path = work / file
    if source is None:
        shutil.copy(HERE / file, path)
    else:
        path.write_text(source)
    out = subprocess.run(
        [
            sys.executable, "-m", "mypy", "--strict", "--show-error-codes",
            "--no-error-summary", "--no-color-output", "--hide-error-context",
            "--cache-dir", str(tmp_path / "mypy-cache"), file,
        ],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode in (0, 1), f"mypy failed to run:\n{out.stdout}\n{out.stderr}"
    found = re.findall(rf"^{re.escape(file)}:(\d+): error: .*\[([a-z-]+)\]$", out.stdout, re.M)
    return {(int(line), code) for line, code in found}, out.stdout


main_suite_only = pytest.mark.skipif(
    WHEEL is not None, reason="the main suite's run covers it (this is a Mooncake wheel's venv)"
)


@main_suite_only
@pytest.mark.parametrize("file", ["sglang_usage.py", "ferry_usage.py"])
def test_mypy_reports_nothing(tmp_path, file):
    found, output = mypy(tmp_path, file)
    assert not found and not output.strip(), output


@main_suite_only
def test_the_stubs_themselves_pass_mypy(tmp_path):
    # mypy silences errors inside installed packages: check the stubs as
    # sources of their own.
    if importlib.util.find_spec("mypy") is None:
        unavailable("mypy", "it is not installed in this venv (tests/pytest.rs installs it)")
    copy = tmp_path / "ferry"
    copy.mkdir()
    for pyi in MODULES.values():
        shutil.copy(PACKAGE / pyi, copy / pyi)
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--show-error-codes", "--no-color-output",
         "--cache-dir", str(tmp_path / "mypy-cache"), "ferry"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@main_suite_only
def test_mypy_rejects_the_misuses(tmp_path):
    text = (HERE / "misuse.py").read_text()
    expected = {
        (i, m.group(1))
        for i, line in enumerate(text.splitlines(), 1)
        for m in [re.search(r"# expect: ([a-z-]+)$", line)]
        if m
    }
    assert len(expected) >= 8
    found, output = mypy(tmp_path, "misuse.py")
    assert found == expected, output


def test_nothing_new_against_the_real_wheel(tmp_path):
    if WHEEL is None:
        pytest.skip("FERRY_TEST_WHEEL is not set (tests/pytest.rs runs this in the wheels' venvs)")
    assert importlib.util.find_spec("mooncake.engine") is not None
    text = (HERE / "sglang_usage.py").read_text()
    ours, ours_out = mypy(tmp_path, "sglang_usage.py")
    real_text = text.replace("from ferry.mooncake import (", "from mooncake.engine import (")
    assert real_text != text
    real, real_out = mypy(tmp_path, "sglang_usage.py", real_text)
    print(f"mypy --strict against {WHEEL}'s mooncake.engine:\n{real_out}")
    assert not ours, ours_out
    assert ours <= real
    # What mypy makes of the wheel: no stubs, no py.typed, so the module is
    # Any (the import reported) and every call of it is unchecked.
    assert {code for _, code in real} <= {"import-untyped", "no-any-return"}, real_out
    assert any(code == "import-untyped" for _, code in real), real_out
