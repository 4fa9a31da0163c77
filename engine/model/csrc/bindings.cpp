// The Python module of the CPU kernels: paged decode and prefill attention, the fused token-wise ops and
// linear layers on panel-packed weights (with AVX-512: fp32, and bf16 with avx512_bf16, on AMX tiles with amx_bf16).
#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor ctx_lens, double scale);
torch::Tensor paged_decode_attention_write(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                                           torch::Tensor v_cache, torch::Tensor slots, torch::Tensor block_tables,
                                           torch::Tensor ctx_lens, double scale);
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_table, int64_t start_pos, double scale, int64_t tile_size);
bool tiled_prefill();
torch::Tensor add_rms_norm(torch::Tensor hidden, c10::optional<torch::Tensor> delta, torch::Tensor weight,
                           double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor row_argmax(torch::Tensor logits);
std::vector<std::string> panel_linear_dtypes();
bool panel_linear_amx();
torch::Tensor pack_panels(torch::Tensor weight);
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features, c10::optional<torch::Tensor> bias);
torch::Tensor pack_gated_panels(torch::Tensor gate_up);
torch::Tensor panel_silu_mul(torch::Tensor x, torch::Tensor packed, int64_t intermediate,
                             c10::optional<torch::Tensor> bias);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> rope(torch::Tensor qkv, torch::Tensor positions,
                                                             torch::Tensor cos, torch::Tensor sin, int64_t num_q_heads,
                                                             int64_t num_kv_heads);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention reading K/V in place through block tables");
  m.def("paged_decode_attention_write", &paged_decode_attention_write,
        "a decode step's new K/V written into their slots, then paged_decode_attention");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "one sequence's chunk attended to its cached prefix, in tiles of queries; each token the same bits as "
        "paged_decode_attention gives it");
  // whether paged_prefill_attention tiles head sizes 16/32/64/128 (else every token runs through the decode kernel)
  m.attr("tiled_prefill") = tiled_prefill();
  m.def("add_rms_norm", &add_rms_norm, "hidden += delta (if given) in place, then RMSNorm(hidden)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [rows, 2I] gate and up side by side");
  m.def("row_argmax", &row_argmax, "each fp32 row's first maximum (a NaN first), as torch's max(dim=-1).indices");
  m.attr("panel_linear_dtypes") = panel_linear_dtypes();  // the dtypes panel_linear runs in here
  m.attr("panel_linear_amx") = panel_linear_amx();  // whether bf16 panels run on AMX tiles (K a multiple of 32)
  m.def("pack_panels", &pack_panels, "a [out, in] weight in panel_linear's panels");
  m.def("panel_linear", &panel_linear, "x @ W^T (+ bias) on a packed weight; a row's bits never depend on the rows "
        "beside it");
  m.def("pack_gated_panels", &pack_gated_panels, "stacked [gate; up] weights in panel_silu_mul's pairs of panels");
  m.def("panel_silu_mul", &panel_silu_mul, "silu(gate) * up of x times gated panels: panel_linear then silu_mul in "
        "one pass, with their bits");
  m.def("rope", &rope, "rotate-half RoPE of the q and k heads of the fused qkv as heads; returns q, k and v (a view)");
}
