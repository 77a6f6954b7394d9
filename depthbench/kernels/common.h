// Shared by the CPU kernels (mhc.cpp, hc.cpp).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace depthbench {

// Compile the marked functions twice, for x86-64-v3 (AVX2 and FMA) and for baseline x86-64, and
// pick one when the library loads: a cached build runs on any x86-64 machine and uses AVX2 and
// FMA where they exist (GCC 11 or later; "avx2" alone would leave out FMA).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DB_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
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

}  // namespace depthbench
