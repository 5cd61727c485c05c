// Weight-only int8 / int4 matrix products for decode on x86 CPUs with AVX-512 VNNI (engine/model/kernels.py).
//
// y = x @ W.T (+ bias) for float32 x [M, K] and a weight stored in blocks of 16 output rows: for each block and
// each pair of input columns (k, k+1), the 16 rows' two weights, row-major — so one 512-bit register holds
// 16 rows x 2 columns as int16 pairs and one VPDPWSSD multiplies them by the pair (x_k, x_k+1) and adds into
// the 16 rows' int32 sums. The activations are quantized per token to int16 (scale max|x| / 32767: relative
// error ~1.5e-5, far under the weights' own); the weights' bytes are what a decode step waits for, so the
// loop reads each weight byte once for up to 4 tokens.
//
// int8: [N/16, K/2, 16, 2] int8, one float scale per row; sums flushed to float every 256 columns, so
//   |sum| <= 256 * 127 * 32767 < 2^31 (no overflow).
// int4: [N/16, K/4, 32] uint8 per block and column quad, byte 4i + c = q[i, c] | q[i + 8, c] << 4 with q in
//   0..15; per group of 32 columns and row an fp16 scale and zero point ([N/16, K/32, 2, 16]): w = q * scale +
//   zero, so y = sum_g scale_g * (q . x)_g + zero_g * (sum of x over g). With a fifth bit (a GGUF's Q5_0
//   blocks, q in 0..31, zero = -16 * scale): one uint64 per block and quad, bit j set adds 16 to byte j of the
//   unpacked 64 (bytes 0..31: the low nibbles, rows 0..7; 32..63: the high nibbles, rows 8..15). The scales and
//   zero points may be float32 instead (a GGUF's Q4_K blocks: fp16 x 6-bit sub-scale, more than fp16 holds).
// int8 in groups (a GGUF's Q8_0 and Q6_K blocks): the int8 layout, with a scale per row and group of 16 or 32
//   columns ([N/16, K/group, 16], fp16 or float32) instead of per row: each group's int32 sums are scaled into
//   the float sums as the group ends.
#include <torch/types.h>  // torch::Tensor and the ATen ops (not torch/extension.h: its nn, optim and data headers
                           // took a third of the build)
#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's tensor casters
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace {

constexpr int64_t ROWS = 16;  // output rows per block (one register of int32 sums)
constexpr int BLOCKS = 4;     // blocks per tile: 64 rows, 4 independent sums per token
constexpr int TOKENS8 = 4;    // tokens per pass over a tile's weights: int8 (4 x 4 sums in registers)
constexpr int TOKENS4 = 4;    // ... int4 (two sums per block and token: 2 blocks x 4 x 2, or 4 x 2 x 2)
constexpr int64_t INT8_FLUSH = 128;  // column pairs summed in int32 before adding to the float sums
constexpr int64_t GROUP_QUADS = 8;   // column quads per int4 group (32 columns)

// 16 scales as floats, from fp16 (uint16_t bits) or float32
inline __m512 load16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// acc[b][m] = the int32 sums of column pairs p0 .. p1 - 1: each pair's 16 rows x 2 int8 weights widened to int16 and
// multiplied by the token's two int16 activations (one VPDPWSSD per block and token).
template <int TM>
inline __attribute__((always_inline)) void dot_pairs(const int8_t* w, int64_t k2, const int32_t* x, int64_t xstride,
                                                     int64_t p0, int64_t p1, __m512i (&acc)[BLOCKS][TM]) {
  for (int b = 0; b < BLOCKS; ++b)
    for (int m = 0; m < TM; ++m) acc[b][m] = _mm512_setzero_si512();
  for (int64_t p = p0; p < p1; ++p) {
    __m512i wv[BLOCKS];
    for (int b = 0; b < BLOCKS; ++b)
      wv[b] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + (b * k2 + p) * 32)));
    for (int m = 0; m < TM; ++m) {
      const __m512i xb = _mm512_set1_epi32(x[m * xstride + p]);
      for (int b = 0; b < BLOCKS; ++b) acc[b][m] = _mm512_dpwssd_epi32(acc[b][m], wv[b], xb);
    }
  }
}

// GP == 0: a scale per row (scale: [BLOCKS * 16] float), applied at the end, the int32 sums added to the float ones
// every INT8_FLUSH pairs. GP > 0: a scale per row and group of GP column pairs (scale: [BLOCKS][groups][16]), each
// group's sums scaled into the float ones as it ends.
template <int TM, int GP, typename S>
void tile_int8(const int8_t* w, int64_t k2, const int32_t* x, int64_t xstride, const S* scale, const float* sx,
               float* y, int64_t ystride) {
  constexpr int64_t SPAN = GP ? GP : INT8_FLUSH;
  const int64_t groups = GP ? k2 / GP : 0;
  __m512 f[BLOCKS][TM];
  for (int b = 0; b < BLOCKS; ++b)
    for (int m = 0; m < TM; ++m) f[b][m] = _mm512_setzero_ps();
  for (int64_t c = 0, g = 0; c < k2; c += SPAN, ++g) {
    __m512i acc[BLOCKS][TM];
    dot_pairs<TM>(w, k2, x, xstride, c, std::min(k2, c + SPAN), acc);
    for (int b = 0; b < BLOCKS; ++b) {
      if constexpr (GP > 0) {
        const __m512 s = load16(scale + (b * groups + g) * ROWS);
        for (int m = 0; m < TM; ++m) f[b][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[b][m]), s, f[b][m]);
      } else {
        for (int m = 0; m < TM; ++m) f[b][m] = _mm512_add_ps(f[b][m], _mm512_cvtepi32_ps(acc[b][m]));
      }
    }
  }
  for (int b = 0; b < BLOCKS; ++b)
    for (int m = 0; m < TM; ++m) {
      __m512 v = f[b][m];
      if constexpr (GP == 0) v = _mm512_mul_ps(v, load16(scale + b * ROWS));
      _mm512_storeu_ps(y + m * ystride + b * ROWS, _mm512_mul_ps(v, _mm512_set1_ps(sx[m])));
    }
}

// NB of the tile's blocks (the others' pointers are the caller's offsets): 2 blocks leave registers for 4 tokens' sums,
// so each unpacked weight serves twice the tokens. Every sum is added in the same order for any TM and NB.
template <int TM, bool HIGH, int NB, typename S>
void tile_int4(const uint8_t* w, const uint64_t* hb, int64_t k4, const S* sz, const int32_t* xl,
               const int32_t* xh, int64_t xstride, const float* xsum, int64_t groups, const float* sx, float* y,
               int64_t ystride) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m512i sixteen = _mm512_set1_epi8(16);
  __m512 f[NB][TM], z[NB][TM];
  for (int b = 0; b < NB; ++b)
    for (int m = 0; m < TM; ++m) f[b][m] = z[b][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i lo[NB][TM], hi[NB][TM];
    for (int b = 0; b < NB; ++b)
      for (int m = 0; m < TM; ++m) lo[b][m] = hi[b][m] = _mm512_setzero_si512();
    const int64_t p0 = g * GROUP_QUADS;
    for (int64_t p = p0; p < p0 + GROUP_QUADS; ++p) {
      __m512i wv[NB];
      for (int b = 0; b < NB; ++b) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(w + (b * k4 + p) * 32));
        const __m256i a = _mm256_and_si256(v, low), c = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        wv[b] = _mm512_inserti64x4(_mm512_castsi256_si512(a), c, 1);
        if (HIGH) wv[b] = _mm512_add_epi8(wv[b], _mm512_maskz_mov_epi8(hb[b * k4 + p], sixteen));
      }
      for (int m = 0; m < TM; ++m) {
        const __m512i l = _mm512_set1_epi32(xl[m * xstride + p]), h = _mm512_set1_epi32(xh[m * xstride + p]);
        for (int b = 0; b < NB; ++b) {
          lo[b][m] = _mm512_dpbusd_epi32(lo[b][m], wv[b], l);
          hi[b][m] = _mm512_dpbusd_epi32(hi[b][m], wv[b], h);
        }
      }
    }
    for (int b = 0; b < NB; ++b) {
      const S* s = sz + ((b * groups + g) * 2) * ROWS;
      const __m512 scale = load16(s), zero = load16(s + ROWS);
      for (int m = 0; m < TM; ++m) {
        const __m512i sum = _mm512_add_epi32(lo[b][m], _mm512_slli_epi32(hi[b][m], 7));
        f[b][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, f[b][m]);
        z[b][m] = _mm512_fmadd_ps(zero, _mm512_set1_ps(xsum[m * groups + g]), z[b][m]);
      }
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int m = 0; m < TM; ++m)
      _mm512_storeu_ps(y + m * ystride + b * ROWS, _mm512_fmadd_ps(f[b][m], _mm512_set1_ps(sx[m]), z[b][m]));
}

// Per token: the scale max|x| / limit (sx [M]) and the rounded values x / scale, handed to put(m, k, value) for
// k < K; the caller's buffers are zeroed past K.
template <typename Put>
void quantize(const float* xp, int64_t M, int64_t K, float limit, float* sx, Put&& put) {
  for (int64_t m = 0; m < M; ++m) {
    const float* row = xp + m * K;
    float mx = 0.f;
    for (int64_t k = 0; k < K; ++k) mx = std::max(mx, std::fabs(row[k]));
    const float s = mx > 0 ? mx / limit : 1.f, inv = 1.f / s;
    sx[m] = s;
    for (int64_t k = 0; k < K; ++k) put(m, k, (int32_t)std::nearbyint(row[k] * inv));
  }
}

// tile(t, m, tm): rows of tile t (64) for tokens m .. m + tm - 1, tm <= tokens. Tiles go a few at a time to whichever
// of torch's threads is free (OpenMP's dynamic schedule): with a static split one preempted thread holds up the product.
template <typename Tile>
void for_tiles(int64_t M, int64_t N, int64_t tokens, Tile&& tile) {
  const int64_t tiles = N / (ROWS * BLOCKS);
  const int threads = tiles >= 8 ? at::get_num_threads() : 1;
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads)
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t m = 0; m < M; m += tokens) tile(t, m, std::min<int64_t>(tokens, M - m));
}

void add_bias(torch::Tensor& y, const c10::optional<torch::Tensor>& bias) {
  if (bias.has_value() && bias->defined()) y.add_(*bias);
}

void check(const torch::Tensor& x, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "packed matmul: x must be a contiguous float32 CPU matrix");
  TORCH_CHECK(N % (ROWS * BLOCKS) == 0, "packed matmul: rows must be a multiple of 64");
}

}  // namespace

// The int8 kernel's tile for a scale per row (scale: [N] float32) or per row and group of GP pairs.
template <int GP, typename S>
void int8_tiles(int64_t M, int64_t N, int64_t k2, const int8_t* wp, const int32_t* xp, const S* sc, const float* sp,
                float* yp) {
  const int64_t per_block = GP ? k2 / GP * ROWS : ROWS;  // scales per block of 16 rows
  for_tiles(M, N, TOKENS8, [&](int64_t t, int64_t m, int64_t tm) {
    const int8_t* wt = wp + t * BLOCKS * k2 * 32;
    const S* st = sc + t * BLOCKS * per_block;
    const int32_t* xm = xp + m * k2;
    float* ym = yp + m * N + t * BLOCKS * ROWS;
    switch (tm) {
      case 1: tile_int8<1, GP>(wt, k2, xm, k2, st, sp + m, ym, N); break;
      case 2: tile_int8<2, GP>(wt, k2, xm, k2, st, sp + m, ym, N); break;
      case 3: tile_int8<3, GP>(wt, k2, xm, k2, st, sp + m, ym, N); break;
      default: tile_int8<4, GP>(wt, k2, xm, k2, st, sp + m, ym, N); break;
    }
  });
}

torch::Tensor int8_matmul(torch::Tensor x, torch::Tensor w, torch::Tensor scale, c10::optional<torch::Tensor> bias) {
  const int64_t M = x.size(0), k2 = w.size(1), N = w.size(0) * ROWS, K = x.size(1);
  check(x, N);
  TORCH_CHECK(w.scalar_type() == torch::kInt8 && w.size(2) == ROWS && w.size(3) == 2 && (K + 1) / 2 == k2 &&
              scale.is_contiguous(), "int8 matmul: packed weight's shape");
  // a scale per row (float32 [N]), or per row and group of 16 or 32 columns (fp16 or float32 [N/16, K/group, 16])
  const int64_t group = scale.numel() == N ? 0 : K * N / std::max<int64_t>(scale.numel(), 1);
  TORCH_CHECK(group == 0 ? scale.scalar_type() == torch::kFloat32
                         : (group == 16 || group == 32) && K % group == 0 && scale.numel() * group == N * K &&
                           (scale.scalar_type() == torch::kFloat32 || scale.scalar_type() == torch::kFloat16),
              "int8 matmul: the scales' shape (one per row, or per row and group of 16 or 32 columns)");
  auto xq = torch::empty({M, k2 * 2}, torch::kInt16);
  auto sx = torch::empty({M}, torch::kFloat32);
  int16_t* q = xq.data_ptr<int16_t>();
  if (K % 2)
    for (int64_t m = 0; m < M; ++m) q[m * k2 * 2 + K] = 0;
  quantize(x.data_ptr<float>(), M, K, 32767.f, sx.data_ptr<float>(),
           [&](int64_t m, int64_t k, int32_t v) { q[m * k2 * 2 + k] = (int16_t)v; });
  auto y = torch::empty({M, N}, torch::kFloat32);
  const int8_t* wp = w.data_ptr<int8_t>();
  const int32_t* xp = (const int32_t*)q;
  const float* sp = sx.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool half = scale.scalar_type() == torch::kFloat16;
  const float* sf = half ? nullptr : scale.data_ptr<float>();
  const uint16_t* sh = half ? (const uint16_t*)scale.data_ptr<at::Half>() : nullptr;
  if (group == 0) int8_tiles<0>(M, N, k2, wp, xp, sf, sp, yp);
  else if (group == 16 && half) int8_tiles<8>(M, N, k2, wp, xp, sh, sp, yp);
  else if (group == 16) int8_tiles<8>(M, N, k2, wp, xp, sf, sp, yp);
  else if (half) int8_tiles<16>(M, N, k2, wp, xp, sh, sp, yp);
  else int8_tiles<16>(M, N, k2, wp, xp, sf, sp, yp);
  add_bias(y, bias);
  return y;
}

torch::Tensor int4_matmul(torch::Tensor x, torch::Tensor w, torch::Tensor scale_zero, c10::optional<torch::Tensor> fifth,
                          c10::optional<torch::Tensor> bias) {
  const int64_t M = x.size(0), K = x.size(1), k4 = w.size(1), N = w.size(0) * ROWS, groups = K / 32;
  check(x, N);
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.size(2) == 32 && K % 32 == 0 && k4 * 4 == K &&
              (scale_zero.scalar_type() == torch::kFloat16 || scale_zero.scalar_type() == torch::kFloat32) &&
              scale_zero.numel() == N * groups * 2 && scale_zero.is_contiguous(),
              "int4 matmul: packed weight's shape");
  const bool five = fifth.has_value() && fifth->defined();
  TORCH_CHECK(!five || (fifth->scalar_type() == torch::kInt64 && fifth->numel() == (N / ROWS) * k4),
              "int4 matmul: the fifth bits' shape");
  const uint64_t* hp = five ? (const uint64_t*)fifth->data_ptr<int64_t>() : nullptr;
  // 15-bit activations split as x = 128 * high + low, low in 0..127 and high in -128..127 (both signed bytes)
  auto parts = torch::empty({2, M, K}, torch::kInt8);
  auto sums = torch::empty({M * groups + M}, torch::kFloat32);  // per token and group: the sum of x; then sx
  int8_t *low = parts.data_ptr<int8_t>(), *high = low + M * K;
  float* xs_ = sums.data_ptr<float>();
  const float* xf = x.data_ptr<float>();
  for (int64_t i = 0; i < M * groups; ++i) {
    float t = 0.f;
    for (int64_t j = 0; j < 32; ++j) t += xf[i * 32 + j];
    xs_[i] = t;
  }
  quantize(xf, M, K, 16383.f, xs_ + M * groups, [&](int64_t m, int64_t k, int32_t v) {
    low[m * K + k] = (int8_t)(v & 127);
    high[m * K + k] = (int8_t)(v >> 7);
  });
  auto y = torch::empty({M, N}, torch::kFloat32);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int32_t *xl = (const int32_t*)low, *xh = (const int32_t*)high;
  const float *sp = xs_ + M * groups, *xs = xs_;
  float* yp = y.data_ptr<float>();
  auto tiles = [&](auto* szp) {
    for_tiles(M, N, TOKENS4, [&](int64_t t, int64_t m, int64_t tm) {
      const uint8_t* wt = wp + t * BLOCKS * k4 * 32;
      const uint64_t* ht = five ? hp + t * BLOCKS * k4 : nullptr;
      const auto* st = szp + t * BLOCKS * groups * 2 * ROWS;
      const int64_t r = t * BLOCKS * ROWS;
      const int32_t *l = xl + m * k4, *h = xh + m * k4;
      const float *xsm = xs + m * groups, *sm = sp + m;
      float* ym = yp + m * N + r;
      // blocks b0 .. b0 + NB - 1 of the tile, for its TM tokens
      auto run = [&](auto tokens, auto blocks, int b0) {
        constexpr int TM = decltype(tokens)::value, NB = decltype(blocks)::value;
        const uint8_t* wb = wt + b0 * k4 * 32;
        const uint64_t* bits = five ? ht + b0 * k4 : nullptr;
        const auto* sb = st + b0 * groups * 2 * ROWS;
        float* yb = ym + b0 * ROWS;
        if (five) tile_int4<TM, true, NB>(wb, bits, k4, sb, l, h, k4, xsm, groups, sm, yb, N);
        else tile_int4<TM, false, NB>(wb, bits, k4, sb, l, h, k4, xsm, groups, sm, yb, N);
      };
      using std::integral_constant;
      if (tm == 1) run(integral_constant<int, 1>{}, integral_constant<int, BLOCKS>{}, 0);
      else if (tm == 2) run(integral_constant<int, 2>{}, integral_constant<int, BLOCKS>{}, 0);
      else
        for (int b0 = 0; b0 < BLOCKS; b0 += 2) {  // two blocks at a time: registers for 3 or 4 tokens' sums
          if (tm == 3) run(integral_constant<int, 3>{}, integral_constant<int, 2>{}, b0);
          else run(integral_constant<int, 4>{}, integral_constant<int, 2>{}, b0);
        }
    });
  };
  if (scale_zero.scalar_type() == torch::kFloat16) tiles((const uint16_t*)scale_zero.data_ptr<at::Half>());
  else tiles(scale_zero.data_ptr<float>());
  add_bias(y, bias);
  return y;
}

void bind_decoder(pybind11::module& m);  // decode_step.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_matmul", &int8_matmul, "y = x @ W.T (+ bias), W int8 per row or per group of 16 / 32 (packed)");
  m.def("int4_matmul", &int4_matmul, "y = x @ W.T (+ bias), W int4 or int5 per group of 32 (packed)");
  bind_decoder(m);
}
