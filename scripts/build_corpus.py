"""The pycode corpus where sweep specs or ratchet programs train on it, on a machine that keeps nothing:

    python scripts/build_corpus.py FILE...        (sweep specs *.toml, ratchet programs *.md)

Built from the bundle in .corpus/pycode when there is one (`fp4lab data pack pycode .corpus/pycode`
where it was built: manifest, tokenizer and xz-compressed token files, every file checked against the
manifest), else downloaded from PyPI; a corpus already built in $FP4LAB_CACHE is kept. Nothing is done
for files that do not train on pycode. The round scripts (`ledger_round.sh`, `ratchet_round.sh`) call
it before their runs, so a GPU machine without network access gets the corpus from the carried bundle.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fp4lab.lab.specs.program import ProgramError, load_program  # noqa: E402
from fp4lab.lab.specs.sweep_spec import SpecError, expand, load_spec  # noqa: E402
from fp4lab.train.config import PYCODE, DataConfig  # noqa: E402

BUNDLE = Path(".corpus") / PYCODE


def data_sources(path: Path) -> set[str]:
    """The data sources the runs of a sweep spec, or of a ratchet program of kind fp4lab, train on."""
    if path.suffix == ".md":
        run = load_program(path).run
        return {(run.base.get("data") or {}).get("source", DataConfig.source)} if run.kind == "fp4lab" else set()
    return {run.config["data"]["source"] for run in expand(load_spec(path))}


def main(files: list[str]) -> int:
    if not files:
        print("usage: python scripts/build_corpus.py FILE... (sweep specs or ratchet programs)", file=sys.stderr)
        return 2
    try:
        if not any(PYCODE in data_sources(Path(f)) for f in files):
            return 0
    except (ProgramError, SpecError) as exc:
        print(f"build_corpus: {exc}", file=sys.stderr)
        return 2
    source = ["--from", str(BUNDLE)] if (BUNDLE / "manifest.json").is_file() else []
    return subprocess.run([sys.executable, "-m", "fp4lab.cli", "data", "build", PYCODE, *source]).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
