"""One set of pins: constraints.txt holds the exact version of every package pyproject.toml
names (dependencies, extras, no-deps packages), pyproject's own specifiers admit them, and the
conda environment for cluster users pins exactly what every scripts/setup.sh installs."""

import re

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip's own copy of tomli
    from pip._vendor import tomli as tomllib

# The extras every `bash scripts/setup.sh` installs, whatever its modes.
SETUP_EXTRAS = ("kernels", "pytest")


def pins(lines):
    """{canonical name: version} of `name==version` lines (comments and blank lines skipped)."""
    out = {}
    for line in lines:
        line = line.split("#")[0].strip()
        if line:
            name, version = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^\s;]+)", line).groups()
            assert canonicalize_name(name) not in out, f"{name} pinned twice"
            out[canonicalize_name(name)] = version
    return out


def constraints():
    return pins((REPO / "constraints.txt").read_text().splitlines())


def pyproject():
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def extras():
    """{extra: [Requirement]} with DepthBench's references to its own extras left out."""
    table = pyproject()["project"]["optional-dependencies"]
    return {
        extra: [r for r in map(Requirement, reqs) if canonicalize_name(r.name) != "depthbench"]
        for extra, reqs in table.items()
    }


def included_extras(extra):
    """The extras that `extra` pulls in through depthbench[...] (itself included), transitively."""
    table, seen, todo = pyproject()["project"]["optional-dependencies"], set(), [extra]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for req in map(Requirement, table[name]):
            if canonicalize_name(req.name) == "depthbench":
                todo.extend(req.extras)
    return seen


def no_deps():
    return pyproject()["tool"]["depthbench"]["no-deps"]


def setup_requirements():
    """What every scripts/setup.sh resolves: the [project] dependencies and SETUP_EXTRAS'."""
    reqs = [Requirement(r) for r in pyproject()["project"]["dependencies"]]
    return reqs + [r for extra in SETUP_EXTRAS for r in extras()[extra]]


def test_conda_env_matches_constraints():
    pinned = constraints()
    names = {canonicalize_name(r.name) for r in setup_requirements()}
    assert not names - set(pinned), "unpinned in constraints.txt"
    env = yaml.safe_load((REPO / "envs" / "depthbench.yaml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert pins(pip_section) == {name: pinned[name] for name in names}
    assert pinned["torch"] == "2.13.0"


def test_every_named_package_is_pinned_once_and_every_pin_is_named():
    pinned = constraints()
    reqs = setup_requirements() + [r for reqs in extras().values() for r in reqs]
    named = {canonicalize_name(r.name) for r in reqs}
    nodeps = {canonicalize_name(n) for names in no_deps().values() for n in names}
    assert not named - set(pinned), "named in pyproject.toml, unpinned in constraints.txt"
    assert not nodeps - set(pinned), "no-deps packages unpinned in constraints.txt"
    assert not set(pinned) - named - nodeps, "pins that pyproject.toml never names"
    assert not named & nodeps, "a no-deps package cannot also be resolved as a dependency"
    for req in reqs:  # pyproject's own specifiers (torch==2.13.0) must admit the pin
        assert req.specifier.contains(pinned[canonicalize_name(req.name)], prereleases=True), req


def test_no_deps_packages_follow_the_extras():
    table, modes = no_deps(), set(pyproject()["project"]["optional-dependencies"])
    assert set(table) <= {"base"} | modes, "a no-deps key that is no setup mode"
    for mode in modes:  # test includes pretrained: it installs pretrained's no-deps packages too
        for inner in included_extras(mode):
            assert set(table.get(inner, [])) <= set(table.get(mode, [])), (mode, inner)


def test_setup_installs_through_the_constraints_and_pyproject():
    script = (REPO / "scripts" / "setup.sh").read_text()
    assert f"extras={','.join(SETUP_EXTRAS)}" in script
    assert 'pip install -c constraints.txt $isolation -e ".[$extras]"' in script
    assert "pip install --no-deps -c constraints.txt $nodeps" in script
    assert '["tool"]["depthbench"]["no-deps"]' in script
    assert not list(REPO.glob("requirements*.txt")), "constraints.txt pins the versions"


def test_installed_versions_are_the_pinned_ones():
    from importlib.metadata import PackageNotFoundError, version

    always = {canonicalize_name(r.name) for r in setup_requirements()}
    for name, pinned in constraints().items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            assert name not in always, f"{name} is not installed"
            continue  # an extra's package that this environment did not install
        assert installed.split("+")[0] == pinned, name


def _rule_blocks(text: str):
    """(rule name, body) of every rule in a Snakefile's text, also rules defined under an `if`:
    a rule's body is the lines indented deeper than its `rule` line."""
    lines, blocks = text.splitlines(), []
    for n, line in enumerate(lines):
        m = re.match(r"(\s*)(?:rule|checkpoint)\s+(\w+)\s*:", line)
        if not m:
            continue
        indent, body = len(m.group(1)), []
        for nxt in lines[n + 1 :]:
            if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                break
            body.append(nxt)
        blocks.append((m.group(2), "\n".join(body)))
    return blocks


def test_every_rule_with_a_job_uses_the_conda_env():
    # Snakemake resolves a rule's conda: path against the file that defines the rule.
    files = [REPO / "Snakefile", *sorted((REPO / "workflow" / "rules").glob("*.smk"))]
    seen = []
    for path in files:
        for name, body in _rule_blocks(path.read_text()):
            if not re.search(r"^\s+(script|shell|run|notebook|wrapper):", body, re.M):
                continue  # a target-only rule (all) runs no job
            m = re.search(r"^\s+conda:\s*\n\s+\"([^\"]+)\"", body, re.M)
            assert m, f"rule {name} in {path.name} has no conda: directive"
            conda_env = (path.parent / m.group(1)).resolve()
            assert conda_env == (REPO / "envs" / "depthbench.yaml").resolve(), name
            seen.append(name)
    stages = {"tokenize", "tokenize_index", "tokenize_piece", "train", "probe", "tables", "nll"}
    assert stages <= set(seen)


