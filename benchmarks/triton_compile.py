"""AttnRes's Triton kernels (depthbench/kernels/attnres_triton_jit.py) compiled ahead of time for a
GPU this machine need not have: registers, spills, shared memory and the global load
instructions of each kernel's code, from Triton's own compiler and the ptxas it ships. What tile
and layout changes do to the code, seen without a GPU; their speed needs one
(benchmarks/attnres_mix.py).

    .venv/bin/python benchmarks/triton_compile.py [--arch 90 --warps 8]

The launcher's specialisations are given as a run would make them at the 400M preset's deepest
shape: every pointer 16-byte aligned, and N, D and the view's strides divisible by 16.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repository's depthbench, installed or not


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (Hopper)")
    p.add_argument("--warps", type=int, default=None, help="default: the kernels' NUM_WARPS")
    p.add_argument("--cases", type=int, default=None, help="only the first CASES kernels")
    args = p.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from depthbench.kernels import attnres_triton as at
    from depthbench.kernels import attnres_triton_jit as jit

    warps = args.warps or at.NUM_WARPS
    bin_dir = Path(triton.__file__).parent / "backends/nvidia/bin"
    ptxas = next((bin_dir / n for n in ("ptxas-blackwell", "ptxas") if (bin_dir / n).exists()))
    rows = []
    # (kernel, readers, sources' dtype, v_0 apart): Full AttnRes's group and merge, Block's block
    shapes = ((8, "bf16", 1), (1, "bf16", 1), (18, "bf16", 1), (8, "fp32", 1))
    cases = [(k, *shape) for k in (jit.mix_forward, jit.mix_backward) for shape in shapes]
    for kernel, G, dtype, first in cases[: args.cases]:
        signature = {"probs": "*fp32", "first": "*fp32", "view": f"*{dtype}"}
        if kernel is jit.mix_forward:
            signature["h"] = "*fp32"
        else:
            signature |= {"dh": "*fp32", "dq": "*fp32", "dfirst": "*fp32", "dview": f"*{dtype}"}
        signature |= {k: "i32" for k in ("N", "S", "D", "stride_vn", "stride_vs")}
        constexprs = dict(G=G, HAS_FIRST=first, **at.tiles(G))
        signature |= {k: "constexpr" for k in constexprs}
        names = list(signature)
        aligned = [k for k in names if signature[k].startswith("*")]
        aligned += ["N", "D", "stride_vn", "stride_vs"]
        attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in aligned}
        source = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
        compiled = compile(source, target=GPUTarget("cuda", args.arch, 32),
                           options=dict(num_warps=warps))  # fmt: skip
        ptx = compiled.asm["ptx"]
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(ptx)
            f.flush()
            out = subprocess.run([str(ptxas), "-v", f"-arch=sm_{args.arch}a", f.name, "-o",
                                  os.devnull], capture_output=True, text=True).stderr  # fmt: skip
        registers = re.search(r"Used (\d+) registers", out)
        spills = re.search(r"(\d+) bytes spill stores", out)
        loads = collections.Counter(re.findall(r"ld\.global(?:\.v\d)?\.b\d+", ptx))
        row = {
            "kernel": kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__,
            "readers": G,
            "sources": dtype,
            "registers": int(registers.group(1)) if registers else None,
            "spill_bytes": int(spills.group(1)) if spills else None,
            "shared_bytes": compiled.metadata.shared,
            "global_load_instructions": dict(sorted(loads.items())),
        }
        rows.append(row)
        print(row, flush=True)
    return rows


if __name__ == "__main__":
    main()
