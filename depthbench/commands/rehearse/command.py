"""The rehearsal's driver and its table: one architecture and shape at a time in this process
(each model freed before the next is built), the memory guard choosing the real or the meta
check, a line per shape as it finishes, and rehearsal.json / rehearsal.csv under the output
folder rewritten atomically after every shape (an interrupted rehearsal keeps what it measured).
The steps themselves are in depthbench.commands.rehearse.rehearsal.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pandas as pd

from depthbench.util.io import atomic_write, atomic_write_json
from depthbench.commands.rehearse.rehearsal import (
    GIB,
    MODES,
    Target,
    cpu_footprint,
    rehearsal_targets,
    rehearse_meta,
    rehearse_real,
)
from depthbench.commands.rehearse.rss import available_memory
from depthbench.train.memory import HEADROOM, estimate_memory

REAL_COLUMNS = [
    ("arch", "<13"),
    ("shape", "<8"),
    ("tag", "<10"),
    ("params", ">13,"),
    ("step_s", ">7.1f"),
    ("seconds", ">8.1f"),
    ("measured_gib", ">9.2f"),
    ("est_gib", ">8.2f"),
    ("ratio", ">6.2f"),
    ("est_weights_gib", ">6.2f"),
    ("est_grads_gib", ">6.2f"),
    ("est_adamw_gib", ">6.2f"),
    ("est_acts_gib", ">6.2f"),
    ("resume_equal", ">7"),
    ("probe_rows", ">6"),
    ("status", ">7"),
]
REAL_HEADER = [
    "arch",
    "shape",
    "tag",
    "params",
    "step s",
    "total s",
    "peak GiB",
    "est GiB",
    "ratio",
    "W",
    "G",
    "AdamW",
    "acts",
    "resume",
    "probes",
    "status",
]
META_COLUMNS = [
    ("arch", "<13"),
    ("shape", "<8"),
    ("tag", "<10"),
    ("params", ">14,"),
    ("fsdp_units", ">6"),
    ("world", ">6"),
    ("gpu_gib", ">9.1f"),
    ("gpu_gib_ac", ">9.1f"),
    ("needs_ac", ">6"),
    ("fits_with_ac", ">6"),
    ("meta_rss_gib", ">8.3f"),
    ("status", ">7"),
]
META_HEADER = [
    "arch",
    "shape",
    "tag",
    "params",
    "units",
    "ranks",
    "GPU GiB",
    "GPU GiB AC",
    "AC?",
    "fits",
    "host GiB",
    "status",
]


def _target_row(target: Target) -> dict:
    s = target.spec.shape
    return {
        "arch": target.arch,
        "shape": target.which,
        "tag": s.tag,
        "n_layer": s.n_layer,
        "d_model": s.d_model,
        "d_ff": s.d_ff,
        "solver_params": s.n_params,
    }


def _rehearse_one(
    target: Target,
    exp,
    out: Path,
    mode: str,
    tokens: int,
    probe_tokens: int,
    probe_passes: int,
    gpu_memory: float,
) -> dict:
    """The memory guard, then the real or the meta check (depthbench.commands.rehearse.rehearsal,
    steps 1-5)."""
    launcher = exp.config.get("launcher", {})
    if mode == "meta":
        return {"mode": "meta", **rehearse_meta(target, launcher, gpu_memory)}
    est = estimate_memory(
        target.spec.model,
        1,
        tokens,
        bf16=False,
        device="cpu",
        loss_chunk_tokens=target.spec.train.loss_chunk_tokens,
    )
    need, avail = cpu_footprint(est, target.spec.shape.n_params), available_memory()
    guard = {"cpu_need_gib": need / GIB, "available_gib": avail / GIB}
    if need > avail:
        why = (
            f"needs {need / GIB:.1f} GiB on the host (estimate with {HEADROOM:.0%} headroom: "
            f"AdamW training step or resume), {avail / GIB:.1f} GiB available"
        )
        if mode == "real":
            return {
                "mode": "real",
                **guard,
                "status": "refused",
                "note": f"{why}; not built (--mode auto checks it on the meta device)",
            }
        return {
            "mode": "meta",
            **guard,
            "note": f"{why}: checked on the meta device",
            **rehearse_meta(target, launcher, gpu_memory),
        }
    return {
        "mode": "real",
        **guard,
        **rehearse_real(target, out, tokens, probe_tokens, probe_passes, est),
    }


def rehearse_experiment(
    exp,
    out: str | Path,
    mode: str = "auto",
    archs: list[str] | None = None,
    which: tuple[str, ...] = ("widest", "deepest"),
    tokens: int = 256,
    probe_tokens: int = 32,
    probe_passes: int = 1,
    gpu_memory: float = 80e9,
    config_path: str = "",
    log=lambda line: print(line, file=sys.stderr, flush=True),
) -> dict:
    """Rehearse every target of `exp` (depthbench.commands.rehearse.rehearsal); the report that
    rehearsal.json holds."""
    if mode not in MODES:
        raise ValueError(f"--mode {mode!r}: valid: {list(MODES)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    report = {
        "config": config_path,
        "mode": mode,
        "tokens": tokens,
        "probe_sequences": 2,
        "probe_tokens": probe_tokens,
        "probe_passes": probe_passes,
        "available_gib_at_start": available_memory() / GIB,
        "rows": [],
    }
    targets = rehearsal_targets(exp, archs, which)
    longest = min(t.spec.model.max_seq_len for t in targets)
    if mode != "meta" and not 2 <= max(tokens, probe_tokens) <= longest:
        raise ValueError(
            f"--tokens {tokens} / --probe-tokens {probe_tokens}: must be between 2 and the models' "
            f"max_seq_len {longest} (train.seq_len of the config)"
        )
    for target in targets:
        log(f"rehearse: {target.arch} {target.which} {target.spec.shape.tag} ...")
        t0 = time.time()
        row = {
            **_target_row(target),
            **_rehearse_one(target, exp, out, mode, tokens, probe_tokens, probe_passes, gpu_memory),
        }
        row["seconds"] = round(time.time() - t0, 1)
        report["rows"].append(row)
        report["total_s"] = round(time.time() - t_start, 1)
        write_report(out, report)
        log(format_rows([row], header=False) + (f"  ({row['note']})" if row.get("note") else ""))
    return report


def write_report(out: Path, report: dict) -> None:
    atomic_write_json(out / "rehearsal.json", report)
    df = pd.DataFrame(
        [
            {k: ";".join(v) if isinstance(v, list) else v for k, v in r.items()}
            for r in report["rows"]
        ]
    )
    atomic_write(out / "rehearsal.csv", lambda tmp: df.to_csv(tmp, index=False))


def _text_format(fmt: str) -> str:
    """The alignment and width of a number format, for text in the same column."""
    align, width = re.match(r"([<>^]?)(\d*)", fmt).groups()
    return f"{align or '<'}{width}"


def _line(row: dict, columns) -> str:
    cells = []
    for key, fmt in columns:
        value = row.get(key, "")
        if isinstance(value, bool):  # format(True, ">7") would print 1
            value = "yes" if value else "no"
        try:
            cells.append(format(value, fmt))
        except (ValueError, TypeError):  # a bool, text or a missing value in a number column
            cells.append(format(str(value), _text_format(fmt)))
    return " ".join(cells)


def _header(names, columns) -> str:
    return " ".join(format(n, _text_format(fmt)) for n, (_, fmt) in zip(names, columns))


def format_rows(rows: list[dict], header: bool = True) -> str:
    """The real rows as one table (GiB: measured peak RSS over build + two steps vs the estimate:
    W weights, G gradients, AdamW moments, acts activations + one block's backward), the meta
    and refused rows as another (per-GPU GiB with headroom, without / with activation
    checkpointing)."""
    lines = []
    real = [r for r in rows if r.get("mode") == "real" and r.get("status") != "refused"]
    other = [r for r in rows if r not in real]
    if real:
        lines += ([_header(REAL_HEADER, REAL_COLUMNS)] if header else []) + [
            _line(r, REAL_COLUMNS) for r in real
        ]
    if other:
        lines += ([_header(META_HEADER, META_COLUMNS)] if header else []) + [
            _line(r, META_COLUMNS) for r in other
        ]
    return "\n".join(lines)


def format_report(report: dict) -> str:
    rows = report["rows"]
    bad = [r for r in rows if r.get("status") != "ok"]
    real = any(r.get("mode") == "real" and r.get("status") != "refused" for r in rows)
    sizes = (
        f"micro-batch 1 x {report['tokens']} random tokens, probes on "
        f"{report['probe_sequences']} x {report['probe_tokens']} tokens; "
        if real
        else ""
    )
    return (
        format_rows(rows) + f"\nrehearsal: {len(rows)} shapes in {report.get('total_s', 0):.0f} s, "
        f"{len(bad)} not ok; {sizes}written to rehearsal.json / rehearsal.csv"
    )


def load_report(out: str | Path) -> dict:
    return json.loads((Path(out) / "rehearsal.json").read_text())
