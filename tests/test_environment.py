"""The conda environment for cluster users pins exactly what requirements.txt pins."""

import re

import yaml

from tests.conftest import REPO


def pins(lines):
    out = {}
    for line in lines:
        line = line.split("#")[0].strip()
        if line:
            name, version = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^\s;]+)", line).groups()
            out[name.lower()] = version
    return out


def test_conda_env_matches_requirements():
    req = pins((REPO / "requirements.txt").read_text().splitlines())
    env = yaml.safe_load((REPO / "envs" / "depthbench.yaml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert pins(pip_section) == req
    assert req["torch"] == "2.13.0"


def test_installed_versions_are_the_pinned_ones():
    from importlib.metadata import version

    for name, pinned in pins((REPO / "requirements.txt").read_text().splitlines()).items():
        assert version(name).split("+")[0] == pinned, name


def _rule_blocks(text: str):
    """(rule name, body) of every rule in a Snakefile's text, also rules defined under an `if`:
    a rule's body is the lines indented deeper than its `rule` line."""
    lines, blocks = text.splitlines(), []
    for n, line in enumerate(lines):
        m = re.match(r"(\s*)(?:rule|checkpoint)\s+(\w+)\s*:", line)
        if not m:
            continue
        indent, body = len(m.group(1)), []
        for nxt in lines[n + 1:]:
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
            assert (path.parent / m.group(1)).resolve() == (REPO / "envs" / "depthbench.yaml").resolve(), name
            seen.append(name)
    assert {"tokenize", "tokenize_index", "tokenize_piece", "train", "probe", "tables", "nll"} <= set(seen)


def test_post_deploy_installs_the_nodeps_packages_and_depthbench():
    script = (REPO / "envs" / "depthbench.post-deploy.sh").read_text()
    assert "requirements-nodeps.txt" in script and "--no-deps -e" in script
