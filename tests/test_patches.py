"""tilewise/patches.py: every replacement of a torch internal is in its manifest, checked against the
torch installed here, and installed where the program needs it."""
import ast
import pathlib
import subprocess
import sys

import pytest
import torch

import tilewise
from tilewise import patches

PACKAGE = pathlib.Path(tilewise.__file__).parent


def _torch_own(target: str):
    patches.current(target)  # imports the target's module, which may install the patch (Dynamo's)
    return patches.original(target) if target in patches.installed() else patches.current(target)


@pytest.mark.parametrize("patch", patches.MANIFEST, ids=lambda patch: patch.target)
def test_torch_is_what_the_patch_was_checked_on(patch):
    found = patches.fingerprint(_torch_own(patch.target))
    assert found == patch.checked, (
        f"torch {torch.__version__} changed {patch.target} underneath tilewise's patch ({patch.why}); "
        f"it was checked on torch {', '.join(patches.CHECKED_ON)}: read the new original, re-check the "
        f"patch, then set checked={found!r} and add the version to CHECKED_ON")


def test_a_program_using_every_feature_has_every_patch_installed_once():
    probe = """
import torch, tilewise
import torch._dynamo
from tilewise import patches
from tilewise.adaptive.tracer import Tracer
from tilewise.distributed import dtensor_random, fsdp
dtensor_random.install(); fsdp.install(Tracer)
before = {target: patches.current(target) for target in patches.installed()}
import importlib, tilewise.device as device
device.serialization.register(device.wrap); device.generators.install(); dtensor_random.install()
missing = sorted({patch.target for patch in patches.MANIFEST} - patches.installed())
unbound = sorted(t for t in patches.installed() if patches.current(t) is patches.original(t))
twice = sorted(t for t in patches.installed() if patches.current(t) is not before[t])
print(missing, unbound, twice)
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "[]", "[]"], done.stdout


def test_a_replacement_not_in_the_manifest_is_refused():
    with pytest.raises(patches.PatchError, match="not in tilewise/patches.py's MANIFEST"):
        patches.replace("torch.nn.functional:relu", lambda relu: relu)
    assert torch.nn.functional.relu is torch.nn.functional.__dict__["relu"]


def test_an_alias_torch_no_longer_shares_is_refused(monkeypatch):
    from torch.distributed.tensor import _dispatch, _random

    target = "torch.distributed.tensor._random:is_rng_supported_mesh"
    monkeypatch.setattr(patches, "_ORIGINALS", {k: v for k, v in patches._ORIGINALS.items() if k != target})
    monkeypatch.setattr(_dispatch, "is_rng_supported_mesh", lambda mesh: True)
    monkeypatch.setattr(_random, "is_rng_supported_mesh", _random.is_rng_supported_mesh)
    with pytest.raises(patches.PatchError, match="_dispatch:is_rng_supported_mesh is no longer"):
        patches.replace(target, lambda supported: supported)


# Where tilewise extends torch through a registry torch documents for it, not a replacement.
PUBLIC_REGISTRIES = {"default_collate_fn_map"}


def _torch_names(tree) -> set:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "torch"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names |= {a.asname or a.name for a in node.names}
    return names


def _root(node):
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def test_no_module_but_the_manifest_replaces_a_torch_internal():
    """An assignment to an attribute (or entry) of anything imported from torch, or a setattr on
    one, outside tilewise/patches.py."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "patches.py" and path.parent == PACKAGE:
            continue
        tree = ast.parse(path.read_text())
        names = _torch_names(tree)
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AugAssign) else []
            for target in targets:
                for each in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(each, (ast.Attribute, ast.Subscript)) and _root(each) in names - PUBLIC_REGISTRIES:
                        found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {ast.unparse(each)}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and _root(node.args[0]) in names:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} setattr({ast.unparse(node.args[0])}, ...)")
    assert found == [], found


def test_no_patch_reads_its_callers_frame():
    installers = [path for path in PACKAGE.rglob("*.py") if "patches.replace(" in path.read_text()]
    assert len(installers) >= 9
    readers = [str(path.relative_to(PACKAGE)) for path in installers if "f_locals" in path.read_text()]
    assert readers == [], readers


def test_pyproject_admits_only_the_torch_releases_the_manifest_was_checked_on():
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    torch_spec = next(Requirement(d).specifier for d in project["dependencies"] if Requirement(d).name == "torch")
    admitted = {f"2.{minor}" for minor in range(0, 40) if torch_spec.contains(f"2.{minor}.0")}
    assert admitted == {version.rsplit(".", 1)[0] for version in patches.CHECKED_ON}
