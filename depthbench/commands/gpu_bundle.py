"""What scripts/gpu_workflow.sh takes to a machine that has a GPU but no package registry and
little time: the workflow's own outputs that need no GPU, made on a CPU machine, and the check
that the carried wheels' requirements are met there.

`pack ROOT TAR`: the outputs under ROOT/results that a `snakemake --until tokenize nll_sets` made
(tokenizer, token shards, tokenized NLL sets, their logs and benchmark records; not the plan
cache, which is keyed to this machine's Python and torch) and Snakemake's metadata of them
(ROOT/.snakemake/metadata: the params, input and code it checks), as one gzipped tar.

`unpack TAR ROOT`: extracts them into the checkout ROOT and sets their modification times so
that Snakemake there finds them up to date: newer than every script and rule file of the
checkout (a script newer than an output reruns its job, and a copied checkout's files are as new
as the copy), and each input older than the outputs made from it (the tokenizer before the
shards and the sets). The times are set, not kept from the tar, because the two machines' clocks
and the copy's times are unknown. The metadata is what makes the check honest: with it Snakemake
compares the recorded params (the corpus, tokenizer and NLL settings) with the config's, so
outputs prepared for another config are redone (and fail for want of the data packages) rather
than taken as up to date; scripts/gpu_workflow.sh verifies with a dry run before any training.

`pins`: the wheels to carry, as NAME==VERSION: the requirement closure of Snakemake, submitit
and jsonschema (what the workflow needs beyond torch, numpy, pandas, pyarrow, matplotlib, scipy,
tokenizers and safetensors, which a GPU image has), markers evaluated for Python 3.12 on x86-64
Linux, at the versions installed here (constraints.txt's, through scripts/setup.sh). The whole
closure is carried, also what the image may have (packaging, PyYAML, Jinja2, ...): the carried
folder comes first on the path, so these are the versions tested here. With them the packages
that pyproject.toml's `[tool.depthbench.no-deps]` lists for the `gpu` mode (Liger-Kernel's and
fla-core's Triton kernels, which the CUDA backend swaps in for HC, mHC and MoDA, and einops), at
constraints.txt's versions, without their dependencies (their declared torch and triton are the
image's).

`check-wheels SITE`: every requirement of every distribution installed in SITE (pip install
--target) is met by a distribution this interpreter sees, at an allowed version; prints each one
that is not and exits 1, before anything runs.
"""

from __future__ import annotations

import os
import sys
import tarfile
import time
from pathlib import Path

CODE = ("Snakefile", "workflow", "scripts")
ROOTS = ("snakemake", "submitit", "jsonschema")  # what the workflow imports that images lack
TARGET = {  # the GPU machine's interpreter, for requirement markers
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}  # what Snakemake compares the outputs' times with
FIRST = "results/tokenizers"  # the prepared outputs that are inputs of the other ones


def pack(root: Path, out: Path) -> list[str]:
    root, names = Path(root), []
    for top in ("results", ".snakemake/metadata"):
        for path in sorted((root / top).rglob("*")):
            rel = path.relative_to(root).as_posix()
            if path.is_file() and not rel.startswith("results/.cache/"):
                names.append(rel)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for rel in names:
            tar.add(root / rel, arcname=rel)
    tmp.replace(out)
    return names


def newest_code_mtime(root: Path) -> float:
    times = [0.0]
    for name in CODE:
        path = root / name
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        times += [p.stat().st_mtime for p in files]
    return max(times)


def unpack(tar_path: Path, root: Path) -> list[str]:
    root = Path(root)
    with tarfile.open(tar_path) as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        for m in members:
            if m.name.startswith("/") or ".." in Path(m.name).parts:
                raise ValueError(f"{tar_path}: unsafe member {m.name!r}")
        if hasattr(tarfile, "data_filter"):  # Python 3.12, and 3.10/3.11 since their fixes
            tar.extractall(root, members=members, filter="data")
        else:
            tar.extractall(root, members=members)
    # without it Snakemake takes the metadata for an older format's and migrates it
    (root / ".snakemake" / "incomplete").mkdir(parents=True, exist_ok=True)
    start = max(time.time(), newest_code_mtime(root)) + 1.0
    for m in members:
        t = start if m.name.startswith(FIRST + "/") else start + 1.0
        os.utime(root / m.name, (t, t))
    return [m.name for m in members]


def wheel_pins(roots=ROOTS, env: dict = TARGET) -> dict[str, str]:
    """{canonical name: installed version} of the requirement closure of `roots`."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in pins:
            continue
        pins[name] = metadata.version(name)
        for text in metadata.requires(name) or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    return dict(sorted(pins.items()))


def gpu_no_deps(repo: Path = Path(__file__).resolve().parents[2]) -> dict[str, str]:
    """{name: version} of the `gpu` mode's no-deps packages: pyproject.toml's list, pinned by
    constraints.txt."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pip's own copy of tomli (as scripts/setup.sh)
        from pip._vendor import tomli as tomllib

    from packaging.utils import canonicalize_name

    listed = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["depthbench"]["no-deps"]
    pins = {}
    for line in (repo / "constraints.txt").read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            pins[canonicalize_name(name)] = version
    return {canonicalize_name(n): pins[canonicalize_name(n)] for n in listed.get("gpu", [])}


def unmet_requirements(site: Path) -> list[str]:
    """'dist: requirement (found: version or nothing)' for each unmet requirement of the
    distributions in `site`, markers evaluated for this interpreter, extras left out."""
    from importlib import metadata

    from packaging.requirements import Requirement

    problems = []
    for dist in metadata.distributions(path=[str(site)]):
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                found = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                found = None
            if found is None or not req.specifier.contains(found, prereleases=True):
                problems.append(f"{dist.metadata['Name']}: {req} (found: {found or 'nothing'})")
    return sorted(set(problems))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 3 and args[0] == "pack":
        names = pack(Path(args[1]), Path(args[2]))
        print(f"{args[2]}: {len(names)} files")
        return 0
    if len(args) == 3 and args[0] == "unpack":
        names = unpack(Path(args[1]), Path(args[2]))
        print(f"{args[1]}: {len(names)} files into {args[2]}, newer than its code")
        return 0
    if args == ["pins"]:
        print(" ".join(f"{name}=={version}" for name, version in wheel_pins().items()))
        return 0
    if args == ["pins-no-deps"]:
        print(" ".join(f"{name}=={version}" for name, version in gpu_no_deps().items()))
        return 0
    if len(args) == 2 and args[0] == "check-wheels":
        problems = unmet_requirements(Path(args[1]))
        for line in problems:
            print(f"unmet: {line}", file=sys.stderr)
        return 1 if problems else 0
    print(
        "usage: pack ROOT TAR | unpack TAR ROOT | pins | pins-no-deps | check-wheels SITE",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
