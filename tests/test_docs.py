"""The documents say what the code does: the plan format's version and keys, the version the CLI prints."""
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import autorecompute
from autorecompute.plan import SCHEMA_VERSION, Plan

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_plan_format_states_the_schema_version_files_are_written_with():
    text = (DOCS / "plan-format.md").read_text()
    assert re.search(r"^# Plan JSON format \(schema_version (\d+)\)", text, re.M).group(1) == str(SCHEMA_VERSION)
    assert re.search(r"reads versions 1 to (\d+)", text).group(1) == str(SCHEMA_VERSION)
    assert re.search(r"^\| `schema_version` \| int \| (\d+)", text, re.M).group(1) == str(SCHEMA_VERSION)
    assert f"reads 1 to {SCHEMA_VERSION}`" in (DOCS / "user-guide.md").read_text()
    assert f"(schema version {SCHEMA_VERSION};" in (DOCS / "architecture.md").read_text()


def test_plan_format_documents_every_key_a_plan_file_has():
    text = (DOCS / "plan-format.md").read_text()
    documented = set(re.findall(r"^\| (`[^|]+) \|", text, re.M))
    keys = {key.strip("` ") for cell in documented for key in cell.split(",")}
    written = {f.name for f in dataclasses.fields(Plan)} | {"schema_version"}
    assert written == keys, f"undocumented: {sorted(written - keys)}; documented, not written: {sorted(keys - written)}"


def test_the_package_and_the_command_line_say_one_version():
    from importlib.metadata import version

    assert autorecompute.__version__ == version("autorecompute")
    done = subprocess.run([sys.executable, "-m", "autorecompute", "--version"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"autorecompute {autorecompute.__version__}"
