"""docs/design.md §1, "Layout", against the tree: it names every module of diffjax/ (and none that is gone), every
extra of pyproject.toml and every `diffjax` command; its "Layering": every import of one part of diffjax/ by another
points down the layers; and the docs' hand-written lists of registered things (§6's protocols, the archs of §2,
docs/training.md and the README) against the registries."""

import argparse
import ast
import re
import tomllib

from helpers import REPO

from diffjax import cli
from diffjax.eval import PROTOCOLS

NAME = re.compile(r"[\w.]+/?")  # a file or directory entry of the layout's name column


def design_section(number: int) -> str:
    text = (REPO / "docs" / "design.md").read_text()
    return text[text.index(f"## {number}. "):text.index(f"## {number + 1}. ")]


def between(text: str, start: str, end: str, after: str = "") -> str:
    """`text` from the first `start` to the first `end` that follows it (and follows `after`, where given)."""
    i = text.index(start)
    return text[i:text.index(end, text.index(after, i) if after else i + len(start))]


def layout() -> str:
    return design_section(1).split("```")[1]


def entries() -> dict[str, str]:
    """Each entry of the layout's tree, its path (`diffjax/train/loop.py`) -> its text (its line and those under it
    that continue it). An entry line starts, indented two spaces per level, with one name or several joined by
    ", ", then two spaces or more and its description; a line indented past the name column continues the entry."""
    found, parents, last = {}, [], []
    for line in layout().splitlines():
        indent = len(line) - len(line.lstrip())
        head = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        names = head.split(", ")
        if indent >= 26:  # the description goes on
            for path in last:
                found[path] += "\n" + line
            continue
        parents = parents[:indent // 2]
        last = ["".join(parents) + n for n in names] if all(NAME.fullmatch(n) for n in names) else []  # [] : a link
        found.update({path: line for path in last})
        if len(names) == 1 and names[0].endswith("/"):
            parents.append(names[0])
    return found


def test_every_module_is_named_and_every_named_module_exists():
    named = {path for path in entries() if path.startswith("diffjax/") and path.endswith(".py")}
    tree = {str(p.relative_to(REPO)) for p in (REPO / "diffjax").rglob("*.py")}
    lines = "\n".join(f"{'  ' * p.count('/')}{p.rsplit('/', 1)[-1]}   <what it holds>" for p in sorted(tree - named))
    assert not tree - named, (f"modules docs/design.md §1 does not name: {sorted(tree - named)}; add to the tree of "
                              f"'## 1. Layout', under its directory (or join it to a sibling's line, 'a.py, b.py'):\n"
                              f"{lines}")
    assert not named - tree, f"docs/design.md §1 names modules that are not in diffjax/: {sorted(named - tree)}"


def test_every_extra_and_every_command_is_named():
    text = entries()
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    missing = [e for e in extras if not re.search(rf"\b{re.escape(e)}\b", text["pyproject.toml"])]
    assert not missing, f"extras of pyproject.toml that docs/design.md §1 does not name: {missing}"
    commands = next(a.choices for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [c for c in commands if not re.search(rf"[`| ]{re.escape(c)}[`| :]", text["diffjax/cli.py"])]
    assert not missing, f"diffjax commands that docs/design.md §1's cli.py line does not name: {missing}"


# docs/design.md §1, "Layering", bottom first: a part of diffjax/ (a top-level module or directory) imports only
# parts of lower layers, never a sibling of its own layer; `diffjax` is the package's __init__.
LAYERS = (
    {"config"},  # plain data: nothing from diffjax
    {"paths"},  # local paths and gs:// URLs: ConfigError from config
    {"stats", "plotting"},  # leaves: they write through paths
    {"data"},  # a leaf above config
    {"host"}, {"diffjax"}, {"launcher"}, {"distributed"},
    {"kernels"},
    {"sharding"},  # asks kernels which platform a mesh targets; the model uses it
    {"model"},
    {"flops", "recipes", "checks"},  # ask model.archs
    {"summary"},
    {"train"},
    {"eval", "sweep", "aot", "hf"},
    {"explore", "generate", "studies", "main_job"},
    {"configs"},
    {"cli"},
)


def imports() -> list[tuple[str, str, str]]:
    """(importing part, imported part, file:line) for every import of diffjax by diffjax/, in functions too (an import
    deferred to call time is a dependency all the same)."""
    found = []
    for path in sorted((REPO / "diffjax").rglob("*.py")):
        rel = path.relative_to(REPO)
        part = rel.parts[1].removesuffix(".py") if len(rel.parts) > 1 else "diffjax"
        part = "diffjax" if part == "__init__" else part
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{a.name}" if node.module == "diffjax" else node.module for a in node.names]
            else:
                continue
            for name in names:
                if name.startswith("diffjax.") and name.split(".")[1] != part:
                    found.append((part, name.split(".")[1], f"{rel}:{node.lineno}"))
    return found


def test_every_import_points_down_the_layers():
    layer = {part: i for i, parts in enumerate(LAYERS) for part in parts}
    tree = {p.name.removesuffix(".py") for p in (REPO / "diffjax").iterdir() if p.suffix == ".py" or
            (p.is_dir() and any(p.glob("*.py")))} - {"__init__"} | {"diffjax"}
    assert tree == set(layer), f"parts of diffjax/ missing from LAYERS (add each to its layer): {tree - set(layer)}; " \
                               f"gone: {set(layer) - tree}"
    upward = [f"{where}: {part} imports {target}" for part, target, where in imports()
              if layer[target] >= layer[part]]
    assert not upward, ("imports against docs/design.md's layering (a part imports only lower layers): " +
                        "; ".join(upward))


def test_the_protocol_table_names_every_declared_protocol():
    rows = dict(re.findall(r"^\| `(\w+)` \| `(\w+)\.py` \|", design_section(6), re.M))  # protocol -> its module
    missing, unknown = sorted(set(PROTOCOLS) - set(rows)), sorted(set(rows) - set(PROTOCOLS))
    assert not missing and not unknown, (f"docs/design.md §6's protocol table lacks {missing} (add a row each: "
                                         f"| `name` | `name.py` | paper | result (applies to) |) and names {unknown}, "
                                         "not in eval.PROTOCOLS")
    assert all(name == module for name, module in rows.items()), rows  # a protocol is the module of its name


def test_every_list_of_archs_in_the_docs_names_the_built_in_archs_and_no_other():
    """Each hand-written list of architectures names every arch diffjax registers (not a test's or a sketch's) and
    no other; §2's table of parameter counts matched to DIFF names only built-in archs that have a match (a new
    arch's column is optional: it needs `diffjax summary` at every size)."""
    from diffjax.model import archs

    built_in = {n for n in archs.names() if archs.get(n).layer.__module__.startswith("diffjax.model.archs.")}
    matched = {n for n in built_in if archs.get(n).match is not None}
    design = design_section(2)
    table = between(design, "**Architectures**", "\n\n", after="\n|")
    columns = next(line for line in design.splitlines() if line.startswith("| size | DIFF |")).split("|")[2:-1]
    training = between((REPO / "docs" / "training.md").read_text(), "## Architectures", "\n## ")
    readme = between((REPO / "README.md").read_text(), "- **Architectures**", "\n- **")
    lists = {  # where -> (the archs it names, the archs it must name, the archs it may name)
        "docs/design.md §2's table of architectures (a row `| `name` | ...`)":
            (re.findall(r"^\| `(\w+)` \|", table, re.M), built_in, built_in),
        "docs/design.md §2's matching table (a column `name` or `name (option)`)":
            ([c.split()[0].lower() for c in columns], set(), matched),
        "docs/training.md's `model.arch` list (a bullet `- `name`: ...`)":
            (re.findall(r"^- `(\w+)`:", training, re.M), built_in, built_in),
        "README.md's Architectures (each arch `name`, nothing else a bare word in backticks)":
            (re.findall(r"`(\w+)`", readme), built_in, built_in)}
    wrong = [f"{where}: lacks {sorted(must - set(names))}, names {sorted(set(names) - may)}"
             for where, (names, must, may) in lists.items() if not must <= set(names) <= may]
    assert not wrong, "lists of archs against the registry: " + "; ".join(wrong)
