// Shared by the CPU kernels (mhc.cpp, hc.cpp).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace depthbench {

// Compile the marked functions twice, for x86-64-v3 (AVX2 and FMA) and for baseline x86-64, and
// pick one when the library loads: a cached build runs on any x86-64 machine and uses AVX2 and
// FMA where they exist (GCC 11 or later; older GCC gets an "avx2" clone, which leaves out FMA).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define DB_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DB_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define DB_CLONES
#endif

// fn(std::integral_constant<int, NC>) with NC = n for the usual stream counts (loops over n
// then unroll, and loops over tokens or features vectorise), NC = 0 (runtime n) otherwise.
template <typename Fn>
void dispatch_n(int64_t n, Fn&& fn) {
  switch (n) {
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 6: fn(std::integral_constant<int, 6>{}); break;
    case 8: fn(std::integral_constant<int, 8>{}); break;
    default: fn(std::integral_constant<int, 0>{});
  }
}

// 32-byte vectors of T (8 floats, 4 doubles) as GCC vector extensions: AVX registers in the
// x86-64-v3 clone, pairs of SSE registers in the baseline one.
template <typename T>
struct VecOf {
  typedef T type __attribute__((vector_size(32)));
};
template <typename T>
using Vec = typename VecOf<T>::type;
template <typename T>
constexpr int64_t LANES = 32 / sizeof(T);

#define DB_INLINE inline __attribute__((always_inline))

template <typename T>
DB_INLINE Vec<T> load(const T* p) {
  Vec<T> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename T>
DB_INLINE void store(T* p, Vec<T> v) {
  std::memcpy(p, &v, sizeof v);
}

template <typename T>
DB_INLINE T lane_sum(Vec<T> v) {
  T s = 0;
  for (int64_t l = 0; l < LANES<T>; ++l) s += v[l];
  return s;
}

// sum_k a_k b_k, one partial sum per vector lane.
template <typename T>
DB_INLINE T dot(const T* __restrict__ a, const T* __restrict__ b, int64_t d) {
  constexpr int64_t V = LANES<T>;
  Vec<T> acc = {};
  int64_t k = 0;
  for (; k + V <= d; k += V) acc += load(a + k) * load(b + k);
  T s = lane_sum<T>(acc);
  for (; k < d; ++k) s += a[k] * b[k];
  return s;
}

// o_k = sum_i w[i * w_stride] x_ik over the n rows x_i (length d) (plus o_k when ACCUMULATE):
// the read and mix of the streams, and the sums over streams in the backward passes. NC = n when
// it is a compile-time constant (the sum over i unrolls), else 0.
template <typename T, int NC, bool ACCUMULATE = false>
DB_INLINE void combine_rows(const T* __restrict__ x, const T* w, int64_t w_stride, T* __restrict__ o, int64_t n_,
                            int64_t d) {
  constexpr int64_t V = LANES<T>;
  const int64_t n = NC > 0 ? NC : n_;
  int64_t k = 0;
  for (; k + V <= d; k += V) {
    Vec<T> a = ACCUMULATE ? load(o + k) + w[0] * load(x + k) : w[0] * load(x + k);
#pragma GCC unroll 16
    for (int64_t i = 1; i < n; ++i) a += w[i * w_stride] * load(x + i * d + k);
    store(o + k, a);
  }
  for (; k < d; ++k) {
    T a = ACCUMULATE ? o[k] : T(0);
    for (int64_t i = 0; i < n; ++i) a += w[i * w_stride] * x[i * d + k];
    o[k] = a;
  }
}

// exp(y) = 2^k (1 + expm1(r)) for y <= 0, y = k ln2 + r, |r| <= ln2 / 2: returns 2^k in s and
// expm1(r) in em. expm1(r) from its Taylor series (to r^7 in float, r^13 in double: truncation
// below half an ulp); k rounded with the 1.5 * 2^(mantissa bits) trick and 2^k built from its
// exponent bits, so y must stay above -87 (float) for 2^k to be a normal number. Vector
// arithmetic only: libm's expf / tanhf, one call per value, bounded the kernels' speed.
template <typename T>
DB_INLINE void exp_parts(Vec<T> y, Vec<T>& s, Vec<T>& em) {
  constexpr bool F = std::is_same_v<T, float>;
  using I = std::conditional_t<F, int32_t, int64_t>;
  typedef I VI __attribute__((vector_size(32)));
  constexpr T magic = F ? T(12582912.0) : T(6755399441055744.0);  // 1.5 * 2^23, 1.5 * 2^52
  // ln 2 = ln2_hi + ln2_lo, ln2_hi with trailing zero bits so that k * ln2_hi is exact
  constexpr T ln2_hi = F ? T(0.693145751953125) : T(0.6931467056274414);
  constexpr T ln2_lo = F ? T(1.4286068203094173e-06) : T(4.7493250390316726e-07);
  constexpr T log2e = T(1.4426950408889634);
  constexpr int terms = F ? 7 : 13;
  const Vec<T> k = (y * log2e + magic) - magic;
  const Vec<T> r = (y - k * ln2_hi) - k * ln2_lo;
  // expm1(r) / r = 1 + r/2! + r^2/3! + ... = 1 + (r/2)(1 + (r/3)(1 + ...)), innermost first;
  // 1 / j is a constant once the loop is unrolled (a division per term would bound the speed)
  Vec<T> poly = Vec<T>{} + T(1);
  for (int j = terms; j >= 2; --j) poly = T(1) + r * poly * (T(1) / T(j));
  em = r * poly;
  const VI bits = (__builtin_convertvector(k, VI) + (F ? 127 : 1023)) << (F ? 23 : 52);
  s = (Vec<T>)bits;
}

// exp(y) for -60 <= y <= 0 (mHC's clamped, max-shifted logits).
template <typename T>
DB_INLINE Vec<T> exp_vec(Vec<T> y) {
  Vec<T> s, em;
  exp_parts<T>(y, s, em);
  return s * em + s;
}

// tanh(x) = -e / (2 + e) with e = expm1(-2a) = 2^k expm1(r) + (2^k - 1), a = |x| (then the sign
// of x), |x| clamped at 20, where tanh is 1 in float and double alike. For k = 0 (|x| < 0.17), e
// is expm1(r) itself, so small arguments keep their relative accuracy.
template <typename T>
DB_INLINE Vec<T> tanh_vec(Vec<T> x) {
  const Vec<T> zero = {};
  Vec<T> a = x < zero ? -x : x;
  a = a < zero + T(20) ? a : zero + T(20);
  Vec<T> s, em;
  exp_parts<T>(T(-2) * a, s, em);
  const Vec<T> ex = s * em + (s - T(1));
  const Vec<T> t = -ex / (T(2) + ex);
  return x < zero ? -t : t;
}

}  // namespace depthbench
