"""The documentation holds: every runnable snippet of README.md and docs/*.md runs (tiny models built from configs,
CPU), every relative link and every file or folder the docs name exists, docs/api.md has a section for every public
name holding its docstring and every argument of its signature, and the README stays a five-minute read."""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
README_MAX_LINES = 150


def _load_api_reference():
    """tests/docs/api_reference.py, by path: tests/docs is no package and `docs` is also the repository's folder."""
    spec = importlib.util.spec_from_file_location("api_reference", Path(__file__).with_name("api_reference.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


api_reference = _load_api_reference()

RUNNABLE = "<!-- runnable -->"
FENCE = re.compile(r"^```")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
# A file named in inline code: an optional folder path, a name and one of the extensions the repo's files have.
FILE = re.compile(r"(?<![\w./<>{}$-])((?:[\w.-]+/)*[\w-]+(?:\.[\w-]+)*\.(?:py|md|json|png|sh|toml))(?![\w/{}])")
# A folder named in inline code: one or more path parts ending in a slash.
FOLDER = re.compile(r"(?<![\w./<>{}$-])((?:[\w.-]+/)+)(?![\w{])")


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _outside_fences(text: str) -> str:
    """``text`` with fenced code blocks blanked out (line numbers kept)."""
    lines, inside = [], False
    for line in text.split("\n"):
        if FENCE.match(line.strip()):
            inside = not inside
            lines.append("")
        else:
            lines.append("" if inside else line)
    return "\n".join(lines)


def runnable_snippets(path: Path) -> list[tuple[int, str]]:
    """(line of the fence, code) of each ```python block that follows a ``<!-- runnable -->`` marker."""
    lines = path.read_text().split("\n")
    snippets = []
    for i, line in enumerate(lines):
        if line.strip() != RUNNABLE:
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j >= len(lines) or lines[j].strip() != "```python":
            raise AssertionError(f"{_relative(path)}:{i + 1}: {RUNNABLE} is not followed by a ```python block")
        end = next(k for k in range(j + 1, len(lines)) if lines[k].strip() == "```")
        snippets.append((j + 1, "\n".join(lines[j + 1 : end])))
    return snippets


SNIPPETS = [(path, line, code) for path in PAGES for line, code in runnable_snippets(path)]


def test_there_are_runnable_snippets():
    pages = {path.name for path, _, _ in SNIPPETS}
    assert "README.md" in pages and "api.md" in pages, pages


@pytest.mark.parametrize("path, line, code", SNIPPETS, ids=[f"{_relative(path)}:{line}" for path, line, _ in SNIPPETS])
def test_runnable_snippet_runs(path, line, code):
    torch.manual_seed(0)
    # A fresh namespace per snippet, compiled under its page and line so a failure points at the docs.
    exec(compile(code, f"{_relative(path)}:{line}", "exec"), {"__name__": "__docs_snippet__"})


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = _outside_fences(path.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=_relative)
def test_relative_links_resolve(page):
    text = _outside_fences(page.read_text())
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        file_part, _, anchor = target.partition("#")
        resolved = (page.parent / file_part).resolve() if file_part else page
        if not resolved.exists():
            broken.append(f"{target}: no {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{anchor} in {_relative(resolved)}")
    assert not broken, broken


def _named_paths(page: Path) -> tuple[set[str], set[str]]:
    files, folders = set(), set()
    for code in INLINE_CODE.findall(_outside_fences(page.read_text())):
        # A bare name other than a module (`config.json`) is a kind of file, not one of the repository's.
        files.update(f for f in FILE.findall(code) if "/" in f or f.endswith(".py"))
        folders.update(FOLDER.findall(code))
    return files, folders


@functools.cache
def _ignored_locals() -> frozenset[str]:
    """Root paths ``.gitignore`` names (``/.whl/``): folders a user makes on their machine, absent from a clone."""
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return frozenset(line.strip("/") for line in lines if line.startswith("/"))


def _exists(name: str, *, folder: bool) -> bool:
    """A path named by the docs: from the repository root or from the package (``engine/sharing.py``); a bare file
    name anywhere in the package or the repository's top folders; or a local path the repository ignores."""
    if name.strip("/") in _ignored_locals():
        return True
    bases = [ROOT, ROOT / "shared_prefix_logps"]
    if any((base / name).is_dir() if folder else (base / name).is_file() for base in bases):
        return True
    if not folder and "/" not in name:
        return any(ROOT.glob(f"*/**/{name}")) or (ROOT / name).is_file()
    return False


@pytest.mark.parametrize("page", PAGES, ids=_relative)
def test_named_files_exist(page):
    files, folders = _named_paths(page)
    missing = sorted(f for f in files if not _exists(f, folder=False))
    missing += sorted(f for f in folders if not _exists(f, folder=True))
    assert not missing, f"{_relative(page)} names paths that do not exist: {missing}"


def test_path_check_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "See `shared_prefix_logps/no_such_module.py`, `engine/sharing.py`, a `config.json` and `tests/nowhere/`.\n"
    )
    files, folders = _named_paths(page)
    assert files == {"shared_prefix_logps/no_such_module.py", "engine/sharing.py"} and folders == {"tests/nowhere/"}
    assert not _exists("shared_prefix_logps/no_such_module.py", folder=False)
    assert _exists("engine/sharing.py", folder=False) and not _exists("tests/nowhere/", folder=True)
    # An ignored local folder (made by the user, absent from a clean clone) counts; an ignored pattern does not.
    assert _exists(".whl/", folder=True) and not _exists("__pycache__/nowhere/", folder=True)


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move details to docs/"


def test_readme_opens_with_the_two_commands_and_links_every_page():
    text = (ROOT / "README.md").read_text()
    first_block = text.split("```")[1]
    assert "make demo" in first_block and "make test" in first_block, first_block
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in LINK.findall(text)}
    assert not [_relative(page) for page in DOCS if page not in linked], "README.md does not link every docs page"


# docs/api.md: one `## heading` per public module, one `### \`name\`` section per public name.
API_MODULES = {
    "shared_prefix_logps": "Core",
    "shared_prefix_logps.kernels": "Kernels",
    "shared_prefix_logps.losses": "Losses",
    "shared_prefix_logps.plan": "Planner",
    "shared_prefix_logps.integrations.trl": "TRL plug-in",
    "shared_prefix_logps.integrations.verl": "verl plug-in",
    "shared_prefix_logps.integrations.openrlhf": "OpenRLHF plug-in",
    "shared_prefix_logps.integrations.swift": "ms-swift plug-in",
}


def _api_sections() -> dict[str, dict[str, str]]:
    """heading of each ``##`` section of docs/api.md -> {public name -> its ``###`` section's text}."""
    text = (ROOT / "docs" / "api.md").read_text()
    modules = {}
    for block in re.split(r"^## ", text, flags=re.M)[1:]:
        heading, _, body = block.partition("\n")
        names = {}
        for sub in re.split(r"^### ", body, flags=re.M)[1:]:
            title, _, content = sub.partition("\n")
            match = re.fullmatch(r"`(\w+)`", title.strip())
            if match:
                names[match.group(1)] = content
        modules[heading.strip()] = names
    return modules


def _plain(text: str) -> str:
    """Markdown text without backticks, list markers and line breaks, for comparison."""
    return " ".join(re.sub(r"^\s*- ", " ", text, flags=re.M).replace("`", "").split())


def _public_api(module_name: str) -> dict[str, tuple[list[str], str | None]]:
    """name -> (argument names, docstring) of every name in the module's ``__all__``. Modules whose
    import needs an optional trainer (verl) are read from their source instead."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return _public_api_from_source(module_name)
    api = {}
    for name in module.__all__:
        obj = getattr(module, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            api[name] = ([], None)
            continue
        try:
            parameters = [
                p.name for p in inspect.signature(obj).parameters.values() if p.kind not in (p.VAR_POSITIONAL,)
            ]
        except (TypeError, ValueError):
            parameters = []
        if inspect.isclass(obj) and issubclass(obj, (BaseException, torch.autograd.Function)):
            parameters = []
        api[name] = ([p for p in parameters if p not in ("args", "kwargs")], inspect.getdoc(obj))
    return api


def _public_api_from_source(module_name: str) -> dict[str, tuple[list[str], str | None]]:
    package = ROOT / Path(*module_name.split("."))
    tree = ast.parse((package / "__init__.py").read_text())
    names = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
    )
    definitions = {}
    for source in sorted(package.glob("*.py")):
        for node in ast.parse(source.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
                arguments = node.args.args + node.args.kwonlyargs if isinstance(node, ast.FunctionDef) else []
                definitions[node.name] = ([a.arg for a in arguments], ast.get_docstring(node))
    return {name: definitions.get(name, ([], None)) for name in names}


@pytest.mark.parametrize("module_name", API_MODULES)
def test_api_documents_every_public_name_and_argument(module_name):
    sections = _api_sections()
    heading = API_MODULES[module_name]
    assert heading in sections, f"docs/api.md has no '## {heading}' section for {module_name}"
    documented = sections[heading]
    problems = []
    for name, (arguments, doc) in _public_api(module_name).items():
        if name not in documented:
            problems.append(f"{name}: no '### `{name}`' section")
            continue
        text = documented[name]
        problems += [f"{name}: argument {a} not named" for a in arguments if not re.search(rf"\b{a}\b", text)]
        if doc and _plain(api_reference.docstring_markdown(doc)) not in _plain(text):
            problems.append(f"{name}: its section does not hold its docstring")
    assert not problems, (
        f"docs/api.md, {heading}: {problems}; print the sections afresh with "
        f"`python tests/docs/api_reference.py {module_name}` and paste them over the old ones"
    )


def test_api_sections_name_their_module():
    text = (ROOT / "docs" / "api.md").read_text()
    for module_name, heading in API_MODULES.items():
        assert re.search(rf"^## {re.escape(heading)}\n\nModule `{re.escape(module_name)}`", text, flags=re.M), heading


#: Words of the engine the one node-call engine replaced: "phase" (Phase 1 / Phase 2 were the prompt's and the
#: completions' forwards, now the two depths of a trie), "one-level sharing" (now the two-level trie) and "tree pass"
#: (now the searched trie). One word per concept: they must not come back in code, messages or docs.
RETIRED_WORDS = re.compile(r"\bphases?\b|\bone[-_]level\b|\btree pass(es)?\b", re.IGNORECASE)

#: Where the library speaks: its code (messages and docstrings included), its tests and scripts, its pages.
#: benchmarks/results/ is left out: results files are records of their day, written in that day's words.
SPOKEN = [
    *sorted((ROOT / "shared_prefix_logps").rglob("*.py")),
    *sorted((ROOT / "tests").rglob("*.py")),
    *sorted((ROOT / "benchmarks").glob("*.py")),
    *sorted((ROOT / "benchmarks").glob("*.sh")),
    *sorted((ROOT / "examples").glob("*.py")),
    ROOT / "ARCHITECTURE.md",
    *PAGES,
]


def retired_words(paths, allowed: set[str] = frozenset()) -> list[str]:
    """``path:line: word`` for every retired word in ``paths``, except on lines that hold one of ``allowed``."""
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if any(text in line for text in allowed):
                continue
            name = _relative(path) if path.is_relative_to(ROOT) else path.name
            found += [f"{name}:{number}: {m.group(0)}" for m in RETIRED_WORDS.finditer(line)]
    return found


def test_retired_words_are_gone():
    # The results reader maps the method name old results files recorded (``one_level``) to today's, and this test
    # names the words it looks for: both name the old words on purpose.
    allowed = {'_RENAMED = {"one_level": "two_level"}', "recorded as ``one_level``"}
    found = retired_words([path for path in SPOKEN if path != Path(__file__)], allowed)
    assert not found, "words of the retired engine:\n" + "\n".join(found)


def test_retired_word_check_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Phase 1 forwards the prompt.\nThe one-level sharing path.\nthe tree pass\nphased out, phasers\n")
    assert [hit.split(": ", 1)[1] for hit in retired_words([page])] == ["Phase", "one-level", "tree pass"]
