// roundpipe.optim's compiled step kernels (built on first use by roundpipe/optim/native.py;
// without a compiler the step falls back to torch's kernels, see [Note: the compiled step] in
// roundpipe/optim/native.py). Two ops, registered as torch.ops.roundpipe_optim.*:
//
// exact_step: Adam/AdamW with the master->model copy in the same pass over memory. The work
//   (every tensor cut into pieces of `piece` elements, a multiple of 256) is split once over
//   the intra-op threads; each thread runs, per piece, torch's own fused Adam kernel on views
//   of the piece (at::_fused_adam(w)_, inline: a parallel region does not nest) and then
//   torch's cast of the piece's master into the low-precision copy, while the piece is still
//   in cache. Torch's kernel on a view computes every element as on the whole tensor as long
//   as the view starts at a multiple of the vector width (see [Note: state on disk] in
//   roundpipe/optim/spill.py), and the cast is torch's copy_: so masters, moments and the copy
//   are bitwise those of torch's fused step followed by copy_.
//
// lean_step: Adam/AdamW with bf16 moments (kind 1) or 8-bit blockwise moments (kind 2), the
//   update computed in fp32, and the low-precision copy written in the same pass. The
//   arithmetic is IEEE single operations only, in a fixed order (no contraction into FMA: the
//   file is compiled with -ffp-contract=off), so the AVX2 path, the scalar path and the torch
//   reference in roundpipe/optim/lean.py give the same bits. See [Note: lean moments] there
//   for the formats.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ops/_fused_adam_ops.h>
#include <ATen/ops/_fused_adamw_ops.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define RP_AVX2 1
#else
#define RP_AVX2 0
#endif

namespace {

constexpr int64_t kBlock = 256;  // elements per 8-bit block (one absmax each)

struct Piece {
  int64_t tensor;
  int64_t start;
  int64_t length;
};

std::vector<Piece> cut(const std::vector<int64_t>& numels, int64_t piece) {
  TORCH_CHECK(piece > 0 && piece % kBlock == 0, "piece must be a positive multiple of 256");
  std::vector<Piece> pieces;
  for (int64_t t = 0; t < static_cast<int64_t>(numels.size()); ++t) {
    for (int64_t s = 0; s < numels[t]; s += piece) {
      pieces.push_back({t, s, std::min(piece, numels[t] - s)});
    }
  }
  return pieces;
}

at::Tensor slice(const at::Tensor& t, const Piece& p) {
  return t.view({-1}).narrow(0, p.start, p.length);
}

void check_cpu_contiguous(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), what, " must be contiguous CPU tensors");
}

void cast_to_low(const float* src, void* dst, at::ScalarType dtype, int64_t n,
                 bool stream);
bool streams_copies(int64_t numel);
void widen(const uint16_t* src, bool half, float* dst, int64_t n);

// ------------------------------------------------------------------------------------------
// exact_step

void exact_step(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs,
    at::TensorList max_exp_avg_sqs,
    at::TensorList steps,
    at::TensorList lows,
    double lr,
    double beta1,
    double beta2,
    double weight_decay,
    double eps,
    bool amsgrad,
    bool maximize,
    bool adamw,
    const std::optional<at::Tensor>& grad_scale,
    int64_t piece) {
  const auto n = static_cast<int64_t>(params.size());
  TORCH_CHECK(
      static_cast<int64_t>(grads.size()) == n && static_cast<int64_t>(exp_avgs.size()) == n &&
          static_cast<int64_t>(exp_avg_sqs.size()) == n &&
          static_cast<int64_t>(steps.size()) == n && static_cast<int64_t>(lows.size()) == n &&
          (!amsgrad || static_cast<int64_t>(max_exp_avg_sqs.size()) == n),
      "exact_step: lists of different lengths");
  std::vector<int64_t> numels;
  for (int64_t i = 0; i < n; ++i) {
    for (const auto* t : {&params[i], &grads[i], &exp_avgs[i], &exp_avg_sqs[i], &lows[i]}) {
      check_cpu_contiguous(*t, "exact_step's tensors");
      TORCH_CHECK(t->numel() == params[i].numel(), "exact_step: sizes differ");
    }
    const auto low = lows[i].scalar_type();
    TORCH_CHECK(low == at::kBFloat16 || low == at::kHalf || low == at::kFloat ||
                params[i].scalar_type() != at::kFloat,
                "exact_step: the copy of an fp32 master is bf16, fp16 or fp32");
    const auto gdt = grads[i].scalar_type();
    TORCH_CHECK(gdt == params[i].scalar_type() ||
                    (params[i].scalar_type() == at::kFloat &&
                     (gdt == at::kBFloat16 || gdt == at::kHalf)),
                "exact_step: a gradient in the master's dtype, or bf16/fp16 for an fp32 master");
    numels.push_back(params[i].numel());
  }
  const auto pieces = cut(numels, piece);
  const auto keys = c10::DispatchKeySet(c10::DispatchKey::CPU);
  const bool stream = streams_copies(std::accumulate(numels.begin(), numels.end(), int64_t{0}));
  at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t b, int64_t e) {
    // Plain tensors here (the caller passes detached ones): no autograd, no version bumps
    // (the caller bumps the versions of what the step wrote).
    at::AutoDispatchBelowADInplaceOrView below;
    for (int64_t i = b; i < e; ++i) {
      const Piece& pc = pieces[i];
      const auto t = pc.tensor;
      std::vector<at::Tensor> p{slice(params[t], pc)}, g{slice(grads[t], pc)},
          m{slice(exp_avgs[t], pc)}, v{slice(exp_avg_sqs[t], pc)}, s{steps[t]}, mx;
      if (g[0].scalar_type() != p[0].scalar_type()) {  // [Note: low-precision gradients]
        // into this thread's buffer, reused piece after piece (an allocation of a piece's
        // size would map and unmap pages each time)
        thread_local std::vector<float> wide;
        if (static_cast<int64_t>(wide.size()) < pc.length) wide.resize(pc.length);
        widen(static_cast<const uint16_t*>(g[0].data_ptr()), g[0].scalar_type() == at::kHalf,
              wide.data(), pc.length);
        g[0] = at::from_blob(wide.data(), {pc.length}, at::TensorOptions().dtype(at::kFloat));
      }
      if (amsgrad) mx.push_back(slice(max_exp_avg_sqs[t], pc));
      if (adamw) {
        at::_ops::_fused_adamw_::redispatch(
            keys, p, g, m, v, mx, s, lr, beta1, beta2, weight_decay, eps, amsgrad, maximize,
            grad_scale, std::nullopt);
      } else {
        at::_ops::_fused_adam_::redispatch(
            keys, p, g, m, v, mx, s, lr, beta1, beta2, weight_decay, eps, amsgrad, maximize,
            grad_scale, std::nullopt);
      }
      const at::Tensor& low = lows[t];
      if (params[t].scalar_type() == at::kFloat) {
        cast_to_low(params[t].data_ptr<float>() + pc.start,
                    static_cast<char*>(low.data_ptr()) + pc.start * low.element_size(),
                    low.scalar_type(), pc.length, stream);
      } else {
        slice(low, pc).copy_(p[0]);
      }
    }
  });
}

// ------------------------------------------------------------------------------------------
// lean_step: the scalar definitions (the reference for every path)

struct Hyper {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay, weight_decay;
  bool adamw, maximize, has_scale;
  float scale;
};

struct Map {  // one 8-bit map (see [Note: lean moments] in lean.py)
  float offset[8];  // O[k]: value(2^k + f) = O[k] + S[k] * (f + 1)
  float step[8];    // S[k]
  float scale[8];   // A[k], B[k]: t = z * A[k] + B[k] is f at z = y * 16^(G-1-k)
  float shift[8];
  int groups;  // G: k runs over 0 .. G-1, the depth e = G-1-k
  bool is_signed;
};

inline uint16_t bf16_bits(float x) {  // round to nearest even; NaN 0xFFFF, as torch's copy_
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if (std::isnan(x)) return 0xFFFF;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float from_bf16_bits(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// [Note: low-precision gradients]
// A master's gradient may be bf16 or fp16 (the sums the device made in device_grad_dtype, handed
// over as they are: Adam(grad_dtype=...)). Each kernel reads it as the fp32 value it is, exactly
// (every bf16 and fp16 value is an fp32 value), so the step gives the bits the same gradient in
// fp32 gives, reading 2 bytes instead of 4. The exact step converts one piece at a time (a
// piece stays in cache); the lean kernels convert as they load.
inline float half_bits_to_float(uint16_t h) {
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

inline float map_value(const Map& map, int mag) {  // value of a magnitude code (0 .. 2^groups-1)
  if (mag == 0) return 0.0f;
  int k = 31 - __builtin_clz(static_cast<unsigned>(mag));
  float f1 = static_cast<float>(mag - (1 << k) + 1);
  float scaled = map.step[k] * f1;
  return map.offset[k] + scaled;
}

inline float dequant(const Map& map, uint8_t code, float absmax) {
  if (map.is_signed) {
    float v = map_value(map, code & 0x7F) * absmax;
    return (code & 0x80) ? -v : v;
  }
  return map_value(map, code) * absmax;
}

inline uint8_t quant(const Map& map, float x, float inv) {
  uint32_t xbits;
  std::memcpy(&xbits, &x, 4);
  float y = std::fabs(x) * inv;  // unsigned: x >= 0 (a -0.0 is 0)
  if (std::isnan(y)) y = 0.0f;
  uint32_t bits;
  std::memcpy(&bits, &y, 4);
  // depth e: y in [16^-(e+1), 16^-e); deeper than the last group: code 0
  const int exponent = static_cast<int>(bits >> 23) - 127;
  const int e = std::max((-exponent - 1) >> 2, 0);
  uint32_t code = 0;
  if (e < map.groups) {
    const int k = map.groups - 1 - e;
    uint32_t zbits = bits + (static_cast<uint32_t>(4 * e) << 23);  // z = y * 16^e, exactly
    float z;
    std::memcpy(&z, &zbits, 4);
    float t = z * map.scale[k];
    t = t + map.shift[k];
    t = std::min(std::max(t, -1.0f), 255.0f);
    int f = static_cast<int>(std::nearbyint(t));  // to nearest, ties to even
    f = std::min(f, (1 << k) - 1);
    code = static_cast<uint32_t>((1 << k) + f);  // f = -1: the top value of the group below
  }
  if (map.is_signed && (xbits >> 31)) code |= 0x80;
  return static_cast<uint8_t>(code);
}

// step_neg = f32(-lr / bc1 * sqrt(bc2)), eps = f32(eps * sqrt(bc2)): the bias corrections
// folded into two per-tensor constants, so one division per element (see lean.py's note).
inline void adam_scalar(
    const Hyper& h, float step_neg, float eps, float& p, float g, float& m, float& v) {
  if (h.has_scale) g = g / h.scale;
  if (h.maximize) g = g * -1.0f;
  if (h.weight_decay != 0.0f) {
    if (h.adamw) {
      p = p * h.decay;
    } else {
      float t = p * h.weight_decay;
      g = g + t;
    }
  }
  float t1 = m * h.beta1;
  float t2 = g * h.one_minus_beta1;
  m = t1 + t2;
  float t3 = v * h.beta2;
  float t4 = g * g;
  float t5 = t4 * h.one_minus_beta2;
  v = t3 + t5;
  float d = std::sqrt(v);
  d = d + eps;
  float u = step_neg * m;
  u = u / d;
  p = p + u;
}

inline void store_low(at::ScalarType dtype, void* low, int64_t i, float p) {
  if (dtype == at::kBFloat16) {
    static_cast<uint16_t*>(low)[i] = bf16_bits(p);
  } else if (dtype == at::kHalf) {
    static_cast<c10::Half*>(low)[i] = c10::Half(p);
  } else {
    static_cast<float*>(low)[i] = p;
  }
}

#if RP_AVX2
// ------------------------------------------------------------------------------------------
// lean_step: AVX2 (8 lanes), the same operations in the same order as the scalar code

struct HyperV {
  __m256 beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay, weight_decay, scale,
      minus_one;
};

inline __m256 adam_v(
    const Hyper& h, const HyperV& hv, __m256 step_neg, __m256 eps, __m256& p, __m256 g,
    __m256& m, __m256& v) {
  if (h.has_scale) g = _mm256_div_ps(g, hv.scale);
  if (h.maximize) g = _mm256_mul_ps(g, hv.minus_one);
  if (h.weight_decay != 0.0f) {
    if (h.adamw) {
      p = _mm256_mul_ps(p, hv.decay);
    } else {
      g = _mm256_add_ps(g, _mm256_mul_ps(p, hv.weight_decay));
    }
  }
  m = _mm256_add_ps(_mm256_mul_ps(m, hv.beta1), _mm256_mul_ps(g, hv.one_minus_beta1));
  v = _mm256_add_ps(
      _mm256_mul_ps(v, hv.beta2), _mm256_mul_ps(_mm256_mul_ps(g, g), hv.one_minus_beta2));
  __m256 d = _mm256_add_ps(_mm256_sqrt_ps(v), eps);
  p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(step_neg, m), d));
  return p;
}

// 8 floats -> their bf16 bits in the low half of each lane (round to nearest even, NaN 0xFFFF)
inline __m256i bf16_lanes(__m256 x) {
  __m256i u = _mm256_castps_si256(x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0xFFFF), nan);
}

inline __m128i bf16_v(__m256 x) {  // 8 floats -> 8 bf16
  __m256i r = bf16_lanes(x);
  __m256i packed = _mm256_packus_epi32(r, r);  // lanes: [0..3 0..3 | 4..7 4..7]
  packed = _mm256_permute4x64_epi64(packed, 0x08);
  return _mm256_castsi256_si128(packed);
}

inline __m256 from_bf16_v(const uint16_t* src) {
  __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}

inline void store_low_v(at::ScalarType dtype, void* low, int64_t i, __m256 p) {
  if (dtype == at::kBFloat16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(low) + i), bf16_v(p));
  } else if (dtype == at::kHalf) {
    _mm_storeu_si128(
        reinterpret_cast<__m128i*>(static_cast<uint16_t*>(low) + i),
        _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    _mm256_storeu_ps(static_cast<float*>(low) + i, p);
  }
}

// 16 floats to the copy (bf16: one lane-crossing permute for both halves)
inline void store_low16(at::ScalarType dtype, void* low, int64_t i, __m256 p0, __m256 p1) {
  if (dtype == at::kBFloat16) {
    __m256i packed = _mm256_packus_epi32(bf16_lanes(p0), bf16_lanes(p1));
    packed = _mm256_permute4x64_epi64(packed, 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(low) + i), packed);
  } else {
    store_low_v(dtype, low, i, p0);
    store_low_v(dtype, low, i + 8, p1);
  }
}

// [Note: the copy's streaming stores]
// The low-precision copy is written, never read, by the step: a plain store first reads each
// line it writes into the cache (2 bytes a parameter of a bf16 copy more than the step must
// move), a non-temporal store writes the line whole, past the caches. A step of at least
// kStreamNumel parameters (what it moves, 290 MB and more, is far beyond any cache, so
// nothing it writes is still cached when the copy is next read) streams its bf16 and fp16
// copies where 16 consecutive bytes start at a multiple of 16 (the whole run, when its first
// element does); a smaller step, which may run from the cache, stores them plainly. The writes
// are fenced before the kernel returns, so the thread that waits for the step sees them. The
// values are store_low_v's either way. Measured (benchmarks/bench_copy_stores.py, 2 cores):
// 5-17% off the exact and bf16-moment steps at 100M parameters, 6-10% at 32M, none at 8M,
// worse at 2M (benchmarks/results/optim.md).
//
// Whether the copy can be streamed from its element i on (its dtype and alignment).
inline bool streams(at::ScalarType dtype, const void* low, int64_t i) {
  return (dtype == at::kBFloat16 || dtype == at::kHalf) &&
         (reinterpret_cast<uintptr_t>(static_cast<const uint16_t*>(low) + i) & 15) == 0;
}

inline void stream_low_v(at::ScalarType dtype, void* low, int64_t i, __m256 p) {
  __m128i bits = dtype == at::kBFloat16
                     ? bf16_v(p)
                     : _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm_stream_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(low) + i), bits);
}

#endif  // RP_AVX2

constexpr int64_t kStreamNumel = int64_t{1} << 24;

// Whether a step of `numel` parameters streams its copies: ROUNDPIPE_COPY_STORES=plain (read
// once; benchmarks/bench_copy_stores.py's other contender) never, else from kStreamNumel.
bool streams_copies(int64_t numel) {
  static const bool plain = [] {
    const char* how = std::getenv("ROUNDPIPE_COPY_STORES");
    return how != nullptr && std::string(how) == "plain";
  }();
  return !plain && numel >= kStreamNumel;
}

void widen(const uint16_t* src, bool half, float* dst, int64_t n) {  // bf16/fp16 -> fp32
  int64_t i = 0;
#if RP_AVX2
  if (half) {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                    reinterpret_cast<const __m128i*>(src + i))));
  } else {
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, from_bf16_v(src + i));
  }
#endif
  for (; i < n; ++i) dst[i] = half ? half_bits_to_float(src[i]) : from_bf16_bits(src[i]);
}

// The low-precision copy of n fp32 values: torch's copy_ bit for bit (round to nearest even;
// NaN: bf16 0xFFFF, fp16 the F16C/c10 quiet NaN); `stream`: with non-temporal stores where
// the copy allows them (see [Note: the copy's streaming stores]).
void cast_to_low(const float* src, void* dst, at::ScalarType dtype, int64_t n, bool stream) {
  int64_t i = 0;
#if RP_AVX2
  if (stream && streams(dtype, dst, 0)) {
    for (; i + 8 <= n; i += 8) stream_low_v(dtype, dst, i, _mm256_loadu_ps(src + i));
    _mm_sfence();
  }
  for (; i + 8 <= n; i += 8) store_low_v(dtype, dst, i, _mm256_loadu_ps(src + i));
#else
  (void)stream;  // the scalar path stores plainly
#endif
  for (; i < n; ++i) store_low(dtype, dst, i, src[i]);
}

#if RP_AVX2
// The vector maps: by group k, offset, step, scale, shift as in Map (the general quantizer);
// by depth e (the fast quantizer), scale and shift of group k = G-1-e.
struct MapV {
  __m256 offset, step, scale, shift;
  __m256 scale_e, shift_e;
};

MapV make_map_v(const Map& map) {
  alignas(32) float scale_e[8] = {}, shift_e[8] = {};
  for (int k = 0; k < map.groups; ++k) {
    scale_e[map.groups - 1 - k] = map.scale[k];
    shift_e[map.groups - 1 - k] = map.shift[k];
  }
  return {_mm256_loadu_ps(map.offset), _mm256_loadu_ps(map.step), _mm256_loadu_ps(map.scale),
          _mm256_loadu_ps(map.shift), _mm256_load_ps(scale_e), _mm256_load_ps(shift_e)};
}

// 8 codes (int32 lanes, 0..255) -> values times absmax. The value of magnitude c in group k,
// O[k] + S[k] * (c - 2^k + 1), is (15c + 15 - 14 * 2^k) * 2^(3k - 4G) (see _map in lean.py):
// computed so, with 2^k the float c's exponent bits (0 for c = 0, which gives 0), every
// product and sum exact (at most 12 significant bits times a power of two) and so the value
// map_value() finds; no table lookup (lane-crossing permutes are slow on some AVX2 cores).
template <bool Signed, int G>
inline __m256 dequant_v(__m256i code, __m256 absmax) {
  __m256i mag = Signed ? _mm256_and_si256(code, _mm256_set1_epi32(0x7F)) : code;
  __m256 c = _mm256_cvtepi32_ps(mag);
  __m256 pow2k = _mm256_and_ps(c, _mm256_castsi256_ps(_mm256_set1_epi32(0x7F800000)));
  const float s = std::ldexp(1.0f, -4 * G);
  __m256 n = _mm256_add_ps(_mm256_mul_ps(c, _mm256_set1_ps(15 * s)), _mm256_set1_ps(15 * s));
  n = _mm256_sub_ps(n, _mm256_mul_ps(pow2k, _mm256_set1_ps(14 * s)));
  __m256 val = _mm256_mul_ps(n, _mm256_mul_ps(_mm256_mul_ps(pow2k, pow2k), pow2k));
  val = _mm256_mul_ps(val, absmax);
  if (Signed) {
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(0x80)), 24);
    val = _mm256_xor_ps(val, _mm256_castsi256_ps(sign));
  }
  return val;
}

// 8 values -> codes (int32 lanes), as the scalar quant() finds them; G groups
template <bool Signed, int G>
inline __m256i quant_v(const MapV& mv, __m256 x, __m256 inv) {
  __m256 y = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_set1_epi32(0x80000000)), x);
  y = _mm256_mul_ps(y, inv);
  y = _mm256_andnot_ps(_mm256_cmp_ps(y, y, _CMP_UNORD_Q), y);  // NaN -> 0
  __m256i bits = _mm256_castps_si256(y);
  __m256i exponent = _mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127));
  __m256i e = _mm256_srai_epi32(_mm256_sub_epi32(_mm256_set1_epi32(-1), exponent), 2);
  e = _mm256_max_epi32(e, _mm256_setzero_si256());
  __m256i deep = _mm256_cmpgt_epi32(e, _mm256_set1_epi32(G - 1));
  __m256i k = _mm256_sub_epi32(_mm256_set1_epi32(G - 1), e);
  __m256 z = _mm256_castsi256_ps(_mm256_add_epi32(bits, _mm256_slli_epi32(e, 25)));
  __m256 t = _mm256_mul_ps(z, _mm256_permutevar8x32_ps(mv.scale, k));
  t = _mm256_add_ps(t, _mm256_permutevar8x32_ps(mv.shift, k));
  // t >= -1 (up to rounding, and below -1 it rounds to -1 anyway): only the top needs a clamp
  t = _mm256_min_ps(t, _mm256_set1_ps(255.0f));
  __m256i f = _mm256_cvtps_epi32(t);  // to nearest, ties to even (MXCSR's default)
  __m256i pow2k = _mm256_sllv_epi32(_mm256_set1_epi32(1), k);
  f = _mm256_min_epi32(f, _mm256_sub_epi32(pow2k, _mm256_set1_epi32(1)));
  __m256i code = _mm256_andnot_si256(deep, _mm256_add_epi32(pow2k, f));
  if (Signed) {
    __m256i sign = _mm256_srli_epi32(_mm256_castps_si256(x), 31);
    code = _mm256_or_si256(code, _mm256_slli_epi32(sign, 7));
  }
  return code;
}

// [Note: the fast quantizer]
// quant_v handles any y = |x| * inv: NaN (code 0), above 1 or infinite (clamped to the top
// code), below the deepest group (code 0). In a block whose new absmax a is finite, with a
// finite inverse and no NaN (nearly every block), y is a number in [0, 1 + 2^-15] (|x| <= a,
// and 1/a rounded, subnormal too, is within 2^-21 of the quotient), and there quant_fast_v
// gives the same codes with fewer operations: no NaN test, no clamps (t stays below 2^k - 1/2
// there), the depth clamped to the deepest group instead of masked (below it, t < -1.375 rounds
// to -1 or -2: code 0 or -1, which the unsigned saturation of the packing makes 0), the sign
// packed from the floats' bits. An exact copy of what it computes for every float y in that
// range, both maps and both signs, was checked against quant() (2^30 values each); the tests
// check a dense sweep (tests/test_optim_lean.py). The unsigned map takes x as it is: the block
// kernel sends a block with a negative (or -0.0) second moment, which only a corrupt state
// makes, to quant_v.
template <bool Signed, int G>
inline __m256i quant_fast_v(const MapV& mv, __m256 x, __m256 inv) {
  __m256 y = Signed ? _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))) : x;
  __m256i bits = _mm256_castps_si256(_mm256_mul_ps(y, inv));
  // 4e << 23 for the depth e = clamp(floor((126 - E) / 4), 0, G-1) of the exponent field E;
  // 126 - E in the top 16 bits of 0x3F7FFFFF - bits, which no borrow reaches
  __m256i e4 = _mm256_and_si256(
      _mm256_subs_epu16(_mm256_set1_epi32(0x3F7FFFFF), bits), _mm256_set1_epi32(0xFE000000));
  e4 = _mm256_min_epi32(e4, _mm256_set1_epi32((G - 1) << 25));
  __m256 z = _mm256_castsi256_ps(_mm256_add_epi32(bits, e4));
  __m256i e = _mm256_srli_epi32(e4, 25);
  __m256 t = _mm256_mul_ps(z, _mm256_permutevar8x32_ps(mv.scale_e, e));
  t = _mm256_add_ps(t, _mm256_permutevar8x32_ps(mv.shift_e, e));
  __m256i f = _mm256_cvtps_epi32(t);
  __m256i k = _mm256_sub_epi32(_mm256_set1_epi32(G - 1), e);
  return _mm256_add_epi32(_mm256_sllv_epi32(_mm256_set1_epi32(1), k), f);
}

// 32 codes from quant_fast_v (c[0..3]) of x[0..3] to dst, in order.
template <bool Signed>
inline void store_codes32_fast(uint8_t* dst, const __m256i* c, const __m256* x) {
  // unsigned saturation: the negative numbers of code 0 become 0
  __m256i codes = _mm256_packus_epi16(
      _mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
  if (Signed) {  // the sign bits by signed saturation of the floats' bits, in the same order
    __m256i signs = _mm256_packs_epi16(
        _mm256_packs_epi32(_mm256_castps_si256(x[0]), _mm256_castps_si256(x[1])),
        _mm256_packs_epi32(_mm256_castps_si256(x[2]), _mm256_castps_si256(x[3])));
    codes = _mm256_or_si256(codes, _mm256_and_si256(signs, _mm256_set1_epi8(-128)));
  }
  codes = _mm256_permutevar8x32_epi32(codes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), codes);
}

inline __m256i load_codes(const uint8_t* src) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
}

inline void store_codes32(uint8_t* dst, __m256i a, __m256i b, __m256i c, __m256i d) {
  __m256i ab = _mm256_packus_epi32(a, b);
  __m256i cd = _mm256_packus_epi32(c, d);
  __m256i abcd = _mm256_packus_epi16(ab, cd);
  abcd = _mm256_permutevar8x32_epi32(abcd, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), abcd);
}

inline float hmax(__m256 x) {
  __m128 lo = _mm256_castps256_ps128(x), hi = _mm256_extractf128_ps(x, 1);
  lo = _mm_max_ps(lo, hi);
  lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_max_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}
#endif  // RP_AVX2

struct LeanTensors {
  float* p;
  const float* g;          // nullptr: the gradient is g16's
  const uint16_t* g16;     // a bf16 or fp16 gradient (see [Note: low-precision gradients])
  bool g16_half;
  void* m;  // uint16 (bf16 bits) or uint8 codes
  void* v;
  float* m_absmax;
  float* v_absmax;
  void* low;  // nullptr: no copy
  at::ScalarType low_dtype;
  bool stream;  // the step streams its copies (see [Note: the copy's streaming stores])
  float step_neg;  // f32(-lr / bc1 * sqrt(bc2))
  float eps;       // f32(eps * sqrt(bc2))
};

// How a kernel reads 8 gradients (see [Note: low-precision gradients]): fp32, bf16 or fp16.
enum class GradKind { kFloat, kBf16, kHalf };

template <GradKind K>
inline float grad_at(const void* g, int64_t i) {
  if (K == GradKind::kFloat) return static_cast<const float*>(g)[i];
  const uint16_t h = static_cast<const uint16_t*>(g)[i];
  return K == GradKind::kHalf ? half_bits_to_float(h) : from_bf16_bits(h);
}

#if RP_AVX2
template <GradKind K>
inline __m256 grads_at(const void* g, int64_t i) {
  if (K == GradKind::kFloat) return _mm256_loadu_ps(static_cast<const float*>(g) + i);
  const uint16_t* h = static_cast<const uint16_t*>(g) + i;
  if (K == GradKind::kHalf)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
  return from_bf16_v(h);
}
#endif

// f(kind, g): f called with t's gradient, its kind a compile-time constant
// (std::integral_constant<GradKind, K>), so that each kernel has one loop per gradient dtype.
template <typename F>
void with_grads(const LeanTensors& t, F&& f) {
  if (t.g) {
    f(std::integral_constant<GradKind, GradKind::kFloat>{}, static_cast<const void*>(t.g));
  } else if (t.g16_half) {
    f(std::integral_constant<GradKind, GradKind::kHalf>{}, static_cast<const void*>(t.g16));
  } else {
    f(std::integral_constant<GradKind, GradKind::kBf16>{}, static_cast<const void*>(t.g16));
  }
}

float nan_aware_absmax(const float* x, int64_t n, bool is_signed) {
  float best = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    float a = is_signed ? std::fabs(x[i]) : x[i];
    if (std::isnan(a)) nan = true;
    else if (a > best) best = a;
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : best;
}

inline float inverse(float absmax) {  // 0 for an all-zero block (every code 0), else 1/absmax
  return absmax > 0.0f ? 1.0f / absmax : (std::isnan(absmax) ? absmax : 0.0f);
}

// One block (n <= 256 elements from `start`) of an 8-bit tensor, scalar.
template <GradKind K>
void block8_scalar(const Hyper& h, const Map& mm, const Map& vm, const LeanTensors& t,
                   const void* g, int64_t start, int64_t n) {
  float mbuf[kBlock], vbuf[kBlock];
  auto* mq = static_cast<uint8_t*>(t.m) + start;
  auto* vq = static_cast<uint8_t*>(t.v) + start;
  const int64_t blk = start / kBlock;
  const float ma = t.m_absmax[blk], va = t.v_absmax[blk];
  for (int64_t i = 0; i < n; ++i) {
    float p = t.p[start + i];
    float m = dequant(mm, mq[i], ma), v = dequant(vm, vq[i], va);
    adam_scalar(h, t.step_neg, t.eps, p, grad_at<K>(g, start + i), m, v);
    t.p[start + i] = p;
    if (t.low) store_low(t.low_dtype, t.low, start + i, p);
    mbuf[i] = m;
    vbuf[i] = v;
  }
  const float nma = nan_aware_absmax(mbuf, n, true), nva = nan_aware_absmax(vbuf, n, false);
  t.m_absmax[blk] = nma;
  t.v_absmax[blk] = nva;
  const float mi = inverse(nma), vi = inverse(nva);
  for (int64_t i = 0; i < n; ++i) {
    mq[i] = quant(mm, mbuf[i], mi);
    vq[i] = quant(vm, vbuf[i], vi);
  }
}

#if RP_AVX2
// [Note: the 8-bit block]
// The AVX2 8-bit step takes a block of 256 in three loops over a buffer of its fp32 moments,
// which stays in L1: decode (codes to values), update (Adam, and the new absmaxes) and encode
// (the codes, and the low-precision copy of the block's updated masters). Measured on an AMD
// EPYC (Zen 3), one block's work at a time: decoding in a loop of its own, rather than inside
// the update, and the copy beside the encoding, rather than behind the update's square root
// and division, each took a tenth or more off the block. The results are the scalar path's:
// only where independent work is done changes.
struct Block8 {
  alignas(32) float m[kBlock];
  alignas(32) float v[kBlock];
};

template <GradKind K>
void block8_avx2(
    const Hyper& h, const HyperV& hv, const MapV& mm, const MapV& vm, const LeanTensors& t,
    const void* g, int64_t start) {
  Block8 b;
  const int64_t blk = start / kBlock;
  auto* const mq = static_cast<uint8_t*>(t.m) + start;
  auto* const vq = static_cast<uint8_t*>(t.v) + start;
  float* const pp = t.p + start;
  const __m256 ma = _mm256_set1_ps(t.m_absmax[blk]), va = _mm256_set1_ps(t.v_absmax[blk]);
  for (int64_t i = 0; i < kBlock; i += 8) {
    _mm256_store_ps(b.m + i, dequant_v<true, 7>(load_codes(mq + i), ma));
    _mm256_store_ps(b.v + i, dequant_v<false, 8>(load_codes(vq + i), va));
  }

  const __m256 sn = _mm256_set1_ps(t.step_neg), ep = _mm256_set1_ps(t.eps);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 mmax = _mm256_setzero_ps(), vmax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  __m256 vsign = _mm256_setzero_ps();
  for (int64_t i = 0; i < kBlock; i += 8) {
    __m256 p = _mm256_loadu_ps(pp + i);
    __m256 m = _mm256_load_ps(b.m + i), v = _mm256_load_ps(b.v + i);
    adam_v(h, hv, sn, ep, p, grads_at<K>(g, start + i), m, v);
    _mm256_storeu_ps(pp + i, p);
    _mm256_store_ps(b.m + i, m);
    _mm256_store_ps(b.v + i, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(m, v, _CMP_UNORD_Q));  // either is NaN
    mmax = _mm256_max_ps(mmax, _mm256_and_ps(m, abs_mask));
    vmax = _mm256_max_ps(vmax, v);
    vsign = _mm256_or_ps(vsign, v);
  }
  float nma = hmax(mmax), nva = hmax(vmax);
  if (_mm256_movemask_ps(nan)) {  // rare: redo the maxima with the scalar NaN rule
    nma = nan_aware_absmax(b.m, kBlock, true);
    nva = nan_aware_absmax(b.v, kBlock, false);
  }
  t.m_absmax[blk] = nma;
  t.v_absmax[blk] = nva;

  const float mif = inverse(nma), vif = inverse(nva);
  const __m256 mi = _mm256_set1_ps(mif), vi = _mm256_set1_ps(vif);
  const bool fast = std::isfinite(nma) && std::isfinite(mif) && std::isfinite(nva) &&
                    std::isfinite(vif) && !_mm256_movemask_ps(vsign);
  void* const low = t.low;
  const at::ScalarType low_dtype = t.low_dtype;
  // see [Note: the copy's streaming stores]
  const bool stream = low && t.stream && streams(low_dtype, low, start);
  for (int64_t i = 0; i < kBlock; i += 32) {
    if (stream) {
      for (int j = 0; j < 32; j += 8) {
        stream_low_v(low_dtype, low, start + i + j, _mm256_loadu_ps(pp + i + j));
      }
    } else if (low) {
      store_low16(low_dtype, low, start + i, _mm256_loadu_ps(pp + i), _mm256_loadu_ps(pp + i + 8));
      store_low16(low_dtype, low, start + i + 16, _mm256_loadu_ps(pp + i + 16),
                  _mm256_loadu_ps(pp + i + 24));
    }
    if (fast) {  // see [Note: the fast quantizer]
      __m256 mx[4], vx[4];
      __m256i mc[4], vc[4];
      for (int j = 0; j < 4; ++j) {
        mx[j] = _mm256_load_ps(b.m + i + 8 * j);
        vx[j] = _mm256_load_ps(b.v + i + 8 * j);
        mc[j] = quant_fast_v<true, 7>(mm, mx[j], mi);
        vc[j] = quant_fast_v<false, 8>(vm, vx[j], vi);
      }
      store_codes32_fast<true>(mq + i, mc, mx);
      store_codes32_fast<false>(vq + i, vc, vx);
    } else {
      store_codes32(
          mq + i, quant_v<true, 7>(mm, _mm256_load_ps(b.m + i), mi),
          quant_v<true, 7>(mm, _mm256_load_ps(b.m + i + 8), mi),
          quant_v<true, 7>(mm, _mm256_load_ps(b.m + i + 16), mi),
          quant_v<true, 7>(mm, _mm256_load_ps(b.m + i + 24), mi));
      store_codes32(
          vq + i, quant_v<false, 8>(vm, _mm256_load_ps(b.v + i), vi),
          quant_v<false, 8>(vm, _mm256_load_ps(b.v + i + 8), vi),
          quant_v<false, 8>(vm, _mm256_load_ps(b.v + i + 16), vi),
          quant_v<false, 8>(vm, _mm256_load_ps(b.v + i + 24), vi));
    }
  }
}
#endif

// Elements [start, start + n) of a bf16-moment tensor, their gradients read as K says.
template <GradKind K>
void range_bf16_as(const Hyper& h, const LeanTensors& t, const void* g, int64_t start,
                   int64_t n) {
  auto* mb = static_cast<uint16_t*>(t.m);
  auto* vb = static_cast<uint16_t*>(t.v);
  int64_t i = start;
  const int64_t end = start + n;
#if RP_AVX2
  const HyperV hv{
      _mm256_set1_ps(h.beta1), _mm256_set1_ps(h.one_minus_beta1), _mm256_set1_ps(h.beta2),
      _mm256_set1_ps(h.one_minus_beta2), _mm256_set1_ps(h.eps), _mm256_set1_ps(h.decay),
      _mm256_set1_ps(h.weight_decay), _mm256_set1_ps(h.scale), _mm256_set1_ps(-1.0f)};
  const __m256 sn = _mm256_set1_ps(t.step_neg), ep = _mm256_set1_ps(t.eps);
  // see [Note: the copy's streaming stores]
  const bool stream = t.low && t.stream && streams(t.low_dtype, t.low, i);
  for (; i + 8 <= end; i += 8) {
    __m256 p = _mm256_loadu_ps(t.p + i);
    __m256 gv = grads_at<K>(g, i);
    __m256 m = from_bf16_v(mb + i), v = from_bf16_v(vb + i);
    adam_v(h, hv, sn, ep, p, gv, m, v);
    _mm256_storeu_ps(t.p + i, p);
    if (stream) {
      stream_low_v(t.low_dtype, t.low, i, p);
    } else if (t.low) {
      store_low_v(t.low_dtype, t.low, i, p);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(mb + i), bf16_v(m));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(vb + i), bf16_v(v));
  }
#endif
  for (; i < end; ++i) {
    float p = t.p[i], m = from_bf16_bits(mb[i]), v = from_bf16_bits(vb[i]);
    adam_scalar(h, t.step_neg, t.eps, p, grad_at<K>(g, i), m, v);
    t.p[i] = p;
    if (t.low) store_low(t.low_dtype, t.low, i, p);
    mb[i] = bf16_bits(m);
    vb[i] = bf16_bits(v);
  }
}

void range_bf16(const Hyper& h, const LeanTensors& t, int64_t start, int64_t n) {
  with_grads(t, [&](auto kind, const void* g) {
    range_bf16_as<decltype(kind)::value>(h, t, g, start, n);
  });
}

Map make_map(const at::Tensor& table, bool is_signed) {
  // table: [offset(8), step(8), scale(8), shift(8)] as fp32 (lean.py's Maps)
  TORCH_CHECK(table.dtype() == at::kFloat && table.numel() == 32 && table.is_contiguous(),
              "lean_step: a map table is 32 float32");
  Map map;
  const float* tb = table.data_ptr<float>();
  for (int k = 0; k < 8; ++k) {
    map.offset[k] = tb[k];
    map.step[k] = tb[8 + k];
    map.scale[k] = tb[16 + k];
    map.shift[k] = tb[24 + k];
  }
  map.is_signed = is_signed;
  map.groups = is_signed ? 7 : 8;
  return map;
}

void lean_step(
    int64_t kind,
    at::TensorList params,
    at::TensorList grads,
    at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs,
    at::TensorList exp_avg_absmax,
    at::TensorList exp_avg_sq_absmax,
    at::TensorList lows,
    at::ArrayRef<double> step_sizes,
    at::ArrayRef<double> bias_correction2_sqrts,
    double lr,
    double beta1,
    double beta2,
    double weight_decay,
    double eps,
    bool maximize,
    bool adamw,
    std::optional<double> grad_scale,
    const at::Tensor& signed_table,
    const at::Tensor& unsigned_table,
    int64_t piece) {
  TORCH_CHECK(kind == 1 || kind == 2, "lean_step: kind is 1 (bf16) or 2 (8-bit)");
  const auto n = static_cast<int64_t>(params.size());
  std::vector<int64_t> numels;
  std::vector<LeanTensors> ts;
  for (int64_t i = 0; i < n; ++i) {
    const auto numel = params[i].numel();
    check_cpu_contiguous(params[i], "lean_step's tensors");
    check_cpu_contiguous(grads[i], "lean_step's tensors");
    check_cpu_contiguous(exp_avgs[i], "lean_step's tensors");
    check_cpu_contiguous(exp_avg_sqs[i], "lean_step's tensors");
    const auto gdt = grads[i].scalar_type();
    TORCH_CHECK(params[i].dtype() == at::kFloat &&
                    (gdt == at::kFloat || gdt == at::kBFloat16 || gdt == at::kHalf),
                "lean_step: params must be float32, grads float32, bf16 or fp16");
    TORCH_CHECK(grads[i].numel() == numel && exp_avgs[i].numel() == numel &&
                exp_avg_sqs[i].numel() == numel, "lean_step: sizes differ");
    LeanTensors t{};
    t.p = params[i].data_ptr<float>();
    if (gdt == at::kFloat) {
      t.g = grads[i].data_ptr<float>();
    } else {
      t.g16 = static_cast<const uint16_t*>(grads[i].data_ptr());
      t.g16_half = gdt == at::kHalf;
    }
    t.m = exp_avgs[i].data_ptr();
    t.v = exp_avg_sqs[i].data_ptr();
    if (kind == 1) {
      TORCH_CHECK(exp_avgs[i].dtype() == at::kBFloat16 && exp_avg_sqs[i].dtype() == at::kBFloat16,
                  "lean_step: bf16 moments expected");
    } else {
      TORCH_CHECK(exp_avgs[i].dtype() == at::kByte && exp_avg_sqs[i].dtype() == at::kByte,
                  "lean_step: uint8 codes expected");
      const int64_t blocks = (numel + kBlock - 1) / kBlock;
      TORCH_CHECK(exp_avg_absmax[i].numel() == blocks && exp_avg_sq_absmax[i].numel() == blocks &&
                  exp_avg_absmax[i].dtype() == at::kFloat &&
                  exp_avg_sq_absmax[i].dtype() == at::kFloat &&
                  exp_avg_absmax[i].is_contiguous() && exp_avg_sq_absmax[i].is_contiguous(),
                  "lean_step: one float32 absmax per block of 256 expected");
      t.m_absmax = exp_avg_absmax[i].data_ptr<float>();
      t.v_absmax = exp_avg_sq_absmax[i].data_ptr<float>();
    }
    if (lows[i].numel() > 0) {
      check_cpu_contiguous(lows[i], "lean_step's tensors");
      TORCH_CHECK(lows[i].numel() == numel, "lean_step: the copy's size differs");
      t.low = lows[i].data_ptr();
      t.low_dtype = lows[i].scalar_type();
      TORCH_CHECK(t.low_dtype == at::kBFloat16 || t.low_dtype == at::kHalf ||
                  t.low_dtype == at::kFloat, "lean_step: the copy is bf16, fp16 or fp32");
    }
    t.step_neg = static_cast<float>(-step_sizes[i] * bias_correction2_sqrts[i]);
    t.eps = static_cast<float>(eps * bias_correction2_sqrts[i]);
    ts.push_back(t);
    numels.push_back(numel);
  }
  const bool stream = streams_copies(std::accumulate(numels.begin(), numels.end(), int64_t{0}));
  for (LeanTensors& t : ts) t.stream = stream;
  Hyper h;
  h.beta1 = static_cast<float>(beta1);
  h.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  h.eps = static_cast<float>(eps);
  h.decay = static_cast<float>(1.0 - lr * weight_decay);
  h.weight_decay = static_cast<float>(weight_decay);
  h.adamw = adamw;
  h.maximize = maximize;
  h.has_scale = grad_scale.has_value();
  h.scale = h.has_scale ? static_cast<float>(*grad_scale) : 1.0f;
  Map mm{}, vm{};
  if (kind == 2) {
    mm = make_map(signed_table, true);
    vm = make_map(unsigned_table, false);
  }
  const auto pieces = cut(numels, piece);
  at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t b, int64_t e) {
#if RP_AVX2
    const HyperV hv{
        _mm256_set1_ps(h.beta1), _mm256_set1_ps(h.one_minus_beta1), _mm256_set1_ps(h.beta2),
        _mm256_set1_ps(h.one_minus_beta2), _mm256_set1_ps(h.eps), _mm256_set1_ps(h.decay),
        _mm256_set1_ps(h.weight_decay), _mm256_set1_ps(h.scale), _mm256_set1_ps(-1.0f)};
    MapV mmv{}, vmv{};
    if (kind == 2) {
      mmv = make_map_v(mm);
      vmv = make_map_v(vm);
    }
#endif
    for (int64_t i = b; i < e; ++i) {
      const Piece& pc = pieces[i];
      const LeanTensors& t = ts[pc.tensor];
      if (kind == 1) {
        range_bf16(h, t, pc.start, pc.length);
        continue;
      }
      with_grads(t, [&](auto kind, const void* g) {
        constexpr GradKind K = decltype(kind)::value;
        for (int64_t s = pc.start; s < pc.start + pc.length; s += kBlock) {
          const int64_t len = std::min(kBlock, pc.start + pc.length - s);
#if RP_AVX2
          if (len == kBlock) {
            block8_avx2<K>(h, hv, mmv, vmv, t, g, s);
            continue;
          }
#endif
          block8_scalar<K>(h, mm, vm, t, g, s, len);
        }
      });
    }
#if RP_AVX2
    _mm_sfence();  // every streamed copy of both kinds (see [Note: the copy's streaming stores])
#endif
  });
}

// Quantize x (fp32) with one map, by path 0 (scalar), 1 (AVX2, quant_v) or 2 (AVX2,
// quant_fast_v: every |x| * inv a number at most 1 + 2^-15, x >= +0 for the unsigned map): the
// tests' and the reference's view of the quantizer alone.
at::Tensor quantize(const at::Tensor& x, double inv, const at::Tensor& table, bool is_signed,
                    int64_t path) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.is_contiguous());
  TORCH_CHECK(path >= 0 && path <= 2, "quantize: path is 0, 1 or 2");
  Map map = make_map(table, is_signed);
  auto out = at::empty({x.numel()}, x.options().dtype(at::kByte));
  const float* src = x.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const float fi = static_cast<float>(inv);
  int64_t i = 0;
  if (path == 2) {
    for (int64_t j = 0; j < x.numel(); ++j) {
      const float y = std::fabs(src[j]) * fi;
      TORCH_CHECK(y <= 1.0f + 0x1p-15f && (is_signed || !std::signbit(src[j])),
                  "quantize: path 2 takes |x| * inv in [0, 1 + 2^-15] (x >= +0 unsigned)");
    }
  }
#if RP_AVX2
  MapV mv = make_map_v(map);
  const __m256 iv = _mm256_set1_ps(fi);
  for (; path == 1 && i + 32 <= x.numel(); i += 32) {
    if (is_signed) {
      store_codes32(dst + i, quant_v<true, 7>(mv, _mm256_loadu_ps(src + i), iv),
                    quant_v<true, 7>(mv, _mm256_loadu_ps(src + i + 8), iv),
                    quant_v<true, 7>(mv, _mm256_loadu_ps(src + i + 16), iv),
                    quant_v<true, 7>(mv, _mm256_loadu_ps(src + i + 24), iv));
    } else {
      store_codes32(dst + i, quant_v<false, 8>(mv, _mm256_loadu_ps(src + i), iv),
                    quant_v<false, 8>(mv, _mm256_loadu_ps(src + i + 8), iv),
                    quant_v<false, 8>(mv, _mm256_loadu_ps(src + i + 16), iv),
                    quant_v<false, 8>(mv, _mm256_loadu_ps(src + i + 24), iv));
    }
  }
  for (; path == 2 && i + 32 <= x.numel(); i += 32) {
    __m256 xs[4];
    __m256i cs[4];
    for (int j = 0; j < 4; ++j) {
      xs[j] = _mm256_loadu_ps(src + i + 8 * j);
      cs[j] = is_signed ? quant_fast_v<true, 7>(mv, xs[j], iv)
                        : quant_fast_v<false, 8>(mv, xs[j], iv);
    }
    if (is_signed) {
      store_codes32_fast<true>(dst + i, cs, xs);
    } else {
      store_codes32_fast<false>(dst + i, cs, xs);
    }
  }
#endif
  for (; i < x.numel(); ++i) dst[i] = quant(map, src[i], fi);
  return out;
}

// The values of codes (uint8) times absmax with one map, scalar or AVX2 path (the tests').
at::Tensor dequantize(const at::Tensor& codes, double absmax, const at::Tensor& table,
                      bool is_signed, bool vectorized) {
  TORCH_CHECK(codes.dtype() == at::kByte && codes.is_contiguous());
  Map map = make_map(table, is_signed);
  auto out = at::empty({codes.numel()}, codes.options().dtype(at::kFloat));
  const uint8_t* src = codes.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  const float a = static_cast<float>(absmax);
  int64_t i = 0;
#if RP_AVX2
  const __m256 av = _mm256_set1_ps(a);
  for (; vectorized && i + 8 <= codes.numel(); i += 8) {
    _mm256_storeu_ps(dst + i, is_signed ? dequant_v<true, 7>(load_codes(src + i), av)
                                        : dequant_v<false, 8>(load_codes(src + i), av));
  }
#else
  (void)vectorized;  // the scalar path only
#endif
  for (; i < codes.numel(); ++i) dst[i] = dequant(map, src[i], a);
  return out;
}

bool has_avx2() { return RP_AVX2; }

int64_t stream_numel() { return kStreamNumel; }  // the tests' view of the threshold

}  // namespace

TORCH_LIBRARY(roundpipe_optim, m) {
  m.def(
      "exact_step(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, "
      "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, Tensor[] steps, "
      "Tensor(f!)[] lows, float lr, float beta1, float beta2, float weight_decay, float eps, "
      "bool amsgrad, bool maximize, bool adamw, Tensor? grad_scale, int piece) -> ()");
  m.def(
      "lean_step(int kind, Tensor(a!)[] params, Tensor[] grads, Tensor(c!)[] exp_avgs, "
      "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] exp_avg_absmax, Tensor(f!)[] exp_avg_sq_absmax, "
      "Tensor(g!)[] lows, float[] step_sizes, float[] bias_correction2_sqrts, float lr, "
      "float beta1, float beta2, float weight_decay, float eps, bool maximize, bool adamw, "
      "float? grad_scale, Tensor signed_table, Tensor unsigned_table, int piece) -> ()");
  m.def("quantize(Tensor x, float inv, Tensor table, bool is_signed, int path) -> Tensor");
  m.def(
      "dequantize(Tensor codes, float absmax, Tensor table, bool is_signed, bool vectorized) "
      "-> Tensor");
  m.def("has_avx2", &has_avx2);
  m.def("stream_numel", &stream_numel);
}

TORCH_LIBRARY_IMPL(roundpipe_optim, CPU, m) {
  m.impl("exact_step", &exact_step);
  m.impl("lean_step", &lean_step);
  m.impl("quantize", &quantize);
  m.impl("dequantize", &dequantize);
}
