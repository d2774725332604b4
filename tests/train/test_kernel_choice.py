"""Which compute paths a run takes (fp4lab.train.paths): resolved once per config and device into one
record, refused where a switch asks for a path the device cannot run, set on every layer by the
builder, and shown in summary.json and the run's first log line."""

import pytest
import torch

from fp4lab.nn.build import build_model, fp4_linears
from fp4lab.nn.model_config import preset
from fp4lab.nn.recipe import load_recipe
from fp4lab.train import paths
from fp4lab.train.build import build_training
from fp4lab.train.config import ConfigError, TrainConfig

CPU = torch.device("cpu")


def test_auto_takes_the_torch_kernels_on_the_cpu_and_a_named_gpu_kernel_is_refused_there():
    auto = paths.resolve(TrainConfig(), CPU, 64)
    assert (auto.attention_kernel, auto.mx_gemm, auto.tensor_cores, auto.fused_quantizers, auto.compile) == ("sdpa", "bf16", False, False, False)
    assert auto.off["tensor_cores"] == "compute='auto' on the CPU: the fp32 reference"
    assert auto.off["fused_quantizers"] == "the reference path" == auto.off["attention_kernel"]
    named = paths.resolve(TrainConfig(attention_kernel="sdpa", mx_gemm="bf16"), CPU, 64)
    assert (named.attention_kernel, named.mx_gemm) == ("sdpa", "bf16")
    assert named.off["attention_kernel"] == "config attention_kernel='sdpa'"
    fast_cpu = paths.resolve(TrainConfig(compute="fast", compile="on"), CPU, 64)
    assert fast_cpu.tensor_cores and fast_cpu.compile and not fast_cpu.fused_quantizers
    assert fast_cpu.off["fused_quantizers"] == "no CUDA device"
    with pytest.raises(ConfigError, match="attention_kernel='triton' needs the fast path on CUDA"):
        paths.resolve(TrainConfig(attention_kernel="triton"), CPU, 64)
    with pytest.raises(ConfigError, match=r"mx_gemm='fp8' needs the fast path on a CUDA device with FP8 tensor cores"):
        paths.resolve(TrainConfig(mx_gemm="fp8"), CPU, 64)
    with pytest.raises(ConfigError, match="attention_kernel='flash' is not supported"):
        TrainConfig(attention_kernel="flash")
    with pytest.raises(ConfigError, match="mx_gemm='fp4' is not supported"):
        TrainConfig(mx_gemm="fp4")


def test_build_model_sets_the_kernels_on_every_attention_and_linear():
    model = build_model(preset("tiny", 256, 64), load_recipe("mxfp4"), seed=0, attention_kernel="triton", mx_gemm="fp8")
    assert [a.kernel for a in model.attentions()] == ["triton"] * len(model.attentions())
    assert {linear.mx_gemm for linear in fp4_linears(model).values()} == {"fp8"}
    default = build_model(preset("tiny", 256, 64), load_recipe("mxfp4"), seed=0)
    assert {a.kernel for a in default.attentions()} == {"sdpa"}
    assert {linear.mx_gemm for linear in fp4_linears(default).values()} == {"bf16"}


@pytest.mark.parametrize("flag, value, message", [
    ("--attention-kernel", "triton", "attention_kernel='triton' needs the fast path on CUDA"),
    ("--mx-gemm", "fp8", "mx_gemm='fp8' needs the fast path on a CUDA device"),
    ("--producer-fusion", "on", "producer_fusion='on' needs the fast path on CUDA"),
    ("--recompute", "gate-up", "recompute='gate-up' recomputes the fast path's FP4 GEMMs"),
])
def test_the_train_and_bench_flags_reach_the_choice(run_cli, tmp_path, flag, value, message):
    train = run_cli("train", "--data", "synthetic", "--steps", "1", "--device", "cpu", flag, value, "--out", str(tmp_path / "run"))
    assert train.returncode == 2 and message in train.stderr, train.stderr
    assert not (tmp_path / "run").exists()  # refused before anything is written
    bench = run_cli("bench", "steps", "--device", "cpu", flag, value)
    assert bench.returncode == 2 and bench.stderr.startswith("fp4lab: error: bench: ") and message in bench.stderr, bench.stderr


def test_recompute_beside_producer_fusion_is_refused_at_the_cli(run_cli, tmp_path):
    """The fused SwiGLU keeps gate and up itself: recompute would silently do nothing beside it."""
    flags = ("--recompute", "gate-up", "--producer-fusion", "on")
    train = run_cli("train", "--data", "synthetic", "--steps", "1", *flags, "--out", str(tmp_path / "run"))
    assert train.returncode == 2 and "both take gate and up" in train.stderr, train.stderr
    assert not (tmp_path / "run").exists()
    bench = run_cli("bench", "steps", *flags)
    assert bench.returncode == 2 and bench.stderr.startswith("fp4lab: error: bench: ") and "both take gate and up" in bench.stderr, bench.stderr


@pytest.mark.cuda
def test_auto_takes_the_triton_attention_and_bf16_gemms_on_a_gpu():
    from fp4lab.numerics.kernels import runs_on

    cuda = torch.device("cuda")
    if not runs_on(cuda):
        pytest.skip("needs Triton")

    def built(config):
        return build_training(config, load_recipe("mxfp4"), preset("tiny", 256, 64), cuda, paths=paths.resolve(config, cuda, 64))[0]

    config = TrainConfig(recipe="mxfp4", device="cuda")
    model = built(config)
    assert all(linear.fused_quantizers and linear.tensor_cores for linear in fp4_linears(model).values())
    assert {a.kernel for a in model.attentions()} == {"triton"}
    assert {linear.mx_gemm for linear in fp4_linears(model).values()} == {"bf16"}  # fp8 is opt-in
    assert not any(linear.fuse_swiglu for linear in fp4_linears(model).values())  # producer fusion is opt-in
    fused = built(TrainConfig(recipe="mxfp4", device="cuda", producer_fusion="on"))
    assert all(block.feed_forward.w2.fuse_swiglu for block in fused.layers)
    if torch.cuda.get_device_capability() >= (8, 9):
        assert paths.resolve(TrainConfig(recipe="mxfp4", device="cuda", mx_gemm="fp8"), cuda, 64).mx_gemm == "fp8"
    sdpa = built(TrainConfig(recipe="mxfp4", device="cuda", attention_kernel="sdpa", mx_gemm="bf16"))
    assert {a.kernel for a in sdpa.attentions()} == {"sdpa"}
    assert {linear.mx_gemm for linear in fp4_linears(sdpa).values()} == {"bf16"}
    odd = paths.resolve(config, cuda, 96)  # a head_dim the kernel does not take
    assert odd.attention_kernel == "sdpa" and odd.off["attention_kernel"] == "the kernel takes head dims 16, 32, 64, 128, not 96"
    with pytest.raises(ConfigError, match="attention_kernel='triton' takes head dims 16, 32, 64, 128; this model's is 96"):
        paths.resolve(TrainConfig(device="cuda", attention_kernel="triton"), cuda, 96)


def test_the_triton_check_is_a_constant_to_torch_compile(recwarn):
    # Every FP4 linear asks it inside the compiled step: traced, its cached body ran again in each graph
    # and dynamo warned about the lru_cache wrapper on every GPU run.
    from fp4lab.numerics.kernels import runs_on

    def pick(x):
        return x + 1 if runs_on(torch.device("cuda")) else x - 1

    torch._dynamo.reset()
    out = torch.compile(pick, backend="eager", fullgraph=True)(torch.zeros(2))
    assert torch.equal(out, torch.full((2,), 1.0 if runs_on(torch.device("cuda")) else -1.0))
    assert not [w for w in recwarn if "lru_cache" in str(w.message)], [str(w.message) for w in recwarn]


def test_the_builder_takes_every_layer_s_path_from_the_record():
    from dataclasses import replace

    config = TrainConfig(recipe="mxfp4", compute="fast")
    chosen = paths.resolve(config, CPU, 16)
    for fused in (False, True):
        record = replace(chosen, fused_quantizers=fused, mx_gemm="fp8" if fused else "bf16")
        model = build_training(config, load_recipe("mxfp4"), preset("tiny", 256, 64), CPU, paths=record)[0]
        linears = fp4_linears(model).values()
        assert {(linear.tensor_cores, linear.fused_quantizers, linear.mx_gemm) for linear in linears} == {(True, fused, record.mx_gemm)}


def test_summary_and_the_first_log_line_show_the_paths(tmp_path, capfd):
    from fp4lab.train.config import DataConfig
    from fp4lab.train.loop import run

    config = TrainConfig(recipe="bf16", model="tiny", data=DataConfig(source="synthetic"), seq_len=16, batch_size=2, steps=1,
                         eval_every=1, eval_batches=1, device="cpu", out_dir=str(tmp_path / "run"))
    summary = run(config, progress=False)
    first = capfd.readouterr().err.splitlines()[0]
    assert first.startswith("compute paths on cpu: tensor_cores=off fused_quantizers=off attention=sdpa"), first
    assert "tensor_cores: compute='auto' on the CPU: the fp32 reference" in first and "cuda_graphs: needs the fast path on CUDA" in first
    assert summary["paths"] == paths.with_cuda_graphs(paths.resolve(config, CPU, 16), config, None).as_dict()
    assert summary["paths"]["cuda_graphs"] is False and not summary["paths"]["compile"]


def test_recompute_reaches_the_fp4_feed_forwards_and_is_refused_where_it_cannot_run():
    """recompute='gate-up' on the fast path: every feed-forward of an FP4 model recomputes gate and up
    (as the model runs: compiled or eager), its bf16 blocks' plain linears too, since they run outside
    the compiled graph there; a bf16 model's (one compiled graph) do not; refused on the reference
    path, under FSDP2 (whose all-gathered weights the kept operands would hold) and beside producer
    fusion."""
    config = TrainConfig(recipe="nvfp4", model="tiny", compute="fast", compile="off", recompute="gate-up")
    chosen = paths.resolve(config, CPU, 32)
    assert chosen.recompute == "gate-up" and "recompute=gate-up" in chosen.describe()
    model = build_training(config, load_recipe("nvfp4"), preset("tiny", 256, 64), CPU, paths=chosen)[0]
    recipe = load_recipe("nvfp4")
    fp4_blocks = [not recipe.linear_for_block(i, len(model.layers)).is_plain_bf16 for i in range(len(model.layers))]
    assert [b.feed_forward.recompute_gate_up for b in model.layers] == ["eager"] * len(model.layers)
    assert all(b.feed_forward.w1.keeps_fprop_operands and b.feed_forward.w3.keeps_fprop_operands for b in model.layers)
    assert any(fp4_blocks) and not all(fp4_blocks)  # both kinds checked
    compiled = build_model(preset("tiny", 256, 64), recipe, seed=0, tensor_cores=True, recompute_gate_up="compiled")
    assert {b.feed_forward.recompute_gate_up for b in compiled.layers} == {"compiled"}
    plain = build_model(preset("tiny", 256, 64), load_recipe("bf16"), seed=0, tensor_cores=True, recompute_gate_up="compiled")
    assert {b.feed_forward.recompute_gate_up for b in plain.layers} == {"off"}
    assert not any(linear.keeps_fprop_operands for linear in fp4_linears(plain).values())
    assert paths.resolve(TrainConfig(compute="fast"), CPU, 32).off["recompute"].startswith("config recompute='off'")
    with pytest.raises(ConfigError, match="recompute='gate-up' recomputes the fast path's FP4 GEMMs"):
        paths.resolve(TrainConfig(recompute="gate-up"), CPU, 32)
    with pytest.raises(ConfigError, match="under parallel='fsdp' holds each all-gathered weight"):
        TrainConfig(recompute="gate-up", parallel="fsdp")
    with pytest.raises(ConfigError, match="recompute='gate-up' and producer_fusion='on' both take gate and up"):
        TrainConfig(recompute="gate-up", producer_fusion="on")
    with pytest.raises(ConfigError, match="recompute='all' is not supported"):
        TrainConfig(recompute="all")
