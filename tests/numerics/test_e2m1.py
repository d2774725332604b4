"""E2M1 element cast, packing and decoding: bit-exact against torchao 0.18 and an independent RNE."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4lab.numerics import e2m1
from tests._refs import (
    E2M1_GRID,
    E2M1_VALUES,
    e2m1_rne,
    f32_to_f4_unpacked,
    float32_neighbours,
    pack_uint4,
    unpack_uint4,
)

MIDPOINTS = tuple((a + b) / 2 for a, b in pairwise(E2M1_GRID))


def both_signs(values) -> torch.Tensor:
    v = torch.tensor(values, dtype=torch.float32)
    return torch.cat((v, -v))


def assert_codes_match_torchao(x: torch.Tensor) -> None:
    ours = e2m1.encode_rne(x)
    theirs = f32_to_f4_unpacked(x)
    independent = torch.from_numpy(e2m1_rne(x.numpy()))
    bad = ours != theirs
    assert not bad.any(), f"{int(bad.sum())} codes differ from torchao, e.g. x={x[bad][:5].tolist()}"
    assert torch.equal(ours, independent)


def test_every_grid_value_encodes_to_its_code():
    x = both_signs(E2M1_GRID)
    codes = e2m1.encode_rne(x)
    assert codes.tolist() == list(range(16))
    assert_codes_match_torchao(x)


@pytest.mark.parametrize(
    ("tie", "expected_code"),
    [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)],
)
def test_midpoint_ties_go_to_the_even_code(tie, expected_code):
    x = torch.tensor([tie, -tie])
    assert e2m1.encode_rne(x).tolist() == [expected_code, expected_code | 0x8]
    assert_codes_match_torchao(x)


def test_all_midpoints_both_signs_match_torchao():
    assert_codes_match_torchao(both_signs(MIDPOINTS))


def test_one_ulp_either_side_of_every_midpoint_and_grid_value():
    points = float32_neighbours(MIDPOINTS + E2M1_GRID, 256)
    x = torch.from_numpy(points)
    assert_codes_match_torchao(torch.cat((x, -x)))
    # just above a tie always rounds up, just below always down
    for m, (lo, hi) in zip(MIDPOINTS, zip(range(8), range(1, 8))):
        up = np.nextafter(np.float32(m), np.float32(10))
        down = np.nextafter(np.float32(m), np.float32(-10))
        assert e2m1.encode_rne(torch.tensor([up, down])).tolist() == [hi, lo]


def test_signed_zero_and_tiny_values():
    x = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 2.0**-126, -(2.0**-126), 1e-30, -1e-30, 0.2499999, -0.2499999])
    codes = e2m1.encode_rne(x)
    # -0.0 and tiny negatives keep the sign bit (0x8), as torchao and the hardware do
    assert codes.tolist() == [0, 8, 0, 8, 0, 8, 0, 8, 0, 8]
    assert_codes_match_torchao(x)


def test_values_beyond_six_saturate():
    x = both_signs([6.0, 6.0000005, 6.5, 7.0, 8.0, 100.0, 1e30, float(np.finfo(np.float32).max)])
    codes = e2m1.encode_rne(x)
    assert codes.tolist() == [7] * 8 + [15] * 8
    assert_codes_match_torchao(x)


def test_inf_saturates_and_nan_encodes_as_zero_magnitude():
    codes = e2m1.encode_rne(torch.tensor([float("inf"), float("-inf"), float("nan")]))
    assert codes[:2].tolist() == [7, 15]
    assert int(codes[2]) & 0x7 == 0


def test_all_bf16_bit_patterns():
    """Every finite bf16 value (as float32), and the same values scaled into +-8 by powers of two
    and by (1 + 2^-9), which adds mantissa bits below bf16 precision."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16).float()
    x = x[torch.isfinite(x)]
    assert_codes_match_torchao(x)
    small = x[(x.abs() < 8) & (x.abs() > 2.0**-20)]
    assert_codes_match_torchao(small * np.float32(1 + 2.0**-9))
    assert_codes_match_torchao(small * np.float32(1 - 2.0**-10))


def test_dense_sweep_of_float32_in_plus_minus_eight():
    """A float32 sweep with every mantissa pattern of its top 16 bits, exponents 2^-4 .. 2^2."""
    exps = torch.arange(127 - 4, 127 + 3, dtype=torch.int32)
    mants = torch.arange(0, 1 << 16, dtype=torch.int32) << 7
    bits = (exps[:, None] << 23) | mants[None, :]
    x = bits.flatten().view(torch.float32)
    assert float(x.max()) < 8
    assert_codes_match_torchao(torch.cat((x, -x)))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=-8, max_value=8, width=32, allow_subnormal=True), min_size=1, max_size=64))
def test_hypothesis_floats(values):
    assert_codes_match_torchao(torch.tensor(values, dtype=torch.float32))


def test_known_packed_vector():
    codes = e2m1.encode_rne(torch.tensor([0.0, 0.5, 4.0, -0.0]))
    packed = e2m1.pack(codes)
    assert packed.tolist() == [0b00010000, 0b10000110]
    assert torch.equal(packed, pack_uint4(codes))


def test_pack_matches_torchao_on_every_nibble_pair():
    lo = torch.arange(16, dtype=torch.uint8).repeat_interleave(16)
    hi = torch.arange(16, dtype=torch.uint8).repeat(16)
    codes = torch.stack((lo, hi), dim=-1).flatten()  # element 2i = lo, 2i+1 = hi
    packed = e2m1.pack(codes)
    assert packed.dtype == torch.uint8
    assert torch.equal(packed, lo | (hi << 4))
    assert torch.equal(packed, pack_uint4(codes))
    assert torch.equal(e2m1.unpack(packed), codes)
    assert torch.equal(unpack_uint4(packed.contiguous()), codes)


def test_pack_unpack_multidim_round_trip():
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = e2m1.pack(codes)
    assert packed.shape == (3, 5, 32)
    assert torch.equal(packed, pack_uint4(codes))
    assert torch.equal(e2m1.unpack(packed), codes)


def test_decode_table():
    table = e2m1.decode(torch.arange(16, dtype=torch.uint8))
    assert table.dtype == torch.float32
    assert table.tolist() == list(E2M1_VALUES)
    assert torch.signbit(table[8])  # code 0x8 is -0.0
    # only the low nibble matters
    assert torch.equal(e2m1.decode(torch.arange(16, dtype=torch.uint8) | 0xA0), table)


def test_decode_matches_torchao_and_inverts_encode_on_the_grid():
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32

    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(e2m1.decode(codes), f4_unpacked_to_f32(codes))
    assert torch.equal(e2m1.encode_rne(e2m1.decode(codes)), codes)


def test_encode_grid_equals_encode_rne_on_every_grid_value():
    from fp4lab.numerics.e2m1 import E2M1_GRID, encode_grid, encode_rne

    grid = torch.tensor(E2M1_GRID + tuple(-v for v in E2M1_GRID), dtype=torch.float32)
    assert torch.equal(encode_grid(grid), encode_rne(grid))  # -0.0 keeps its sign bit: code 0x8
    assert encode_grid(torch.tensor([-0.0])).item() == 0x8
    g = torch.Generator().manual_seed(3)
    on_grid = grid[torch.randint(len(grid), (4096,), generator=g)]
    assert torch.equal(encode_grid(on_grid), encode_rne(on_grid))
