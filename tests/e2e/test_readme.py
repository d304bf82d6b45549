"""Every command README.md shows runs as written, from the repository root, after the README's set-up line.

:func:`readme_commands` extracts them: each line of a ```` ```bash ```` block, and each inline code span that
starts like a command (`` `meshkit plan ...` ``, a span broken over lines joined). :data:`HOW` says how each one
is run here; a command it does not know fails :func:`test_every_readme_command_is_run_somewhere`, so a new
README command cannot go unchecked. Cheap ones run exactly as written; the long ones run at a cheap size, and
where that is another test's job it is named:

- the set-up line (``pip install ... && meshkit demo``): this test runs inside the environment it built; what it
  installs is checked against what the examples import (:func:`test_setup_line_installs_what_the_examples_import`),
  and its demo runs as ``meshkit demo --steps 12`` (the ``demo_run`` fixture of tests/e2e/conftest.py);
- the test command: ``.ci/run`` runs it (it installs at least what the set-up line does, checked here);
- ``meshkit analyze meshkit_logs`` / ``meshkit doctor meshkit_logs``: as written, in the demo's folder;
- ``python examples/X.py``: as written plus ``--help`` (every import the script makes); at ``--tiny`` in
  tests/e2e/test_examples.py;
- ``meshkit consolidate hsdp_tp_logs/checkpoint ...``: as written, after the hsdp_tp example, in test_examples.py;
- ``tensorboard --logdir ...``: with ``--help`` (a server that never exits); tests/e2e/test_tensorboard*.py serve a run;
- ``benchmarks/gpu/run_all.sh ...``: GPU only; tests/e2e/test_gpu_run_all.py dry-runs it with ``--cpu``;
- ``pip install -e ".[EXTRA]"``: the extra exists and the test command installs it (its packages are importable
  here; tests/e2e/test_tensorboard.py uses the ``tb-profiler`` one).
"""

from __future__ import annotations

import ast
import configparser
import importlib.metadata as md
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
LOOKS_LIKE_A_COMMAND = re.compile(r"^(?:(?:meshkit|python|tensorboard|pip|bash)\s|benchmarks/)")

HOW: dict[str, str] = {
    r"^pip install torch==\S+ && pip install -e \S+ && meshkit demo$": "setup",
    r"^pip install torch==\S+ && pip install -e \S+ && python -m pytest -q$": "ci",
    r"^meshkit (analyze|doctor) meshkit_logs$": "after_demo",
    r"^python examples/\w+\.py$": "help",
    r"^tensorboard --logdir \S+$": "help",
    r"^meshkit consolidate hsdp_tp_logs/checkpoint ": "after_hsdp_tp_example",
    r"^meshkit (plan|bubble|occupancy) ": "as_written",
    r"^benchmarks/gpu/run_all\.sh \S+$": "gpu",
    r"^pip install -e \"\.\[[\w-]+\]\"$": "extra",
}
"""regex on a command (its trailing ``# comment`` dropped) -> how this suite runs it (see the module docstring)."""


def readme_commands(text: str | None = None) -> list[str]:
    """Every command README.md shows, once each, in order: ```bash block lines first, then inline spans; comments
    dropped."""
    text = open(README, encoding="utf-8").read() if text is None else text
    fenced = [line for block in re.findall(r"```bash\n(.*?)```", text, re.S) for line in block.splitlines()]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    out = [shlex.join(shlex.split(line, comments=True)) if "#" in line else line.strip() for line in fenced]
    return list(dict.fromkeys([c for c in out if c] + [s for s in spans if LOOKS_LIKE_A_COMMAND.match(s)]))


def how(command: str) -> str | None:
    found = [mode for pattern, mode in HOW.items() if re.search(pattern, command)]
    return found[0] if len(found) == 1 else None


def commands(mode: str) -> list[str]:
    return [c for c in readme_commands() if how(c) == mode]


def run_as_written(command: str, cwd: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``bash -c command`` in ``cwd`` with this interpreter's scripts (``meshkit``, ``tensorboard``) first on PATH."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"README command `{command}` (in {cwd}) exited {proc.returncode}:\n" \
                                 f"{(proc.stdout + proc.stderr)[-4000:]}"
    return proc


def test_every_readme_command_is_run_somewhere():
    found = readme_commands()
    assert len(found) >= 10, found  # the extractor still sees the README's commands
    unknown = [c for c in found if how(c) is None]
    assert not unknown, f"README commands this suite does not run (add them to HOW in {__file__}): {unknown}"
    unused = [p for p in HOW if not any(re.search(p, c) for c in found)]
    assert not unused, f"HOW rows no README command matches (drop them): {unused}"


def test_readme_commands_extraction_joins_spans_and_drops_comments():
    text = "a `meshkit plan --params\n70e9` b `meshkit.Doctor()`\n```bash\npython x.py   # what it does\n```\n"
    assert readme_commands(text) == ["python x.py", "meshkit plan --params 70e9"]


def _requirements(extras: set[str]) -> set[str]:
    """The distributions setup.cfg installs for ``pip install -e .[extras]``, self-references resolved."""
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    table = {k: v for k, v in cfg["options.extras_require"].items()}
    lines = cfg["options"]["install_requires"].splitlines()
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for line in table[extra].splitlines():
            self_ref = re.match(r"meshkit\[([\w,-]+)\]", line.strip())
            todo += self_ref.group(1).split(",") if self_ref else []
            lines += [] if self_ref else [line]
    names = {re.split(r"[\s<>=!~;\[]", line.strip(), maxsplit=1)[0] for line in lines if line.strip()}
    return {md_name(n) for n in names if n and not n.startswith("#")}


def md_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(dists: set[str]) -> set[str]:
    """``dists`` and everything they require (installed metadata; optional extras left out)."""
    from packaging.requirements import Requirement

    out, todo = set(), list(dists)
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out.add(name)
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for r in map(Requirement, reqs):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(md_name(r.name))
    return out


def _extras_of(line: str) -> set[str]:
    found = re.search(r"pip install -e \"?\.(?:\[([\w,-]+)\])?\"?", line)
    assert found, line
    return set(found.group(1).split(",")) if found.group(1) else set()


def _examples_imports() -> dict[str, set[str]]:
    """{example script: the top-level modules it imports that are neither stdlib, meshkit nor its own folder}."""
    here = {os.path.splitext(f)[0] for f in os.listdir(os.path.join(ROOT, "examples"))}
    out = {}
    for name in sorted(os.listdir(os.path.join(ROOT, "examples"))):
        if name.endswith(".py"):
            tree = ast.parse(open(os.path.join(ROOT, "examples", name), encoding="utf-8").read())
            mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
            out[name] = {m for m in mods if m not in sys.stdlib_module_names and m != "meshkit" and m not in here}
    return out


def test_setup_line_installs_what_the_examples_import():
    """Issue 26: `examples/hsdp_tp_transformers.py` failed with ModuleNotFoundError right after the set-up line
    (transformers was only in the test extra). Every module an example imports must come with the set-up line."""
    (setup,) = commands("setup")
    installed = _closure(_requirements(_extras_of(setup)))
    owners = md.packages_distributions()
    missing = {script: sorted(m for m in mods if not {md_name(d) for d in owners.get(m, [m])} & installed)
               for script, mods in _examples_imports().items()}
    assert not any(missing.values()), f"the set-up line `{setup}` does not install {missing}"


def test_test_command_installs_at_least_the_setup_line():
    (setup,), (ci,) = commands("setup"), commands("ci")
    assert _requirements(_extras_of(setup)) <= _requirements(_extras_of(ci)), (setup, ci)


@pytest.mark.parametrize("command", commands("as_written"))
def test_command_as_written(command):
    run_as_written(command, ROOT, timeout=300)


@pytest.mark.parametrize("command", commands("help"))
def test_command_imports_and_answers_help(command):
    out = run_as_written(command + " --help", ROOT, timeout=120).stdout
    assert "usage" in out.lower(), out[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("command", commands("after_demo"))
def test_command_after_the_demo(demo_run, command):
    out = run_as_written(command, demo_run.cwd, timeout=120)
    assert "partial result" not in out.stderr and out.stdout.strip(), out.stdout + out.stderr


@pytest.mark.parametrize("command", commands("gpu"))
def test_gpu_command_is_there(command):
    """Its run needs CUDA; tests/e2e/test_gpu_run_all.py runs the same script with ``--cpu``."""
    script = os.path.join(ROOT, shlex.split(command)[0])
    assert os.access(script, os.X_OK), script


@pytest.mark.parametrize("command", commands("extra"))
def test_extra_exists_and_the_test_command_installs_it(command):
    (ci,) = commands("ci")
    extra = _extras_of(command)
    wanted, installed = _requirements(extra), _requirements(_extras_of(ci))  # KeyError: no such extra
    assert wanted <= installed, (command, ci)
    for name in wanted:
        md.version(name)  # installed in this environment (PackageNotFoundError otherwise)
