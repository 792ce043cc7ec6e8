"""MkDocs hook: the reference pages written at build time from the code's own definitions, so that they
cannot drift from it.

* ``reference/cli.md``: every `heterps` command and option, from the argparse parsers
  (heterps_ray/cli.py and each part's commands.py);
* ``reference/config.md``: every field of the job, cluster and model files and of the problem file, from
  the pydantic models (heterps_ray/config/, heterps_ray/costmodel/problem.py);
* ``reference/errors.md``: every message the CLI can print for a user error, read from the ``raise``
  statements of the package (the error types of heterps_ray/errors.py), with their exit codes;
* the site's home, figures, benchmark scripts and tools pages: README.md, BENCHMARKS.md, benchmarks/README.md
  and scripts/README.md, their links made relative to the site.

tests/test_docs.py checks that every command and field is in the pages this hook writes.
"""

from __future__ import annotations

import argparse
import ast
import types
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "heterps_ray"


# ---------------------------------------------------------------------------------------------------
# The command line


def _commands(parser: argparse.ArgumentParser, prefix: str = "heterps") -> list[tuple[str, Any]]:
    """(the command line, its parser) of every command and sub-command, in `heterps --help` order."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                found.append((f"{prefix} {name}", sub, helps.get(name)))
                found.extend(_commands(sub, f"{prefix} {name}"))
    return found


def _option_row(action: argparse.Action) -> str | None:
    if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
        return None
    if action.option_strings:
        name = ", ".join(f"`{s}`" for s in action.option_strings)
        if action.nargs != 0:
            name += f" `{action.metavar or action.dest.upper()}`"
    else:
        name = f"`{action.metavar or action.dest}`"
    default = action.default
    shown = "" if default in (None, False, argparse.SUPPRESS) or action.nargs == 0 else f"`{default}`"
    if action.choices and not isinstance(action.choices, dict):
        shown += (" " if shown else "") + "one of " + ", ".join(f"`{c}`" for c in action.choices)
    return f"| {name} | {shown} | {_cell(action.help or '')} |"


def cli_page() -> str:
    """The reference of the `heterps` command line, from its parsers."""
    from heterps_ray.cli import build_parser

    parser = build_parser()
    lines = [
        "# Command reference",
        "",
        "Generated at build time from the argparse parsers (heterps_ray/cli.py and each part's "
        "commands.py): what `heterps COMMAND --help` prints, on one page. The exit codes: 0 done, "
        "1 a run that failed (an actor died too often, a file that could not be written), 2 bad input, "
        "3 no plan meets the throughput floor; the messages are in [the error reference](errors.md).",
        "",
        "```",
        parser.format_usage().strip(),
        "```",
        "",
        "| option | | |",
        "| --- | --- | --- |",
    ]
    lines += [row for row in map(_option_row, parser._actions) if row]
    for command, sub, short in _commands(parser):
        lines += ["", f"## `{command}`", ""]
        if short:
            lines += [_text(short) + ".", ""]
        if sub.description:
            lines += [_text(sub.description), ""]
        lines += ["```", sub.format_usage().strip().removeprefix("usage: "), "```", ""]
        rows = [row for row in map(_option_row, sub._actions) if row]
        if rows:
            lines += ["| argument | default | what |", "| --- | --- | --- |", *rows]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------
# The files' fields

CONFIG_MODELS = (  # (heading, model, what the file is): the job file and what it holds, then the problem
    ("Job file", "heterps_ray.config:JobConfig", "`configs/jobs/*.yaml`, read by `heterps run`, `train`, `profile`"),
    ("model", "heterps_ray.config:ModelConfig", "inline in the job, or a path to `configs/models/*.yaml`"),
    ("data", "heterps_ray.config:DataConfig", ""),
    ("optimizer", "heterps_ray.config:OptimizerConfig", ""),
    ("table", "heterps_ray.config:TableConfig", ""),
    ("runtime", "heterps_ray.config:RuntimeConfig", ""),
    ("Cluster file", "heterps_ray.config:ClusterConfig", "inline in the job, or a path to `configs/clusters/*.yaml`"),
    ("resource_types[]", "heterps_ray.config:ResourceType", ""),
    ("ps", "heterps_ray.config:PSConfig", ""),
    ("autoscale", "heterps_ray.config:AutoscaleConfig", ""),
    ("Problem file", "heterps_ray.costmodel.problem:Problem", "the planner's input (DESIGN.md §4)"),
    ("resources[]", "heterps_ray.costmodel.problem:Resource", ""),
    ("layers[]", "heterps_ray.costmodel.problem:Layer", ""),
    ("layers[].time_ms.TYPE", "heterps_ray.costmodel.problem:LayerTime", ""),
    ("ps (problem)", "heterps_ray.costmodel.problem:PSTier", ""),
    ("ps.table", "heterps_ray.costmodel.problem:PSTable", ""),
    ("hosts[]", "heterps_ray.costmodel.problem:Host", ""),
    ("runtime (problem)", "heterps_ray.costmodel.problem:RuntimeTerms", "DESIGN.md §3b"),
)


def _load(path: str) -> Any:
    import importlib

    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _type_name(annotation: Any) -> str:
    """A field's type as a reader writes it (`int | None`, `sync | async`)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(str(v) for v in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: Any) -> str:
    from pydantic_core import PydanticUndefined

    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default_factory() if field.default is PydanticUndefined else field.default
    if hasattr(value, "model_dump"):
        return "(its defaults)"
    return f"`{value!r}`"


def config_page() -> str:
    """The reference of every file's fields, from the pydantic models."""
    lines = [
        "# File reference",
        "",
        "Generated at build time from the pydantic models that validate the files "
        "(heterps_ray/config/, heterps_ray/costmodel/problem.py): every field, its type, its default and "
        "what it means. A field a model does not list is refused (exit 2) naming the file and the field; "
        "a model's own builder arguments (`model:` beyond `name`) are checked by the model zoo. "
        "[Formats](../formats.md) shows whole files.",
    ]
    for heading, path, what in CONFIG_MODELS:
        model = _load(path)
        lines += ["", f"## {heading}", ""]
        doc = (model.__doc__ or "").strip()
        if doc and not doc.startswith("!!!"):
            lines += [_text(doc), ""]
        if what:
            lines += [f"The file: {what}.", ""]
        lines += ["| field | type | default | what |", "| --- | --- | --- | --- |"]
        for name, field in model.model_fields.items():
            lines.append(
                f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} | "
                f"{_cell(field.description or '')} |"
            )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------
# The errors the CLI prints

def error_types() -> dict[str, int]:
    """Every user error type (HeterPSError and the classes built on it, wherever they are defined) and
    the exit code the CLI maps it to."""
    import importlib

    classes: dict[str, str] = {}  # name -> module
    bases: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = module
                bases[node.name] = [getattr(b, "id", getattr(b, "attr", "")) for b in node.bases]
    found = {"HeterPSError"}
    while True:
        more = {name for name, of in bases.items() if set(of) & found} - found
        if not more:
            break
        found |= more
    return {name: importlib.import_module(classes[name]).__dict__[name].exit_code for name in sorted(found)}


def _template(node: ast.AST) -> str:
    """A message argument as text: literals as they are, each computed part as `{...}`."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(
            str(v.value) if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}" for v in node.values
        )
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _template(node.left) + _template(node.right)
    return "{" + ast.unparse(node) + "}"


def _raised(path: Path, errors: dict[str, int]) -> list[tuple[str, int, str, tuple[str, ...]]]:
    """(error type, line, function, message parts) of each user error raised in the file."""
    tree = ast.parse(path.read_text())
    found = []
    for function in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]:
        for node in ast.walk(function):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            name = getattr(node.exc.func, "id", getattr(node.exc.func, "attr", ""))
            if name in errors:
                parts = [_template(a) for a in node.exc.args]
                found.append((name, node.lineno, function.name, tuple(parts)))
    return sorted(set(found), key=lambda r: r[1])


def _message(kind: str, parts: list[str]) -> str:
    """The message as the CLI prints it after `error: ` (ConfigError's shape is errors.py's)."""
    if kind == "ConfigError" and len(parts) >= 3:
        file = "" if parts[0] == "None" else f"{parts[0]}: "
        got = f" (got {parts[3]})" if len(parts) > 3 and parts[3] != "None" else ""
        return f"{file}field '{parts[1]}': expected {parts[2]}{got}"
    return parts[0] if parts else ""


def errors_page() -> str:
    """Every user error the package raises, by part and module, with its exit code."""
    lines = [
        "# Error reference",
        "",
        "Generated at build time from the `raise` statements of the package: every user error a command "
        "can end with, printed as `error: MESSAGE` on stderr, and its exit code (2 bad input, 3 no plan "
        "meets the floor, 1 a run that could not go on). `{...}` stands for a value filled in at run time "
        "(a file, a field, a figure). What to do about the common ones: [Troubleshooting](../troubleshooting.md).",
    ]
    errors = error_types()
    for path in sorted(PACKAGE.rglob("*.py")):
        rows = _raised(path, errors)
        if not rows:
            continue
        lines += ["", f"## `{path.relative_to(ROOT).as_posix()}`", "", "| error | exit | where | message |"]
        lines += ["| --- | --- | --- | --- |"]
        for kind, line, function, parts in rows:
            message = _cell(_message(kind, list(parts)))
            lines.append(f"| {kind} | {errors[kind]} | `{function}` (line {line}) | {message} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------
# Pages from the repository's root


def _site_links(text: str, links: dict[str, str]) -> str:
    """Links of a file outside docs/ (README.md, BENCHMARKS.md, the READMEs of benchmarks/ and scripts/)
    as they resolve inside the site: each prefix in `links` (a path from that file) becomes the site path
    given."""
    for prefix, target in links.items():
        text = text.replace(f"]({prefix}", f"]({target}")
    return text


def root_pages() -> dict[str, str]:
    """The site's pages made from files outside docs/: the home page, today's figures, the benchmark
    scripts' index and the tools'."""
    return {
        "index.md": _site_links(
            (ROOT / "README.md").read_text(),
            {
                "docs/": "",
                "BENCHMARKS.md": "benchmarks/index.md",
                "benchmarks/README.md": "benchmarks/scripts.md",
                "scripts/README.md": "scripts.md",
            },
        ),
        "benchmarks/index.md": _site_links(
            (ROOT / "BENCHMARKS.md").read_text(),
            {"docs/": "../", "benchmarks/README.md": "scripts.md", "scripts/README.md": "../scripts.md"},
        ),
        "benchmarks/scripts.md": _site_links(
            (ROOT / "benchmarks" / "README.md").read_text(),
            {"../docs/": "../", "../BENCHMARKS.md": "index.md", "../scripts/README.md": "../scripts.md"},
        ),
        "scripts.md": _site_links(
            (ROOT / "scripts" / "README.md").read_text(),
            {
                "../docs/": "",
                "../BENCHMARKS.md": "benchmarks/index.md",
                "../benchmarks/README.md": "benchmarks/scripts.md",
            },
        ),
    }


def pages() -> dict[str, str]:
    """Every page this hook writes, by its path in the site."""
    return {
        **root_pages(),
        "reference/cli.md": cli_page(),
        "reference/config.md": config_page(),
        "reference/errors.md": errors_page(),
    }


def _text(text: str) -> str:
    return " ".join(text.split())


def _cell(text: str) -> str:
    """Text inside a table cell: one line, pipes escaped, HTML-like brackets kept as text."""
    text = _text(text).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
    return text.replace("[", "\\[").replace("]", "\\]")


# the folders whose result files (plots) docs/benchmarks/*.md link as ../../FOLDER/NAME/...
RESULTS = ("benchmarks/", "scripts/")


def on_files(files: Any, config: Any) -> Any:
    """MkDocs: add the generated pages to the site (replacing any file of the same path), and the plots
    the benchmark pages show, from the result folders beside the repository's benchmark scripts and tools
    (benchmarks/NAME/, scripts/NAME/)."""
    from mkdocs.structure.files import File

    for path, content in pages().items():
        existing = files.get_file_from_path(path)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, path, content=content))
    for folder in RESULTS:
        for plot in sorted((ROOT / folder).rglob("*.png")):
            path = plot.relative_to(ROOT).as_posix()
            files.append(File.generated(config, f"benchmarks/results/{path}", abs_src_path=str(plot)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs: a benchmark page's links to the repository's result files point at their copies in the site."""
    if page.file.src_uri.startswith("benchmarks/"):
        for folder in RESULTS:
            markdown = markdown.replace(f"](../../{folder}", f"](results/{folder}")
    return markdown
