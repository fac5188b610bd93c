"""What users' configurations and scripts name keeps working: CLI commands and flags, config fields,
the connector's module path, the plugin and console-script entry points.

`compat_surface.json` was written from the code before the layout change (issue 11) and is the
contract: a test here failing means a user-visible name or default changed or went away (new ones
are fine). Change the file only on purpose,
with a note in docs/ for the users it breaks.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

from cachefuse.cli.main import build_parser
from cachefuse.config import CacheFuseConfig

SURFACE = json.loads((Path(__file__).parent / "compat_surface.json").read_text())


def cli_surface(parser: argparse.ArgumentParser) -> dict[str, dict[str, str]]:
    """Subcommand -> option -> its flags, destination, default, choices, nargs and whether required."""
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    surface = {}
    for name, sub in sorted(subparsers.choices.items()):
        options = {}
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            choices = None if action.choices is None else [str(c) for c in action.choices]
            options[action.option_strings[0] if action.option_strings else action.dest] = (
                f"flags={action.option_strings} dest={action.dest} default={action.default!r} "
                f"choices={choices} nargs={action.nargs!r} required={action.required}")
        surface[name] = options
    return surface


def config_surface() -> dict[str, str]:
    """CacheFuseConfig field -> repr of its default."""
    return {f.name: repr(f.default if f.default is not dataclasses.MISSING else f.default_factory())
            for f in dataclasses.fields(CacheFuseConfig)}


def missing_or_changed(recorded: dict, current: dict) -> dict:
    """What was recorded and is now gone or different (additions are fine: nothing of a user's breaks)."""
    out = {}
    for name, spec in recorded.items():
        if isinstance(spec, dict):
            inner = missing_or_changed(spec, current.get(name, {}))
            if inner:
                out[name] = inner
        elif current.get(name) != spec:
            out[name] = (spec, current.get(name))
    return out


def test_every_cli_command_and_flag_is_unchanged():
    assert missing_or_changed(SURFACE["cli"], cli_surface(build_parser())) == {}


def test_the_cli_check_sees_a_renamed_flag():
    parser = build_parser()
    surface = cli_surface(parser)
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in subparsers.choices["precompute"]._actions if a.dest == "batch_size")
    action.option_strings = ["--batch"]  # negative control: what a careless rename would do
    assert missing_or_changed(surface, cli_surface(parser)) != {}


def test_every_config_field_and_default_is_unchanged():
    assert missing_or_changed(SURFACE["config_fields"], config_surface()) == {}
    fields = dict(SURFACE["config_fields"], selector="'epic'")  # negative control: a changed default
    assert missing_or_changed(fields, config_surface()) == {"selector": ("'epic'", "'cacheblend'")}


def test_python_dash_m_cachefuse_cli_still_runs():
    out = subprocess.run([sys.executable, "-m", "cachefuse.cli", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    for command in SURFACE["cli"]:
        assert command in out.stdout


def test_entry_points_resolve():
    (plugin,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "cachefuse"]
    assert plugin.value == "cachefuse.vllm.plugin:register"
    assert callable(plugin.load())
    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "cachefuse"]
    assert script.value == "cachefuse.cli.main:main"  # the command's name is the surface; its module may move
    assert script.load() is importlib.import_module("cachefuse.cli.main").main


def test_the_connector_module_path_users_configure_still_holds_the_connector():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    module = importlib.import_module("cachefuse.vllm.connector")  # kv_connector_module_path in users' configs
    assert issubclass(module.CacheFuseConnector, KVConnectorBase_V1)
