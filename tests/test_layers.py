"""What `import tilewise` costs a program: the engine's layers that a program only needs once it
compiles (the compiler, Dynamo for torch.compile, networkx for the stability analysis) load on
first use, not at import."""
import subprocess
import sys

LAZY = ("tilewise.compiler", "torch._dynamo", "networkx")


def test_import_tilewise_loads_no_compiler_no_dynamo_no_networkx():
    probe = f"import sys, tilewise; print([m for m in sys.modules if m.split('.')[0] in {LAZY!r} or " \
            f"any(m == p or m.startswith(p + '.') for p in {LAZY!r})])"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_the_torch_compile_backend_is_found_through_the_entry_point_alone():
    probe = ("import sys, torch, tilewise; from torch._dynamo.backends.registry import lookup_backend; "
             "lookup_backend('tilewise'); print('tilewise.compiler.backend' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "True", done.stdout + done.stderr
