// Matrix-vector (and small-batch) products over float32, int8 and int4 weights, on the CPU.
//
// Decode multiplies every weight matrix by a few rows x (B, in): the arithmetic is tiny, the cost is reading the
// weight. So each kernel streams its weight once: at::parallel_for gives each thread a contiguous range of output
// rows, which it reads as four runs side by side (four streams of bytes in flight; for_rows), and a row is read once
// for all B inputs (its bytes sit in L1 while each batch tile uses them). int8 and int4 weights are widened in
// registers, never written back, so only 1 byte (int8) or half a byte plus 1/8 of a float (int4, group 32) per
// weight leaves memory. Every output is computed by one thread in a fixed order: results do not depend on the
// number of threads. With AVX-512 (compiled -march=native) the loops use its intrinsics; elsewhere plain loops the
// compiler vectorises. Built by labkit/core/quant/gemv.py; introduced in notebook 14. The same module holds
// the other ops of a float32 decode layer that PyTorch's CPU path spends several small ops on, each ~2-5 us of
// dispatch from Python for a few hundred floats: rms_norm_f32, silu_mul_f32 (SwiGLU's gate) and rope_f32.
//
// Layouts: x (B, in) float32; weight rows contiguous, (out, in). int8: q (out, in) int8, scales (out,). int4: packed
// (out, in / 2) uint8 (byte j: element 2j in the low nibble, 2j + 1 in the high, each + 8), scales
// (out, in / group). The int4 kernel first copies x with each 32-element block permuted to (even elements, odd
// elements), once per call, so a byte's low nibbles meet x[0:16] and its high nibbles x[16:32] of the block.
#include <torch/extension.h>

#include "../../attention/csrc/exp_f32.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxTile = 8;  // batch rows sharing one pass over a weight row (accumulators in registers)

#if defined(__AVX512F__)

// Each kernel asks for the weight bytes kPrefetchBytes ahead of the ones it reads (in the same run of rows: rows are
// contiguous). Measured on a 2-core Intel Xeon VM (8 layers 4096 x 2048, interleaved rounds; one-off script):
// float32 25 -> 27 GB/s, int8 15 -> 18, int4 12-13 -> 16-18, int4 with int8 activations 20-21 -> 31-35. The
// hardware prefetcher alone keeps too few lines in flight for one core at these kernels' rate of bytes. 256 bytes
// ahead was slower than none. 4096 rather than 2048: smollm2-135m's 121 layers of a decode step, each weight read
// once (one-off script, 12-20 interleaved rounds): int4 group 32 with int16 activations +4%, with int8 activations
// +7%, float32 and int8 with int16 activations within 1%; 8192 as 4096, 1024 slower, and none 30% slower.
constexpr int64_t kPrefetchBytes = 4096;

inline void prefetch_ahead(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
}

template <int NB>
inline void row_f32(const float* w, const float* x, int64_t in, int64_t x_stride, float* out) {
  __m512 acc[NB][2];
  for (int b = 0; b < NB; ++b) acc[b][0] = acc[b][1] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= in; i += 32) {  // 128 bytes: two cache lines
    prefetch_ahead(w + i);
    prefetch_ahead(w + i + 16);
    const __m512 w0 = _mm512_loadu_ps(w + i), w1 = _mm512_loadu_ps(w + i + 16);
    for (int b = 0; b < NB; ++b) {
      acc[b][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + b * x_stride + i), acc[b][0]);
      acc[b][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + b * x_stride + i + 16), acc[b][1]);
    }
  }
  for (int b = 0; b < NB; ++b) {
    float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[b][0], acc[b][1]));
    for (int64_t j = i; j < in; ++j) s += w[j] * x[b * x_stride + j];
    out[b] = s;
  }
}

template <int NB>
inline void row_int8(const int8_t* w, const float* x, int64_t in, int64_t x_stride, float scale, float* out) {
  __m512 acc[NB][2];
  for (int b = 0; b < NB; ++b) acc[b][0] = acc[b][1] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= in; i += 32) {
    if ((i & 63) == 0) prefetch_ahead(w + i);  // once per 64 bytes
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i));  // 32 weights
    const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
    const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
    for (int b = 0; b < NB; ++b) {
      acc[b][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + b * x_stride + i), acc[b][0]);
      acc[b][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + b * x_stride + i + 16), acc[b][1]);
    }
  }
  for (int b = 0; b < NB; ++b) {
    float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[b][0], acc[b][1]));
    for (int64_t j = i; j < in; ++j) s += static_cast<float>(w[j]) * x[b * x_stride + j];
    out[b] = s * scale;
  }
}

// in is a multiple of group (itself a multiple of 32): checked by the caller. A nibble n becomes (n - 8) * scale by
// a table lookup: _mm512_permutexvar_ps reads only the low 4 bits of each index lane, so the 16-entry table of the
// group (values -8..7 times its scale) is indexed by the bytes as they are (low nibble) and shifted right by 4 (high
// nibble): no masking, no integer-to-float conversion, and the scale is applied once per group, to the table. The
// group's scale is reached by a pointer that steps once per group, not by g0 / group: a 64-bit division per group of
// 32 weights (16 bytes) cost about a sixth of the kernel's time (measured: 18.6 -> 22.3 GB/s, scripts/
// bench_quantization.py's Notes). Two 32-weight chunks per iteration, each with its own table and accumulators (two
// more independent chains of FMAs): on a 2-core Intel Xeon VM, with the prefetch above, 4096 x 2048 layers 19.6-20.3
// -> 21.8-22.1 GB/s (group 32), 21.7-22.4 -> 25.5 (group 64), smollm2-135m's shapes 0-5% (one-off script, two runs).
// (On an AMD EPYC VM of an earlier session, without the prefetch, a first 64-weight version had been slower, 19.3
// against 22.3 GB/s; not measured there again.) A group's table is built when the chunks reach it: the step to the
// next group's scale is counted down, not divided.
template <int NB>
inline void row_int4(const uint8_t* w, const float* x, int64_t in, int64_t x_stride, const float* scales,
                     int64_t group, float* out) {
  __m512 acc[NB][4];
  for (int b = 0; b < NB; ++b) acc[b][0] = acc[b][1] = acc[b][2] = acc[b][3] = _mm512_setzero_ps();
  const __m512 levels = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const float* scale = scales;
  const float* last = scales + in / group - 1;
  const int64_t chunks = group / 32;
  int64_t left = chunks;
  __m512 table = _mm512_mul_ps(levels, _mm512_set1_ps(*scale));
  auto advance = [&]() {  // one chunk done: the next group's table after `chunks` of them (none past the last)
    if (--left == 0 && scale < last) {
      left = chunks;
      table = _mm512_mul_ps(levels, _mm512_set1_ps(*++scale));
    }
  };
  int64_t i = 0;
  for (; i + 64 <= in; i += 64) {
    if ((i & 127) == 0) prefetch_ahead(w + i / 2);  // once per 64 bytes
    const __m512 ta = table;
    advance();
    const __m512 tb = table;
    advance();
    const __m512i ba = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i / 2)));
    const __m512i bb = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i / 2 + 16)));
    const __m512 ea = _mm512_permutexvar_ps(ba, ta), oa = _mm512_permutexvar_ps(_mm512_srli_epi32(ba, 4), ta);
    const __m512 eb = _mm512_permutexvar_ps(bb, tb), ob = _mm512_permutexvar_ps(_mm512_srli_epi32(bb, 4), tb);
    for (int b = 0; b < NB; ++b) {
      acc[b][0] = _mm512_fmadd_ps(ea, _mm512_loadu_ps(x + b * x_stride + i), acc[b][0]);
      acc[b][1] = _mm512_fmadd_ps(oa, _mm512_loadu_ps(x + b * x_stride + i + 16), acc[b][1]);
      acc[b][2] = _mm512_fmadd_ps(eb, _mm512_loadu_ps(x + b * x_stride + i + 32), acc[b][2]);
      acc[b][3] = _mm512_fmadd_ps(ob, _mm512_loadu_ps(x + b * x_stride + i + 48), acc[b][3]);
    }
  }
  if (i < in) {  // one chunk of 32 left
    const __m512i ba = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i / 2)));
    const __m512 ea = _mm512_permutexvar_ps(ba, table), oa = _mm512_permutexvar_ps(_mm512_srli_epi32(ba, 4), table);
    for (int b = 0; b < NB; ++b) {
      acc[b][0] = _mm512_fmadd_ps(ea, _mm512_loadu_ps(x + b * x_stride + i), acc[b][0]);
      acc[b][1] = _mm512_fmadd_ps(oa, _mm512_loadu_ps(x + b * x_stride + i + 16), acc[b][1]);
    }
  }
  for (int b = 0; b < NB; ++b) {
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[b][0], acc[b][2]), _mm512_add_ps(acc[b][1], acc[b][3]));
    out[b] = _mm512_reduce_add_ps(sum);
  }
}

#else  // portable loops: kLanes partial sums the compiler turns into vector registers

constexpr int kLanes = 16;

template <int NB>
inline void row_f32(const float* w, const float* x, int64_t in, int64_t x_stride, float* out) {
  for (int b = 0; b < NB; ++b) {
    float part[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= in; i += kLanes)
      for (int j = 0; j < kLanes; ++j) part[j] += w[i + j] * x[b * x_stride + i + j];
    float s = 0;
    for (; i < in; ++i) s += w[i] * x[b * x_stride + i];
    for (int j = 0; j < kLanes; ++j) s += part[j];
    out[b] = s;
  }
}

template <int NB>
inline void row_int8(const int8_t* w, const float* x, int64_t in, int64_t x_stride, float scale, float* out) {
  for (int b = 0; b < NB; ++b) {
    float part[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= in; i += kLanes)
      for (int j = 0; j < kLanes; ++j) part[j] += static_cast<float>(w[i + j]) * x[b * x_stride + i + j];
    float s = 0;
    for (; i < in; ++i) s += static_cast<float>(w[i]) * x[b * x_stride + i];
    for (int j = 0; j < kLanes; ++j) s += part[j];
    out[b] = s * scale;
  }
}

template <int NB>
inline void row_int4(const uint8_t* w, const float* x, int64_t in, int64_t x_stride, const float* scales,
                     int64_t group, float* out) {
  for (int b = 0; b < NB; ++b) {
    const float* xb = x + b * x_stride;
    float s = 0;
    const float* scale = scales;
    for (int64_t g0 = 0; g0 < in; g0 += group, ++scale) {
      float part[kLanes] = {};
      for (int64_t i = g0; i < g0 + group; i += 32)
        for (int j = 0; j < 16; ++j) {
          const uint8_t byte = w[i / 2 + j];
          part[j] += static_cast<float>((byte & 0x0F) - 8) * xb[i + j] +
                     static_cast<float>((byte >> 4) - 8) * xb[i + 16 + j];
        }
      float p = 0;
      for (int j = 0; j < kLanes; ++j) p += part[j];
      s += p * *scale;
    }
    out[b] = s;
  }
}

#endif

// A thread reads its rows [begin, end) as kStreams runs side by side (row k of each run in turn), not front to back:
// more streams of weight bytes in flight at once than one stream, however far ahead it is prefetched. Measured on a
// 2-core Intel Xeon VM (smollm2-135m's 121 layers of a decode step, each weight read once, interleaved rounds;
// one-off script): one stream -> two: int8 14.9 -> 18.9-20.4 GB/s, int8 with int16 activations 16.4 -> 22.3,
// float32 23.7 -> 25.5-26.0; four as two or a little faster (int8 20.7, float32 26.4). Each row is computed as
// before, so the same bits in any order.
constexpr int64_t kStreams = 4;

// The rows of run s of [begin, end): [begin + s * run, min(begin + (s + 1) * run, end)), run = ceil((end - begin) / 4).
inline int64_t run_length(int64_t begin, int64_t end) { return (end - begin + kStreams - 1) / kStreams; }

// Calls row(r, tile_start, NB, out_ptr) for every output row and batch tile; rows split between threads, each
// thread's read as kStreams runs.
template <typename RowFn>
void for_rows(int64_t rows, int64_t batch, int64_t grain, RowFn row) {
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    const int64_t run = run_length(begin, end);
    for (int64_t k = 0; k < run; ++k)
      for (int64_t r = begin + k; r < end; r += run)
        for (int64_t b0 = 0; b0 < batch; b0 += kMaxTile) row(r, b0, std::min(kMaxTile, batch - b0));
  });
}

#define LABKIT_TILE_DISPATCH(nb, CALL)      \
  switch (nb) {                             \
    case 1: CALL(1); break;                 \
    case 2: CALL(2); break;                 \
    case 3: CALL(3); break;                 \
    case 4: CALL(4); break;                 \
    case 5: CALL(5); break;                 \
    case 6: CALL(6); break;                 \
    case 7: CALL(7); break;                 \
    default: CALL(8); break;                \
  }

// Every tensor is read through a raw pointer: shape, dtype, contiguity and device (host memory) are checked first.
void check_cpu(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU, got ", t.device());
}

void check_x(const torch::Tensor& x, int64_t in) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous (B, in) float32 tensor");
  TORCH_CHECK(x.size(1) == in, "x has ", x.size(1), " inputs, the weight ", in);
}

// The residual stream a decode layer adds its output to (x + o_proj(h), x + down(...)): added as each output is
// written, so the layer's add is not a separate PyTorch op (~2-3 us from Python, twice a layer). residual (B, out)
// contiguous float32, or none. out[b] + residual[b] is the same float addition as residual + out: the same bits.
const float* residual_ptr(const c10::optional<torch::Tensor>& residual, int64_t batch, int64_t rows) {
  if (!residual.has_value()) return nullptr;
  const torch::Tensor& t = *residual;
  check_cpu(t, "residual");
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.size(0) == batch &&
              t.size(1) == rows, "residual must be a contiguous (", batch, ", ", rows, ") float32 tensor, got ",
              t.sizes());
  return t.data_ptr<float>();
}

// Writes one output row's tile (nb batch rows from b0) to y: (out, B) memory without a residual (each row's outputs
// side by side, returned as a (B, out) view), (B, out) with one (a contiguous result the next layer reads as is).
inline void store_tile(const float* tile, float* y, const float* residual, int64_t r, int64_t b0, int64_t nb,
                       int64_t batch, int64_t rows) {
  if (residual == nullptr) {
    for (int64_t b = 0; b < nb; ++b) y[r * batch + b0 + b] = tile[b];
  } else {
    for (int64_t b = b0; b < b0 + nb; ++b) y[b * rows + r] = residual[b * rows + r] + tile[b - b0];
  }
}

// The frame every GEMV kernel shares: the output, (out, B) memory without a residual (returned as a (B, out) view) or
// (B, out) with one; the rows split between threads (for_rows); tile(r, b0, nb, out) computes one output row for nb
// batch rows from b0 (a row kernel dispatched on nb: LABKIT_TILE_DISPATCH), and the tile is stored as it is computed.
// A kernel that also gives streams(r, run, out) (rows r, r + run, ... r + (kStreams - 1) * run for a batch of one,
// their instructions interleaved) has a batch of one computed kStreams rows at a time, one from each run; the rows a
// short last run leaves unmatched go to tile.
struct NoStreams {};

template <typename TileFn, typename StreamsFn = NoStreams>
torch::Tensor run_rows(const torch::Tensor& x, int64_t rows, int64_t grain,
                       const c10::optional<torch::Tensor>& residual, TileFn tile_fn, StreamsFn streams_fn = {}) {
  const int64_t batch = x.size(0);
  const float* res = residual_ptr(residual, batch, rows);
  auto y = res == nullptr ? torch::empty({rows, batch}, x.options()) : torch::empty({batch, rows}, x.options());
  float* yp = y.data_ptr<float>();
  if constexpr (!std::is_same_v<StreamsFn, NoStreams>) {
    if (batch == 1) {
      at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
        const int64_t run = run_length(begin, end);
        float out[kStreams];
        for (int64_t k = 0; k < run; ++k) {
          const int64_t r = begin + k;
          if (r + (kStreams - 1) * run < end) {
            streams_fn(r, run, out);
          } else {
            for (int64_t s = 0; r + s * run < end; ++s) tile_fn(r + s * run, 0, 1, out + s);
          }
          for (int64_t s = 0; s < kStreams && r + s * run < end; ++s)
            store_tile(out + s, yp, res, r + s * run, 0, 1, 1, rows);
        }
      });
      return res == nullptr ? y.t() : y;
    }
  }
  for_rows(rows, batch, grain, [&](int64_t r, int64_t b0, int64_t nb) {
    float tile[kMaxTile];
    tile_fn(r, b0, nb, tile);  // tile_fn holds its pointers by value (no reload through a reference per row)
    store_tile(tile, yp, res, r, b0, nb, batch, rows);
  });
  return res == nullptr ? y.t() : y;  // (B, out)
}

// int8 weights: q (out, in) int8 and scales (out,) float32, contiguous on the CPU, x (B, in).
void check_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8 && q.is_contiguous(),
              "q must be a contiguous (out, in) int8 tensor");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.numel() == q.size(0) && scales.is_contiguous(),
              "scales must be (out,) float32");
  check_cpu(q, "q");
  check_cpu(scales, "scales");
  check_x(x, q.size(1));
}

torch::Tensor gemv_f32(const torch::Tensor& x, const torch::Tensor& w, int64_t grain,
                       const c10::optional<torch::Tensor>& residual) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.is_contiguous(),
              "w must be a contiguous (out, in) float32 tensor");
  check_cpu(w, "w");
  const int64_t in = w.size(1);
  check_x(x, in);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  return run_rows(x, w.size(0), grain, residual, [=](int64_t r, int64_t b0, int64_t nb, float* tile) {
#define CALL(N) row_f32<N>(wp + r * in, xp + b0 * in, in, in, tile)
    LABKIT_TILE_DISPATCH(nb, CALL)
#undef CALL
  });
}

torch::Tensor gemv_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales, int64_t grain,
                        const c10::optional<torch::Tensor>& residual) {
  check_int8(x, q, scales);
  const int64_t in = q.size(1);
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  return run_rows(x, q.size(0), grain, residual, [=](int64_t r, int64_t b0, int64_t nb, float* tile) {
#define CALL(N) row_int8<N>(qp + r * in, xp + b0 * in, in, in, sp[r], tile)
    LABKIT_TILE_DISPATCH(nb, CALL)
#undef CALL
  });
}

// x (B, in) -> (B, in) with each block of 32 inputs reordered to (even inputs, odd inputs): the order the int4 rows
// read x in. Done here once per call, not from Python: reshape, transpose and copy there cost ~7 us a call (about
// 0.9 ms of a smollm2-135m decode step's 121 int4 calls, measured); here it is a pass over a few KB.
std::vector<float> permute_blocks(const float* x, int64_t batch, int64_t in) {
  std::vector<float> out(batch * in);
  for (int64_t i = 0; i < batch * in; i += 32)
    for (int64_t j = 0; j < 16; ++j) {
      out[i + j] = x[i + 2 * j];
      out[i + 16 + j] = x[i + 2 * j + 1];
    }
  return out;
}

// The int4 kernels' inputs: packed (out, in / 2) uint8, scales (out, in / group) float32, x (B, in); the group a
// positive multiple of 32 dividing in (and, for rounded activations, dividing 128: 32, 64 or 128, so each of the
// kernels' blocks of inputs lies in one group).
void check_int4(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales, int64_t group,
                bool rounded_activations) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(),
              "packed must be a contiguous (out, in / 2) uint8 tensor");
  const int64_t rows = packed.size(0), in = packed.size(1) * 2;
  if (rounded_activations) {
    TORCH_CHECK(group > 0 && group % 32 == 0 && 128 % group == 0 && in % group == 0,
                "with int8 or int16 activations the group size must be 32, 64 or 128 and divide in (", in, "), got ",
                group);
  } else {
    TORCH_CHECK(group > 0 && group % 32 == 0 && in % group == 0,
                "group size must be a positive multiple of 32 dividing in (", in, "), got ", group);
  }
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == rows && scales.size(1) == in / group,
              "scales must be (out, in / group) float32");
  check_cpu(packed, "packed");
  check_cpu(scales, "scales");
  check_x(x, in);
}

torch::Tensor gemv_int4(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                        int64_t group, int64_t grain, const c10::optional<torch::Tensor>& residual) {
  check_int4(x, packed, scales, group, false);
  const int64_t in = packed.size(1) * 2, groups = in / group;
  const std::vector<float> x_perm = permute_blocks(x.data_ptr<float>(), x.size(0), in);  // in % 32 == 0: checked
  const float* xp = x_perm.data();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  return run_rows(x, packed.size(0), grain, residual, [=](int64_t r, int64_t b0, int64_t nb, float* tile) {
#define CALL(N) row_int4<N>(wp + r * (in / 2), xp + b0 * in, in, in, sp + r * groups, group, tile)
    LABKIT_TILE_DISPATCH(nb, CALL)
#undef CALL
  });
}

// int4 weights times int8 activations (QuantizationConfig(..., activations="int8"), llama.cpp's Q4_0 x Q8_0 scheme):
// with float activations the int4 kernel above is bound by its instructions, not by memory (measured: ~12 GB/s a
// core against ~22 GB/s of read bandwidth; widening nibbles to floats costs 4 vector ops per 32 weights besides the 2
// FMAs). Rounding x to int8 once per call (one float32 scale per 32 inputs, amax / 127) lets one integer
// instruction (AVX-512 VNNI's vpdpbusd: 64 byte products summed 4 at a time into 16 int32 lanes) multiply 64 weights:
// per 128 weights, 3 ops unpack the nibbles, 2 multiply, and 3 apply the scales. The integer sums are exact; the
// error is x's rounding (relative ~0.4% per input).
//
// x is prepared per call in blocks of 128 inputs (a block's 64 weight bytes): lo / hi hold the int8 inputs that
// meet each byte's low nibbles (even elements) and high nibbles (odd elements), so byte j of the weights and byte j
// of lo / hi line up for vpdpbusd; a lane i of 16 sums bytes 4i..4i+3, i.e. elements 8i..8i+7, one x group and one
// weight group (group sizes divide 128). off[i] = -8 * (the lane's int8 inputs): the nibbles are stored + 8, and
// sum((n - 8) * x) = sum(n * x) - 8 * sum(x). sx[i]: the x scale of the lane's elements.
struct Int8Activations {
  int64_t blocks;               // ceil(in / 128)
  std::vector<int8_t> lo, hi;   // (B, blocks, 64), zero past in
  std::vector<int32_t> off;     // (B, blocks, 16)
  std::vector<float> sx;        // (B, blocks, 16)
  // per block, computed once per call rather than once per row: the weight bytes it holds (64, or fewer in the
  // last), and where its weight scales start in a row and how many there are (a row's last block may hold fewer)
  std::vector<int64_t> bytes, first_scale, n_scales;
};

Int8Activations quantize_activations(const float* x, int64_t batch, int64_t in, int64_t group) {
  const int64_t blocks = (in + 127) / 128;
  Int8Activations a{blocks, std::vector<int8_t>(batch * blocks * 64, 0), std::vector<int8_t>(batch * blocks * 64, 0),
                    std::vector<int32_t>(batch * blocks * 16, 0), std::vector<float>(batch * blocks * 16, 0.0f),
                    std::vector<int64_t>(blocks), std::vector<int64_t>(blocks), std::vector<int64_t>(blocks)};
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t inputs = std::min<int64_t>(in - blk * 128, 128);
    a.bytes[blk] = inputs / 2;
    a.first_scale[blk] = blk * 128 / group;
    a.n_scales[blk] = (inputs + group - 1) / group;
  }
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t g = 0; g < in / 32; ++g) {  // in % 32 == 0: checked by the caller
      const float* xg = x + b * in + g * 32;
      const int64_t block = b * blocks + g / 4, first = (g % 4) * 16;  // the group's first byte (lane 4 * (g % 4))
      int32_t q[32];
#if defined(__AVX512F__)
      const __m512 x0 = _mm512_loadu_ps(xg), x1 = _mm512_loadu_ps(xg + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      const float inv = amax > 0 ? 127.0f / amax : 0.0f;
      // cvtps_epi32 rounds to nearest even (the default rounding mode), as std::nearbyint does
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(inv)));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(inv)));
      const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a.lo.data() + block * 64 + first),
                       _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(q0, even, q1)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a.hi.data() + block * 64 + first),
                       _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(q0, odd, q1)));
      _mm512_storeu_si512(q, q0);
      _mm512_storeu_si512(q + 16, q1);
#else
      float amax = 0;
      for (int e = 0; e < 32; ++e) amax = std::max(amax, std::fabs(xg[e]));
      const float inv = amax > 0 ? 127.0f / amax : 0.0f;
      for (int e = 0; e < 32; ++e) {
        q[e] = static_cast<int32_t>(std::nearbyint(xg[e] * inv));  // |q| <= 127: |x| <= amax
        (e % 2 == 0 ? a.lo : a.hi)[block * 64 + first + e / 2] = static_cast<int8_t>(q[e]);
      }
#endif
      for (int lane = 0; lane < 4; ++lane) {  // lanes 4 * (g % 4) ... + 3: elements 8 * lane ... + 7 of the group
        int32_t sum = 0;
        for (int e = 8 * lane; e < 8 * lane + 8; ++e) sum += q[e];
        a.off[block * 16 + first / 4 + lane] = -8 * sum;
        a.sx[block * 16 + first / 4 + lane] = amax / 127.0f;
      }
    }
  return a;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

// One weight row against NB activation rows. idx: lane i -> which of the block's scales (8i / group).
template <int NB>
inline void row_int4_a8(const uint8_t* w, const Int8Activations& a, int64_t b0, const float* scales, __m512i idx,
                        float* out) {
  __m512 acc[NB];
  for (int b = 0; b < NB; ++b) acc[b] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t blk = 0; blk < a.blocks; ++blk) {
    prefetch_ahead(w + blk * 64);  // kPrefetchBytes: defined with the float-input kernels above
    const int64_t bytes = a.bytes[blk];  // 64, or fewer (a multiple of 16) in a row's last block
    const __m512i wv = bytes == 64 ? _mm512_loadu_si512(w + blk * 64)
                                   : _mm512_maskz_loadu_epi8((__mmask64(1) << bytes) - 1, w + blk * 64);
    const __m512i lo = _mm512_and_si512(wv, low4), hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low4);
    const __m512 sw = _mm512_permutexvar_ps(
        idx, _mm512_maskz_loadu_ps(__mmask16((1u << a.n_scales[blk]) - 1), scales + a.first_scale[blk]));
    for (int b = 0; b < NB; ++b) {
      const int64_t at = (b0 + b) * a.blocks + blk;
      __m512i d = _mm512_loadu_si512(a.off.data() + at * 16);
      d = _mm512_dpbusd_epi32(d, lo, _mm512_loadu_si512(a.lo.data() + at * 64));
      d = _mm512_dpbusd_epi32(d, hi, _mm512_loadu_si512(a.hi.data() + at * 64));
      acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sw, _mm512_loadu_ps(a.sx.data() + at * 16)),
                               acc[b]);
    }
  }
  for (int b = 0; b < NB; ++b) out[b] = _mm512_reduce_add_ps(acc[b]);
}

#else  // the same integer sums and the same per-lane scaling, in plain loops

template <int NB>
inline void row_int4_a8(const uint8_t* w, const Int8Activations& a, int64_t b0, const float* scales,
                        const int32_t* idx, float* out) {
  for (int b = 0; b < NB; ++b) {
    float lanes[16] = {};
    for (int64_t blk = 0; blk < a.blocks; ++blk) {
      const int64_t at = (b0 + b) * a.blocks + blk;
      for (int i = 0; 4 * i < a.bytes[blk]; ++i) {
        int32_t d = a.off[at * 16 + i];
        for (int j = 4 * i; j < 4 * i + 4; ++j) {
          const uint8_t byte = w[blk * 64 + j];
          d += (byte & 0x0F) * a.lo[at * 64 + j] + (byte >> 4) * a.hi[at * 64 + j];
        }
        lanes[i] += static_cast<float>(d) * (scales[a.first_scale[blk] + idx[i]] * a.sx[at * 16 + i]);
      }
    }
    float s = 0;
    for (float v : lanes) s += v;
    out[b] = s;
  }
}

#endif

torch::Tensor gemv_int4_a8(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                           int64_t group, int64_t grain, const c10::optional<torch::Tensor>& residual) {
  check_int4(x, packed, scales, group, true);
  const int64_t in = packed.size(1) * 2, groups = in / group;
  const Int8Activations a = quantize_activations(x.data_ptr<float>(), x.size(0), in, group);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  alignas(64) int32_t lane_scale[16];  // lane i (elements 8i ... 8i + 7 of a block) -> the block's scale 8i / group
  for (int i = 0; i < 16; ++i) lane_scale[i] = static_cast<int32_t>(8 * i / group);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  const __m512i idx = _mm512_load_si512(lane_scale);
#else
  const int32_t* idx = lane_scale;
#endif
  return run_rows(x, packed.size(0), grain, residual, [=, &a](int64_t r, int64_t b0, int64_t nb, float* tile) {
#define CALL(N) row_int4_a8<N>(wp + r * (in / 2), a, b0, sp + r * groups, idx, tile)
    LABKIT_TILE_DISPATCH(nb, CALL)
#undef CALL
  });
}

// int8 or int4 weights times 16-bit integer activations (QuantizationConfig(..., activations="int16")): on an
// AVX-512 core the float-input kernels above are bound by instructions, not by memory (widening each weight to a
// float costs more vector ops than the FMA that uses it; measured in scripts/bench_quantization.py's kernel table).
// Rounding x to int16 once per call (one float32 scale per 32 inputs, amax / 32767) lets AVX-512 VNNI's vpdpwssd
// multiply 32 weights (widened to int16: one instruction) by 32 inputs and sum them in pairs into 16 int32 lanes, and
// the group's sum becomes float once. The integer sums are exact; the only rounding is x's, at most amax / 65534 per
// input: a group's dot product errs by at most amax * |w| / 2048, the bound of rounding x to float16 (2^-11 of each
// |x|, summed over 32 inputs) at the group's largest input, and less than float16 where the inputs are alike. So this
// is weight-only quantization in vLLM's W8A16 / W4A16 sense (16-bit activations), not int8 activations.
// Measured on a 2-core Intel Xeon VM (smollm2-135m's 121 GEMV calls of a decode step, lm_head included, 9 interleaved
// rounds, one-off script, two runs): int8 9.44 -> 8.80 and 9.47 -> 9.03 ms, int4 group 32 7.04 -> 6.23 and
// 7.32 -> 6.53, group 64 6.55 -> 5.69 and 6.73 -> 5.71. Two things mattered: accumulators named, not indexed by a
// group's parity (indexed, they lived in memory: int4 ran at half the speed of its float kernel), and x prepared with
// vector stores only (scalar reads of a just-stored vector stall on store forwarding: 5.5 -> 2.6 us for 4096 inputs).
//
// x is prepared per call in chunks of 64 inputs (int8: natural order; int4: a chunk's 32 weight bytes are two
// 32-input blocks, and q holds first the inputs that meet the low nibbles (even elements of block A, then of block B),
// then those that meet the high nibbles (odd ones), so int16 lane m of the widened bytes and lane m of each half line
// up). sx: the scale of each 16-lane int32 sum's lanes (int8: one per 32 inputs; int4: lanes 0-7 block A's, 8-15
// block B's). off (int4): -8 * the inputs of each int32 lane (the nibbles are stored + 8).
struct Int16Activations {
  int64_t chunks;                // ceil(in / 64)
  std::vector<int16_t> q;        // (B, chunks, 64), zero past in
  std::vector<float> sx;         // int8: (B, chunks * 2); int4: (B, chunks, 16)
  std::vector<int32_t> off;      // int4 only: (B, chunks, 16)
};

// x (32 floats) -> q (32 int, round to nearest even as std::nearbyint) and the scale amax / 32767.
inline float round_group_int16(const float* x, int32_t* q) {
#if defined(__AVX512F__)
  const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const __m512 inv = _mm512_set1_ps(amax > 0 ? 32767.0f / amax : 0.0f);
  _mm512_storeu_si512(q, _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)));  // the default rounding: to nearest even
  _mm512_storeu_si512(q + 16, _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv)));
#else
  float amax = 0;
  for (int e = 0; e < 32; ++e) amax = std::max(amax, std::fabs(x[e]));
  const float inv = amax > 0 ? 32767.0f / amax : 0.0f;
  for (int e = 0; e < 32; ++e) q[e] = static_cast<int32_t>(std::nearbyint(x[e] * inv));  // |q| <= 32767
#endif
  return amax / 32767.0f;
}

Int16Activations int16_activations(const float* x, int64_t batch, int64_t in, bool int4) {
  const int64_t chunks = (in + 63) / 64;
  Int16Activations a{chunks, std::vector<int16_t>(batch * chunks * 64, 0),
                     std::vector<float>(batch * chunks * (int4 ? 16 : 2), 0.0f),
                     std::vector<int32_t>(int4 ? batch * chunks * 16 : 0, 0)};
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t g = 0; g * 32 < in; ++g) {
      const int64_t n = std::min<int64_t>(32, in - g * 32);  // int8's last group may be short; int4's never is
      float tail[32] = {};
      const float* xg = x + b * in + g * 32;
      if (n < 32) xg = static_cast<const float*>(std::memcpy(tail, xg, n * sizeof(float)));
      int32_t q[32];
      const float scale = round_group_int16(xg, q);
      const int64_t chunk = b * chunks + g / 2, half = g % 2;  // block A (half 0) or B of its chunk
      int16_t* dst = a.q.data() + chunk * 64;
      if (!int4) {
#if defined(__AVX512F__)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + half * 32), _mm512_cvtepi32_epi16(_mm512_loadu_si512(q)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + half * 32 + 16),
                            _mm512_cvtepi32_epi16(_mm512_loadu_si512(q + 16)));
#else
        for (int e = 0; e < 32; ++e) dst[half * 32 + e] = static_cast<int16_t>(q[e]);
#endif
        a.sx[chunk * 2 + half] = scale;
        continue;
      }
#if defined(__AVX512F__)
      const __m512i q0 = _mm512_loadu_si512(q), q1 = _mm512_loadu_si512(q + 16);
      const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + half * 16),  // meet each byte's low nibble
                          _mm512_cvtepi32_epi16(_mm512_permutex2var_epi32(q0, even, q1)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 + half * 16),  // and its high nibble
                          _mm512_cvtepi32_epi16(_mm512_permutex2var_epi32(q0, odd, q1)));
      const __m512i pairs = _mm512_add_epi32(_mm512_permutex2var_epi32(q0, even, q1),  // lane j: q[2j] + q[2j + 1]
                                             _mm512_permutex2var_epi32(q0, odd, q1));
      const __m512i quads = _mm512_add_epi32(_mm512_permutexvar_epi32(even, pairs),  // lane l < 8: q[4l ... 4l + 3]
                                             _mm512_permutexvar_epi32(odd, pairs));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.off.data() + chunk * 16 + half * 8),
                          _mm512_castsi512_si256(_mm512_mullo_epi32(quads, _mm512_set1_epi32(-8))));
      _mm256_storeu_ps(a.sx.data() + chunk * 16 + half * 8, _mm256_set1_ps(scale));
#else
      for (int j = 0; j < 16; ++j) {
        dst[half * 16 + j] = static_cast<int16_t>(q[2 * j]);           // meets byte j's low nibble
        dst[32 + half * 16 + j] = static_cast<int16_t>(q[2 * j + 1]);  // and its high nibble
      }
      for (int lane = 0; lane < 8; ++lane) {  // int32 lane 8 * half + lane: bytes 2 * lane, 2 * lane + 1
        const int e = 4 * lane;               // their elements 4 * lane ... 4 * lane + 3
        a.off[chunk * 16 + half * 8 + lane] = -8 * (q[e] + q[e + 1] + q[e + 2] + q[e + 3]);
        a.sx[chunk * 16 + half * 8 + lane] = scale;
      }
#endif
    }
  return a;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

// One int8 weight row against NB activation rows: per 32 weights one widening, one vpdpwssd, one conversion and one
// FMA by the group's x scale. Two groups per iteration, each into its own accumulator, so FMAs do not wait on each
// other (accumulators are named, not indexed by the group's parity: indexed ones were kept in memory, not registers).
template <int NB>
inline void row_int8_a16(const int8_t* w, const Int16Activations& a, int64_t b0, int64_t in, float scale,
                         float* out) {
  __m512 acc0[NB], acc1[NB];
  for (int b = 0; b < NB; ++b) acc0[b] = acc1[b] = _mm512_setzero_ps();
  const int16_t* q = a.q.data() + b0 * a.chunks * 64;  // batch row b: q + b * stride, inputs in natural order
  const float* sx = a.sx.data() + b0 * a.chunks * 2;   // one scale per 32 inputs
  const int64_t stride = a.chunks * 64, sstride = a.chunks * 2;
  auto group = [&](int64_t g, __m512* acc) {
    const int64_t i = g * 32, n = std::min<int64_t>(32, in - i);
    const __m256i bytes = n == 32 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i))
                                  : _mm256_maskz_loadu_epi8((__mmask32(1) << n) - 1, w + i);
    const __m512i w16 = _mm512_cvtepi8_epi16(bytes);  // (32,) int16
    for (int b = 0; b < NB; ++b) {
      const __m512i d = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w16, _mm512_loadu_si512(q + b * stride + i));
      acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(sx[b * sstride + g]), acc[b]);
    }
  };
  const int64_t groups = (in + 31) / 32;
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    prefetch_ahead(w + g * 32);  // once per 64 bytes
    group(g, acc0);
    group(g + 1, acc1);
  }
  if (g < groups) group(g, acc0);
  for (int b = 0; b < NB; ++b) out[b] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[b], acc1[b])) * scale;
}

// NR int4 weight rows (row r at w + r * row_stride, its scales at scales + r * scale_stride) against NB activation
// rows, out[r * NB + b]: per 64 weights (32 bytes) of a row one widening, a mask and a shift split the nibbles, two
// vpdpwssd sum them against x, and one conversion and one FMA apply both scales. Two chunks per iteration into named
// accumulators, as above. A batch of one runs kStreams rows at once, one from each of a thread's runs (run_rows):
// one row's chain of dependent instructions (unpack, two vpdpwssd, convert, FMA, and the row's final sum) is longer
// than the instructions the core keeps in flight for it, so one row at a time left the core waiting, and the rows'
// streams of bytes are read side by side. Measured on a 2-core Intel Xeon VM (one-off scripts): one thread, weights
// in cache, two adjacent rows at once: smollm2-135m's 3072 x 576 layer 94 -> 57-62 us, its lm_head 1.41-1.45 ->
// 0.91-0.98 ms; the step's 121 layers, each read once: two adjacent rows 18.1 GB/s, two runs 20.0-22.7, four runs
// 21.8-25.1 (against 19.4-19.5 for four runs a row at a time). Each row's arithmetic is the same in any grouping.
template <int NR, int NB>
inline void rows_int4_a16(const uint8_t* w, int64_t row_stride, const Int16Activations& a, int64_t b0, int64_t in,
                          const float* scales, int64_t scale_stride, int64_t group, float* out) {
  __m512 acc0[NR * NB], acc1[NR * NB];
  for (int k = 0; k < NR * NB; ++k) acc0[k] = acc1[k] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  const int16_t* q = a.q.data() + b0 * a.chunks * 64;   // (NB, chunks, 64)
  const int32_t* off = a.off.data() + b0 * a.chunks * 16;  // (NB, chunks, 16)
  const float* sx = a.sx.data() + b0 * a.chunks * 16;      // (NB, chunks, 16)
  const int64_t chunks = a.chunks;
  // group is 32, 64 or 128 (checked by the caller): a shift, not the 64-bit division the compiler emitted for
  // i / group once per chunk (one thread, weights in L2, one-off script: 512 x 576 19.4 -> 16.3 us, 64 x 4096
  // 17.0 -> 15.5 us)
  const int group_shift = group == 32 ? 5 : group == 64 ? 6 : 7;
  auto chunk = [&](int64_t c, bool whole, __m512* acc) {  // whole: both blocks (else block A only: in % 64 == 32)
    const int64_t i = c * 64;
    for (int r = 0; r < NR; ++r) {
      const uint8_t* wr = w + r * row_stride + i / 2;
      const __m256i bytes = whole ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr))
                                  : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr)));
      const __m512i v = _mm512_cvtepu8_epi16(bytes);
      const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_srli_epi16(v, 4);
      const float* sa = scales + r * scale_stride + (i >> group_shift);  // block A's; B's is the next in group 32
      const __m512 sw = group == 32 && whole
                            ? _mm512_mask_broadcastss_ps(_mm512_set1_ps(sa[0]), 0xFF00, _mm_load_ss(sa + 1))
                            : _mm512_set1_ps(sa[0]);
      for (int b = 0; b < NB; ++b) {
        const int64_t at = b * chunks + c;
        __m512i d = _mm512_loadu_si512(off + at * 16);
        d = _mm512_dpwssd_epi32(d, lo, _mm512_loadu_si512(q + at * 64));
        d = _mm512_dpwssd_epi32(d, hi, _mm512_loadu_si512(q + at * 64 + 32));
        acc[r * NB + b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sw, _mm512_loadu_ps(sx + at * 16)),
                                          acc[r * NB + b]);
      }
    }
  };
  const int64_t full = in / 64;  // chunks with both blocks
  int64_t c = 0;
  for (; c + 2 <= full; c += 2) {
    for (int r = 0; r < NR; ++r) prefetch_ahead(w + r * row_stride + c * 32);  // once per 64 bytes of each row
    chunk(c, true, acc0);
    chunk(c + 1, true, acc1);
  }
  if (c < full) chunk(c++, true, acc0);
  if (c < chunks) chunk(c, false, acc1);
  for (int k = 0; k < NR * NB; ++k) out[k] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[k], acc1[k]));
}

#else  // the same integer sums, each scaled and added in plain loops

template <int NB>
inline void row_int8_a16(const int8_t* w, const Int16Activations& a, int64_t b0, int64_t in, float scale,
                         float* out) {
  for (int b = 0; b < NB; ++b) {
    const int16_t* q = a.q.data() + (b0 + b) * a.chunks * 64;
    float s = 0;
    for (int64_t g = 0; g * 32 < in; ++g) {
      int32_t d = 0;
      for (int64_t i = g * 32; i < std::min<int64_t>(in, g * 32 + 32); ++i) d += w[i] * q[i];
      s += static_cast<float>(d) * a.sx[(b0 + b) * a.chunks * 2 + g];
    }
    out[b] = s * scale;
  }
}

template <int NR, int NB>
inline void rows_int4_a16(const uint8_t* w, int64_t row_stride, const Int16Activations& a, int64_t b0, int64_t in,
                          const float* scales, int64_t scale_stride, int64_t group, float* out) {
  for (int r = 0; r < NR; ++r)
    for (int b = 0; b < NB; ++b) {
      float s = 0;
      for (int64_t c = 0; c < a.chunks; ++c) {
        const int64_t at = (b0 + b) * a.chunks + c;
        for (int half = 0; half < 2 && c * 64 + half * 32 < in; ++half) {
          int32_t d = 0;
          for (int j = 0; j < 16; ++j) {
            const uint8_t byte = w[r * row_stride + c * 32 + half * 16 + j];
            d += (byte & 0x0F) * a.q[at * 64 + half * 16 + j] + (byte >> 4) * a.q[at * 64 + 32 + half * 16 + j];
          }
          for (int lane = 0; lane < 8; ++lane) d += a.off[at * 16 + half * 8 + lane];
          const float sw = scales[r * scale_stride + (c * 64 + half * 32) / group];
          s += static_cast<float>(d) * (sw * a.sx[at * 16 + half * 8]);
        }
      }
      out[r * NB + b] = s;
    }
}

#endif

torch::Tensor gemv_int8_a16(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
                            int64_t grain, const c10::optional<torch::Tensor>& residual) {
  check_int8(x, q, scales);
  const int64_t in = q.size(1);
  const Int16Activations a = int16_activations(x.data_ptr<float>(), x.size(0), in, false);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  return run_rows(x, q.size(0), grain, residual, [=, &a](int64_t r, int64_t b0, int64_t nb, float* tile) {
#define CALL(N) row_int8_a16<N>(qp + r * in, a, b0, in, sp[r], tile)
    LABKIT_TILE_DISPATCH(nb, CALL)
#undef CALL
  });
}

torch::Tensor gemv_int4_a16(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                            int64_t group, int64_t grain, const c10::optional<torch::Tensor>& residual) {
  check_int4(x, packed, scales, group, true);
  const int64_t in = packed.size(1) * 2, groups = in / group;
  const Int16Activations a = int16_activations(x.data_ptr<float>(), x.size(0), in, true);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const auto tile = [=, &a](int64_t r, int64_t b0, int64_t nb, float* out) {
#define CALL(N) rows_int4_a16<1, N>(wp + r * (in / 2), in / 2, a, b0, in, sp + r * groups, groups, group, out)
    LABKIT_TILE_DISPATCH(nb, CALL)
#undef CALL
  };
  const auto streams = [=, &a](int64_t r, int64_t run, float* out) {  // rows r, r + run, ... of a batch of one
    rows_int4_a16<kStreams, 1>(wp + r * (in / 2), run * (in / 2), a, 0, in, sp + r * groups, run * groups, group, out);
  };
  return run_rows(x, packed.size(0), grain, residual, tile, streams);
}

// The streaming-read roof: sum a large float32 tensor with the same threads and the same row split, 16 lanes of
// partial sums (the same loads as the float32 kernel, without the second operand).
double stream_sum(const torch::Tensor& t, int64_t grain) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == torch::kFloat32 && t.is_contiguous(), "t must be 2-D float32");
  check_cpu(t, "t");
  const int64_t rows = t.size(0), cols = t.size(1);
  const float* p = t.data_ptr<float>();
  std::vector<float> partial(rows);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = p + r * cols;
      float acc[16] = {};
      int64_t i = 0;
      for (; i + 16 <= cols; i += 16)
        for (int j = 0; j < 16; ++j) acc[j] += row[i + j];
      float s = 0;
      for (; i < cols; ++i) s += row[i];
      for (int j = 0; j < 16; ++j) s += acc[j];
      partial[r] = s;
    }
  });
  double total = 0;
  for (float v : partial) total += v;
  return total;
}

// RMSNorm over the last dimension, one pass over each row: y = x * rsqrt(mean(x^2) + eps) * w, in the order
// F.rms_norm computes it. On a CPU, F.rms_norm runs as six PyTorch ops (pow, mean, add, rsqrt, mul, mul): about 25 us
// for one row of 576 here, twice per layer in every decode step (a 30-layer model: 1.5 ms a step). Rows are split
// between threads only when there are enough of them (prefill); a decode's few rows run on the calling thread.
torch::Tensor rms_norm_f32(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.size(0) > 0,
              "w must be a non-empty contiguous (d,) float32 tensor");
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 tensor");
  TORCH_CHECK(x.size(-1) == w.size(0), "x's last dimension is ", x.size(-1), ", the weight's ", w.size(0));
  check_cpu(x, "x");
  check_cpu(w, "w");
  const int64_t d = w.size(0), rows = x.numel() / d;
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, (int64_t{1} << 16) / d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * d;
      float acc[16] = {};  // 16 lanes of partial sums: one vector register
      int64_t i = 0;
      for (; i + 16 <= d; i += 16)
        for (int j = 0; j < 16; ++j) acc[j] += row[i + j] * row[i + j];
      float sum = 0;
      for (; i < d; ++i) sum += row[i] * row[i];
      for (int j = 0; j < 16; ++j) sum += acc[j];
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(d) + epsf);
      float* out = yp + r * d;
      for (int64_t k = 0; k < d; ++k) out[k] = row[k] * inv * wp[k];
    }
  });
  return y;
}

using labkit::exp_f32;  // ../../attention/csrc/exp_f32.h

void check_rows(const torch::Tensor& x, const char* name) {
  check_cpu(x, name);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, name, " must be a (rows, n) float32 tensor");
}

// SwiGLU's gate: a merged gate/up output gu (rows, 2 * I) -> silu(gu[:, :I]) * gu[:, I:], silu(g) = g / (1 + e^-g)
// as F.silu computes it. One pass instead of split, silu and mul (three PyTorch ops, ~7 us from Python for a
// decode's row). gu may be strided (the GEMV kernel returns (B, out) as a view of (out, B) memory).
torch::Tensor silu_mul_f32(const torch::Tensor& gu) {
  check_rows(gu, "gu");
  TORCH_CHECK(gu.size(1) % 2 == 0, "gu must hold gate and up side by side (an even width), got ", gu.size(1));
  const int64_t rows = gu.size(0), half = gu.size(1) / 2, rs = gu.stride(0), cs = gu.stride(1);
  auto out = torch::empty({rows, half}, gu.options());
  const float* src = gu.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = src + r * rs;
    float* o = dst + r * half;
    if (cs == 1) {  // contiguous: a vector loop
      for (int64_t i = 0; i < half; ++i) o[i] = row[i] / (1.0f + exp_f32(-row[i])) * row[half + i];
    } else {
      for (int64_t i = 0; i < half; ++i) {
        const float g = row[i * cs];
        o[i] = g / (1.0f + exp_f32(-g)) * row[(half + i) * cs];
      }
    }
  }
  return out;
}

// RoPE on the first n_rot heads of each row of x (rows, heads * d), which may be strided (a merged q/k/v output):
// out[h, i] = x[h, i] * cos[i] + x[h, (i + d/2) % d] * sin[i], with sin holding (-sin, sin) halves as
// labkit.core.model.layers.RotaryEmbedding.cos_sin makes them; cos, sin (rows, d). Returns (rows, n_rot * d),
// contiguous: the rotated q and k heads side by side. One pass instead of mul, roll, mul and add (~10 us a row).
torch::Tensor rope_f32(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t n_rot) {
  check_rows(x, "x");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0),
              "cos and sin must be contiguous (rows, head_dim) tensors, one row per row of x");
  const int64_t rows = x.size(0), d = cos.size(1), rs = x.stride(0), cs = x.stride(1);
  TORCH_CHECK(d > 0 && d % 2 == 0, "head_dim must be even, got ", d);
  TORCH_CHECK(n_rot >= 0 && n_rot * d <= x.size(1), "n_rot = ", n_rot, " heads of ", d, " do not fit in x's ",
              x.size(1), " columns");
  auto out = torch::empty({rows, n_rot * d}, x.options());
  const float* src = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t half = d / 2;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < n_rot; ++h) {
      const float* head = src + r * rs + h * d * cs;
      const float* c = cp + r * d;
      const float* sn = sp + r * d;
      float* o = dst + (r * n_rot + h) * d;
      if (cs == 1) {
        for (int64_t i = 0; i < half; ++i) o[i] = head[i] * c[i] + head[i + half] * sn[i];
        for (int64_t i = half; i < d; ++i) o[i] = head[i] * c[i] + head[i - half] * sn[i];
      } else {
        for (int64_t i = 0; i < d; ++i) o[i] = head[i * cs] * c[i] + head[((i + half) % d) * cs] * sn[i];
      }
    }
  return out;
}

}  // namespace

#ifndef LABKIT_KERNELS_ONLY  // labkit/core/engine/csrc/decode_step_cpu.cpp includes the kernels above into its module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  const auto none = py::arg("residual") = py::none();  // optional (B, out) added to the output
  m.def("gemv_f32", &gemv_f32, "y = x @ w.T (+ residual), float32 weight (out, in)", py::arg("x"), py::arg("w"),
        py::arg("grain"), none);
  m.def("gemv_int8", &gemv_int8, "y = x @ (q * scales).T (+ residual), int8 weight, one scale per row", py::arg("x"),
        py::arg("q"), py::arg("scales"), py::arg("grain"), none);
  m.def("gemv_int4", &gemv_int4, "y = x @ dequant(packed).T (+ residual), int4 weight two per byte, a scale per group",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("group"), py::arg("grain"), none);
  m.def("gemv_int4_a8", &gemv_int4_a8, "as gemv_int4 with x rounded to int8 per 32 inputs (VNNI)", py::arg("x"),
        py::arg("packed"), py::arg("scales"), py::arg("group"), py::arg("grain"), none);
  m.def("gemv_int8_a16", &gemv_int8_a16, "as gemv_int8 with x rounded to int16 per 32 inputs (VNNI)", py::arg("x"),
        py::arg("q"), py::arg("scales"), py::arg("grain"), none);
  m.def("gemv_int4_a16", &gemv_int4_a16, "as gemv_int4 with x rounded to int16 per 32 inputs (VNNI)", py::arg("x"),
        py::arg("packed"), py::arg("scales"), py::arg("group"), py::arg("grain"), none);
  m.def("rms_norm_f32", &rms_norm_f32, "RMSNorm over the last dimension, float32, one pass per row");
  m.def("silu_mul_f32", &silu_mul_f32, "silu(gate) * up over a merged (rows, 2 * I) gate/up output, float32");
  m.def("rope_f32", &rope_f32, "RoPE on the first n_rot heads of (rows, heads * d) float32 rows, out of place");
  m.def("stream_sum", &stream_sum, "sum of a 2-D float32 tensor, rows split between threads (the read roof)");
}
#endif
