// mHC's coefficients on the CPU (mhc_coefficients_forward / _backward, below): the sigmoids,
// the stabilised exp and the Sinkhorn-Knopp iterations of every token, fused.
//
// Sinkhorn-Knopp: one pass over the tokens does all 2 * iterations alternating row and column
// normalisations of each token's n x n matrix, and the backward recomputes them tile by tile
// instead of reading 2 * iterations saved tensors back from memory. A tile of TILE tokens lives
// in a local buffer laid out (n, n, TILE): entry (i, j) of token t at (i * n + j) * TILE + t. The
// innermost loops run over the tile's tokens, contiguous, so the compiler vectorises them
// (target_clones below compiles an AVX2 version beside the baseline one and picks one when the
// library loads, so a build runs on any x86-64 machine).
//
// The arithmetic is that of the PyTorch loop in depthbench.models.archs.mhc.sinkhorn_knopp,
// except that each entry is multiplied by the reciprocal of its sum instead of divided by the
// sum (n divisions per half-step instead of n * n: the divisions bounded the kernel's speed);
// results differ from the loop's by rounding only. A row sum adds the n entries j = 0..n-1 in
// turn. Backward of y = x / s, s = sum over the normalised dim: dx = (dy - sum(dy y)) / s.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t TILE = 32;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DB_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define DB_CLONES
#endif

// One half-step on a tile: normalise rows (rows = true: sum over j) or columns (sum over i)
// of every token's matrix in x (n * n * TILE) into out (another tile: the two must not
// overlap), keeping the reciprocal sums in r (n * TILE).
// Entry (a, b) of the rows' view is x[first + b * stride]; the sum over b is the inner loop of
// each token, so that, with n a compile-time constant, GCC vectorises the loop over tokens (the
// form "for b: for t: r[t] += x[...]" it did not vectorise: 6x slower).
template <typename T, int NC>
DB_CLONES void half_step(const T* __restrict__ x, T* __restrict__ out, T* __restrict__ r, int64_t n_, bool rows) {
  const int64_t n = NC > 0 ? NC : n_;
  for (int64_t a = 0; a < n; ++a) {
    T* __restrict__ ra = r + a * TILE;
    const int64_t first = (rows ? a * n : a) * TILE, stride = (rows ? 1 : n) * TILE;
    for (int64_t t = 0; t < TILE; ++t) {
      T sum = 0;
      for (int64_t b = 0; b < n; ++b) sum += x[first + b * stride + t];
      ra[t] = T(1) / sum;
    }
    for (int64_t b = 0; b < n; ++b) {
      const T* __restrict__ xe = x + first + b * stride;
      T* __restrict__ oe = out + first + b * stride;
      for (int64_t t = 0; t < TILE; ++t) oe[t] = xe[t] * ra[t];
    }
  }
}

// Reverse of one half-step: g <- (g - sum(g * y)) / s over the same dim, with r = 1 / s.
template <typename T, int NC>
DB_CLONES void half_step_backward(T* __restrict__ g, const T* __restrict__ y, const T* __restrict__ r,
                                  T* __restrict__ acc, int64_t n_, bool rows) {
  const int64_t n = NC > 0 ? NC : n_;
  for (int64_t a = 0; a < n; ++a) {
    const T* __restrict__ ra = r + a * TILE;
    const int64_t first = (rows ? a * n : a) * TILE, stride = (rows ? 1 : n) * TILE;
    for (int64_t t = 0; t < TILE; ++t) {
      T dot = 0;
      for (int64_t b = 0; b < n; ++b) dot += g[first + b * stride + t] * y[first + b * stride + t];
      acc[t] = dot;
    }
    for (int64_t b = 0; b < n; ++b) {
      T* __restrict__ ge = g + first + b * stride;
      for (int64_t t = 0; t < TILE; ++t) ge[t] = (ge[t] - acc[t]) * ra[t];
    }
  }
}

// --- mHC's coefficients -----------------------------------------------------------------------
// From the pre-activations u = g * (x Phi) + b of one token, laid out [u_pre (n) | u_post (n) |
// u_res (n * n, row-major)], mHC's sublayer coefficients (depthbench/models/archs/mhc.py):
//   pre  = sigmoid(u_pre),  post = 2 sigmoid(u_post),
//   res  = SinkhornKnopp(exp(max(u_res - rowmax(u_res), -60)))   (the row max a constant)
// written as coeff (N, n + 1, n) = [pre; res] (row 0 reads the streams, rows 1..n mix them) and
// post (N, n).

template <typename T>
inline T sigmoid(T v) {
  return T(1) / (T(1) + std::exp(-v));
}

// The Sinkhorn input of a tile: exp of the row-shifted, clamped logits, tile layout; mask = 1
// where the clamp let the gradient through.
template <typename T, int NC>
void exp_logits(const T* u, T* x, T* mask, int64_t n_, int64_t N, int64_t t0, int64_t w) {
  const int64_t n = NC > 0 ? NC : n_, width = 2 * n + n * n;
  for (int64_t t = 0; t < TILE; ++t) {
    if (t >= w) {  // padding of a last, partial tile: matrices of ones
      for (int64_t e = 0; e < n * n; ++e) x[e * TILE + t] = T(1);
      continue;
    }
    const T* ut = u + (t0 + t) * width + 2 * n;
    for (int64_t i = 0; i < n; ++i) {
      T mx = ut[i * n];
      for (int64_t j = 1; j < n; ++j) mx = std::max(mx, ut[i * n + j]);
      for (int64_t j = 0; j < n; ++j) {
        const T shifted = ut[i * n + j] - mx;
        const bool inside = shifted >= T(-60);
        x[(i * n + j) * TILE + t] = std::exp(inside ? shifted : T(-60));
        if (mask) mask[(i * n + j) * TILE + t] = inside ? T(1) : T(0);
      }
    }
  }
}

template <typename T, int NC>
void coefficients_forward_tiles(const T* u, T* coeff, T* post, int64_t n_, int64_t N, int64_t iterations,
                                int64_t begin, int64_t end) {
  const int64_t n = NC > 0 ? NC : n_, nn = n * n, width = 2 * n + nn;
  std::vector<T> x(nn * TILE), y(nn * TILE), r(n * TILE);
  for (int64_t k = begin; k < end; ++k) {
    const int64_t t0 = k * TILE, w = std::min(TILE, N - t0);
    exp_logits<T, NC>(u, x.data(), nullptr, n, N, t0, w);
    for (int64_t it = 0; it < iterations; ++it) {
      half_step<T, NC>(x.data(), y.data(), r.data(), n, true);
      half_step<T, NC>(y.data(), x.data(), r.data(), n, false);
    }
    for (int64_t t = 0; t < w; ++t) {
      const T* ut = u + (t0 + t) * width;
      T* ct = coeff + (t0 + t) * (n + 1) * n;
      for (int64_t j = 0; j < n; ++j) ct[j] = sigmoid(ut[j]);
      for (int64_t e = 0; e < nn; ++e) ct[n + e] = x[e * TILE + t];
      for (int64_t i = 0; i < n; ++i) post[(t0 + t) * n + i] = T(2) * sigmoid(ut[n + i]);
    }
  }
}

// Gradient with respect to u from the gradients of coeff and post: every half-step's result and
// reciprocal sums recomputed for one tile from u, then the half-steps' VJPs applied in reverse.
template <typename T, int NC>
void coefficients_backward_tiles(const T* u, const T* gcoeff, const T* gpost, T* gu, int64_t n_, int64_t N,
                                 int64_t iterations, int64_t begin, int64_t end) {
  const int64_t n = NC > 0 ? NC : n_, nn = n * n, width = 2 * n + nn, steps = 2 * iterations;
  std::vector<T> ys((steps + 1) * nn * TILE), rs(std::max<int64_t>(steps, 1) * n * TILE);
  std::vector<T> mask(nn * TILE), g(nn * TILE), acc(TILE);
  for (int64_t k = begin; k < end; ++k) {
    const int64_t t0 = k * TILE, w = std::min(TILE, N - t0);
    exp_logits<T, NC>(u, ys.data(), mask.data(), n, N, t0, w);
    for (int64_t h = 0; h < steps; ++h)
      half_step<T, NC>(ys.data() + h * nn * TILE, ys.data() + (h + 1) * nn * TILE, rs.data() + h * n * TILE, n,
                       h % 2 == 0);
    for (int64_t e = 0; e < nn; ++e)
      for (int64_t t = 0; t < TILE; ++t) g[e * TILE + t] = t < w ? gcoeff[(t0 + t) * (n + 1) * n + n + e] : T(0);
    for (int64_t h = steps - 1; h >= 0; --h)
      half_step_backward<T, NC>(g.data(), ys.data() + (h + 1) * nn * TILE, rs.data() + h * n * TILE,
                                acc.data(), n, h % 2 == 0);
    for (int64_t t = 0; t < w; ++t) {
      const T* ut = u + (t0 + t) * width;
      T* gt = gu + (t0 + t) * width;
      for (int64_t j = 0; j < n; ++j) {
        const T sp = sigmoid(ut[j]), sq = sigmoid(ut[n + j]);
        gt[j] = gcoeff[(t0 + t) * (n + 1) * n + j] * sp * (T(1) - sp);
        gt[n + j] = gpost[(t0 + t) * n + j] * T(2) * sq * (T(1) - sq);
      }
      // d exp(l) / dl = exp(l), zero where clamped; the row max is a constant
      for (int64_t e = 0; e < nn; ++e) gt[2 * n + e] = g[e * TILE + t] * ys[e * TILE + t] * mask[e * TILE + t];
    }
  }
}

// fn(std::integral_constant<int, NC>) with NC = n for the usual stream counts (the loops over n
// then unroll and the loops over tokens vectorise, see half_step), NC = 0 (runtime n) otherwise.
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

}  // namespace

static void check_coefficients(const torch::Tensor& u, int64_t n, int64_t iterations) {
  TORCH_CHECK(u.device().is_cpu(), "mhc coefficient kernel: expected a CPU tensor, got ", u.device());
  TORCH_CHECK(n >= 1 && u.dim() == 2 && u.size(1) == 2 * n + n * n,
              "mhc coefficient kernel: expected (tokens, 2n + n^2) = (N, ", 2 * n + n * n, ") for n = ", n,
              ", got ", u.sizes());
  TORCH_CHECK(u.scalar_type() == torch::kFloat || u.scalar_type() == torch::kDouble,
              "mhc coefficient kernel: float32 or float64 only, got ", u.scalar_type());
  TORCH_CHECK(iterations >= 0, "mhc coefficient kernel: iterations must be >= 0, got ", iterations);
}

// (coeff (N, n + 1, n), post (N, n)) from the pre-activations u (N, 2n + n^2).
std::vector<torch::Tensor> mhc_coefficients_forward(torch::Tensor u, int64_t n, int64_t iterations) {
  check_coefficients(u, n, iterations);
  u = u.contiguous();
  const int64_t N = u.size(0);
  auto coeff = torch::empty({N, n + 1, n}, u.options());
  auto post = torch::empty({N, n}, u.options());
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "mhc_coefficients_forward", [&] {
    const scalar_t* up = u.data_ptr<scalar_t>();
    scalar_t* cp = coeff.data_ptr<scalar_t>();
    scalar_t* pp = post.data_ptr<scalar_t>();
    at::parallel_for(0, (N + TILE - 1) / TILE, 16, [&](int64_t begin, int64_t end) {
      dispatch_n(n, [&](auto nc) {
        coefficients_forward_tiles<scalar_t, decltype(nc)::value>(up, cp, pp, n, N, iterations, begin, end);
      });
    });
  });
  return {coeff, post};
}

// The gradient with respect to u, given those of coeff and post.
torch::Tensor mhc_coefficients_backward(torch::Tensor u, torch::Tensor gcoeff, torch::Tensor gpost, int64_t n,
                                        int64_t iterations) {
  check_coefficients(u, n, iterations);
  const int64_t N = u.size(0);
  TORCH_CHECK(gcoeff.sizes() == torch::IntArrayRef({N, n + 1, n}) && gpost.sizes() == torch::IntArrayRef({N, n}),
              "mhc coefficient kernel: gradients of shape ", gcoeff.sizes(), " and ", gpost.sizes(),
              " do not match the outputs (", N, ", ", n + 1, ", ", n, ") and (", N, ", ", n, ")");
  TORCH_CHECK(gcoeff.scalar_type() == u.scalar_type() && gpost.scalar_type() == u.scalar_type(),
              "mhc coefficient kernel: gradient dtypes must be ", u.scalar_type());
  u = u.contiguous();
  gcoeff = gcoeff.contiguous();
  gpost = gpost.contiguous();
  auto gu = torch::empty_like(u);
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "mhc_coefficients_backward", [&] {
    const scalar_t* up = u.data_ptr<scalar_t>();
    const scalar_t* gcp = gcoeff.data_ptr<scalar_t>();
    const scalar_t* gpp = gpost.data_ptr<scalar_t>();
    scalar_t* gp = gu.data_ptr<scalar_t>();
    at::parallel_for(0, (N + TILE - 1) / TILE, 16, [&](int64_t begin, int64_t end) {
      dispatch_n(n, [&](auto nc) {
        coefficients_backward_tiles<scalar_t, decltype(nc)::value>(up, gcp, gpp, gp, n, N, iterations, begin, end);
      });
    });
  });
  return gu;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("mhc_coefficients_forward", &mhc_coefficients_forward, "mHC's pre, res and post coefficients");
  module.def("mhc_coefficients_backward", &mhc_coefficients_backward, "their gradient w.r.t. the pre-activations");
}
