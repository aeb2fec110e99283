// Paged decode attention on the CPU: one new token per sequence, K/V read in place from the block pool.
//
// Each (sequence, KV head) pair is one task for at::parallel_for (OpenMP threads, as many as
// torch.get_num_threads()). A task walks its sequence's blocks in table order, up to its context length, and keeps
// an online softmax for every query head of the KV head's group: a running max m, a running sum l of exp(s - m) and
// an accumulator o of exp(s - m) * v, rescaled by exp(m_old - m_new) whenever the max grows. No block is copied and
// no slot past the context is read. The same math as labkit.core.attention.decode.split_decode_attention, with the merge
// done block by block. Built by labkit/core/attention/cpp_decode.py; introduced in notebook 06.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kLanes = 8;  // independent partial sums: the compiler turns them into one vector register

// q . k over head_dim, with kLanes partial sums so it vectorises without reordering a single sum.
template <typename scalar_t, typename acc_t>
inline acc_t dot(const scalar_t* a, const scalar_t* b, int64_t d) {
  acc_t part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) part[j] += static_cast<acc_t>(a[i + j]) * static_cast<acc_t>(b[i + j]);
  acc_t sum = 0;
  for (; i < d; ++i) sum += static_cast<acc_t>(a[i]) * static_cast<acc_t>(b[i]);
  for (int64_t j = 0; j < kLanes; ++j) sum += part[j];
  return sum;
}

template <typename scalar_t, typename index_t>
void decode_kernel(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                   const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale,
                   int64_t grain_size, torch::Tensor& out) {
  using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  const int64_t batch = q.size(0), n_heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_pool.size(1), n_kv = k_pool.size(2), group = n_heads / n_kv;
  const int64_t slot_stride = n_kv * d;  // elements between two slots (tokens) of one block
  const int64_t table_stride = block_tables.stride(0);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_pool.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_pool.data_ptr<scalar_t>();
  const index_t* tables = block_tables.data_ptr<index_t>();
  const index_t* lens = context_lens.data_ptr<index_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();

  // grain_size >= batch * n_kv: one thread (the caller's choice for small work, or while another process holds a core)
  at::parallel_for(0, batch * n_kv, grain_size, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> acc(group * d), m(group), l(group), scores(block_size);  // per thread, reused per task
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / n_kv, kv = task % n_kv;
      const int64_t ctx = lens[b];
      const scalar_t* q_group = q_ptr + (b * n_heads + kv * group) * d;  // (group, d): heads kv*group ...
      std::fill(acc.begin(), acc.end(), acc_t(0));
      std::fill(m.begin(), m.end(), -std::numeric_limits<acc_t>::infinity());
      std::fill(l.begin(), l.end(), acc_t(0));
      for (int64_t j = 0; j * block_size < ctx; ++j) {
        const int64_t block = tables[b * table_stride + j];
        const int64_t n_valid = std::min(block_size, ctx - j * block_size);  // slots holding context
        const scalar_t* k_block = k_ptr + block * block_size * slot_stride + kv * d;  // slot t at + t * slot_stride
        const scalar_t* v_block = v_ptr + block * block_size * slot_stride + kv * d;
        for (int64_t g = 0; g < group; ++g) {
          const scalar_t* qg = q_group + g * d;
          acc_t block_max = -std::numeric_limits<acc_t>::infinity();
          for (int64_t t = 0; t < n_valid; ++t) {
            scores[t] = dot<scalar_t, acc_t>(qg, k_block + t * slot_stride, d) * static_cast<acc_t>(scale);
            block_max = std::max(block_max, scores[t]);
          }
          const acc_t new_m = std::max(m[g], block_max);  // finite: every block holds >= 1 context slot
          const acc_t rescale = std::exp(m[g] - new_m);  // exp(-inf) = 0 on the first block
          acc_t* o = acc.data() + g * d;
          for (int64_t i = 0; i < d; ++i) o[i] *= rescale;
          acc_t sum = l[g] * rescale;
          for (int64_t t = 0; t < n_valid; ++t) {
            const acc_t p = std::exp(scores[t] - new_m);
            sum += p;
            const scalar_t* vt = v_block + t * slot_stride;
            for (int64_t i = 0; i < d; ++i) o[i] += p * static_cast<acc_t>(vt[i]);
          }
          l[g] = sum;
          m[g] = new_m;
        }
      }
      scalar_t* out_group = out_ptr + (b * n_heads + kv * group) * d;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < d; ++i) out_group[g * d + i] = static_cast<scalar_t>(acc[g * d + i] / l[g]);
    }
  });
}

template <typename index_t>
void check_tables(const torch::Tensor& block_tables, const torch::Tensor& context_lens, int64_t num_blocks,
                  int64_t block_size) {
  const index_t* tables = block_tables.data_ptr<index_t>();
  const index_t* lens = context_lens.data_ptr<index_t>();
  const int64_t width = block_tables.size(1), stride = block_tables.stride(0);
  for (int64_t b = 0; b < block_tables.size(0); ++b) {
    const int64_t ctx = lens[b], n_blocks = (ctx + block_size - 1) / block_size;
    TORCH_CHECK(ctx >= 1, "context_lens[", b, "] = ", ctx, ": every decode holds at least one token");
    TORCH_CHECK(n_blocks <= width, "context_lens[", b, "] = ", ctx, " needs ", n_blocks, " blocks of ", block_size,
                " but block_tables has ", width, " columns");
    for (int64_t j = 0; j < n_blocks; ++j) {
      const int64_t block = tables[b * stride + j];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block_tables[", b, ", ", j, "] = ", block,
                  " is outside the pool's ", num_blocks, " blocks");
    }
  }
}

}  // namespace

// q (B, n_heads, d), k_pool / v_pool (num_blocks, block_size, n_kv, d), block_tables (B, W), context_lens (B,)
// -> (B, n_heads, d); grain_size: the fewest (sequence, KV head) tasks one thread takes (at::parallel_for's)
torch::Tensor paged_decode(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                           const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale,
                           int64_t grain_size) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.dim() == 4, "q must be (B, n_heads, d) and the pools "
              "(num_blocks, block_size, n_kv_heads, d)");
  TORCH_CHECK(q.device().is_cpu() && k_pool.device().is_cpu() && v_pool.device().is_cpu() &&
              block_tables.device().is_cpu() && context_lens.device().is_cpu(), "the C++ decode kernel runs on the CPU");
  TORCH_CHECK(k_pool.sizes() == v_pool.sizes(), "k_pool and v_pool must have the same shape");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(),
              "q, k_pool and v_pool must have the same dtype");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kFloat64,
              "the C++ decode kernel takes float32 or float64, got ", q.scalar_type());
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous(), "q and the pools must be "
              "contiguous");
  TORCH_CHECK(q.size(2) == k_pool.size(3), "q's head_dim ", q.size(2), " differs from the pool's ", k_pool.size(3));
  // Checked before anything divides by them: an empty block or no KV head would be an integer division by zero
  // (SIGFPE, which kills the Python process, not an exception) in the two checks below.
  TORCH_CHECK(k_pool.size(1) >= 1 && k_pool.size(2) >= 1, "the pools need block_size >= 1 and n_kv_heads >= 1, got ",
              k_pool.size(1), " and ", k_pool.size(2));
  TORCH_CHECK(q.size(1) % k_pool.size(2) == 0, "n_heads ", q.size(1), " is not a multiple of n_kv_heads ",
              k_pool.size(2));
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && block_tables.stride(1) == 1,
              "block_tables must be (B, max_blocks) with contiguous rows");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == q.size(0) && context_lens.is_contiguous(),
              "context_lens must be a contiguous (B,) tensor");
  TORCH_CHECK(grain_size >= 1, "grain_size must be at least 1, got ", grain_size);
  TORCH_CHECK(block_tables.scalar_type() == context_lens.scalar_type() &&
              (block_tables.scalar_type() == torch::kInt32 || block_tables.scalar_type() == torch::kInt64),
              "block_tables and context_lens must both be int32 or both int64");
  auto out = torch::empty_like(q);
  const bool int32 = block_tables.scalar_type() == torch::kInt32;
  if (int32) check_tables<int32_t>(block_tables, context_lens, k_pool.size(0), k_pool.size(1));
  else check_tables<int64_t>(block_tables, context_lens, k_pool.size(0), k_pool.size(1));
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "paged_decode", [&] {
    if (int32) decode_kernel<scalar_t, int32_t>(q, k_pool, v_pool, block_tables, context_lens, scale, grain_size, out);
    else decode_kernel<scalar_t, int64_t>(q, k_pool, v_pool, block_tables, context_lens, scale, grain_size, out);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Paged decode attention, K/V read in place (labkit, notebook 06)");
}
