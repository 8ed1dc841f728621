"""fullshard's packages form layers: nothing imports upward, and no two import each other.

Every ``import`` in ``src/fullshard`` counts, including those inside functions (they
hide cycles, they do not remove them). docs/architecture.md draws the same layers.
"""

import ast
import collections
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "fullshard"

# Bottom first. A module may import from its own layer and the layers below it.
LAYERS = [
    {"torch_version"},                                     # the installed torch, read once
    {"policies", "gpt", "errors", "bounds"},               # plain data, a plain model, checks
    {"core"},                                              # the runtime
    {"fsdp_module", "api", "placement_meshes"},            # the FSDP2 front
    {"optim", "step_calls", "overlapped_step", "captured", "delayed_update", "whole_matrix", "offload", "grad_norm", "wrap",
     "activation_checkpointing",
     "checkpoint", "torch_names"},
    {"fsdp1"},                                             # the FSDP1 front, on the above
    {"memory", "projection"},                              # estimate, plan, tracker; scale projection
    {"train"},                                             # the trainer
    {"testing", "cli", "run", "__main__", "__init__"},     # entry points and test helpers
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def _package_of(dotted: str) -> str:
    """``fullshard.core.group`` -> ``core``; a name taken from the package itself
    (``from fullshard import fully_shard``) -> ``__init__``."""
    parts = dotted.split(".")
    if len(parts) == 1 or not ((SRC / parts[1]).is_dir() or (SRC / f"{parts[1]}.py").exists()):
        return "__init__"
    return parts[1]


def _imported(path: pathlib.Path) -> tuple[list[str], list[str]]:
    """The dotted name of the module at ``path``'s package, and every ``fullshard.*`` name
    it imports (relative imports resolved)."""
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    here = parts[:-1] if is_package else parts
    targets: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            package = here if is_package else here[:-1]
            base = package[:len(package) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
            names = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        targets += [t for t in names if t == "fullshard" or t.startswith("fullshard.")]
    return here, targets


def _imports() -> dict[tuple[str, str], list[str]]:
    """(importer package, imported package) -> the files where it happens."""
    found: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    for path in sorted(SRC.rglob("*.py")):
        here, targets = _imported(path)
        for target in targets:
            a, b = _package_of(".".join(here)), _package_of(target)
            if a != b:
                found[(a, b)].append(str(path.relative_to(SRC)))
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its nodes in order, the first repeated last), or None."""
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])):
            return cycle[cycle.index(cycle[-1]):]
    return None


def test_every_package_has_a_layer():
    packages = {p.stem if p.is_file() else p.name for p in SRC.iterdir()
                if (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert packages <= set(LAYER_OF), f"give these a layer: {sorted(packages - set(LAYER_OF))}"


def test_nothing_imports_upward():
    upward = [f"{a} -> {b} ({', '.join(sorted(set(files)))})"
              for (a, b), files in _imports().items()
              if a in LAYER_OF and b in LAYER_OF and LAYER_OF[b] > LAYER_OF[a]]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_import_cycle_between_packages():
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for a, b in _imports():
        graph[a].add(b)
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_between_files():
    """Inside a package too, no two files import each other, not even for type hints
    only (an ``if TYPE_CHECKING:`` import still says each needs the other: the shared
    name belongs in a third file). A package's ``__init__`` gathers its files and is
    left out."""
    files = {".".join(p.relative_to(SRC.parent).with_suffix("").parts): p
             for p in SRC.rglob("*.py") if p.name != "__init__.py"}
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in files.items():
        for target in _imported(path)[1]:
            # ``from .pkg import name`` may name a module or something a module defines
            module = target if target in files else target.rpartition(".")[0]
            if module in files and module != name:
                graph[name].add(module)
    cycle = _cycle(graph)
    assert cycle is None, "import cycle between files: " + " -> ".join(cycle)


# Inside core/ (docs/architecture.md, "Inside core/"): what each sub-package may import of
# core besides itself. The guard and the side roads sit on the engine's collectives and the
# refusals only, so that the engine may call them without a loop between the folders.
CORE_SUB_PACKAGES_USE = {
    "refusals": set(),
    "guard": {"fullshard.core.comm", "fullshard.core.refusals"},
    "features": {"fullshard.core.comm", "fullshard.core.refusals"},
}


def test_core_sub_packages_use_only_the_engine_s_collectives_and_refusals():
    wrong = []
    for sub, allowed in CORE_SUB_PACKAGES_USE.items():
        own = f"fullshard.core.{sub}"
        for path in sorted((SRC / "core" / sub).glob("*.py")):
            for target in _imported(path)[1]:
                if target.startswith("fullshard.core") and not any(
                        target == a or target.startswith(a + ".") for a in allowed | {own}):
                    wrong.append(f"{path.relative_to(SRC)} imports {target}")
    assert sorted(CORE_SUB_PACKAGES_USE) == sorted(
        p.name for p in (SRC / "core").iterdir() if (p / "__init__.py").exists())
    assert not wrong, "core's sub-packages reach into the engine:\n" + "\n".join(wrong)


def test_every_note_is_defined_once_and_indexed():
    """A ``Note [title]`` reference must lead to its Note, and docs/architecture.md's
    index must list every Note."""
    import re

    defined: dict[str, list[str]] = collections.defaultdict(list)
    referenced: set[str] = set()
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        for match in re.finditer(r"^\s*(?:# )?Note (\[[^\]]+\])\s*$", text, re.M):
            defined[match.group(1)].append(str(path.relative_to(SRC)))
        referenced |= {re.sub(r"\s+(?:#\s+)?", " ", ref)  # a title wrapped over two lines
                       for ref in re.findall(r"Note\s+(\[[^\]]+\])", text)}
    index = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    assert not {t: f for t, f in defined.items() if len(f) > 1}, "Notes defined twice"
    assert not referenced - set(defined), f"references to no Note: {referenced - set(defined)}"
    assert not [t for t in defined if t not in index], "Notes missing from the index"


# Folders of tests/ that mirror no package: code fullshard did not write, the CUDA lane,
# the scale lane (the whole step at 1,024 ranks), what tests share, faults injected into
# workers, and the repository's own files (docs, benchmarks, Makefile, the test lanes).
TEST_FOLDERS_OF_THEIR_OWN = {"conformance", "gpu", "scale", "support", "faults", "repo"}


def _modules_of(package: pathlib.Path) -> set[str]:
    """The names a test of this package may start with: its files and subpackages, and
    the package itself (for what its ``__init__`` holds or the package as a whole)."""
    names = {p.stem for p in package.glob("*.py") if not p.stem.startswith("__")}
    return names | {p.name for p in package.iterdir() if (p / "__init__.py").exists()} \
        | {package.name}


def _is_named_for(test: str, modules: set[str]) -> bool:
    name = test.removeprefix("test_")
    return any(name == m or name.startswith(m + "_") for m in modules)


def test_tests_are_laid_out_like_the_package_and_import_no_test_module():
    """tests/PKG/ holds the tests of src/fullshard/PKG/, each named for the file it tests
    (``test_<file>.py`` or ``test_<file>_<topic>.py``); a test module imports what it shares
    from tests/support (or fullshard.testing), never from another test module."""
    tests = pathlib.Path(__file__).resolve().parents[1]
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert not folders - packages - TEST_FOLDERS_OF_THEIR_OWN, \
        "test folders that match no package of src/fullshard"
    unnamed = [str(t.relative_to(tests)) for folder in [tests, *(tests / p for p in packages)]
               for t in sorted(folder.glob("test_*.py"))
               if not _is_named_for(t.stem, _modules_of(SRC if folder == tests
                                                        else SRC / folder.name))]
    assert not unnamed, f"tests named for no file of their package: {unnamed}"
    test_modules = {p.stem for p in tests.rglob("test_*.py")}
    importing_tests = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[-1] in test_modules for n in names):
                importing_tests.append(str(path.relative_to(tests)))
    assert not importing_tests, f"test modules imported by {importing_tests}"


def _road_and_clock() -> list[str]:
    """The files docs/architecture.md walks a parameter through, then the clock's."""
    import re

    doc = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    life = doc[doc.index("## The life of one parameter"):doc.index("### Shard time")]
    road = re.findall(r"^\| \d \| `([^`]+)` \|", life, re.M)
    clock = life[life.index("Three more files are the clock"):life.index("Features that are off")]
    return road + re.findall(r"`([\w/]+\.py)`", clock)


def test_every_file_of_the_core_and_of_the_road_has_tests_named_for_it():
    """A reader about to change a file a parameter's life runs through, or any file of
    core/ and its sub-packages, finds its tests by the file's name: tests/core/test_group*.py
    for core/group.py, tests/core/test_guard_ledger*.py for core/guard/ledger.py."""
    tests = pathlib.Path(__file__).resolve().parents[1]
    road = _road_and_clock()
    assert len(road) == 11, road
    core = [str(p.relative_to(SRC)) for p in sorted((SRC / "core").rglob("*.py"))
            if not p.stem.startswith("__")]

    def named_for(file: str) -> set[str]:
        # tests of PKG/SUB/Y.py are tests/PKG/test_SUB_Y*.py
        package, *sub, stem = pathlib.Path(file).with_suffix("").parts if "/" in file \
            else ("", file.removesuffix(".py"))
        return {"_".join([*sub, stem])}

    def folder(file: str) -> pathlib.Path:
        return tests / pathlib.Path(file).parts[0] if "/" in file else tests

    untested = [f for f in dict.fromkeys(road + core)
                if not [t for t in folder(f).glob("test_*.py")
                        if _is_named_for(t.stem, named_for(f))]]
    assert not untested, f"no tests named for {untested}"


def _files_of_a_steady_step() -> list[str]:
    """The fullshard files whose functions run in a second training step of a 3-unit
    model (the first step made the root and its buffers)."""
    import os
    import sys

    import torch

    import fullshard
    from fullshard import fully_shard

    root = os.path.dirname(fullshard.__file__)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
                                  for _ in range(3)])
    for block in model:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)

    def step():
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    seen: set[str] = set()

    def called(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            seen.add(os.path.relpath(frame.f_code.co_filename, root).replace(os.sep, "/"))

    sys.setprofile(called)
    try:
        step()
    finally:
        sys.setprofile(None)
    return sorted(seen)


def test_a_steady_step_stays_on_the_road_the_architecture_walks():
    """docs/architecture.md names the eight files of a parameter's road, the clock's and
    the guard's; a steady step at 2 ranks runs in exactly the files it says."""
    import re

    from fullshard.testing import run_distributed

    doc = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    steady = doc[doc.index("A steady step ("):doc.index("### Checkpoint")]
    named = set(_road_and_clock()) | set(re.findall(r"`([\w/]+\.py)`", steady))
    said = named - {"api.py", "core/init.py", "tests/repo/test_layers.py"}  # shard time; this test
    for files in run_distributed(_files_of_a_steady_step, 2):
        assert set(files) == said, (f"a steady step ran in {sorted(set(files) - said)} "
                                    f"beyond docs/architecture.md's walk, and not in "
                                    f"{sorted(said - set(files))}")
