"""Where code lives (the docs' architecture page): every import points down the layers, and no
module is over 500 lines.

Layers, lowest first; a module imports only from its own layer or lower ones:

1. base: dslaunch's own foundations under ``dslaunch/`` (``BASE``): errors, the one writer of
   files, bounded text reads, and the small utilities runtime and launcher share;
2. kernels (``kernels/``): the dispatched ops, their fused implementations and torch references;
3. runtime (``runtime/``): the engines (training, pipeline, inference), ZeRO, config, checkpoints;
4. launcher (``launcher/``): the CLI, hosts, runners, the agent and monitor;
5. DeepSpeed's import paths: every other module under ``dslaunch/``, thin re-exports of 1-4.

The root package ``dslaunch`` (its version, its lazy DeepSpeed names) is importable from anywhere.
Imports counted: ``import``/``from`` at any depth (function-level ones too) and string targets
resolved at run time (``"dslaunch.x:attr"``, ``importlib.import_module("dslaunch.x")``).
"""

from __future__ import annotations

import functools

from tests.source_tree import imports, modules

MAX_LINES = 500

#: dslaunch/ modules that are foundations, not DeepSpeed paths: importable from every layer.
BASE = frozenset({
    "dslaunch.errors", "dslaunch.safe_write", "dslaunch.textfile", "dslaunch.constants",
    "dslaunch.utils.beat", "dslaunch.utils.hostlist", "dslaunch.utils.lazy", "dslaunch.utils.logging",
    "dslaunch.utils.ports", "dslaunch.utils.private_cache", "dslaunch.utils.refused", "dslaunch.utils.restart",
})
LAYERS = ("base", "kernels", "runtime", "launcher", "deepspeed paths")

#: (importer, imported) -> why it stays for now. Each is implementation still at a DeepSpeed path
#: under dslaunch/ (issue 42: to move under runtime/ or launcher/ with a thin re-export left).
ALLOWED: dict[tuple[str, str], str] = {}


def layer(name: str) -> int:
    """The layer index of module ``name`` (``LAYERS``)."""
    parts = name.split(".")
    if len(parts) > 1 and parts[1] in ("kernels", "runtime", "launcher"):
        return LAYERS.index(parts[1])
    return 0 if name in BASE else LAYERS.index("deepspeed paths")


@functools.cache
def upward_imports() -> dict[tuple[str, str], int]:
    """``(importer, imported) -> line`` for every import of a higher layer's module."""
    known = modules()
    found: dict[tuple[str, str], int] = {}
    for name in known:
        for line, target in imports(name):
            while target not in known and "." in target:  # ``import a.b.c`` of an attribute path
                target = target.rpartition(".")[0]
            if target.startswith("dslaunch.") and layer(target) > layer(name):
                found.setdefault((name, target), line)
    return found


def test_no_import_from_a_lower_layer_to_a_higher_one() -> None:
    found = upward_imports()
    bad = [f"{modules()[a].relative_to(modules()['dslaunch'].parents[1])}:{line}: {a} ({LAYERS[layer(a)]}) "
           f"imports {b} ({LAYERS[layer(b)]})" for (a, b), line in sorted(found.items()) if (a, b) not in ALLOWED]
    assert not bad, "imports against the layers (move the code down, or the import up):\n" + "\n".join(bad)


def test_the_allow_list_only_names_imports_that_exist() -> None:
    stale = sorted(set(ALLOWED) - set(upward_imports()))
    assert not stale, f"no longer imported, remove from ALLOWED: {stale}"


def test_kernels_import_nothing_from_runtime_or_launcher() -> None:
    # the headline: with the references in kernels/, no entry of ALLOWED may ever excuse this
    kernels = [(a, b) for a, b in upward_imports() if layer(a) == LAYERS.index("kernels")]
    assert kernels == []


def test_the_walk_sees_function_level_and_string_imports() -> None:
    seen = {target for _, target in imports("dslaunch.kernels.dispatch")}
    assert "dslaunch.kernels.reference" in seen  # only named in "module:attr" strings
    assert "dslaunch.kernels.cpu.ops" in seen
    assert "dslaunch.runtime.inference.loading" in {t for _, t in imports("dslaunch.runtime.tensor_parallel.training")}
    assert layer("dslaunch.errors") < layer("dslaunch.kernels.dispatch") < layer("dslaunch.runtime.engine")
    assert layer("dslaunch.runtime.engine") < layer("dslaunch.launcher.cli") < layer("dslaunch.inference")


def test_no_module_is_over_500_lines() -> None:
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split along a real seam (over {MAX_LINES} lines): {long}"
