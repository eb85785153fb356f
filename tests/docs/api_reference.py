"""docs/api.md's reference sections from the docstrings: one ``### `name` `` section per public name, its signature
and its docstring in Markdown. ``tests/docs/test_docs.py`` checks api.md against the same docstrings; after a
docstring changes, print the module's sections and paste them over the old ones:

    python tests/docs/api_reference.py shared_prefix_logps.kernels [more modules, or module:name1,name2]

or let it replace them in docs/api.md: ``python tests/docs/api_reference.py --write shared_prefix_logps.plan``.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path

SECTION_HEADERS = ("Args", "Arguments", "Attributes", "Returns", "Raises", "Notes", "Yields", "Example", "Examples")
_HEADER_LINE = re.compile(rf"^({'|'.join(SECTION_HEADERS)}):\s*$")
_ROLE = re.compile(r":\w+:`~?([\w.]+)`")


def markdown_text(text: str) -> str:
    """reST inline markup as Markdown: ``x`` as `x`, :func:`~a.b` as `b`."""
    return _ROLE.sub(lambda m: "`" + m.group(1).split(".")[-1] + "`", text).replace("``", "`")


def docstring_markdown(doc: str) -> str:
    """A Google-style docstring as Markdown: section headers bold, each argument or attribute a bullet."""
    out, section = [], None
    for line in doc.split("\n"):
        header = _HEADER_LINE.match(line)
        if header:
            section = header.group(1)
            out += ["", f"**{section}**", ""]
            continue
        listed = section in ("Args", "Arguments", "Attributes", "Raises")
        # An entry starts at the section's indent (4 spaces); deeper lines continue it.
        item = re.match(r"^    ([\w*/.][\w*, /.]*?):(?:\s(.*))?$", line) if listed else None
        if item:
            out.append(f"- `{item.group(1)}`: {item.group(2) or ''}".rstrip())
        elif section and line.startswith("    "):
            out.append(("  " if listed else "") + line.strip())
        else:
            if line and not line.startswith(" "):
                section = None
            out.append(line)
    return markdown_text("\n".join(out))


def _signature(qualified: str, obj) -> str:
    """``qualified(...)``, one argument per line when long; string annotations unquoted."""
    signature = inspect.signature(obj)
    parameters = []
    for parameter in signature.parameters.values():
        if parameter.kind is parameter.KEYWORD_ONLY and not any(p.startswith("*") for p in parameters):
            parameters.append("*")
        parameters.append(re.sub(r": '([^']*)'", r": \1", str(parameter)))
    returns = signature.return_annotation
    if inspect.isclass(obj) or returns is inspect.Signature.empty:
        returns = ""
    else:
        returns = " -> " + (returns if isinstance(returns, str) else getattr(returns, "__name__", str(returns)))
    head = ("class " if inspect.isclass(obj) else "") + qualified
    if sum(map(len, parameters)) + len(head) > 100:
        return head + "(\n" + "".join(f"    {p},\n" for p in parameters) + ")" + returns
    return head + "(" + ", ".join(parameters) + ")" + returns


def section(module_name: str, name: str) -> str:
    """The ``### `name` `` section of ``module_name.name``."""
    obj = getattr(importlib.import_module(module_name), name)
    lines = [f"### `{name}`", ""]
    if not (inspect.isclass(obj) or inspect.isfunction(obj)):
        return "\n".join([*lines, f"`{module_name}.{name} = {obj!r}`", ""])
    try:
        lines += ["```python", _signature(f"{module_name}.{name}", obj), "```", ""]
    except (TypeError, ValueError):
        pass
    doc = inspect.getdoc(obj)
    if doc:
        lines += [docstring_markdown(doc), ""]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines))


API_MD = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def replace_section(text: str, module_name: str, name: str) -> str:
    """``text`` (api.md) with the section of ``module_name.name`` printed afresh; the section is the ``### `name` ``
    one whose body names ``module_name.name``, up to the next ``##``/``###`` heading."""
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines) if line == f"### `{name}`"]
    for start in starts:
        end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith(("## ", "### "))), len(lines))
        body = "\n".join(lines[start:end])
        if f"{module_name}.{name}" in body or len(starts) == 1:
            fresh = section(module_name, name).rstrip("\n").split("\n") + [""]
            return "\n".join(lines[:start] + fresh + lines[end:])
    raise SystemExit(f"docs/api.md has no section for {module_name}.{name}")


def main(argv: list[str]) -> None:
    write = "--write" in argv
    text = API_MD.read_text() if write else ""
    for spec in (a for a in argv if a != "--write"):
        module_name, _, names = spec.partition(":")
        module = importlib.import_module(module_name)
        for name in names.split(",") if names else module.__all__:
            if write:
                text = replace_section(text, module_name, name)
            else:
                print(section(module_name, name))
    if write:
        API_MD.write_text(text)


if __name__ == "__main__":
    main(sys.argv[1:])
