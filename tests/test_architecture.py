"""The package's architecture, read from its import graph (every ``import`` and ``from ...
import`` statement, at module level or inside functions, and ``importlib.import_module`` of a
literal name): no import cycles; the subpackages form layers and import only downward; the
pure-math subpackages import no Lightning, HuggingFace or I/O module.  And its rooms: each weight
quantizer keeps its math and its strategy in one subpackage, each rule is one function in one
module, and no two modules or classes share a name for different things."""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A module imports only modules of its own subpackage or of a lower layer.
LAYERS = {
    "kbbq_pl._version": 0, "kbbq_pl._compat": 0, "kbbq_pl.resources": 0,
    "kbbq_pl.recipes": 0,
    "kbbq_pl.formats": 1,
    "kbbq_pl.kernels": 2, "kbbq_pl.law": 2,
    "kbbq_pl.transforms": 3,
    "kbbq_pl.quant": 4,
    "kbbq_pl.io": 5,
    "kbbq_pl.eval": 6,
    "kbbq_pl.callbacks": 7,
    "kbbq_pl.cli": 8,
    "kbbq_pl": 9,
}
PURE_MATH = ("kbbq_pl.formats", "kbbq_pl.law", "kbbq_pl.transforms", "kbbq_pl.quant.scales",
             "kbbq_pl.quant.rtn.algorithm", "kbbq_pl.quant.gptq.algorithm",
             "kbbq_pl.quant.act_scale", "kbbq_pl.quant.autobrake")
WEIGHT_QUANTIZER_ROOMS = {"rtn": "RTN", "gptq": "GPTQ"}
"""Each weight quantizer's room, ``kbbq_pl.quant.<room>``: its math on tensors (``algorithm``) and
its strategy of the pipeline (``quantizer``, the class named here), nothing else."""
ONE_HOME = {"pad_features": "kbbq_pl.formats.padding",
            "check_act_scale": "kbbq_pl.quant.act_scale",
            "effective_act_scale": "kbbq_pl.quant.act_scale",
            "count_tokens": "kbbq_pl.quant.tokens",
            "split_sequences": "kbbq_pl.quant.sequential",
            "rtn": "kbbq_pl.quant.rtn.algorithm",
            "group_scales": "kbbq_pl.quant.scales",
            "fold_o_proj": "kbbq_pl.transforms.o_proj_fold",
            "nvfp4_tensor_scale": "kbbq_pl.formats.rounding",
            "static_act_scale": "kbbq_pl.quant.act_scale",
            "choose_lambda": "kbbq_pl.quant.autobrake",
            "output_error": "kbbq_pl.quant.autobrake"}
"""Functions that each hold one rule, and the one module that defines them."""
WRITTEN_ONCE = {r'"input_ids"\]\.numel\(\)': "kbbq_pl.quant.tokens",
                r'act_scale == "static" and [\w.(]*fmt\.global_scale': "kbbq_pl.quant.act_scale",
                r"act_scale not in ": "kbbq_pl.quant.act_scale",
                r"\b448(\.0*)?\s*\*\s*6\b|\b2688\b|E4M3_MAX\s*\*\s*E2M1_MAX":
                    "kbbq_pl.formats.rounding"}
"""Code patterns of a rule (token counting, the static activation scale rule, the act_scale
values, the NVFP4 per-tensor scale ``amax / (448 * 6)``) and the one module whose code (not its
docstrings or comments) may hold it: everywhere else calls its function."""
SHARED_MODULE_NAMES = {"__init__", "algorithm", "quantizer"}
"""Module names that several subpackages hold for the same thing (a package, a weight
quantizer's math, its strategy); any other name is one module's."""
LIGHTNING_HF_IO = {"lightning", "pytorch_lightning", "lightning_fabric", "transformers",
                   "huggingface_hub", "tokenizers", "safetensors", "datasets", "lm_eval",
                   "compressed_tensors", "jsonargparse", "yaml", "json", "pickle", "requests"}
EDGE_PACKAGES = ("kbbq_pl.io", "kbbq_pl.eval", "kbbq_pl.cli", "kbbq_pl.callbacks")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the installed package: name -> (file, is a package)."""
    found = {}
    roots = [(ROOT / "kbbq_pl", "kbbq_pl"), (ROOT / "callbacks", "kbbq_pl.callbacks"),
             (ROOT / "recipes", "kbbq_pl.recipes")]
    for folder, prefix in roots:
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            name = ".".join((prefix, *(parts[:-1] if is_package else parts)))
            found[name] = (path, is_package)
    return found


MODULES = _modules()


MISSING: list[str] = []  # imports of package modules or names that do not exist (_imports)


@functools.cache
def _bound_names(module: str) -> set[str] | None:
    """The names module ``module`` binds at module level (its own definitions and imports, and
    its submodules); None when a star import makes that unknowable."""
    names = {m.rpartition(".")[2] for m in MODULES if m.rpartition(".")[0] == module}
    for node in ast.parse(MODULES[module][0].read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(alias.name == "*" for alias in node.names):
                return None
            names |= {(alias.asname or alias.name).partition(".")[0] for alias in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)
                      and isinstance(n.ctx, ast.Store)}
            names |= {(a.asname or a.name).partition(".")[0] for n in ast.walk(node)
                      if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
            names |= {n.name for n in ast.walk(node)
                      if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return names


def _imports(name: str) -> tuple[set[str], set[str]]:
    """(package modules, top-level external packages) that module ``name`` imports."""
    path, is_package = MODULES[name]
    package = name if is_package else name.rpartition(".")[0]
    internal, external = set(), set()

    def add(target: str) -> None:
        if target == "kbbq_pl" or target.startswith("kbbq_pl."):
            if target not in MODULES:
                MISSING.append(f"{path.relative_to(ROOT)} imports {target}")
                return
            internal.add(target)
        else:
            external.add(target.partition(".")[0])

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
                bound = _bound_names(base) if base in MODULES else None
                if bound is not None and alias.name != "*" and alias.name not in bound:
                    MISSING.append(f"{path.relative_to(ROOT)} imports {alias.name} from {base}, "
                                   "which does not define it")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            add(node.args[0].value)
    internal.discard(name)
    return internal, external


@functools.cache
def _graph() -> dict[str, tuple[set[str], set[str]]]:
    return {name: _imports(name) for name in MODULES}


def _layer(module: str) -> str:
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if module == prefix or (prefix != "kbbq_pl" and module.startswith(prefix + ".")):
            return prefix
    raise AssertionError(f"{module} belongs to no layer of {sorted(LAYERS)}: put it in a "
                         "subpackage (a new flat module hides the architecture)")


def _closure(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for target in _graph()[todo.pop()][0]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_every_import_names_a_module():
    assert len(_graph()) == len(MODULES)
    assert not MISSING, ("imports of modules or names that do not exist (relative imports left "
                         "behind by a move?):\n" + "\n".join(MISSING))


def test_the_graph_sees_module_and_function_level_imports():
    # module level (relative), function level (relative), importlib.import_module
    assert "kbbq_pl.formats" in _graph()["kbbq_pl.quant.layers"][0]
    assert "kbbq_pl.io.compressed_tensors" in _graph()["kbbq_pl.cli.commands"][0]
    assert "kbbq_pl.kernels" in _graph()["kbbq_pl.quant.w4a4"][0]
    assert "transformers" in _graph()["kbbq_pl.io.models"][1]
    assert "kbbq_pl.quant.pipeline" in _graph()["kbbq_pl.quant"][0]


def test_no_import_cycles():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(_graph()[module][0]):
            if state.get(target) == 1:
                cycle = stack[stack.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(_graph()):
        if module not in state:
            visit(module)


def test_every_module_imports_its_own_layer_or_lower_ones():
    upward = [f"{a} -> {b}" for a, (targets, _) in _graph().items() for b in targets
              if _layer(a) != _layer(b) and LAYERS[_layer(a)] <= LAYERS[_layer(b)]]
    assert not upward, "imports that climb back up a layer: " + "; ".join(sorted(upward))


@pytest.mark.parametrize("root", PURE_MATH)
def test_pure_math_imports_no_lightning_hf_or_io(root):
    modules = [m for m in MODULES if m == root or m.startswith(root + ".")]
    assert modules
    for module in modules:
        reached = {module} | _closure(module)
        edges = sorted(m for m in reached if m.startswith(EDGE_PACKAGES))
        assert not edges, f"{module} reaches the edge modules {edges}"
        external = sorted(set().union(*(_graph()[m][1] for m in reached)) & LIGHTNING_HF_IO)
        assert not external, f"{module} reaches {external} (through {sorted(reached)})"


def test_quantization_imports_no_lightning_and_no_io():
    for module in (m for m in MODULES if m.startswith("kbbq_pl.quant")):
        reached = {module} | _closure(module)
        assert not sorted(m for m in reached if m.startswith(EDGE_PACKAGES)), module
        external = set().union(*(_graph()[m][1] for m in reached))
        assert not external & {"lightning", "pytorch_lightning", "safetensors", "datasets",
                               "jsonargparse", "lm_eval", "compressed_tensors"}, module


def test_each_weight_quantizer_has_one_room():
    from kbbq_pl.quant.pipeline import WEIGHT_QUANTIZERS
    from kbbq_pl.quant.weight_quantizer import WeightQuantizer

    assert set(WEIGHT_QUANTIZERS) == set(WEIGHT_QUANTIZER_ROOMS)
    for room, cls in WEIGHT_QUANTIZER_ROOMS.items():
        package = f"kbbq_pl.quant.{room}"
        assert {m for m in MODULES if m.startswith(package + ".")} == {
            f"{package}.algorithm", f"{package}.quantizer"}
        strategy = WEIGHT_QUANTIZERS[room]
        assert strategy.__name__ == cls and issubclass(strategy, WeightQuantizer)
        assert strategy.__module__ == f"{package}.quantizer"
        # the math is below its strategy: it never imports a weight quantizer
        assert not {m for m in _closure(f"{package}.algorithm")
                    if m.endswith(".quantizer") or m == "kbbq_pl.quant.weight_quantizer"}


def _definitions() -> dict[str, list[str]]:
    """Top-level function and class names -> the modules that define them."""
    found: dict[str, list[str]] = {}
    for module, (path, _) in MODULES.items():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.setdefault(node.name, []).append(module)
    return found


def test_each_rule_has_one_function():
    definitions = _definitions()
    for name, home in ONE_HOME.items():
        assert definitions.get(name) == [home], f"{name} is defined in {definitions.get(name)}"
    for text, home in WRITTEN_ONCE.items():
        places = sorted(m for m, (path, _) in MODULES.items() if re.search(text, _code(path)))
        assert places == [home], f"{text!r} is written in {places}: call {home}'s function"


def _code(path: Path) -> str:
    """The source of ``path`` without its docstrings and comments (the code that runs)."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines(keepends=True)
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            docstrings.update(range(body[0].lineno - 1, body[0].end_lineno))
    kept = []
    for index, line in enumerate(lines):
        if index in docstrings:
            continue
        tokens = io.StringIO(line)
        try:
            comment = next((t.start[1] for t in tokenize.generate_tokens(tokens.readline)
                            if t.type == tokenize.COMMENT), None)
        except (tokenize.TokenError, IndentationError):
            comment = None
        kept.append(line if comment is None else line[:comment] + "\n")
    return "".join(kept)


def test_names_say_one_thing():
    by_name: dict[str, list[str]] = {}
    for module in MODULES:
        by_name.setdefault(module.rpartition(".")[2], []).append(module)
    shared = {n: ms for n, ms in by_name.items() if len(ms) > 1 and n not in SHARED_MODULE_NAMES}
    assert not shared, f"modules that share a name for different things: {shared}"
    classes = {n: ms for n, ms in _definitions().items() if n[:1].isupper() and len(ms) > 1}
    assert not classes, f"classes that share a name for different things: {classes}"


def test_every_package_is_shipped():
    tomllib = pytest.importorskip("tomllib")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
                 ["tool"]["setuptools"]["packages"])
    packages = {name for name, (_, is_package) in MODULES.items() if is_package}
    assert packages == listed, ("pyproject.toml's [tool.setuptools] packages must list every "
                                f"package: missing {sorted(packages - listed)}, "
                                f"stale {sorted(listed - packages)}")


WRITTEN_FILES = {"kbbq_pl_loader.py"}
"""Python files the package writes into its outputs, named in the layout table beside the
module that writes them."""


def test_the_layout_table_names_every_module():
    """docs/architecture.md's layout table: the row of each folder of the package (and of
    ``callbacks/``, ``scripts/``) names every Python file in it, and every file it names
    exists (a row may name a file of a subfolder, ``rtn/algorithm.py``, or a repository path)."""
    rows = dict(re.findall(r"^\| `([\w/]+/)` \| (.*) \|$",
                           (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"), re.M))
    stale, unnamed = [], []
    for folder, text in rows.items():
        if not (folder.startswith("kbbq_pl/") or folder in ("callbacks/", "scripts/")):
            continue
        named = set(re.findall(r"`([\w/]+\.py)`", text))
        for name in named - WRITTEN_FILES:
            if not ((ROOT / folder / name).exists() or (ROOT / name).exists()
                    or any((ROOT / folder / sub / name).exists()
                           for sub in re.findall(r"`(\w+)/`", text))):
                stale.append(f"{folder}: {name}")
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT / folder).as_posix()
            if path.name in ("__init__.py", "__main__.py") and relative.count("/") == 0:
                continue
            if path.name == "__init__.py" or relative in named or path.name in named:
                continue
            unnamed.append(f"{folder}{relative}")
    assert not stale, f"docs/architecture.md names files that do not exist: {stale}"
    assert not unnamed, f"docs/architecture.md's layout table does not name: {unnamed}"
