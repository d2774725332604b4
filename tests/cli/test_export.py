"""`fp4lab export`: the command writes a folder transformers loads and says which recipe trained the
weights; a run id resolves through the catalog; bad input is one line and exit code 2."""

from __future__ import annotations

import json

import pytest

from fp4lab.lab.records.catalog import Catalog
from tests.train.test_export import train

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def nvfp4_run(tmp_path_factory, one_thread):
    return train(tmp_path_factory.mktemp("runs") / "nvfp4", "nvfp4", "synthetic", 3, batch_size=2)


def test_export_writes_a_folder_transformers_loads_and_names_the_recipe(run_cli, nvfp4_run, tmp_path):
    out = tmp_path / "hf"
    done = run_cli("export", str(nvfp4_run), "--format", "hf", str(out))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"exported {nvfp4_run} (recipe nvfp4, step 3) to {out} as a Hugging Face Llama: master weights in float32")
    assert "  tokenizer: none, the synthetic corpus is token ids" in lines
    assert lines[-1] == f"load it: transformers.LlamaForCausalLM.from_pretrained({str(out)!r})"
    assert transformers.AutoConfig.from_pretrained(out).fp4lab["recipe"] == "nvfp4"
    assert transformers.LlamaForCausalLM.from_pretrained(out).num_parameters() == int(lines[0].split(", ")[-1].split()[0].replace(",", ""))

    as_json = run_cli("export", str(nvfp4_run), str(tmp_path / "hf-bf16"), "--dtype", "bfloat16", "--json")
    assert as_json.returncode == 0, as_json.stderr
    document = json.loads(as_json.stdout)
    assert document["recipe"] == "nvfp4" and document["dtype"] == "bfloat16" and document["step"] == 3
    assert document["tokenizer"] is None and document["files"] == ["model.safetensors", "config.json", "README.md"]


def test_a_run_id_is_looked_up_in_the_catalog(run_cli, nvfp4_run, tmp_path):
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    catalog.upsert({"id": "0123456789ab", "paths": {"run_dir": str(nvfp4_run)}})
    done = run_cli("export", "0123456789ab", str(tmp_path / "hf"), "--catalog", str(catalog.path), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["run"] == str(nvfp4_run)


@pytest.mark.parametrize("args, fragment", [
    (["export", "no-such-run", "{tmp}/hf"], "export: 'no-such-run' is neither a run folder nor a run id (no catalog at"),
    (["export", "{run}", "{tmp}/busy"], "export: {tmp}/busy is not empty; pass --force to replace it"),
    (["export", "{run}", "{tmp}/hf", "--format", "gguf"], "export: --format 'gguf' is not supported; allowed: hf"),
    (["export", "{run}", "{tmp}/hf", "--dtype", "float16"], "export: --dtype 'float16' is not supported; allowed: float32, bfloat16"),
    (["export", "{tmp}/qk-norm", "{tmp}/hf"], "the run's model has qk_norm, which HF's LlamaConfig cannot express"),
], ids=["unknown-run", "out-not-empty", "format", "dtype", "model-feature"])  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(run_cli, nvfp4_run, tmp_path, args, fragment):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("")
    (tmp_path / "qk-norm").mkdir()
    identity = json.loads((nvfp4_run / "config.json").read_text())
    identity["model"]["qk_norm"] = True
    (tmp_path / "qk-norm" / "config.json").write_text(json.dumps(identity))
    done = run_cli(*(a.format(tmp=tmp_path, run=nvfp4_run) for a in args))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fp4lab: error: ")
    assert fragment.format(tmp=tmp_path) in lines[0], lines[0]
    assert not (tmp_path / "hf").exists()
