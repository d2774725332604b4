"""The README and the manual in docs/ stay true: the README's set-up commands are the ones CI runs, its
main job is a CPU sweep that exists, it stays a short page, every link and docs path resolves, and the
Python examples run as written."""

import re
import shutil
import tomllib
from pathlib import Path

import pytest

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
# Pages whose ```python blocks are examples to run (docs/ratchet_generic.md's is a user's benchmark script).
EXAMPLE_PAGES = ["docs/NUMERICS.md", "docs/SWEEPS.md"]


def _without_code(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _bash_blocks(text: str) -> list[list[str]]:
    return [block.strip().splitlines() for block in re.findall(r"```bash\n(.*?)```", text, re.S)]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_setup_commands_are_what_ci_runs():
    ci_lines = {line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()}
    # a command as CI runs it, with the environment it sets for it (FP4LAB_REQUIRE_TOOLS=1 ...) left aside
    ci_commands = {re.sub(r"^(\w+=\S+ )+", "", line) for line in ci_lines if line and not line.startswith("#")}
    setup = _bash_blocks(README.read_text())[0]
    assert len(setup) == 2, f"the README's first bash block must hold the two set-up commands, not {setup}"
    for command in setup:
        assert command in ci_commands, f".ci/run does not run the README command {command!r}"


def test_readme_main_job_is_a_cpu_sweep_that_exists():
    main_job = re.search(r"## The main job.*?```bash\n(.*?)```", README.read_text(), re.S)
    assert main_job, "README lost its main-job section"
    command = main_job.group(1).strip()
    spec_path = re.fullmatch(r"\.venv/bin/fp4lab sweep (\S+\.toml)", command)
    assert spec_path, f"the main job should be one `fp4lab sweep SPEC` command, not {command!r}"
    spec = tomllib.loads((REPO / spec_path.group(1)).read_text())
    assert spec["base"]["device"] == "cpu", "the README's main job must run on the CPU of a fresh machine"


def test_readme_is_a_short_page_for_an_80_column_terminal():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; the manual belongs in docs/"
    wide = [n for n, line in enumerate(lines, 1) if len(line) > 80]
    assert not wide, f"README.md lines wider than 80 columns: {wide}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_resolves(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", _without_code(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: link {target!r} points at nothing"
        if anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", _without_code(file.read_text()), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{page.name}: link {target!r}: no such heading"


def test_every_docs_path_named_in_the_repo_exists():
    sources = [*PAGES, REPO / "program.md", *(REPO / "sweeps").glob("*.toml")]
    sources += [p for folder in ("fp4lab", "scripts") for p in (REPO / folder).rglob("*.py")]
    texts = {p: p.read_text() for p in sources}
    for source, text in texts.items():
        for name in re.findall(r"\bdocs/([\w./-]+?\.md)\b", text):
            assert (REPO / "docs" / name).is_file(), f"{source.relative_to(REPO)} names docs/{name}, which does not exist"


@pytest.mark.parametrize("page", EXAMPLE_PAGES)
def test_python_examples_run(page, tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", (REPO / page).read_text(), re.S)
    assert blocks, f"{page} lost its Python example"
    # The examples read the shipped specs and write jobs/ where they run: run them in a scratch copy.
    shutil.copytree(REPO / "sweeps", tmp_path / "sweeps")
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        exec(compile(block, page, "exec"), {})


def test_readme_counts_and_command_list_are_the_programs():
    """What the README counts, it counts right: the built-in recipes, and every command `fp4lab --help`
    lists is named in it (as `fp4lab COMMAND`)."""
    import typer

    from fp4lab.cli import app
    from fp4lab.nn.recipe import list_recipes

    text = README.read_text()
    counts = {int(n) for n in re.findall(r"(\d+) (?:named|built-in) recipes|all (\d+) recipes", text) for n in n if n}
    assert counts == {len(list_recipes())}, f"the README counts {counts} recipes; there are {len(list_recipes())}"
    commands = sorted(typer.main.get_command(app).commands)
    missing = [c for c in commands if not re.search(rf"`fp4lab {c}\b", text)]
    assert not missing, f"the README does not name the command(s) {missing}"


def test_quickstart_time_is_one_measured_figure():
    """The quickstart's time, measured (wall clock of `fp4lab sweep sweeps/quickstart.toml`), is said the same in the README and in
    the spec's own comment."""
    spec = (REPO / "sweeps" / "quickstart.toml").read_text()
    said = re.search(r"trains them on this machine \(about (\d+) minutes on 2 cores", " ".join(README.read_text().split()))
    comment = " ".join(line.lstrip("# ") for line in spec.splitlines() if line.startswith("#"))
    commented = re.search(r"in about (\d+) minutes on 2 cores", comment)
    assert said and commented and said.group(1) == commented.group(1), "README and sweeps/quickstart.toml disagree on its time"
