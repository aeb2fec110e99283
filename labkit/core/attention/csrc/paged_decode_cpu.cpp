// Paged decode attention on the CPU: one new token per sequence, K/V read in place from the block pool.
//
// Each (sequence, KV head, split) triple is one task for at::parallel_for (OpenMP threads, as many as
// torch.get_num_threads()). A split is a contiguous run of the sequence's blocks (split-KV flash decoding, notebook
// 11's shape): at batch 1 a model with 3 KV heads has 3 tasks, which 2 threads would share 2 to 1; cut in two splits
// each, 6 tasks share 3 to 3, and a long context is read by every thread at once. A task walks its blocks in table
// order and keeps an online softmax for every query head of the KV head's group: a running max m, a running sum l
// of exp(s - m) and an accumulator o of exp(s - m) * v, rescaled by exp(m_old - m_new) whenever the max grows. With
// one split it writes o / l; with several, each split's (m, l, o) is merged per (sequence, head) afterwards:
// weights exp(m - M) with M the largest m, output sum(w * o) / sum(w * l) (the log-sum-exp rule of notebook 06).
// No block is copied and no slot past the context is read. With AVX-512 (compiled -march=native), float32 blocks of a
// head_dim that is a multiple of 16 run the same steps on 16-lane vectors (attend_block_avx512); elsewhere plain loops.
// Built by labkit/core/attention/cpp_decode.py; introduced in notebook 06.
#include <torch/extension.h>

#include "exp_f32.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPrefetchBlocks = 4;  // blocks whose rows are asked for ahead of use
constexpr int64_t kDotLanes = 8;  // independent partial sums: the compiler turns them into one vector register

// q . k over head_dim, with kDotLanes partial sums so it vectorises, added pairwise at the end (a chain of kDotLanes
// scalar adds would cost more than the products).
template <typename scalar_t, typename acc_t>
inline acc_t dot(const scalar_t* a, const scalar_t* b, int64_t d) {
  acc_t part[kDotLanes] = {};
  int64_t i = 0;
  for (; i + kDotLanes <= d; i += kDotLanes)
    for (int64_t j = 0; j < kDotLanes; ++j) part[j] += static_cast<acc_t>(a[i + j]) * static_cast<acc_t>(b[i + j]);
  acc_t sum = 0;
  for (; i < d; ++i) sum += static_cast<acc_t>(a[i]) * static_cast<acc_t>(b[i]);
  for (int64_t width = kDotLanes / 2; width > 0; width /= 2)
    for (int64_t j = 0; j < width; ++j) part[j] += part[j + width];
  return sum + part[0];
}

// Ask for a block's rows of one KV head ahead of use: the blocks of a table lie anywhere in the pool, so the
// hardware's stride prefetcher cannot guess the next one, and a decode reads each row from memory exactly once.
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* first, int64_t rows, int64_t row_stride, int64_t d) {
  const char* p = reinterpret_cast<const char*>(first);
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(scalar_t)), stride_bytes = row_stride * sizeof(scalar_t);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + t * stride_bytes + off, 0, 3);
}

// exp(x) for x <= 0: labkit's float32 exp (exp_f32.h: a loop over it vectorises; std::exp is one call per score).
inline float exp_nonpositive(float x) { return labkit::exp_f32(x); }
inline double exp_nonpositive(double x) { return std::exp(x); }  // float64 keeps the library's exp

#if defined(__AVX512F__)
// exp_f32's steps (exp_f32.h) for x <= 0, on 16 lanes at once (compiled -march=native on a CPU with AVX-512,
// as the GEMV kernels are).
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // floor(x / ln 2 + 0.5)
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);  // x - n * ln 2
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// 16 vectors -> one: lane t holds the sum of v[t]'s 16 lanes (a transpose and add in 4 rounds of shuffles, 45 ops,
// instead of 16 horizontal reductions of ~8 dependent ops each).
inline __m512 sum16(__m512 v[16]) {
  __m512 u[4];
  for (int p = 0; p < 4; ++p) {
    const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(v[4 * p], v[4 * p + 1]),
                                   _mm512_unpackhi_ps(v[4 * p], v[4 * p + 1]));
    const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(v[4 * p + 2], v[4 * p + 3]),
                                   _mm512_unpackhi_ps(v[4 * p + 2], v[4 * p + 3]));
    const __m512d ad = _mm512_castps_pd(a), bd = _mm512_castps_pd(b);
    u[p] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ad, bd)), _mm512_castpd_ps(_mm512_unpackhi_pd(ad, bd)));
  }
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

// o (NC x 16 floats) = o * rescale + sum_t p[t] * v_t: NC independent accumulators per token, two tokens' worth
// (even and odd rows) so 2 * NC FMA chains run side by side instead of one chain of n_valid dependent FMAs per chunk.
template <int NC>
inline void pv_chunks(float* o, const float* p, const float* v_block, int64_t n_valid, int64_t slot_stride,
                      float rescale) {
  __m512 a[NC], b[NC];
  for (int c = 0; c < NC; ++c) {
    a[c] = _mm512_mul_ps(_mm512_loadu_ps(o + 16 * c), _mm512_set1_ps(rescale));
    b[c] = _mm512_setzero_ps();
  }
  int64_t t = 0;
  for (; t + 2 <= n_valid; t += 2) {
    const __m512 p0 = _mm512_set1_ps(p[t]), p1 = _mm512_set1_ps(p[t + 1]);
    const float* v0 = v_block + t * slot_stride;
    const float* v1 = v0 + slot_stride;
    for (int c = 0; c < NC; ++c) {
      a[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * c), a[c]);
      b[c] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1 + 16 * c), b[c]);
    }
  }
  if (t < n_valid) {
    const __m512 p0 = _mm512_set1_ps(p[t]);
    for (int c = 0; c < NC; ++c) a[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v_block + t * slot_stride + 16 * c), a[c]);
  }
  for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_add_ps(a[c], b[c]));
}

// part[t] = q * k_t lane by lane, summed over head_dim's NC chunks of 16, for 16 rows: q held in registers, each
// row's chunks in two independent chains.
template <int NC>
inline void qk16(const float* q, const float* k, int64_t slot_stride, __m512 part[16]) {
  __m512 qc[NC];
  for (int c = 0; c < NC; ++c) qc[c] = _mm512_loadu_ps(q + 16 * c);
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    const float* kt = k + t * slot_stride;
    __m512 a = _mm512_mul_ps(qc[0], _mm512_loadu_ps(kt)), b = _mm512_mul_ps(qc[1], _mm512_loadu_ps(kt + 16));
    for (int c = 2; c < NC; c += 2) {
      a = _mm512_fmadd_ps(qc[c], _mm512_loadu_ps(kt + 16 * c), a);
      b = _mm512_fmadd_ps(qc[c + 1], _mm512_loadu_ps(kt + 16 * c + 16), b);
    }
    part[t] = _mm512_add_ps(a, b);
  }
}

// One block of one task in float32 with head_dim a multiple of 16: the same steps as the generic loop in
// decode_kernel (scores, online-softmax update, o += p . V), on 16-lane vectors. Written for the chains of dependent
// instructions, not the instruction count: scores come 16 rows at a time (qk16: q in registers, two chains per row;
// sum16: one transpose-and-add instead of 16 horizontal sums), and o += p . V keeps 2 * d/16 accumulators (pv_chunks)
// where one per 16 columns made a chain of block_size dependent FMAs (perf: 30% of the kernel's time on it). 23 -> 17
// us for a 300-token context of smollm2-135m's 3 KV heads on one thread, its blocks in L2 (measured).
// scores: (group, block_size) scratch; m, l: (group,); acc: (group, d).
inline void attend_block_avx512(const float* q_group, int64_t group, int64_t d, const float* k_block,
                                const float* v_block, int64_t n_valid, int64_t slot_stride, float scale,
                                float* scores, int64_t block_size, float* m, float* l, float* acc) {
  for (int64_t t0 = 0; t0 < n_valid; t0 += 16) {
    const int64_t nt = std::min<int64_t>(16, n_valid - t0);
    const __mmask16 mask = nt == 16 ? __mmask16(0xFFFF) : __mmask16((1u << nt) - 1);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q_group + g * d;
      __m512 part[16];
      if (d == 64 && nt == 16) {
        qk16<4>(qg, k_block + t0 * slot_stride, slot_stride, part);
      } else if (d == 128 && nt == 16) {
        qk16<8>(qg, k_block + t0 * slot_stride, slot_stride, part);
      } else {
        for (int64_t t = 0; t < 16; ++t) {
          __m512 a = _mm512_setzero_ps();
          if (t < nt) {
            const float* kt = k_block + (t0 + t) * slot_stride;
            for (int64_t i = 0; i < d; i += 16)
              a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + i), _mm512_loadu_ps(kt + i), a);
          }
          part[t] = a;
        }
      }
      const __m512 sv = _mm512_mul_ps(sum16(part), _mm512_set1_ps(scale));
      _mm512_mask_storeu_ps(scores + g * block_size + t0, mask, sv);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * block_size;
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t0 = 0; t0 < n_valid; t0 += 16) {
      const __mmask16 mask = n_valid - t0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n_valid - t0)) - 1);
      vmax = _mm512_mask_max_ps(vmax, mask, vmax, _mm512_maskz_loadu_ps(mask, sg + t0));
    }
    const float block_max = _mm512_reduce_max_ps(vmax);
    const float new_m = std::max(m[g], block_max);
    const float rescale = std::exp(m[g] - new_m);  // exp(-inf) = 0 on the split's first block
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < n_valid; t0 += 16) {
      const __mmask16 mask = n_valid - t0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n_valid - t0)) - 1);
      const __m512 w = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, sg + t0), _mm512_set1_ps(new_m)));
      _mm512_mask_storeu_ps(sg + t0, mask, w);
      vsum = _mm512_mask_add_ps(vsum, mask, vsum, w);
    }
    l[g] = l[g] * rescale + _mm512_reduce_add_ps(vsum);
    m[g] = new_m;
    float* o = acc + g * d;
    if (d == 64) pv_chunks<4>(o, sg, v_block, n_valid, slot_stride, rescale);
    else if (d == 128) pv_chunks<8>(o, sg, v_block, n_valid, slot_stride, rescale);
    else for (int64_t i = 0; i < d; i += 16) {
      __m512 oi = _mm512_mul_ps(_mm512_loadu_ps(o + i), _mm512_set1_ps(rescale));
      for (int64_t t = 0; t < n_valid; ++t)
        oi = _mm512_fmadd_ps(_mm512_set1_ps(sg[t]), _mm512_loadu_ps(v_block + t * slot_stride + i), oi);
      _mm512_storeu_ps(o + i, oi);
    }
  }
}
#endif

// The blocks [first, last) of split s when a sequence's n_blocks are cut into num_splits near-equal runs.
inline int64_t split_start(int64_t n_blocks, int64_t s, int64_t num_splits) { return n_blocks * s / num_splits; }

template <typename scalar_t, typename index_t>
void decode_kernel(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                   const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale,
                   int64_t grain_size, int64_t num_splits, torch::Tensor& out) {
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
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  // Several splits: each task's (m, l, o) per query head of its group, merged below. (tasks, group, d + 2)
  std::vector<acc_t> partial(num_splits > 1 ? batch * n_kv * num_splits * group * (d + 2) : 0);

  // grain_size >= the number of tasks: one thread (the caller's choice for small work, or while another process
  // holds a core)
  at::parallel_for(0, batch * n_kv * num_splits, grain_size, [&](int64_t begin, int64_t end) {
    // per thread, reused per task: o for the group, m and l per head, a block's scores then weights per head
    std::vector<acc_t> acc(group * d), m(group), l(group), scores(group * block_size);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (n_kv * num_splits), kv = task / num_splits % n_kv, s = task % num_splits;
      const int64_t ctx = lens[b], n_blocks = (ctx + block_size - 1) / block_size;
      const scalar_t* q_group = q_ptr + (b * n_heads + kv * group) * d;  // (group, d): heads kv*group ...
      std::fill(acc.begin(), acc.end(), acc_t(0));
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), acc_t(0));
      const int64_t first = split_start(n_blocks, s, num_splits), last = split_start(n_blocks, s + 1, num_splits);
      for (int64_t j = first; j < last; ++j) {
        const int64_t block = tables[b * table_stride + j];
        const int64_t n_valid = std::min(block_size, ctx - j * block_size);  // slots holding context
        const scalar_t* k_block = k_ptr + block * block_size * slot_stride + kv * d;  // slot t at + t * slot_stride
        const scalar_t* v_block = v_ptr + block * block_size * slot_stride + kv * d;
        for (int64_t ahead = (j == first ? 1 : kPrefetchBlocks); ahead <= kPrefetchBlocks; ++ahead) {
          if (j + ahead >= last) break;  // the rows of the blocks ahead, while this one is computed
          const int64_t next = tables[b * table_stride + j + ahead];
          const int64_t next_valid = std::min(block_size, ctx - (j + ahead) * block_size);
          prefetch_rows(k_ptr + next * block_size * slot_stride + kv * d, next_valid, slot_stride, d);
          prefetch_rows(v_ptr + next * block_size * slot_stride + kv * d, next_valid, slot_stride, d);
        }
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<scalar_t, float>) {
          if (d % 16 == 0) {
            attend_block_avx512(q_group, group, d, k_block, v_block, n_valid, slot_stride, static_cast<float>(scale),
                                scores.data(), block_size, m.data(), l.data(), acc.data());
            continue;
          }
        }
#endif
        for (int64_t t = 0; t < n_valid; ++t)  // each key row read from memory once, for every head of the group
          for (int64_t g = 0; g < group; ++g)
            scores[g * block_size + t] = dot<scalar_t, acc_t>(q_group + g * d, k_block + t * slot_stride, d) *
                                         static_cast<acc_t>(scale);
        for (int64_t g = 0; g < group; ++g) {
          acc_t* sg = scores.data() + g * block_size;
          acc_t block_max = neg_inf;
          for (int64_t t = 0; t < n_valid; ++t) block_max = std::max(block_max, sg[t]);
          const acc_t new_m = std::max(m[g], block_max);  // finite: every block holds >= 1 context slot
          const acc_t rescale = std::exp(m[g] - new_m);  // exp(-inf) = 0 on the split's first block
          acc_t sum = 0;
          // scores become weights in place: a loop of its own (no running sum in it), so float32's vectorises
          for (int64_t t = 0; t < n_valid; ++t) sg[t] = exp_nonpositive(sg[t] - new_m);
          for (int64_t t = 0; t < n_valid; ++t) sum += sg[t];
          acc_t* o = acc.data() + g * d;
          for (int64_t i = 0; i < d; ++i) o[i] *= rescale;
          l[g] = l[g] * rescale + sum;
          m[g] = new_m;
        }
        // o += p . V, kDotLanes * 2 columns of o at a time held in registers over the block's rows (written back once
        // per block, not once per row); the rows are the block's, read from L1 after the first head
        for (int64_t g = 0; g < group; ++g) {
          const acc_t* pg = scores.data() + g * block_size;
          acc_t* o = acc.data() + g * d;
          int64_t i = 0;
          for (; i + 2 * kDotLanes <= d; i += 2 * kDotLanes) {
            acc_t part[2 * kDotLanes];
            for (int64_t j = 0; j < 2 * kDotLanes; ++j) part[j] = o[i + j];
            for (int64_t t = 0; t < n_valid; ++t) {
              const scalar_t* vt = v_block + t * slot_stride + i;
              const acc_t p = pg[t];
              for (int64_t j = 0; j < 2 * kDotLanes; ++j) part[j] += p * static_cast<acc_t>(vt[j]);
            }
            for (int64_t j = 0; j < 2 * kDotLanes; ++j) o[i + j] = part[j];
          }
          for (; i < d; ++i)
            for (int64_t t = 0; t < n_valid; ++t) o[i] += pg[t] * static_cast<acc_t>(v_block[t * slot_stride + i]);
        }
      }
      if (num_splits == 1) {
        scalar_t* out_group = out_ptr + (b * n_heads + kv * group) * d;
        for (int64_t g = 0; g < group; ++g)
          for (int64_t i = 0; i < d; ++i) out_group[g * d + i] = static_cast<scalar_t>(acc[g * d + i] / l[g]);
        continue;
      }
      acc_t* mine = partial.data() + task * group * (d + 2);  // per head: m, l, then o (d)
      for (int64_t g = 0; g < group; ++g) {
        mine[g * (d + 2)] = m[g];
        mine[g * (d + 2) + 1] = l[g];
        std::copy(acc.begin() + g * d, acc.begin() + (g + 1) * d, mine + g * (d + 2) + 2);
      }
    }
  });
  if (num_splits == 1) return;
  // The merge, per (sequence, query head): small (num_splits x d per head), on the calling thread.
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < n_heads; ++h) {
      const int64_t kv = h / group, g = h % group;
      const acc_t* first = partial.data() + ((b * n_kv + kv) * num_splits * group + g) * (d + 2);
      const int64_t split_stride = group * (d + 2);
      acc_t big_m = neg_inf;
      for (int64_t s = 0; s < num_splits; ++s) big_m = std::max(big_m, first[s * split_stride]);
      acc_t total = 0;
      std::vector<acc_t> o(d, acc_t(0));
      for (int64_t s = 0; s < num_splits; ++s) {
        const acc_t* part = first + s * split_stride;
        if (part[1] == acc_t(0)) continue;  // a split with no block (fewer blocks than splits): m = -inf, l = 0
        const acc_t w = std::exp(part[0] - big_m);
        total += w * part[1];
        for (int64_t i = 0; i < d; ++i) o[i] += w * part[2 + i];
      }
      scalar_t* dst = out_ptr + (b * n_heads + h) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<scalar_t>(o[i] / total);
    }
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

template <typename scalar_t>
void write_slots(torch::Tensor& pool, const torch::Tensor& x, const int64_t* slots) {
  const int64_t n = x.size(0), n_kv = x.size(1), d = x.size(2);
  const int64_t s0 = x.stride(0), s1 = x.stride(1), s2 = x.stride(2);
  const scalar_t* src = x.data_ptr<scalar_t>();
  scalar_t* dst = pool.data_ptr<scalar_t>();
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < n_kv; ++h) {
      scalar_t* slot = dst + (slots[t] * n_kv + h) * d;  // pool (num_blocks * block_size, n_kv, d), contiguous
      const scalar_t* row = src + t * s0 + h * s1;
      for (int64_t i = 0; i < d; ++i) slot[i] = row[i * s2];
    }
}

}  // namespace

// vLLM's reshape_and_cache: each new token's K and V, k / v (N, n_kv, d) of any strides, into its slot of the pools
// (num_blocks, block_size, n_kv, d); slot_mapping (N,) int64, slot s = block s / block_size, position s % block_size.
// One call instead of two indexed assignments from Python (~9 us for a decode's token).
void write_kv(torch::Tensor& k_pool, torch::Tensor& v_pool, const torch::Tensor& k, const torch::Tensor& v,
              const torch::Tensor& slot_mapping) {
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.is_contiguous() &&
              v_pool.is_contiguous(), "k_pool and v_pool must be contiguous (num_blocks, block_size, n_kv_heads, d) "
              "tensors of one shape");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == k_pool.size(2) && k.size(2) == k_pool.size(3),
              "k and v must be (N, n_kv_heads, d) with the pool's n_kv_heads ", k_pool.size(2), " and d ",
              k_pool.size(3));
  TORCH_CHECK(k.scalar_type() == k_pool.scalar_type() && v.scalar_type() == k_pool.scalar_type() &&
              v_pool.scalar_type() == k_pool.scalar_type(), "k, v and the pools must have the same dtype");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0) && slot_mapping.is_contiguous() &&
              slot_mapping.scalar_type() == torch::kInt64, "slot_mapping must be a contiguous (N,) int64 tensor");
  TORCH_CHECK(k_pool.device().is_cpu() && v_pool.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() &&
              slot_mapping.device().is_cpu(), "write_kv runs on the CPU");
  const int64_t num_slots = k_pool.size(0) * k_pool.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot_mapping[", t, "] = ", slots[t], " is outside the pool's ",
                num_slots, " slots");
  AT_DISPATCH_FLOATING_TYPES(k.scalar_type(), "write_kv", [&] {
    write_slots<scalar_t>(k_pool, k, slots);
    write_slots<scalar_t>(v_pool, v, slots);
  });
}

// q (B, n_heads, d), k_pool / v_pool (num_blocks, block_size, n_kv, d), block_tables (B, W), context_lens (B,)
// -> (B, n_heads, d); grain_size: the fewest (sequence, KV head, split) tasks one thread takes (at::parallel_for's);
// num_splits: the runs of blocks each sequence's context is cut into (1: one task per sequence and KV head)
torch::Tensor paged_decode(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                           const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale,
                           int64_t grain_size, int64_t num_splits) {
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
  TORCH_CHECK(num_splits >= 1 && num_splits <= 1024, "num_splits must be between 1 and 1024, got ", num_splits);
  TORCH_CHECK(block_tables.scalar_type() == context_lens.scalar_type() &&
              (block_tables.scalar_type() == torch::kInt32 || block_tables.scalar_type() == torch::kInt64),
              "block_tables and context_lens must both be int32 or both int64");
  auto out = torch::empty_like(q);
  const bool int32 = block_tables.scalar_type() == torch::kInt32;
  if (int32) check_tables<int32_t>(block_tables, context_lens, k_pool.size(0), k_pool.size(1));
  else check_tables<int64_t>(block_tables, context_lens, k_pool.size(0), k_pool.size(1));
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "paged_decode", [&] {
    if (int32) decode_kernel<scalar_t, int32_t>(q, k_pool, v_pool, block_tables, context_lens, scale, grain_size,
                                                  num_splits, out);
    else decode_kernel<scalar_t, int64_t>(q, k_pool, v_pool, block_tables, context_lens, scale, grain_size,
                                               num_splits, out);
  });
  return out;
}

#ifndef LABKIT_KERNELS_ONLY  // labkit/core/engine/csrc/decode_step_cpu.cpp includes the kernels above into its module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Paged decode attention, K/V read in place (labkit, notebook 06)");
  m.def("write_kv", &write_kv, "New tokens' K/V into their pool slots (vLLM's reshape_and_cache; labkit, notebook 06)");
}
#endif
