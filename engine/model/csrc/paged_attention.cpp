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

// Blocks sit at random places in the cache; fetch the next block's row while this one is used.
template <typename T>
inline void prefetch_row(const T* row, int64_t count) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < count * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off);
}

// HEAD_DIM > 0 fixes the head size at compile time (fully unrolled inner loops); 0 reads it
// from the tensors.
template <typename T, int64_t HEAD_DIM>
void decode_attention_impl(const torch::Tensor& q, const torch::Tensor& k_cache,
                           const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                           const torch::Tensor& ctx_lens, double scale, torch::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1);
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : q.size(2);
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

  // One work item per sequence: each cached token's K (and V) row, all kv heads together, is
  // one contiguous run of memory, so blocks stream through the cache in order.
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(num_heads * head_dim), acc(num_heads * head_dim), row(token_stride);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t ctx = len_ptr[b];
      const int64_t num_blocks = (ctx + block_size - 1) / block_size;
      const int64_t* table = bt_ptr + b * max_blocks;
      scores.resize(num_heads * ctx);
      for (int64_t i = 0; i < num_heads * head_dim; ++i)
        qf[i] = to_float(q_ptr[b * num_heads * head_dim + i]) * fscale;
      for (int64_t blk = 0; blk < num_blocks; ++blk) {
        const int64_t first = blk * block_size, count = std::min(block_size, ctx - first);
        const T* key = k_ptr + table[blk] * block_size * token_stride;
        const T* next_key = k_ptr + table[std::min(blk + 1, num_blocks - 1)] * block_size * token_stride;
        for (int64_t i = 0; i < count; ++i, key += token_stride) {
          prefetch_row(next_key + i * token_stride, token_stride);
          for (int64_t j = 0; j < token_stride; ++j) row[j] = to_float(key[j]);
          for (int64_t h = 0; h < num_heads; ++h) {
            const float* qh = qf.data() + h * head_dim;
            const float* kh = row.data() + (h / group) * head_dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * kh[d];
            scores[h * ctx + first + i] = dot;
          }
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        float* s = scores.data() + h * ctx;
        const float max_score = *std::max_element(s, s + ctx);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < ctx; ++t) {  // vectorised expf (libmvec)
          s[t] = expf(s[t] - max_score);
          sum += s[t];
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t t = 0; t < ctx; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t blk = 0; blk < num_blocks; ++blk) {
        const int64_t first = blk * block_size, count = std::min(block_size, ctx - first);
        const T* value = v_ptr + table[blk] * block_size * token_stride;
        const T* next_value = v_ptr + table[std::min(blk + 1, num_blocks - 1)] * block_size * token_stride;
        for (int64_t i = 0; i < count; ++i, value += token_stride) {
          prefetch_row(next_value + i * token_stride, token_stride);
          for (int64_t j = 0; j < token_stride; ++j) row[j] = to_float(value[j]);
          for (int64_t h = 0; h < num_heads; ++h) {
            const float p = scores[h * ctx + first + i];
            const float* vh = row.data() + (h / group) * head_dim;
            float* a = acc.data() + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vh[d];
          }
        }
      }
      for (int64_t i = 0; i < num_heads * head_dim; ++i)
        out_ptr[b * num_heads * head_dim + i] = static_cast<T>(acc[i]);
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
    switch (q.size(2)) {
      case 64: decode_attention_impl<scalar_t, 64>(q, k_cache, v_cache, tables, lens, scale, out); break;
      case 128: decode_attention_impl<scalar_t, 128>(q, k_cache, v_cache, tables, lens, scale, out); break;
      default: decode_attention_impl<scalar_t, 0>(q, k_cache, v_cache, tables, lens, scale, out);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention reading K/V in place through block tables");
}
