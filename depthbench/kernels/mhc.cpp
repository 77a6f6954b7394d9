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

#include "common.h"

#include <algorithm>
#include <tuple>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

using namespace depthbench;  // common.h: dispatch, vectors, exp, tanh

constexpr int64_t TILE = 32;

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

// exp in place of m values in [-60, 0], m a multiple of the vector length (TILE is).
template <typename T>
DB_CLONES void exp_tile(T* x, int64_t m) {
  for (int64_t e = 0; e < m; e += LANES<T>) store(x + e, depthbench::exp_vec<T>(load(x + e)));
}

// The Sinkhorn input of a tile: exp of the row-shifted, clamped logits, tile layout; mask = 1
// where the clamp let the gradient through.
template <typename T, int NC>
void exp_logits(const T* u, T* x, T* mask, int64_t n_, int64_t t0, int64_t w) {
  const int64_t n = NC > 0 ? NC : n_, width = 2 * n + n * n;
  for (int64_t t = 0; t < TILE; ++t) {
    if (t >= w) {  // padding of a last, partial tile: matrices of ones
      for (int64_t e = 0; e < n * n; ++e) x[e * TILE + t] = T(0);  // exp(0)
      continue;
    }
    const T* ut = u + (t0 + t) * width + 2 * n;
    for (int64_t i = 0; i < n; ++i) {
      T mx = ut[i * n];
      for (int64_t j = 1; j < n; ++j) mx = std::max(mx, ut[i * n + j]);
      for (int64_t j = 0; j < n; ++j) {
        const T shifted = ut[i * n + j] - mx;
        const bool inside = shifted >= T(-60);
        x[(i * n + j) * TILE + t] = inside ? shifted : T(-60);
        if (mask) mask[(i * n + j) * TILE + t] = inside ? T(1) : T(0);
      }
    }
  }
  exp_tile<T>(x, n * n * TILE);
}

template <typename T, int NC>
void coefficients_forward_tiles(const T* u, T* coeff, T* post, int64_t n_, int64_t N, int64_t iterations,
                                int64_t begin, int64_t end) {
  const int64_t n = NC > 0 ? NC : n_, nn = n * n, width = 2 * n + nn;
  std::vector<T> x(nn * TILE), y(nn * TILE), r(n * TILE);
  for (int64_t k = begin; k < end; ++k) {
    const int64_t t0 = k * TILE, w = std::min(TILE, N - t0);
    exp_logits<T, NC>(u, x.data(), nullptr, n, t0, w);
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
    exp_logits<T, NC>(u, ys.data(), mask.data(), n, t0, w);
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

// --- mHC's whole read -----------------------------------------------------------------------
// For token t with streams H (n x d), flattened h (D = n d) (depthbench/models/archs/mhc.py):
//   r = 1 / sqrt(mean_f h_f^2 + eps),  z_e = r sum_f h_f W_ef        N(flatten(H)) Phi, W = Phi^T * gain
//   u_e = scale_e z_e + bias_e                                          (scale: g_pre, g_post or g_res)
//   [H_pre; H_res], H_post = the coefficients above, from u
//   x = sum_i H_pre,i H_i,  mixed_j = sum_i H_res,ji H_i
// In parallel over chunks of READ_CHUNK tokens, each chunk gets its projections q = h W^T, then
// each tile of TILE tokens its u, its coefficients (the tile functions above) and its read and
// mix, while its H is in cache. The backward takes q and the coefficients back from the forward's
// outputs and recomputes u and the Sinkhorn iterations; the projection's gradients are
// dh += dq W (per token, in its chunk) and dW = dq^T h (in parallel over blocks of columns).
// Every output element is one sum in a fixed order computed by one thread, so the results are
// bitwise the same for any thread count: a BLAS GEMM splits its inner sum between threads on some
// CPUs (MKL does under MKL_CBWR=COMPATIBLE and on Intel CPUs), which made dW and q depend on it.
// Eager PyTorch ran this read as about 15 kernels forward and 30 backward, each a pass over the
// n-wide state.

constexpr int64_t READ_CHUNK = 4 * TILE;  // tokens per parallel work item and per partial gain/bias sum

constexpr int64_t GRAD_W_COLUMNS = 64;  // columns of dW per parallel work item

// The tensor operations inside the kernels run as plain arithmetic in the inputs' dtype: no
// autograd recording, no autocast (under CPU autocast a matmul would return bfloat16).
struct PlainMath {
  torch::NoGradGuard no_grad;
  c10::impl::ExcludeDispatchKeyGuard no_autocast{c10::autocast_dispatch_keyset};
};

// q_te = sum_f h_tf W_ef for tokens [t0, t0 + w) (q points at token t0's row): four tokens at a
// time share each load of a row of W; the remaining tokens go one at a time. Which tokens go
// together depends only on t0 and w, never on the thread count.
template <typename T>
DB_CLONES void project_tokens(const T* __restrict__ H, const T* __restrict__ W, T* __restrict__ q, int64_t P,
                              int64_t D, int64_t t0, int64_t w) {
  constexpr int64_t V = LANES<T>;
  int64_t t = 0;
  for (; t + 4 <= w; t += 4) {
    const T* h0 = H + (t0 + t) * D;
    const T *h1 = h0 + D, *h2 = h1 + D, *h3 = h2 + D;
    for (int64_t e = 0; e < P; ++e) {
      const T* we = W + e * D;
      Vec<T> a0 = {}, a1 = {}, a2 = {}, a3 = {};
      int64_t k = 0;
      for (; k + V <= D; k += V) {
        const Vec<T> wv = load(we + k);
        a0 += wv * load(h0 + k);
        a1 += wv * load(h1 + k);
        a2 += wv * load(h2 + k);
        a3 += wv * load(h3 + k);
      }
      T s0 = lane_sum<T>(a0), s1 = lane_sum<T>(a1), s2 = lane_sum<T>(a2), s3 = lane_sum<T>(a3);
      for (; k < D; ++k) {
        s0 += we[k] * h0[k];
        s1 += we[k] * h1[k];
        s2 += we[k] * h2[k];
        s3 += we[k] * h3[k];
      }
      q[t * P + e] = s0;
      q[(t + 1) * P + e] = s1;
      q[(t + 2) * P + e] = s2;
      q[(t + 3) * P + e] = s3;
    }
  }
  for (; t < w; ++t)
    for (int64_t e = 0; e < P; ++e) q[t * P + e] = dot(W + e * D, H + (t0 + t) * D, D);
}

// dW_ef = sum_t dq_te h_tf for the columns [c0, c1) of dW (P x D, zeroed), summed over all N tokens
// in token order, four tokens to each load and store of dW.
template <typename T>
DB_CLONES void weight_gradient_columns(const T* __restrict__ gq, const T* __restrict__ H, T* __restrict__ gW,
                                       int64_t N, int64_t P, int64_t D, int64_t c0, int64_t c1) {
  constexpr int64_t V = LANES<T>;
  const int64_t width = c1 - c0;
  int64_t t = 0;
  for (; t + 4 <= N; t += 4) {
    const T* h0 = H + t * D + c0;
    const T *h1 = h0 + D, *h2 = h1 + D, *h3 = h2 + D;
    const T* g = gq + t * P;
    for (int64_t e = 0; e < P; ++e) {
      const T g0 = g[e], g1 = g[P + e], g2 = g[2 * P + e], g3 = g[3 * P + e];
      T* o = gW + e * D + c0;
      int64_t k = 0;
      for (; k + V <= width; k += V)
        store(o + k, load(o + k) + (g0 * load(h0 + k) + g1 * load(h1 + k) + g2 * load(h2 + k) + g3 * load(h3 + k)));
      for (; k < width; ++k) o[k] += g0 * h0[k] + g1 * h1[k] + g2 * h2[k] + g3 * h3[k];
    }
  }
  for (; t < N; ++t) {
    const T* h = H + t * D + c0;
    const T* g = gq + t * P;
    for (int64_t e = 0; e < P; ++e) {
      const T ge = g[e];
      T* o = gW + e * D + c0;
      int64_t k = 0;
      for (; k + V <= width; k += V) store(o + k, load(o + k) + ge * load(h + k));
      for (; k < width; ++k) o[k] += ge * h[k];
    }
  }
}

template <typename T>
DB_CLONES T sum_of_squares(const T* __restrict__ h, int64_t D) {
  constexpr int64_t V = LANES<T>;
  Vec<T> acc0 = {}, acc1 = {};
  int64_t k = 0;
  for (; k + 2 * V <= D; k += 2 * V) {
    const Vec<T> a = load(h + k), b = load(h + k + V);
    acc0 += a * a;
    acc1 += b * b;
  }
  for (; k + V <= D; k += V) {
    const Vec<T> a = load(h + k);
    acc0 += a * a;
  }
  T s = lane_sum<T>(acc0 + acc1);
  for (; k < D; ++k) s += h[k] * h[k];
  return s;
}

// out_r = sum_i M_ri H_i for r = 0..n (rows of M: n + 1, each n long), out_0 to x, the rest to mixed.
template <typename T, int NC>
DB_CLONES void mix_rows(const T* __restrict__ h, const T* __restrict__ M, T* __restrict__ x, T* __restrict__ mixed,
                        int64_t n_, int64_t d) {
  const int64_t n = NC > 0 ? NC : n_;
  for (int64_t r = 0; r <= n; ++r) combine_rows<T, NC>(h, M + r * n, 1, r == 0 ? x : mixed + (r - 1) * d, n, d);
}

// dM_ri = g_r . H_i for one token (g_0 = dx, g_1+j = dmixed_j), added to gc (n + 1, n), and
// dH_i = sum_r M_ri g_r + cr H_i written to gh (the projection's part is added later).
template <typename T, int NC>
DB_CLONES void mix_rows_backward(const T* __restrict__ h, const T* __restrict__ M, const T* __restrict__ gx,
                                 const T* __restrict__ gm, T cr, T* __restrict__ gc, T* __restrict__ gh, int64_t n_,
                                 int64_t d) {
  constexpr int64_t V = LANES<T>, RA = NC > 0 ? NC + 1 : 1;
  const int64_t n = NC > 0 ? NC : n_;
  for (int64_t i = 0; i < n; ++i) {
    const T* __restrict__ hi = h + i * d;
    T* __restrict__ o = gh + i * d;
    if constexpr (NC > 0) {  // the n + 1 dot products with H_i side by side, in registers
      Vec<T> acc[RA];
#pragma GCC unroll 17
      for (int64_t r = 0; r < RA; ++r) acc[r] = Vec<T>{};
      int64_t k = 0;
      for (; k + V <= d; k += V) {
        const Vec<T> hv = load(hi + k), g0 = load(gx + k);
        acc[0] += g0 * hv;
        Vec<T> a = M[i] * g0 + cr * hv;
#pragma GCC unroll 16
        for (int64_t j = 0; j < n; ++j) {
          const Vec<T> gj = load(gm + j * d + k);
          acc[1 + j] += gj * hv;
          a += M[(1 + j) * n + i] * gj;
        }
        store(o + k, a);
      }
      for (int64_t r = 0; r <= n; ++r) {
        const T* g = r == 0 ? gx : gm + (r - 1) * d;
        T s = lane_sum<T>(acc[r]);
        for (int64_t kk = k; kk < d; ++kk) s += g[kk] * hi[kk];
        gc[r * n + i] += s;
      }
      for (; k < d; ++k) {
        T a = M[i] * gx[k] + cr * hi[k];
        for (int64_t j = 0; j < n; ++j) a += M[(1 + j) * n + i] * gm[j * d + k];
        o[k] = a;
      }
    } else {
      for (int64_t r = 0; r <= n; ++r) gc[r * n + i] += dot(r == 0 ? gx : gm + (r - 1) * d, hi, d);
      for (int64_t k = 0; k < d; ++k) {
        T a = M[i] * gx[k] + cr * hi[k];
        for (int64_t j = 0; j < n; ++j) a += M[(1 + j) * n + i] * gm[j * d + k];
        o[k] = a;
      }
    }
  }
}

// Tokens [t0, t0 + w) of one chunk, whose projections q = h W^T (w x P) are computed: x, mixed,
// coeff and post.
template <typename T, int NC>
void read_forward_chunk(const T* H, const T* q, const T* scale, const T* bias, T eps, int64_t iterations, T* x,
                        T* mixed, T* coeff, T* post, int64_t n_, int64_t d, int64_t t0, int64_t w) {
  const int64_t n = NC > 0 ? NC : n_, P = 2 * n + n * n, D = n * d;
  std::vector<T> u(TILE * P);
  for (int64_t s0 = 0; s0 < w; s0 += TILE) {
    const int64_t tw = std::min(TILE, w - s0);
    for (int64_t t = 0; t < tw; ++t) {
      const int64_t tok = t0 + s0 + t;
      const T r = T(1) / std::sqrt(sum_of_squares<T>(H + tok * D, D) / T(D) + eps);
      for (int64_t e = 0; e < P; ++e) u[t * P + e] = scale[e] * (r * q[(s0 + t) * P + e]) + bias[e];
    }
    const int64_t first = t0 + s0;
    coefficients_forward_tiles<T, NC>(u.data(), coeff + first * (n + 1) * n, post + first * n, n, tw, iterations, 0, 1);
    for (int64_t t = 0; t < tw; ++t)
      mix_rows<T, NC>(H + (first + t) * D, coeff + (first + t) * (n + 1) * n, x + (first + t) * d,
                      mixed + (first + t) * D, n, d);
  }
}

// Backward of one chunk, given its projections q (w x P): dH (gH), dL/dq with respect to the
// projections' input (gq, w x P), and this chunk's sums of the scale and bias gradients (zeroed
// by the caller).
template <typename T, int NC>
void read_backward_chunk(const T* H, const T* W, const T* q, const T* scale, const T* bias, T eps, int64_t iterations,
                         const T* coeff, const T* gx, const T* gmixed, const T* gcoeff, const T* gpost, T* gH, T* gq,
                         T* gscale, T* gbias, int64_t n_, int64_t d, int64_t t0, int64_t w) {
  const int64_t n = NC > 0 ? NC : n_, P = 2 * n + n * n, D = n * d, nc = (n + 1) * n;
  std::vector<T> u(TILE * P), rs(TILE), gc(TILE * nc), gu(TILE * P);
  for (int64_t s0 = 0; s0 < w; s0 += TILE) {
    const int64_t tw = std::min(TILE, w - s0), first = t0 + s0;
    for (int64_t t = 0; t < tw; ++t) {
      rs[t] = T(1) / std::sqrt(sum_of_squares<T>(H + (first + t) * D, D) / T(D) + eps);
      for (int64_t e = 0; e < P; ++e) u[t * P + e] = scale[e] * (rs[t] * q[(s0 + t) * P + e]) + bias[e];
      for (int64_t e = 0; e < nc; ++e) gc[t * nc + e] = gcoeff[(first + t) * nc + e];
    }
    // dL/dM from the read and mix (dots with H), and the mix's part of dH; cr comes later, so
    // the H term is added below with it
    for (int64_t t = 0; t < tw; ++t)
      mix_rows_backward<T, NC>(H + (first + t) * D, coeff + (first + t) * nc, gx + (first + t) * d,
                               gmixed + (first + t) * D, T(0), gc.data() + t * nc, gH + (first + t) * D, n, d);
    coefficients_backward_tiles<T, NC>(u.data(), gc.data(), gpost + first * n, gu.data(), n, tw, iterations, 0, 1);
    for (int64_t t = 0; t < tw; ++t) {
      const T r = rs[t];
      const T* qt = q + (s0 + t) * P;
      T* gqt = gq + (s0 + t) * P;
      T gr = 0;
      for (int64_t e = 0; e < P; ++e) {
        const T g = gu[t * P + e];
        gscale[e] += g * (r * qt[e]);
        gbias[e] += g;
        const T gz = g * scale[e];
        gqt[e] = gz * r;  // z = r q
        gr += gz * qt[e];
      }
      const T cr = -gr * r * r * r / T(D);  // dr / dh_f = -r^3 h_f / D
      const T* h = H + (first + t) * D;
      T* o = gH + (first + t) * D;
      for (int64_t f = 0; f < D; ++f) o[f] += cr * h[f];
      combine_rows<T, 0, true>(W, gqt, 1, o, P, D);  // the projection's part: dh += dq W
    }
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

static void check_read(const torch::Tensor& H, const torch::Tensor& W, const torch::Tensor& scale,
                       const torch::Tensor& bias, int64_t iterations) {
  TORCH_CHECK(H.device().is_cpu() && W.device().is_cpu() && scale.device().is_cpu() && bias.device().is_cpu(),
              "mhc read kernel: expected CPU tensors");
  TORCH_CHECK(H.dim() == 3 && H.size(1) >= 1, "mhc read kernel: expected streams of shape (tokens, n, d), got ",
              H.sizes());
  const int64_t n = H.size(1), D = n * H.size(2), P = 2 * n + n * n;
  TORCH_CHECK(W.dim() == 2 && W.size(0) == P && W.size(1) == D, "mhc read kernel: expected weight (2n + n^2, n d) = (",
              P, ", ", D, "), got ", W.sizes());
  TORCH_CHECK(scale.sizes() == torch::IntArrayRef({P}) && bias.sizes() == torch::IntArrayRef({P}),
              "mhc read kernel: expected scale and bias of shape (", P, "), got ", scale.sizes(), " and ", bias.sizes());
  TORCH_CHECK(H.scalar_type() == torch::kFloat || H.scalar_type() == torch::kDouble,
              "mhc read kernel: float32 or float64 only, got ", H.scalar_type());
  TORCH_CHECK(W.scalar_type() == H.scalar_type() && scale.scalar_type() == H.scalar_type() &&
                  bias.scalar_type() == H.scalar_type(),
              "mhc read kernel: parameters must have the streams' dtype ", H.scalar_type());
  TORCH_CHECK(iterations >= 0, "mhc read kernel: iterations must be >= 0, got ", iterations);
}

// x (N, d), mixed (N, n, d), coeff (N, n + 1, n) = [H_pre; H_res], post (N, n) from the streams H
// (N, n, d), W = Phi^T * gain (2n + n^2, n d), scale and bias (2n + n^2); and proj = h W^T
// (N, 2n + n^2), kept for the backward.
std::vector<torch::Tensor> mhc_read_forward(torch::Tensor H, torch::Tensor W, torch::Tensor scale, torch::Tensor bias,
                                            double eps, int64_t iterations) {
  check_read(H, W, scale, bias, iterations);
  PlainMath plain_math;
  H = H.contiguous();
  W = W.contiguous();
  scale = scale.contiguous();
  bias = bias.contiguous();
  const int64_t N = H.size(0), n = H.size(1), d = H.size(2), D = n * d, P = 2 * n + n * n;
  const int64_t chunks = (N + READ_CHUNK - 1) / READ_CHUNK;
  auto x = torch::empty({N, d}, H.options());
  auto mixed = torch::empty({N, n, d}, H.options());
  auto coeff = torch::empty({N, n + 1, n}, H.options());
  auto post = torch::empty({N, n}, H.options());
  auto q = torch::empty({N, P}, H.options());  // the projections of every token
  AT_DISPATCH_FLOATING_TYPES(H.scalar_type(), "mhc_read_forward", [&] {
    const scalar_t *hp = H.data_ptr<scalar_t>(), *wp = W.data_ptr<scalar_t>(), *sp = scale.data_ptr<scalar_t>(),
                   *bp = bias.data_ptr<scalar_t>();
    scalar_t *qp = q.data_ptr<scalar_t>(), *xp = x.data_ptr<scalar_t>(), *mp = mixed.data_ptr<scalar_t>(),
             *cp = coeff.data_ptr<scalar_t>(), *pp = post.data_ptr<scalar_t>();
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t chunk = begin; chunk < end; ++chunk) {
        const int64_t t0 = chunk * READ_CHUNK, w = std::min(READ_CHUNK, N - t0);
        project_tokens<scalar_t>(hp, wp, qp + t0 * P, P, D, t0, w);
        dispatch_n(n, [&](auto nc) {
          read_forward_chunk<scalar_t, decltype(nc)::value>(hp, qp + t0 * P, sp, bp, scalar_t(eps), iterations, xp, mp,
                                                            cp, pp, n, d, t0, w);
        });
      }
    });
  });
  return {x, mixed, coeff, post, q};
}

// dH, dW, dscale, dbias from the gradients of x, mixed, coeff and post (and the forward's coeff
// and proj).
std::vector<torch::Tensor> mhc_read_backward(torch::Tensor H, torch::Tensor W, torch::Tensor scale, torch::Tensor bias,
                                             double eps, int64_t iterations, torch::Tensor coeff, torch::Tensor proj,
                                             torch::Tensor gx, torch::Tensor gmixed, torch::Tensor gcoeff,
                                             torch::Tensor gpost) {
  check_read(H, W, scale, bias, iterations);
  PlainMath plain_math;
  const int64_t N = H.size(0), n = H.size(1), d = H.size(2), D = n * d, P = 2 * n + n * n;
  for (const auto& [name, t, shape] :
       {std::tuple<const char*, const torch::Tensor&, std::vector<int64_t>>{"coeff", coeff, {N, n + 1, n}},
        {"proj", proj, {N, P}},
        {"grad x", gx, {N, d}}, {"grad mixed", gmixed, {N, n, d}}, {"grad coeff", gcoeff, {N, n + 1, n}},
        {"grad post", gpost, {N, n}}}) {
    TORCH_CHECK(t.sizes() == torch::IntArrayRef(shape) && t.scalar_type() == H.scalar_type(), "mhc read kernel: ",
                name, " has shape ", t.sizes(), " and dtype ", t.scalar_type(), ", expected ",
                torch::IntArrayRef(shape), " and ", H.scalar_type());
  }
  H = H.contiguous();
  W = W.contiguous();
  scale = scale.contiguous();
  bias = bias.contiguous();
  coeff = coeff.contiguous();
  gx = gx.contiguous();
  gmixed = gmixed.contiguous();
  gcoeff = gcoeff.contiguous();
  gpost = gpost.contiguous();
  const int64_t chunks = std::max<int64_t>(1, (N + READ_CHUNK - 1) / READ_CHUNK);
  auto gH = torch::empty_like(H);
  auto gq = torch::empty({N, P}, H.options());
  auto partial_sb = torch::zeros({chunks, 2, P}, H.options());  // scale, bias
  const auto q = proj.contiguous();
  AT_DISPATCH_FLOATING_TYPES(H.scalar_type(), "mhc_read_backward", [&] {
    const scalar_t *hp = H.data_ptr<scalar_t>(), *wp = W.data_ptr<scalar_t>(), *qp = q.data_ptr<scalar_t>(),
                   *sp = scale.data_ptr<scalar_t>(), *bp = bias.data_ptr<scalar_t>(), *cp = coeff.data_ptr<scalar_t>(),
                   *gxp = gx.data_ptr<scalar_t>(),
                   *gmp = gmixed.data_ptr<scalar_t>(), *gcp = gcoeff.data_ptr<scalar_t>(),
                   *gpp = gpost.data_ptr<scalar_t>();
    scalar_t *ghp = gH.data_ptr<scalar_t>(), *gqp = gq.data_ptr<scalar_t>(), *psb = partial_sb.data_ptr<scalar_t>();
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t chunk = begin; chunk < end; ++chunk) {
        const int64_t t0 = chunk * READ_CHUNK, w = std::min(READ_CHUNK, N - t0);
        dispatch_n(n, [&](auto nc) {
          read_backward_chunk<scalar_t, decltype(nc)::value>(hp, wp, qp + t0 * P, sp, bp, scalar_t(eps), iterations, cp,
                                                             gxp, gmp, gcp, gpp, ghp, gqp + t0 * P,
                                                             psb + chunk * 2 * P, psb + chunk * 2 * P + P, n, d, t0, w);
        });
      }
    });
  });
  auto gW = torch::zeros({P, D}, H.options());
  AT_DISPATCH_FLOATING_TYPES(H.scalar_type(), "mhc_read_weight_gradient", [&] {
    const scalar_t *gqp = gq.data_ptr<scalar_t>(), *hp = H.data_ptr<scalar_t>();
    scalar_t* gwp = gW.data_ptr<scalar_t>();
    at::parallel_for(0, (D + GRAD_W_COLUMNS - 1) / GRAD_W_COLUMNS, 1, [&](int64_t begin, int64_t end) {
      for (int64_t block = begin; block < end; ++block)
        weight_gradient_columns<scalar_t>(gqp, hp, gwp, N, P, D, block * GRAD_W_COLUMNS,
                                          std::min(D, (block + 1) * GRAD_W_COLUMNS));
    });
  });
  // the chunks' sums added in chunk order: the same result for any number of threads
  auto gsb = partial_sb.select(0, 0).clone();
  for (int64_t chunk = 1; chunk < chunks; ++chunk) gsb.add_(partial_sb.select(0, chunk));
  return {gH, gW, gsb.select(0, 0).clone(), gsb.select(0, 1).clone()};  // separate tensors, not views of one
}

// Hyper-Connections' read (hc.cpp).
std::vector<at::Tensor> hc_read_forward(at::Tensor H, at::Tensor W, at::Tensor S, at::Tensor scale, double eps);
std::vector<at::Tensor> hc_read_backward(at::Tensor H, at::Tensor W, at::Tensor S, at::Tensor scale, double eps,
                                         at::Tensor gx, at::Tensor gmixed, at::Tensor gcoeff);
std::vector<at::Tensor> stream_write_backward(at::Tensor gH, at::Tensor w, at::Tensor out);

// The extension's one module, for the kernels of every source file.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("mhc_coefficients_forward", &mhc_coefficients_forward, "mHC's pre, res and post coefficients");
  module.def("mhc_coefficients_backward", &mhc_coefficients_backward, "their gradient w.r.t. the pre-activations");
  module.def("mhc_read_forward", &mhc_read_forward, "mHC's read: x, mixed streams and coefficients from the streams");
  module.def("mhc_read_backward", &mhc_read_backward, "its gradients w.r.t. the streams, weight, scale and bias");
  module.def("stream_write_backward", &stream_write_backward, "HC's and mHC's write H = mixed + w^T out, backward");
  module.def("hc_read_forward", &hc_read_forward, "HC's read: x, mixed streams and coefficients from the streams");
  module.def("hc_read_backward", &hc_read_backward, "its gradients w.r.t. the streams, weight, static weights and scales");
}
