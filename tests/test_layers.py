"""The package's layers. What `import tilewise` costs a program: the engine's layers that a program
only needs once it compiles (the compiler, Dynamo for torch.compile, networkx for the stability
analysis, sympy for symbolic sizes) load on first use, not at import. And how its modules import one another: no circle, no
import from a layer above (`LAYERS`), none between layers held apart (`INDEPENDENT`), every import
statement counted, inside functions too (not those under `if TYPE_CHECKING:`, which never run)."""
import ast
import os
import subprocess
import sys

import networkx
import pytest
import torch

import tilewise

LAZY = ("tilewise.compiler", "tilewise.kernels", "tilewise.testing", "torch._dynamo", "networkx", "sympy")


def test_import_tilewise_loads_no_compiler_no_dynamo_no_networkx_no_sympy():
    probe = f"import sys, tilewise; print([m for m in sys.modules if m.split('.')[0] in {LAZY!r} or " \
            f"any(m == p or m.startswith(p + '.') for p in {LAZY!r})])"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_the_torch_compile_backend_is_found_through_the_entry_point_alone():
    probe = ("import sys, torch, tilewise; from torch._dynamo.backends.registry import lookup_backend; "
             "lookup_backend('tilewise'); print('tilewise.compiler.backend' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "True", done.stdout + done.stderr


# The package's layers, lowest first: a module imports (at module level or inside a function) only
# from its own layer or lower ones. The most specific prefix names a module's layer. The compiler's
# subpackages are layers of their own, in pipeline order; cache.disk (the signed directory that the
# native libraries and the compiled regions are both kept in) sits below the native backend.
LAYERS = (
    ("tilewise.errors", "tilewise.reasons", "tilewise.config", "tilewise.graphs", "tilewise.host_threads", "tilewise.host_memory",
     "tilewise.collector", "tilewise.settings_doc", "tilewise.op_facts", "tilewise.patches"),
    ("tilewise.device", "tilewise.distributed.cost"),
    ("tilewise.eager",),
    ("tilewise.compiler.ir",),
    ("tilewise.compiler.cache.disk",),
    ("tilewise.compiler.native",),
    ("tilewise.compiler.passes",),
    ("tilewise.compiler.driver",),
    ("tilewise.compiler.generic",),
    ("tilewise.compiler.cache",),
    ("tilewise.compiler.process",),
    ("tilewise.compiler",),  # entry.py, backend.py and the package itself
    ("tilewise.kernels",),   # hand-written tile kernels: the tile IR, its interpreter, the device
    ("tilewise.adaptive",),
    ("tilewise", "tilewise.distributed", "tilewise.dynamo", "tilewise.explorer", "tilewise.workloads",
     "tilewise.routes"),
    ("tilewise.testing",),  # the suite's and the scripts' harnesses, above all they test
)

# Layers that share nothing but what lies below both: the compiler reads what it needs to know of an
# op from tilewise.op_facts, which eager fills, and never eager itself (nor eager the compiler).
INDEPENDENT = (("tilewise.eager", "tilewise.compiler"),)


def _type_checking_nodes(tree) -> set:
    """Imports under `if TYPE_CHECKING:` are for annotations only: they never run."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            for inner in node.body:
                skip.update(id(n) for n in ast.walk(inner))
    return skip


def import_graph(annotations: bool = False) -> networkx.DiGraph:
    """Module -> the package's modules it imports, wherever the import statement is (with
    `annotations`, under `if TYPE_CHECKING:` too)."""
    package_dir = os.path.dirname(tilewise.__file__)
    root = os.path.dirname(package_dir)
    modules = {}
    for directory, _, files in os.walk(package_dir):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                module = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                modules[module.removesuffix(".__init__")] = (path, name == "__init__.py")
    graph = networkx.DiGraph()
    for module, (path, is_package) in modules.items():
        graph.add_node(module)
        tree = ast.parse(open(path).read())
        skip = set() if annotations else _type_checking_nodes(tree)
        package = module if is_package else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                parts = package.split(".")
                base = parts[:len(parts) - node.level + 1] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                           for alias in node.names]
            else:
                continue
            graph.add_edges_from((module, target) for target in targets if target in modules and target != module)
    return graph


def layer_of(module: str) -> int:
    matches = [(len(prefix), index) for index, prefixes in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    return max(matches)[1]


@pytest.mark.parametrize("annotations", [False, True], ids=["run-time imports", "annotation imports too"])
def test_the_package_has_no_import_circle(annotations):
    cycles = list(networkx.simple_cycles(import_graph(annotations)))
    assert cycles == [], cycles


def test_no_module_imports_from_a_layer_above_its_own():
    upward = [(a, b) for a, b in import_graph().edges if layer_of(b) > layer_of(a)]
    assert upward == [], upward


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_independent_layers_import_nothing_of_each_other():
    crossing = [(a, b) for a, b in import_graph().edges for one, other in INDEPENDENT
                if _within(a, one) and _within(b, other) or _within(a, other) and _within(b, one)]
    assert crossing == [], crossing


def test_every_layer_names_modules_that_exist():
    modules = set(import_graph())
    stale = [prefix for layer in LAYERS for prefix in layer if not any(_within(m, prefix) for m in modules)]
    assert stale == [], stale


def test_a_fact_about_an_op_is_stated_once():
    from tilewise import op_facts

    assert torch.ops.aten._thnn_fused_lstm_cell.default in op_facts.COMPOSITE  # filled by eager at import
    assert "empty" in op_facts.NO_KERNEL
    with pytest.raises(op_facts.DuplicateFact, match="empty"):
        op_facts.NO_KERNEL.register({"empty"})
    with pytest.raises(op_facts.DuplicateFact, match="_thnn_fused_lstm_cell"):
        op_facts.COMPOSITE.register({torch.ops.aten._thnn_fused_lstm_cell.default: print})
    assert op_facts.COMPOSITE[torch.ops.aten._thnn_fused_lstm_cell.default] is not print
