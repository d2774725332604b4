"""Which kernels a run's attention and MXFP4 GEMMs take (TrainConfig.attention_kernel, .mx_gemm):
resolved per device in fp4lab.train.loop, refused where they cannot run, and set on every layer."""

import pytest
import torch

from fp4lab.nn.build import build_model, fp4_linears
from fp4lab.nn.model import preset
from fp4lab.nn.recipe import load_recipe
from fp4lab.train.config import ConfigError, TrainConfig
from fp4lab.train.loop import attention_kernel, build_training, mx_gemm

CPU = torch.device("cpu")


def test_auto_takes_the_torch_kernels_on_the_cpu_and_a_named_gpu_kernel_is_refused_there():
    assert attention_kernel(TrainConfig(), CPU, 64) == "sdpa"
    assert mx_gemm(TrainConfig(), CPU) == "bf16"
    assert attention_kernel(TrainConfig(attention_kernel="sdpa"), CPU, 64) == "sdpa"
    assert mx_gemm(TrainConfig(mx_gemm="bf16"), CPU) == "bf16"
    with pytest.raises(ConfigError, match="attention_kernel='triton' needs the fast path on CUDA"):
        attention_kernel(TrainConfig(attention_kernel="triton"), CPU, 64)
    with pytest.raises(ConfigError, match=r"mx_gemm='fp8' needs the fast path on a CUDA device with FP8 tensor cores"):
        mx_gemm(TrainConfig(mx_gemm="fp8"), CPU)
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
])
def test_the_train_and_bench_flags_reach_the_choice(run_cli, tmp_path, flag, value, message):
    train = run_cli("train", "--data", "synthetic", "--steps", "1", "--device", "cpu", flag, value, "--out", str(tmp_path / "run"))
    assert train.returncode == 2 and message in train.stderr, train.stderr
    assert not (tmp_path / "run").exists()  # refused before anything is written
    bench = run_cli("bench", "steps", "--device", "cpu", flag, value)
    assert bench.returncode == 2 and bench.stderr.startswith("fp4lab: error: bench: ") and message in bench.stderr, bench.stderr


@pytest.mark.cuda
def test_auto_takes_the_triton_attention_and_bf16_gemms_on_a_gpu():
    from fp4lab.numerics.fast import triton_available

    if not triton_available():
        pytest.skip("needs Triton")
    cuda = torch.device("cuda")
    config = TrainConfig(recipe="mxfp4", device="cuda")
    model, _, _ = build_training(config, load_recipe("mxfp4"), preset("tiny", 256, 64), cuda)
    assert {a.kernel for a in model.attentions()} == {"triton"}
    assert {linear.mx_gemm for linear in fp4_linears(model).values()} == {"bf16"}  # fp8 is opt-in
    assert not any(linear.fuse_swiglu for linear in fp4_linears(model).values())  # producer fusion is opt-in
    fused, _, _ = build_training(TrainConfig(recipe="mxfp4", device="cuda", producer_fusion="on"), load_recipe("mxfp4"),
                                 preset("tiny", 256, 64), cuda)
    assert all(block.feed_forward.w2.fuse_swiglu for block in fused.layers)
    if torch.cuda.get_device_capability() >= (8, 9):
        assert mx_gemm(TrainConfig(recipe="mxfp4", device="cuda", mx_gemm="fp8"), cuda) == "fp8"
    sdpa, _, _ = build_training(TrainConfig(recipe="mxfp4", device="cuda", attention_kernel="sdpa", mx_gemm="bf16"),
                                load_recipe("mxfp4"), preset("tiny", 256, 64), cuda)
    assert {a.kernel for a in sdpa.attentions()} == {"sdpa"}
    assert {linear.mx_gemm for linear in fp4_linears(sdpa).values()} == {"bf16"}
    assert attention_kernel(config, cuda, 96) == "sdpa"  # a head_dim the kernel does not take
    with pytest.raises(ConfigError, match="attention_kernel='triton' takes head dims 16, 32, 64, 128; this model's is 96"):
        attention_kernel(TrainConfig(device="cuda", attention_kernel="triton"), cuda, 96)


def test_the_triton_check_is_a_constant_to_torch_compile(recwarn):
    # Every FP4 linear asks it inside the compiled step: traced, its cached body ran again in each graph
    # and dynamo warned about the lru_cache wrapper on every GPU run.
    from fp4lab.numerics.fast import triton_available, triton_runs_on

    def pick(x):
        return x + 1 if triton_runs_on(torch.device("cuda")) else x - 1

    torch._dynamo.reset()
    out = torch.compile(pick, backend="eager", fullgraph=True)(torch.zeros(2))
    assert torch.equal(out, torch.full((2,), 1.0 if triton_available() else -1.0))
    assert not [w for w in recwarn if "lru_cache" in str(w.message)], [str(w.message) for w in recwarn]
