"""Learners' JupyterLab without nbgrader's instructor tools: README.md's commands turn off exactly those (the Create
Assignment sidebar, the Formgrader, the Course List, and the Formgrader's and Course List's server extensions), by
the names the installed nbgrader gives them, and keep the learners' own (the Assignment List, the Validate button).
Binder's environment has no nbgrader at all."""

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import nbgrader

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")

INSTRUCTOR_PLUGINS = {
    "@jupyter/nbgrader:create-assignment",
    "@jupyter/nbgrader:formgrader",
    "@jupyter/nbgrader:course-list",
}
LEARNER_PLUGINS = {
    "@jupyter/nbgrader:assignment-list",
    "@jupyter/nbgrader:validate-assignment",
    "@jupyter/nbgrader:menu",
}
INSTRUCTOR_SERVER = {"nbgrader.server_extensions.formgrader", "nbgrader.server_extensions.course_list"}
LEARNER_SERVER = {"nbgrader.server_extensions.assignment_list", "nbgrader.server_extensions.validate_assignment"}
JUPYTER = Path(sys.executable).parent / "jupyter"


def readme_command(start: str) -> str:
    """The one line of README.md's bash blocks that starts with `start`."""
    lines = [line.strip() for block in re.findall(r"```bash\n(.*?)```", README, re.S) for line in block.splitlines()]
    (line,) = [line for line in lines if line.startswith(start)]
    return line


def installed_plugins() -> set[str]:
    """The JupyterLab plugins of the installed nbgrader, by id, as its lab extension's bundle registers them."""
    bundles = (Path(nbgrader.__file__).parent / "labextension" / "static").glob("*.js")
    return {name for js in bundles for name in re.findall(r'"(@jupyter/nbgrader:[\w-]+)"', js.read_text())}


def server_config() -> Path:
    """The config file the installed nbgrader ships to turn its server extensions on (`jupyter_server_config.d/`)."""
    (shipped,) = [f for f in importlib.metadata.files("nbgrader") if f.match("jupyter_server_config.d/nbgrader.json")]
    return Path(shipped.locate())


def test_the_readme_turns_off_exactly_nbgraders_instructor_tools():
    plugins = readme_command("jupyter labextension disable").split()[3:]
    assert sorted(plugins) == sorted(INSTRUCTOR_PLUGINS)
    assert installed_plugins() == INSTRUCTOR_PLUGINS | LEARNER_PLUGINS
    server = readme_command("jupyter server extension disable").split()[4:]
    assert sorted(server) == sorted(INSTRUCTOR_SERVER)
    shipped = json.loads(server_config().read_text())["ServerApp"]["jpserver_extensions"]
    assert shipped == dict.fromkeys(INSTRUCTOR_SERVER | LEARNER_SERVER, True)
    binder = (ROOT / "binder" / "requirements.txt").read_text(encoding="utf-8").splitlines()
    assert [line for line in binder if line and not line.startswith("#")][-1] == "-e .[course]"
    course = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    assert not [line for line in binder + course["course"] if "nbgrader" in line.split("#")[0]]  # Binder has none


def test_the_readme_commands_leave_jupyterlab_without_them(tmp_path):
    """README.md's commands, run at the user level in a scratch config folder (as written they change the environment's
    own, which the other tests use as installed): JupyterLab lists exactly the instructor plugins as disabled, and
    the server loads the learners' nbgrader extensions only."""
    from jupyter_server.extension.config import ExtensionConfigManager

    (tmp_path / "jupyter_server_config.d").mkdir()  # nbgrader's extensions turned on there, as in the environment
    shutil.copy(server_config(), tmp_path / "jupyter_server_config.d")
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path)}
    for command, level in (
        ("jupyter labextension disable", "--level=user"),
        ("jupyter server extension disable", "--user"),
    ):
        line = readme_command(command).replace("jupyter", str(JUPYTER), 1)
        subprocess.run([*line.split(), level], env=env, check=True, capture_output=True, timeout=120)
    listed = subprocess.run(
        [str(JUPYTER), "labextension", "list"], env=env, check=True, capture_output=True, text=True, timeout=120
    )
    disabled = listed.stderr.split("Disabled extensions:")[1].split()  # the list is logged
    assert sorted(disabled) == sorted(INSTRUCTOR_PLUGINS)
    # the command writes its file beside the one nbgrader ships (as written: in the environment's own folder), and
    # the server reads that folder's files in name order: "nbgrader.json", then each "nbgrader.server_extensions.*.json"
    loaded = ExtensionConfigManager(read_config_path=[str(tmp_path)]).get_jpserver_extensions()
    assert {name for name, on in loaded.items() if name.startswith("nbgrader") and on} == LEARNER_SERVER
    assert json.loads((tmp_path / "labconfig" / "page_config.json").read_text())["disabledExtensions"] == dict.fromkeys(
        INSTRUCTOR_PLUGINS, True
    )
