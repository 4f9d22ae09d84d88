"""servelm.yaml and the settings table of docs/DEPLOY.md, made from the settings model.

Each setting is described once, in ``servelm/settings.py``; ``--help``
(``servelm/cli.py``), the example config file and the docs table are all
made from that description, and a test checks that the committed files are
what this module makes. After changing a setting::

    .venv/bin/python -m servelm.settings_doc --write
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import yaml

from servelm.cli import NESTED_FLAGS, default_text, flag_of, setting_default
from servelm.settings import ENV_PREFIX, GROUPS, Settings

REPO = Path(__file__).resolve().parents[1]
YAML_PATH = REPO / "servelm.yaml"
DEPLOY_PATH = REPO / "docs" / "DEPLOY.md"
TABLE_START = "<!-- settings table: made by `python -m servelm.settings_doc --write` -->"
TABLE_END = "<!-- end of settings table -->"

_YAML_HEADER = f"""\
# servelm configuration: every setting, with its default.
#
#   servelm serve --config servelm.yaml
#
# Precedence: defaults < this file < {ENV_PREFIX}* environment variables < flags.
# Each key is also an environment variable ({ENV_PREFIX}<KEY>, upper case) and,
# where one is named, a flag. An unknown key or a bad value stops the server
# with exit status 2 and a message naming it.
#
# Made from servelm/settings.py by `python -m servelm.settings_doc --write`.
"""


def _names_by_group() -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {title: [] for title in GROUPS}
    for name, field in Settings.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        group = str(extra.get("group", ""))
        if group:
            groups[group].append(name)
    return groups


def _flags_text(name: str) -> str:
    flag = flag_of(name)
    if flag is not None:
        return flag
    nested = [f for f, path in NESTED_FLAGS.values() if path[0] == name]
    return ", ".join(nested)


def _wrap(text: str) -> list[str]:
    return textwrap.wrap(text, 76, break_on_hyphens=False, break_long_words=False)


def render_yaml() -> str:
    """The text of servelm.yaml: every setting but ``config``, its description as a comment, its default."""
    parts = [_YAML_HEADER]
    for title, names in _names_by_group().items():
        parts.append(f"\n# --- {title} " + "-" * max(3, 72 - len(title)) + "\n")
        parts.append("".join(f"# {line}\n" for line in _wrap(GROUPS[title])))
        for name in names:
            description = Settings.model_fields[name].description or ""
            flags = _flags_text(name)
            comment = f"{description}." + (f" Flag: {flags}." if flags else "")
            parts.append("\n" + "".join(f"# {line}\n" for line in _wrap(comment)))
            default = setting_default(name)
            if hasattr(default, "model_dump"):
                default = default.model_dump()
            parts.append(yaml.safe_dump({name: default}, sort_keys=False, default_flow_style=False))
    return "".join(parts)


def render_table() -> str:
    """The markdown table of every setting: config key, flag, environment variable, default, description."""
    rows = ["| Setting | Flag | Default | What |", "|---|---|---|---|"]
    for names in _names_by_group().values():
        for name in names:
            description = (Settings.model_fields[name].description or "").replace("|", "\\|")
            flags = _flags_text(name)
            flag_cell = ", ".join(f"`{f.strip()}`" for f in flags.split(",")) if flags else "config file only"
            rows.append(
                f"| `{name}` (`{ENV_PREFIX}{name.upper()}`) | {flag_cell} | {default_text(name)} | {description} |"
            )
    return "\n".join(rows) + "\n"


def deploy_doc_with_table(doc: str) -> str:
    """``doc`` (docs/DEPLOY.md's text) with the settings table between its markers made anew."""
    start = doc.index(TABLE_START) + len(TABLE_START)
    end = doc.index(TABLE_END)
    return doc[:start] + "\n" + render_table() + doc[end:]


def main(argv: list[str] | None = None) -> int:
    """Write (``--write``) or check (default) servelm.yaml and docs/DEPLOY.md's settings table."""
    parser = argparse.ArgumentParser(prog="python -m servelm.settings_doc", description=main.__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite the files instead of checking them")
    args = parser.parse_args(argv)
    expected = {YAML_PATH: render_yaml(), DEPLOY_PATH: deploy_doc_with_table(DEPLOY_PATH.read_text())}
    stale = [path for path, text in expected.items() if path.read_text() != text]
    if args.write:
        for path in stale:
            path.write_text(expected[path])
            print(f"wrote {path.relative_to(REPO)}")
        return 0
    for path in stale:
        print(f"{path.relative_to(REPO)} is out of date: run python -m servelm.settings_doc --write", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
