"""A linear layer gives a row the same bits however many rows share the product.

This is what batch invariance rests on: a request decoding alone runs its linear layers on
one row, the same request in a batch on many. (The products here are the engine's: the CPU
kernel's on panels where it is built, else oneDNN's.) On a CPU with avx512_bf16 and no AMX (an AMD
EPYC), oneDNN's one-row path rounded SmolLM2's down projection differently from the same
row among others, for real activations (random ones did not show it), and a greedy request
alone drifted from the same request batched after 7 tokens. The activations here are the
real ones, captured from a forward over a real prompt. The gate and up projections are one
product ending in silu(gate) * up (`gated_linear`), held to the same.
"""

import pytest
import torch

import pdserve.engine.model.llama as llama
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model.fused import silu_mul
from pdserve.engine.model.linear import PanelWeight, cpu_has_amx

PRODUCTS = ("linear", "gated_linear")  # the model's products: llama.linear, llama.gated_linear


def capture_products(llm: LLM) -> list[tuple]:
    """(product, x, weight, bias) of every product of a short greedy generation, `product`
    the function (of PRODUCTS) that ran it."""
    captured = []
    originals = {name: getattr(llama, name) for name in PRODUCTS}

    def capturing(product):
        def capture(x, weight, bias=None):
            captured.append((product, x.clone(), weight, bias))
            return product(x, weight, bias)
        return capture

    for name, product in originals.items():
        setattr(llama, name, capturing(product))
    try:
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        llm.generate(["Write a poem about autumn leaves."], params)
    finally:
        for name, product in originals.items():
            setattr(llama, name, product)
    return captured


def unpacked(weight: PanelWeight) -> torch.Tensor:
    """A PanelWeight's `[out, in]` weight (`[panels, in / u, 48, u]` back; a gated one's pairs
    of panels back to the gate projection stacked over the up projection)."""
    def plain(panels, out_features):
        return panels.transpose(1, 2).reshape(-1, weight.in_features)[:out_features]
    if weight.gated:
        half = weight.out_features // 2
        return torch.cat([plain(weight.panels[0::2], half), plain(weight.panels[1::2], half)]).contiguous()
    return plain(weight.panels, weight.out_features).contiguous()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_row_gets_the_same_bits_alone_and_among_others(smollm2_dir, dtype):
    llm = LLM(str(smollm2_dir), max_model_len=128, dtype=dtype)
    captured = capture_products(llm)
    decode_calls = [c for c in captured if c[1].shape[0] == 1]
    assert len(decode_calls) >= 2 * 4 * llm.engine.loaded.shape.num_layers  # every layer's 4 products, 2 steps
    generator = torch.Generator().manual_seed(0)
    mismatched = []
    for index, (product, row, weight, bias) in enumerate(decode_calls):
        alone = product(row, weight, bias)
        others = torch.randn(63, row.shape[1], generator=generator).to(row.dtype)
        for batch in (torch.cat([row, others[:1]]), torch.cat([others[:4], row]), torch.cat([others, row])):
            position = 0 if batch[0].equal(row[0]) else batch.shape[0] - 1
            if not torch.equal(product(batch, weight, bias)[position], alone[0]):
                plain = isinstance(weight, torch.Tensor) and weight.layout == torch.strided
                mismatched.append((index, tuple(weight.shape) if plain else "packed", batch.shape[0]))
    assert not mismatched, f"{len(mismatched)} (call, weight, rows) differing from the row alone: {mismatched[:5]}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cpu_kernels_products_give_onednns_bits_on_real_activations(smollm2_dir, dtype):
    """Where weights are PanelWeights (AVX-512, and avx512_bf16 for bf16; not bf16 on AMX), every
    product of a real prefill and decode gives the bits oneDNN's packed product gives the same
    rows (at 2 rows or more, its path for one row rounds otherwise), and the gated gate/up
    product the bits of oneDNN's followed by silu_mul: a worker without the kernels computes
    what one with them does."""
    if dtype == "bfloat16" and cpu_has_amx():
        pytest.skip("bf16 runs on AMX tiles here, whose bits are not the AVX-512 panels' "
                    "(tests/unit/test_panel_linear.py)")
    llm = LLM(str(smollm2_dir), max_model_len=128, dtype=dtype)
    captured = [c for c in capture_products(llm) if isinstance(c[2], PanelWeight)]
    if not captured:
        pytest.skip(f"{dtype} weights are not PanelWeights on this CPU")
    assert sum(weight.gated for _, _, weight, _ in captured) >= 2 * llm.engine.loaded.shape.num_layers
    mismatched = []
    for index, (product, x, weight, bias) in enumerate(captured):
        rows = x if x.shape[0] >= 2 else torch.cat([x, x])
        expected = torch.ops.mkldnn._linear_pointwise(rows, torch.ops.mkldnn._reorder_linear_weight(unpacked(weight)),
                                                      bias, "none", [], "")[:x.shape[0]]
        if weight.gated:  # oneDNN's product, then the kernel's silu_mul
            expected = silu_mul(expected)
        if not torch.equal(product(x, weight, bias), expected):
            mismatched.append((index, x.shape[0], weight.out_features, weight.in_features))
    assert len(captured) >= 2 * 4 * llm.engine.loaded.shape.num_layers
    assert not mismatched, f"{len(mismatched)} products differing from oneDNN's: {mismatched[:5]}"
