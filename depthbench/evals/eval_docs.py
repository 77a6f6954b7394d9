"""An evaluation document (a context and its gold continuation, by set and domain) and the
user's own sets: JSONL files with one object per line holding `context` and `continuation`
(and optionally `domain` and `id`). The built-in sets are in depthbench.evals.builtin_sets.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from depthbench.util.errors import ConfigError


@dataclass(frozen=True)
class EvalDoc:
    set: str
    domain: str
    doc_id: str
    context: str
    continuation: str

    def to_dict(self) -> dict:
        return asdict(self)


def load_jsonl(name: str, path: str | Path, domain: str | None = None) -> list[EvalDoc]:
    """A user's set: JSON lines with `context` and `continuation` (and optional `domain`, `id`)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"nll.custom[{name}].path", f"{path} does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    docs = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"nll.custom[{name}].path", f"{path}:{line_no}: not JSON ({exc.msg})"
                ) from None
            missing = [k for k in ("context", "continuation") if not isinstance(row.get(k), str)]
            if missing:
                raise ConfigError(
                    f"nll.custom[{name}].path", f"{path}:{line_no}: needs string fields {missing}"
                )
            if not row["continuation"]:
                raise ConfigError(
                    f"nll.custom[{name}].path", f"{path}:{line_no}: empty continuation"
                )
            row_domain = row.get("domain", domain)
            if not row_domain:
                raise ConfigError(
                    f"nll.custom[{name}].domain",
                    f"{path}:{line_no}: no domain on the line and none in the config",
                )
            docs.append(
                EvalDoc(
                    name,
                    str(row_domain),
                    str(row.get("id", line_no - 1)),
                    row["context"],
                    row["continuation"],
                )
            )
    if not docs:
        raise ConfigError(f"nll.custom[{name}].path", f"{path} has no documents")
    return docs
