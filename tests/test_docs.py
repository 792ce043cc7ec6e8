"""The docs' reference pages cover the code: every `heterps` command and option, every field of the job,
cluster, model and problem files, and every user error a command can end with. The pages are what the
MkDocs hook (docs/hooks/reference.py) writes at build time; `mkdocs build --strict` (scripts/test.sh)
checks their links."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hook():
    spec = importlib.util.spec_from_file_location("docs_reference_hook", ROOT / "docs" / "hooks" / "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_command_and_option_is_in_the_command_reference(hook):
    from heterps_ray.cli import build_parser

    page = hook.cli_page()
    commands = hook._commands(build_parser())
    assert len(commands) > 20
    for command, parser, _ in commands:
        assert f"## `{command}`" in page, command
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            for flag in action.option_strings:
                assert f"`{flag}`" in page, f"{command} {flag}"


def test_every_field_of_every_file_is_in_the_file_reference(hook):
    from pydantic import BaseModel

    page = hook.config_page()
    listed = {hook._load(path) for _, path, _ in hook.CONFIG_MODELS}
    for model in listed:
        for name in model.model_fields:
            assert f"| `{name}` |" in page, f"{model.__name__}.{name}"
    # every model a listed model holds is listed too, so no nested section is left out
    for model in listed:
        for field in model.model_fields.values():
            for inner in (field.annotation, *getattr(field.annotation, "__args__", ())):
                for candidate in (inner, *getattr(inner, "__args__", ())):
                    if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                        assert candidate in listed, f"{model.__name__} holds {candidate.__name__}, not listed"


def test_every_user_error_is_in_the_error_reference(hook):
    from heterps_ray.errors import ConfigError, InfeasibleError

    types = hook.error_types()
    assert types["ConfigError"] == ConfigError.exit_code and types["InfeasibleError"] == InfeasibleError.exit_code
    page = hook.errors_page()
    raised = [row for path in sorted(hook.PACKAGE.rglob("*.py")) for row in hook._raised(path, types)]
    assert len(raised) > 100
    for kind, line, function, _ in raised:
        assert f"| {kind} | {types[kind]} | `{function}` (line {line}) |" in page


def test_the_site_links_of_the_readme_point_into_the_site(hook):
    pages = hook.root_pages()
    assert "](docs/" not in pages["index.md"] and "](cli.md)" in pages["index.md"]
    assert "](docs/" not in pages["benchmarks/index.md"]
    assert "](../docs/" not in pages["benchmarks/scripts.md"] and "](../docs/" not in pages["scripts.md"]
