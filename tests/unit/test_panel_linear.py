"""The CPU kernel's linear layer on panels (csrc/panel_linear.cpp, engine.model.linear.PanelWeight),
in bf16 and fp32: a row's bits never depend on the rows beside it, and on AVX-512 (vdpbf16ps,
FMAs) they are oneDNN's bits; its gated form (SwiGLU's gate and up, then silu(gate) * up) gives
the bits of the product followed by silu_mul. With AMX, bf16 panels run on tiles (panel_amx.h),
whose bits are the tiles' own: there the tests hold their invariance and their accuracy."""

import pytest
import torch

from pdserve.engine.model.kernels import cpu_kernels
from pdserve.engine.model.linear import PanelWeight, cpu_has_amx, gated_linear, linear, pack, pack_gated

KERNELS = cpu_kernels()
DTYPES = [pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
              KERNELS is None or "bfloat16" not in KERNELS.panel_linear_dtypes, reason="needs avx512_bf16")),
          pytest.param(torch.float32, marks=pytest.mark.skipif(
              KERNELS is None or "float32" not in KERNELS.panel_linear_dtypes, reason="needs AVX-512"))]

AMX = KERNELS is not None and KERNELS.panel_linear_amx
# the dtypes whose panels give oneDNN's bits: not bf16 on a CPU with AMX, where oneDNN's bf16
# products run on tiles (and so do the panels, unless the kernels were built without AMX)
ONEDNN_DTYPES = [DTYPES[0] if not cpu_has_amx() else pytest.param(torch.bfloat16, marks=pytest.mark.skip(
                     reason="bf16 runs on AMX tiles here, whose bits are not the AVX-512 panels'")), DTYPES[1]]

# SmolLM2-135M's products: qkv, o, gate_up, down; then shapes whose outputs end mid-panel
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (100, 64), (17, 2080)]


def onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """oneDNN's product on a packed weight, at 2 rows or more (its 1-row path differs)."""
    assert x.shape[0] >= 2
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def order_revealing(out_features: int, in_features: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Weights whose sums depend on their order: per row, +2^24 and -2^24 at random places
    and 1s at 60 others. With inputs of 1, a 1 added while 2^24 is in a partial sum is lost,
    so any other grouping of the products gives another result."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.zeros(out_features, in_features)
    for row in w:
        places = torch.randperm(in_features, generator=gen)
        row[places[0]], row[places[1]] = 2.0**24, -(2.0**24)
        row[places[2:62]] = 1.0
    return w.to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("dtype", ONEDNN_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [2, 3, 9, 17, 64, 65, 130])
def test_rows_get_onednns_bits(shape, rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(*shape, generator=gen) * 0.05).to(dtype)
    x = torch.randn(rows, shape[1], generator=gen).to(dtype)
    packed = pack(weight)
    assert isinstance(packed, PanelWeight)
    assert torch.equal(bits(linear(x, packed)), bits(onednn(x, weight)))


@pytest.mark.parametrize("dtype", ONEDNN_DTYPES)
@pytest.mark.parametrize("in_features", [64, 576, 1024, 1040, 1536, 2080, 4096])
def test_the_summation_order_is_onednns(in_features, dtype):
    """512-input blocks up to 1,024 inputs, 1,024-input blocks beyond, the blocks' sums added
    in order: weights built so that any other order gives other sums tell it apart."""
    weight = order_revealing(64, in_features, seed=in_features, dtype=dtype)
    x = torch.ones(2, in_features).to(dtype)
    assert torch.equal(bits(linear(x, pack(weight))), bits(onednn(x, weight)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(dtype):
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(3072, 576, generator=gen) * 0.05).to(dtype)
    x = torch.randn(137, 576, generator=gen).to(dtype)
    packed = pack(weight)
    together = linear(x, packed)
    # alone, in tiles cut elsewhere (of 8 rows; of 16 and 32 with AMX), sharing chunks (up to 64
    # rows), tile by tile (more), all
    for start, stop in [(0, 1), (5, 6), (3, 11), (0, 16), (0, 17), (15, 48), (0, 37), (20, 37), (0, 64), (1, 66),
                        (0, 137)]:
        assert torch.equal(bits(linear(x[start:stop], packed)), bits(together[start:stop]))


@pytest.mark.parametrize("dtype", ONEDNN_DTYPES)
def test_bias_is_added_before_rounding_as_onednn_adds_it(dtype):
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(100, 576, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(100, generator=gen).to(dtype)
    x = torch.randn(5, 576, generator=gen).to(dtype)
    assert torch.equal(bits(linear(x, pack(weight), bias)), bits(onednn(x, weight, bias)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_leading_dimensions_and_no_rows(dtype):
    weight = torch.randn(100, 64).to(dtype)
    packed = pack(weight)
    x = torch.randn(2, 3, 64).to(dtype)
    assert torch.equal(linear(x, packed), linear(x.reshape(6, 64), packed).view(2, 3, 100))
    assert linear(torch.empty(0, 64, dtype=dtype), packed).shape == (0, 100)


@pytest.mark.parametrize("dtype", DTYPES[:1])
def test_what_it_cannot_take_is_named(dtype):
    with pytest.raises(RuntimeError, match="even number of input features"):
        KERNELS.pack_panels(torch.randn(4, 5).bfloat16())
    assert not isinstance(pack(torch.randn(4, 5).bfloat16()), PanelWeight)  # oneDNN takes it instead
    with pytest.raises(RuntimeError, match="does not take rows of 32"):
        KERNELS.panel_linear(torch.randn(2, 32).bfloat16(), pack(torch.randn(4, 64).bfloat16()).panels, 4, None)
    with pytest.raises(RuntimeError, match="does not take rows of 64 Float"):  # panels of another dtype
        KERNELS.panel_linear(torch.randn(2, 64), pack(torch.randn(4, 64).bfloat16()).panels, 4, None)
    with pytest.raises(RuntimeError, match="runs in this build's dtypes only"):
        KERNELS.pack_panels(torch.randn(4, 64).half())


# (intermediate, in_features): SmolLM2-135M's MLP; intermediates ending mid-panel and mid-vector,
# and in_features past one K block
GATED_SHAPES = [(1536, 576), (50, 64), (100, 2080), (17, 1040)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GATED_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_gated_product_gives_the_product_then_silu_mul_bits(shape, with_bias, dtype):
    intermediate, in_features = shape
    gen = torch.Generator().manual_seed(intermediate)
    gate_up = (torch.randn(2 * intermediate, in_features, generator=gen) * 0.1).to(dtype)
    bias = torch.randn(2 * intermediate, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(130, in_features, generator=gen).to(dtype)
    gated, plain = pack_gated(gate_up), pack(gate_up)
    assert isinstance(gated, PanelWeight) and gated.gated
    for rows in (1, 2, 9, 64, 65, 130):  # one tile, shared chunks (up to 64 rows), tile by tile
        expected = KERNELS.silu_mul(linear(x[:rows], plain, bias))
        assert torch.equal(bits(gated_linear(x[:rows], gated, bias)), bits(expected)), rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_gated_bits_do_not_depend_on_the_rows_beside_it(dtype):
    gen = torch.Generator().manual_seed(2)
    gated = pack_gated((torch.randn(3072, 576, generator=gen) * 0.05).to(dtype))
    x = torch.randn(137, 576, generator=gen).to(dtype)
    together = gated_linear(x, gated)
    for start, stop in [(0, 1), (5, 6), (3, 11), (0, 64), (1, 66), (0, 137)]:
        assert torch.equal(bits(gated_linear(x[start:stop], gated)), bits(together[start:stop]))


@pytest.mark.parametrize("dtype", DTYPES[:1])
def test_what_the_gated_product_cannot_take_is_named(dtype):
    gated = pack_gated(torch.randn(200, 64).bfloat16())
    with pytest.raises(RuntimeError, match=r"the bias must be \[2 \* 100\]"):
        KERNELS.panel_silu_mul(torch.randn(2, 64).bfloat16(), gated.panels, 100, torch.randn(100))
    with pytest.raises(RuntimeError, match="does not take rows of 32"):
        KERNELS.panel_silu_mul(torch.randn(2, 32).bfloat16(), gated.panels, 100, None)
    with pytest.raises(RuntimeError, match="takes pack_gated_panels' pairs"):
        KERNELS.panel_silu_mul(torch.randn(2, 64).bfloat16(), pack(torch.randn(100, 64).bfloat16()).panels, 50, None)
    with pytest.raises(RuntimeError, match="stacked"):
        KERNELS.pack_gated_panels(torch.randn(201, 64).bfloat16())
    with pytest.raises(AssertionError, match="runs in gated_linear"):
        linear(torch.randn(2, 64).bfloat16(), gated)


@pytest.mark.skipif(not AMX, reason="needs AMX (amx_bf16, granted by the kernel)")
@pytest.mark.parametrize("shape", SHAPES)
def test_amx_products_are_exact_products_summed_in_fp32(shape):
    """On tiles, each output is its exact bf16 products summed in fp32 (then rounded to bf16),
    bias added before rounding: within fp32 summation error of the float64 sum, in every
    output, at row counts on and off the tiles' 16 and 32."""
    gen = torch.Generator().manual_seed(shape[0])
    weight = (torch.randn(*shape, generator=gen) * 0.05).bfloat16()
    bias = torch.randn(shape[0], generator=gen).bfloat16()
    x = torch.randn(70, shape[1], generator=gen).bfloat16()
    exact = x.double() @ weight.double().T + bias.double()
    bound = shape[1] * 2.0**-23 * (x.double().abs() @ weight.double().abs().T)  # fp32 summation error
    for rows in (1, 16, 33, 70):
        out = linear(x[:rows], pack(weight), bias).double()
        rounding = exact[:rows].abs() * 2.0**-8 + bound[:rows]  # bf16's half ulp, then the sums' error
        assert ((out - exact[:rows]).abs() <= rounding).all(), rows


def vdpbf16ps_sums(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the AVX-512 bf16 panels compute, in torch: per output, each input pair's products
    (exact in fp32) added in turn, the pair's second first (vdpbf16ps' order), within blocks of
    512 inputs (1,024 past 1,024 inputs) whose sums are added in order; rounded to bf16."""
    xf, wf = x.float(), weight.float()
    inputs = x.shape[1]
    block = 512 if inputs <= 1024 else 1024
    total = None
    for k0 in range(0, inputs, block):
        acc = torch.zeros(x.shape[0], weight.shape[0])
        for k in range(k0, min(inputs, k0 + block), 2):
            acc = acc + xf[:, k + 1, None] * wf[None, :, k + 1]
            acc = acc + xf[:, k, None] * wf[None, :, k]
        total = acc if total is None else total + acc
    return total.bfloat16()


@pytest.mark.skipif(not AMX, reason="needs AMX (amx_bf16, granted by the kernel)")
def test_amx_sums_all_of_k_on_the_tiles():
    """On tiles, each output sums its products in one fp32 chain over all of K, with no K
    blocks: 2^24, then 1 (lost to rounding beside 2^24), then -2^24 give 0, at any row count.
    In the AVX-512 path's blocks of 512 inputs (2^24 in the first; 1 - 2^24, exact, in the
    second) the same products give 1."""
    inputs = 1024
    weight = torch.zeros(48, inputs)
    weight[:, 0], weight[:, 600], weight[:, 700] = 2.0**24, 1.0, -(2.0**24)
    x = torch.zeros(40, inputs)
    x[:, [0, 600, 700]] = 1.0
    weight, x = weight.bfloat16(), x.bfloat16()
    assert (vdpbf16ps_sums(x[:1], weight) == 1).all()  # the blocks' order would show
    for rows in (1, 16, 40):
        assert (linear(x[:rows], pack(weight)) == 0).all(), rows


@pytest.mark.skipif(not AMX, reason="needs AMX (amx_bf16, granted by the kernel)")
def test_amx_takes_weights_whose_inputs_fill_its_tiles():
    """A bf16 weight runs on tiles when its inputs are a multiple of a tile's 32, else on
    vdpbf16ps (whose order vdpbf16ps_sums follows): by its shape, never by the rows."""
    for inputs, tiles in ((578, False), (576, True)):
        weight = order_revealing(96, inputs, seed=inputs)  # any other order of the sums shows
        x = torch.ones(9, inputs).bfloat16()
        out = linear(x, pack(weight))
        assert torch.equal(bits(out), bits(vdpbf16ps_sums(x, weight))) != tiles, inputs
        assert torch.equal(bits(linear(x[:1], pack(weight))), bits(out[:1]))
