// Decode attention over a paged KV cache, for the CPU.
//
// One query token per sequence attends to that sequence's first ctx_lens[b] cached tokens,
// read in place through its block table: no gathered copy of the KV is made. Work is split
// over (sequence, kv head); every query head of a GQA group shares one pass over the keys.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

template <typename T>
void decode_attention_impl(const torch::Tensor& q, const torch::Tensor& k_cache,
                           const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                           const torch::Tensor& ctx_lens, double scale, torch::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  const int64_t* bt_ptr = block_tables.data_ptr<int64_t>();
  const int64_t* len_ptr = ctx_lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t token_stride = num_kv_heads * head_dim;
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(group * head_dim), acc(group * head_dim);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / num_kv_heads, kvh = work % num_kv_heads;
      const int64_t ctx = len_ptr[b];
      scores.assign(group * ctx, 0.f);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          qf[g * head_dim + d] = to_float(q_ptr[(b * num_heads + kvh * group + g) * head_dim + d]) * fscale;
      const int64_t* table = bt_ptr + b * max_blocks;
      for (int64_t t = 0; t < ctx; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const T* key = k_ptr + slot * token_stride + kvh * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float dot = 0.f;
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * to_float(key[d]);
          scores[g * ctx + t] = dot;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * ctx;
        const float max_score = *std::max_element(s, s + ctx);
        float sum = 0.f;
        for (int64_t t = 0; t < ctx; ++t) { s[t] = std::exp(s[t] - max_score); sum += s[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < ctx; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < ctx; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const T* value = v_ptr + slot * token_stride + kvh * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * ctx + t];
          float* a = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * to_float(value[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          out_ptr[(b * num_heads + kvh * group + g) * head_dim + d] = static_cast<T>(acc[g * head_dim + d]);
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor ctx_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "expected q [B, H, D] and k/v cache [blocks, block_size, kv_heads, D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q and the caches must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && ctx_lens.scalar_type() == torch::kInt64,
              "block_tables and ctx_lens must be int64");
  auto tables = block_tables.contiguous();
  auto lens = ctx_lens.contiguous();
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_impl<scalar_t>(q, k_cache, v_cache, tables, lens, scale, out);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention reading K/V in place through block tables");
}
