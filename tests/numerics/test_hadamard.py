"""Hadamard transforms, blockwise and full-dimension: orthonormality, TE's signs, random signs, GEMM invariance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp4lab.numerics import HADAMARD_SIZES, TE_SIGNS, hadamard, hadamard_full, hadamard_matrix, hadamard_signs
from tests._refs import randn

TE_SIGN_VECTOR = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]  # TE get_wgrad_sign_vector


def sylvester(n: int) -> np.ndarray:
    """Sylvester-ordered Hadamard matrix: H[i, j] = (-1)^popcount(i & j)."""
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    return np.where(np.vectorize(lambda v: int(v).bit_count() % 2)(i & j) == 1, -1.0, 1.0)


def random_signs(size: int, seed: int) -> torch.Tensor:
    return hadamard_signs(size, "random", torch.Generator().manual_seed(seed))


SIGN_CHOICES = ["fixed", "none", "random"]


def signs_for(kind: str, size: int):
    return random_signs(size, 7) if kind == "random" else kind


@pytest.mark.parametrize("size", HADAMARD_SIZES)
@pytest.mark.parametrize("kind", SIGN_CHOICES)
def test_orthonormal(size, kind):
    r = hadamard_matrix(size, signs_for(kind, size))
    assert r.shape == (size, size) and r.dtype == torch.float32
    rd = r.double()
    assert torch.allclose(rd @ rd.T, torch.eye(size, dtype=torch.float64), rtol=0, atol=1e-6)
    assert torch.allclose(rd.T @ rd, torch.eye(size, dtype=torch.float64), rtol=0, atol=1e-6)
    assert (r.abs() == torch.tensor(1 / np.sqrt(size), dtype=torch.float32)).all()


@pytest.mark.parametrize("size", HADAMARD_SIZES)
def test_matrix_is_sign_diagonal_times_sylvester(size):
    signs = np.tile(TE_SIGN_VECTOR, size // 16).astype(np.float64)
    expected = signs[:, None] * sylvester(size) / np.sqrt(size)
    assert np.allclose(hadamard_matrix(size, "fixed").double().numpy(), expected, rtol=0, atol=1e-7)
    assert np.allclose(
        hadamard_matrix(size, "none").double().numpy(), sylvester(size) / np.sqrt(size), rtol=0, atol=1e-7
    )


def test_te_sign_vector():
    assert list(TE_SIGNS) == TE_SIGN_VECTOR
    mask = sum(1 << i for i, s in enumerate(TE_SIGNS) if s == -1)
    assert mask == 0xD7E8  # TE's kernel bitmask
    assert hadamard_signs(16, "fixed").tolist() == TE_SIGN_VECTOR
    assert hadamard_signs(16, "none").tolist() == [1.0] * 16


@pytest.mark.parametrize("size", [32, 64, 128])
def test_longer_fixed_signs_repeat_te_vector(size):
    s = hadamard_signs(size, "fixed")
    assert s.dtype == torch.float32 and s.tolist() == TE_SIGN_VECTOR * (size // 16)
    r = hadamard_matrix(size, "fixed")
    assert torch.equal(r, hadamard_matrix(size, s))
    # rows whose sign is -1 are negated Sylvester rows
    h = torch.from_numpy(sylvester(size)).float() / np.float32(np.sqrt(size))
    assert torch.allclose(r, s[:, None] * h, atol=1e-7, rtol=0)


def test_random_signs_reproducible_from_generator():
    a = random_signs(128, 1)
    b = random_signs(128, 1)
    c = random_signs(128, 2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.dtype == torch.float32 and set(a.unique().tolist()) == {-1.0, 1.0}
    g = torch.Generator().manual_seed(3)
    d1, d2 = hadamard_signs(64, "random", g), hadamard_signs(64, "random", g)
    assert not torch.equal(d1, d2)  # the generator advances


@pytest.mark.parametrize("size", HADAMARD_SIZES)
@pytest.mark.parametrize("kind", SIGN_CHOICES)
def test_transform_is_blockwise_matmul(size, kind):
    signs = signs_for(kind, size)
    x = randn((6, 2 * 128), seed=60)
    r = hadamard_matrix(size, signs).double()
    expected = (x.double().reshape(-1, size) @ r).reshape(x.shape)
    y = hadamard(x, size, signs)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert torch.allclose(y.double(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("size", HADAMARD_SIZES)
@pytest.mark.parametrize("kind", SIGN_CHOICES)
def test_paired_transform_preserves_gemm(size, kind):
    """(A R)(B R)^T = A B^T: in fp32 every entry is within 1e-5 * |a_i| |b_j| of the float64 product."""
    signs = signs_for(kind, size)
    a, b = randn((32, 256), seed=61), randn((24, 256), seed=62) * 100
    exact = a.double() @ b.double().T
    got = (hadamard(a, size, signs) @ hadamard(b, size, signs).T).double()
    bound = 1e-5 * a.double().norm(dim=1)[:, None] * b.double().norm(dim=1)[None, :]
    assert ((got - exact).abs() <= bound).all()
    # the check is sensitive: mismatched transforms do not cancel
    other = "none" if kind != "none" else "fixed"
    wrong = (hadamard(a, size, signs) @ hadamard(b, size, other).T).double()
    assert ((wrong - exact).abs() > bound).any()


@pytest.mark.parametrize("size", HADAMARD_SIZES)
@pytest.mark.parametrize("kind", SIGN_CHOICES)
def test_inverse_round_trip(size, kind):
    signs = signs_for(kind, size)
    x = randn((3, 4, 256), seed=63)
    y = hadamard(x, size, signs)
    back = hadamard(y, size, signs, inverse=True)
    assert torch.allclose(back, x, rtol=0, atol=1e-5)
    back2 = hadamard(hadamard(x, size, signs, inverse=True), size, signs)
    assert torch.allclose(back2, x, rtol=0, atol=1e-5)
    if kind == "fixed":  # diag(s) H is not symmetric: the inverse is a different map
        assert not torch.allclose(hadamard(x, size, signs, inverse=True), y, atol=1e-3)


@pytest.mark.parametrize("size", [16, 32])
def test_bf16_in_bf16_out_rounded_once(size):
    x = randn((32, 128), seed=64).bfloat16()
    y = hadamard(x, size, "fixed")
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, hadamard(x.float(), size, "fixed").bfloat16())
    assert hadamard(x.double(), size, "fixed").dtype == torch.float64


def test_norm_preserved_per_block():
    x = randn((16, 128), seed=65)
    y = hadamard(x, 128, random_signs(128, 5))
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)


@pytest.mark.parametrize("size", [0, 8, 24, 48, 256, "16", 16.0])
def test_bad_size_raises(size):
    x = torch.zeros(2, 256)
    with pytest.raises(ValueError, match="size"):
        hadamard(x, size)
    with pytest.raises(ValueError, match="size"):
        hadamard_matrix(size)
    with pytest.raises(ValueError, match="size"):
        hadamard_signs(size)


def test_last_dim_not_a_multiple_raises():
    with pytest.raises(ValueError, match="size=32"):
        hadamard(torch.zeros(4, 48), 32)
    with pytest.raises(ValueError, match="x"):
        hadamard(torch.zeros(()), 16)


@pytest.mark.parametrize(
    "signs",
    [
        torch.ones(8),
        torch.ones(32),
        torch.zeros(16),
        torch.full((16,), 2.0),
        torch.ones(4, 4),
        [1] * 16,
        "random",
        "foo",
    ],
    ids=["short", "long", "zeros", "twos", "2d", "list", "random-string", "unknown-string"],
)
def test_bad_signs_raise_naming_signs(signs):
    with pytest.raises(ValueError, match="signs"):
        hadamard(torch.zeros(2, 16), 16, signs)
    with pytest.raises(ValueError, match="signs"):
        hadamard_matrix(16, signs)


def test_unknown_string_signs_message_lists_allowed_values():
    with pytest.raises(ValueError, match=r"signs='foo'.*'fixed', 'none'"):
        hadamard(torch.zeros(2, 16), 16, "foo")


def test_bad_sign_kind_raises():
    with pytest.raises(ValueError, match=r"kind='foo'.*'fixed', 'random', 'none'"):
        hadamard_signs(16, "foo")


def test_non_float_input_raises():
    with pytest.raises(ValueError, match="x must be a floating-point"):
        hadamard(torch.zeros(2, 16, dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="x must be a floating-point"):
        hadamard(np.zeros((2, 16), dtype=np.float32), 16)


@pytest.mark.parametrize("inverse", [False, True])
def test_hadamard_never_writes_into_its_input(inverse):
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    before = x.clone()
    hadamard(x, 32, "fixed", inverse=inverse)
    assert torch.equal(x, before)


# Full-dimension transform (OptiTrain-FP4's U = H D / sqrt(N) over the zero-padded dim).


@pytest.mark.parametrize("n, length", [(2, 1), (8, 5), (256, 200), (512, 512), (2048, 1500)])
def test_full_transform_is_the_dense_u_on_the_zero_padded_rows(n, length):
    x = randn((6, length), seed=n)
    s = random_signs(n, n)
    padded = torch.nn.functional.pad(x.double(), (0, n - length))
    dense = padded @ (s.double()[:, None] * torch.from_numpy(sylvester(n))) / np.sqrt(n)
    y = hadamard_full(x, s)
    assert y.shape == (6, n) and y.dtype == torch.float32
    assert torch.allclose(y.double(), dense, rtol=0, atol=1e-5 * dense.abs().max().item())
    back = hadamard_full(y, s, inverse=True)[:, :length]
    assert torch.allclose(back, x, rtol=0, atol=1e-5 * x.abs().max().item())


@pytest.mark.parametrize("n", [4, 16, 64, 256, 1024])
def test_full_transform_is_exact_where_the_arithmetic_is(n):
    """Small integers and N = 4^k: every butterfly sum and the 1/sqrt(N) = 2^-k product are exact, so
    the butterfly equals the dense product bit for bit."""
    g = torch.Generator().manual_seed(n)
    x = torch.randint(-8, 9, (3, n - 1), generator=g).float()
    s = random_signs(n, 1)
    u = s.double()[:, None] * torch.from_numpy(sylvester(n))
    dense = (torch.nn.functional.pad(x, (0, 1)).double() @ u) / np.sqrt(n)
    assert torch.equal(hadamard_full(x, s), dense.float())


@pytest.mark.parametrize("size", HADAMARD_SIZES)
def test_full_transform_of_one_block_is_the_blockwise_transform_bit_for_bit(size):
    x, s = randn((5, size), seed=size), random_signs(size, 3)
    assert torch.equal(hadamard_full(x, s), hadamard(x, size, s))
    assert torch.equal(hadamard_full(x, s, inverse=True), hadamard(x, size, s, inverse=True))


def test_full_transform_with_one_sign_vector_preserves_the_gemm():
    a, b = randn((32, 300), seed=1), randn((24, 300), seed=2)
    s = random_signs(512, 4)
    product = hadamard_full(a, s) @ hadamard_full(b, s).T
    assert torch.allclose(product, a @ b.T, rtol=0, atol=1e-4 * (a.abs() @ b.abs().T).max().item())


@pytest.mark.parametrize("signs", [torch.ones(48), torch.ones(64), "fixed", torch.full((512,), 2.0)])
def test_full_transform_needs_a_power_of_two_sign_vector_covering_the_dim(signs):
    with pytest.raises(ValueError, match="hadamard_full: signs|hadamard: signs"):
        hadamard_full(torch.zeros(2, 100), signs)


def test_random_signs_of_any_power_of_two_and_only_block_sizes_for_fixed():
    assert hadamard_signs(4096, "random", torch.Generator().manual_seed(0)).shape == (4096,)
    assert torch.equal(hadamard_signs(2, "none"), torch.ones(2))
    with pytest.raises(ValueError, match="size"):
        hadamard_signs(4096, "fixed")
    with pytest.raises(ValueError, match="size"):
        hadamard_signs(48, "random")
