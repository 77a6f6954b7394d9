// Hyper-Connections' read on the CPU (hc_read_forward / _backward, below): everything between
// the streams H of one sublayer and the sublayer's input, fused, one token at a time.
//
// For token t with streams H (n x d) (depthbench/models/archs/hc.py):
//   r_i  = 1 / sqrt(mean_k H_ik^2 + eps)                       per-stream RMS of N(H_i)
//   p_ij = r_i sum_k H_ik W_jk                                  N(H_i) W^T, W = dynamic * gain (P x d)
//   c_ij = S_ij + s_j tanh(p_ij)                                row i = [a_i | A_i,: | b_i], P = n + 2
//   x_k  = sum_i c_i0 H_ik                                      read   a^T H
//   m_jk = sum_i c_i,1+j H_ik                                   mix    A^T H
// s (P) holds the learnable dynamic scales per coefficient column: s_alpha for the read and mix
// columns 0..n, s_beta for the write column n + 1.
// Outputs x (N, d), mixed (N, n, d) and coeff (N, n, P) (its last column is the write weights b,
// the rest is what the probes record). The write H <- mixed + b^T F(x) stays in PyTorch.
//
// Eager PyTorch runs this as about ten kernels forward and twenty backward, each a pass over the
// 4x wider state; here the forward reads H once and the backward reads H, dx and dmixed once,
// recomputing r, p and tanh instead of saving them. The dot products over the features keep L
// partial sums, one per lane (acc[j][l] below), so that they vectorise without reassociating
// floating-point sums (GCC does not vectorise a plain `s += a[k] * b[k]` without -ffast-math).
// The weight, static and scale gradients are sums over tokens: each chunk of CHUNK tokens sums
// into its own buffer, and the buffers are added in chunk order, so results do not depend on the
// number of threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

using namespace depthbench;  // common.h: dispatch, vectors, exp, tanh

constexpr int64_t CHUNK = 128;    // tokens per partial sum of the weight gradients
constexpr int64_t MAX_STREAMS = 16;
constexpr int64_t MAX_P = MAX_STREAMS + 2;

// tanh in place of m values, m rounded up to whole vectors (the caller's buffer is that long).
template <typename T>
DB_INLINE void tanh_inplace(T* v, int64_t m) {
  for (int64_t e = 0; e < m; e += LANES<T>) store(v + e, tanh_vec<T>(load(v + e)));
}

// Per-stream dot products of one token's streams with themselves (ss) and with W's P rows (q),
// each summed in vector lanes first, then across the lanes. With GRADS, also those with dx (d)
// and with the n rows of dmixed (n x d) (gdots), for the backward.
template <typename T, int NC, bool GRADS>
DB_INLINE void stream_dots(const T* __restrict__ h, const T* __restrict__ W, int64_t n_, int64_t d,
                           T* __restrict__ ss, T* __restrict__ q, const T* __restrict__ gx,
                           const T* __restrict__ gm, T* __restrict__ gdots) {
  constexpr int64_t PA = NC > 0 ? NC + 2 : MAX_P, GA = NC > 0 ? NC + 1 : MAX_STREAMS + 1, V = LANES<T>;
  const int64_t n = NC > 0 ? NC : n_, P = n + 2, dv = d - d % V;
  for (int64_t i = 0; i < n; ++i) {
    const T* __restrict__ hi = h + i * d;
    Vec<T> sq = {}, acc[PA], ga[GRADS ? GA : 1];
#pragma GCC unroll 18
    for (int64_t j = 0; j < PA; ++j) acc[j] = Vec<T>{};
#pragma GCC unroll 17
    for (int64_t j = 0; j < (GRADS ? GA : 1); ++j) ga[j] = Vec<T>{};
    for (int64_t k0 = 0; k0 < dv; k0 += V) {
      const Vec<T> hv = load(hi + k0);
      sq += hv * hv;
      // unrolled, so that the accumulators stay in registers
#pragma GCC unroll 18
      for (int64_t j = 0; j < P; ++j) acc[j] += hv * load(W + j * d + k0);
      if constexpr (GRADS) {
        ga[0] += hv * load(gx + k0);
#pragma GCC unroll 16
        for (int64_t j = 0; j < n; ++j) ga[1 + j] += hv * load(gm + j * d + k0);
      }
    }
    T s = lane_sum<T>(sq);
    for (int64_t k = dv; k < d; ++k) s += hi[k] * hi[k];
    ss[i] = s;
    for (int64_t j = 0; j < P; ++j) {
      T a = lane_sum<T>(acc[j]);
      for (int64_t k = dv; k < d; ++k) a += hi[k] * W[j * d + k];
      q[i * P + j] = a;
    }
    if constexpr (GRADS) {
      for (int64_t j = 0; j <= n; ++j) {
        const T* __restrict__ g = j == 0 ? gx : gm + (j - 1) * d;
        T a = lane_sum<T>(ga[j]);
        for (int64_t k = dv; k < d; ++k) a += hi[k] * g[k];
        gdots[i * (n + 1) + j] = a;
      }
    }
  }
}

// The forward pass over tokens [begin, end).
template <typename T, int NC>
DB_CLONES void read_forward_range(const T* H, const T* W, const T* S, const T* scale, T eps, T* x, T* mixed,
                                  T* coeff, int64_t n_, int64_t d, int64_t begin, int64_t end) {
  const int64_t n = NC > 0 ? NC : n_, P = n + 2;
  T ss[MAX_STREAMS], q[MAX_STREAMS * MAX_P], c[MAX_STREAMS * MAX_P] = {};  // c: whole vectors
  for (int64_t t = begin; t < end; ++t) {
    const T* __restrict__ h = H + t * n * d;
    stream_dots<T, NC, false>(h, W, n, d, ss, q, nullptr, nullptr, nullptr);
    for (int64_t i = 0; i < n; ++i) {
      const T r = T(1) / std::sqrt(ss[i] / T(d) + eps);
      for (int64_t j = 0; j < P; ++j) c[i * P + j] = r * q[i * P + j];
    }
    tanh_inplace(c, n * P);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < P; ++j) c[i * P + j] = S[i * P + j] + scale[j] * c[i * P + j];
    std::memcpy(coeff + t * n * P, c, n * P * sizeof(T));
    // output row 0 reads (weights c_i0), rows 1..n mix (weights c_i,1+j); i is the inner sum
    combine_rows<T, NC>(h, c, P, x + t * d, n, d);
    for (int64_t j = 1; j <= n; ++j) combine_rows<T, NC>(h, c + j, P, mixed + (t * n + j - 1) * d, n, d);
  }
}

// The backward pass over tokens [begin, end): dH for each token, and this range's sums of the
// gradients of W (gW, P x d), S (gS, n x P) and the scales (gs, P), which the caller zeroed.
template <typename T, int NC>
DB_CLONES void read_backward_range(const T* H, const T* W, const T* S, const T* scale, T eps, const T* gx,
                                   const T* gmixed, const T* gcoeff, T* gH, T* gW, T* gS, T* gs, int64_t n_,
                                   int64_t d, int64_t begin, int64_t end) {
  constexpr int64_t V = LANES<T>;
  const int64_t n = NC > 0 ? NC : n_, P = n + 2;
  T ss[MAX_STREAMS], q[MAX_STREAMS * MAX_P], gdots[MAX_STREAMS * (MAX_STREAMS + 1)];
  T c[MAX_STREAMS * MAX_P], gq[MAX_STREAMS * MAX_P], cr[MAX_STREAMS], rs[MAX_STREAMS];
  T tanh_p[MAX_STREAMS * MAX_P] = {};  // whole vectors
  for (int64_t t = begin; t < end; ++t) {
    const T* __restrict__ h = H + t * n * d;
    const T* __restrict__ gxt = gx + t * d;
    const T* __restrict__ gmt = gmixed + t * n * d;
    const T* __restrict__ gct = gcoeff + t * n * P;
    stream_dots<T, NC, true>(h, W, n, d, ss, q, gxt, gmt, gdots);
    for (int64_t i = 0; i < n; ++i) {
      rs[i] = T(1) / std::sqrt(ss[i] / T(d) + eps);
      for (int64_t j = 0; j < P; ++j) tanh_p[i * P + j] = rs[i] * q[i * P + j];
    }
    tanh_inplace(tanh_p, n * P);
    for (int64_t i = 0; i < n; ++i) {
      const T r = rs[i];
      T gr = 0;
      for (int64_t j = 0; j < P; ++j) {
        const T th = tanh_p[i * P + j];
        c[i * P + j] = S[i * P + j] + scale[j] * th;
        // dL/dc: from the outputs that used c (read, mix; the write column only from outside)
        const T gc = gct[i * P + j] + (j <= n ? gdots[i * (n + 1) + j] : T(0));
        gS[i * P + j] += gc;
        gs[j] += gc * th;                               // dc / ds_j = tanh(p)
        const T gp = gc * scale[j] * (T(1) - th * th);  // d tanh(p) / dp
        gq[i * P + j] = gp * r;                      // p = r q
        gr += gp * q[i * P + j];
      }
      cr[i] = -gr * r * r * r / T(d);  // dr / dH_ik = -r^3 H_ik / d
    }
    // dH_ik = c_i0 dx_k + sum_j c_i,1+j dm_jk + sum_j gq_ij W_jk + cr_i H_ik
    for (int64_t i = 0; i < n; ++i) {
      T* __restrict__ o = gH + (t * n + i) * d;
      const T* __restrict__ hi = h + i * d;
      const T* ci = c + i * P;
      const T* gqi = gq + i * P;
      int64_t k = 0;
      for (; k + V <= d; k += V) {
        Vec<T> a = ci[0] * load(gxt + k) + cr[i] * load(hi + k);
#pragma GCC unroll 16
        for (int64_t j = 0; j < n; ++j) a += ci[1 + j] * load(gmt + j * d + k);
#pragma GCC unroll 18
        for (int64_t j = 0; j < P; ++j) a += gqi[j] * load(W + j * d + k);
        store(o + k, a);
      }
      for (; k < d; ++k) {
        T a = ci[0] * gxt[k] + cr[i] * hi[k];
        for (int64_t j = 0; j < n; ++j) a += ci[1 + j] * gmt[j * d + k];
        for (int64_t j = 0; j < P; ++j) a += gqi[j] * W[j * d + k];
        o[k] = a;
      }
    }
    // dW_jk += sum_i gq_ij H_ik
    for (int64_t j = 0; j < P; ++j) combine_rows<T, NC, true>(h, gq + j, P, gW + j * d, n, d);
  }
}

// Backward of the write H = mixed + w^T out (w: n per token, out: d per token):
//   dw_i = sum_k dH_ik out_k,  dout_k = sum_i w_i dH_ik   (dmixed is dH itself)
// in one pass over dH, where autograd through addcmul makes four.
template <typename T, int NC>
DB_CLONES void write_backward_range(const T* gH, const T* w, const T* out, T* gw, T* gout, int64_t n_, int64_t d,
                                    int64_t begin, int64_t end) {
  const int64_t n = NC > 0 ? NC : n_;
  for (int64_t t = begin; t < end; ++t) {
    const T* __restrict__ g = gH + t * n * d;
    combine_rows<T, NC>(g, w + t * n, 1, gout + t * d, n, d);
    for (int64_t i = 0; i < n; ++i) gw[t * n + i] = dot(g + i * d, out + t * d, d);
  }
}

void check_read(const at::Tensor& H, const at::Tensor& W, const at::Tensor& S, const at::Tensor& scale) {
  TORCH_CHECK(H.device().is_cpu() && W.device().is_cpu() && S.device().is_cpu() && scale.device().is_cpu(),
              "hc read kernel: expected CPU tensors, got ", H.device(), ", ", W.device(), ", ", S.device(), ", ",
              scale.device());
  TORCH_CHECK(H.dim() == 3, "hc read kernel: expected streams of shape (tokens, n, d), got ", H.sizes());
  const int64_t n = H.size(1), d = H.size(2);
  TORCH_CHECK(n >= 1 && n <= MAX_STREAMS, "hc read kernel: 1 to ", MAX_STREAMS, " streams, got ", n);
  TORCH_CHECK(W.dim() == 2 && W.size(0) == n + 2 && W.size(1) == d, "hc read kernel: expected weight (n + 2, d) = (",
              n + 2, ", ", d, "), got ", W.sizes());
  TORCH_CHECK(S.dim() == 2 && S.size(0) == n && S.size(1) == n + 2,
              "hc read kernel: expected static weights (n, n + 2) = (", n, ", ", n + 2, "), got ", S.sizes());
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == n + 2, "hc read kernel: expected scales (n + 2) = (", n + 2,
              "), got ", scale.sizes());
  TORCH_CHECK(H.scalar_type() == at::kFloat || H.scalar_type() == at::kDouble,
              "hc read kernel: float32 or float64 only, got ", H.scalar_type());
  TORCH_CHECK(W.scalar_type() == H.scalar_type() && S.scalar_type() == H.scalar_type() &&
                  scale.scalar_type() == H.scalar_type(),
              "hc read kernel: weights must have the streams' dtype ", H.scalar_type());
}

}  // namespace

// x (N, d), mixed (N, n, d), coeff (N, n, n + 2) from the streams H (N, n, d), the folded
// dynamic weight W (n + 2, d), the static weights S (n, n + 2) and the scales (n + 2).
std::vector<at::Tensor> hc_read_forward(at::Tensor H, at::Tensor W, at::Tensor S, at::Tensor scale, double eps) {
  check_read(H, W, S, scale);
  H = H.contiguous();
  W = W.contiguous();
  S = S.contiguous();
  scale = scale.contiguous();
  const int64_t N = H.size(0), n = H.size(1), d = H.size(2);
  auto x = at::empty({N, d}, H.options());
  auto mixed = at::empty({N, n, d}, H.options());
  auto coeff = at::empty({N, n, n + 2}, H.options());
  AT_DISPATCH_FLOATING_TYPES(H.scalar_type(), "hc_read_forward", [&] {
    const scalar_t *hp = H.data_ptr<scalar_t>(), *wp = W.data_ptr<scalar_t>(), *sp = S.data_ptr<scalar_t>(),
                   *scp = scale.data_ptr<scalar_t>();
    scalar_t *xp = x.data_ptr<scalar_t>(), *mp = mixed.data_ptr<scalar_t>(), *cp = coeff.data_ptr<scalar_t>();
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      dispatch_n(n, [&](auto nc) {
        read_forward_range<scalar_t, decltype(nc)::value>(hp, wp, sp, scp, scalar_t(eps), xp, mp, cp, n, d, begin,
                                                          end);
      });
    });
  });
  return {x, mixed, coeff};
}

// dH (N, n, d), dW (n + 2, d), dS (n, n + 2), dscale (n + 2) from the gradients of the three outputs.
std::vector<at::Tensor> hc_read_backward(at::Tensor H, at::Tensor W, at::Tensor S, at::Tensor scale, double eps,
                                         at::Tensor gx, at::Tensor gmixed, at::Tensor gcoeff) {
  check_read(H, W, S, scale);
  const int64_t N = H.size(0), n = H.size(1), d = H.size(2), P = n + 2;
  TORCH_CHECK(gx.sizes() == at::IntArrayRef({N, d}) && gmixed.sizes() == at::IntArrayRef({N, n, d}) &&
                  gcoeff.sizes() == at::IntArrayRef({N, n, P}),
              "hc read kernel: gradients of shape ", gx.sizes(), ", ", gmixed.sizes(), ", ", gcoeff.sizes(),
              " do not match the outputs (", N, ", ", d, "), (", N, ", ", n, ", ", d, "), (", N, ", ", n, ", ", P, ")");
  TORCH_CHECK(gx.scalar_type() == H.scalar_type() && gmixed.scalar_type() == H.scalar_type() &&
                  gcoeff.scalar_type() == H.scalar_type(),
              "hc read kernel: gradient dtypes must be ", H.scalar_type());
  H = H.contiguous();
  W = W.contiguous();
  S = S.contiguous();
  scale = scale.contiguous();
  gx = gx.contiguous();
  gmixed = gmixed.contiguous();
  gcoeff = gcoeff.contiguous();
  const int64_t chunks = std::max<int64_t>(1, (N + CHUNK - 1) / CHUNK);
  auto gH = at::empty_like(H);
  auto partial_W = at::zeros({chunks, P, d}, H.options());
  auto partial_S = at::zeros({chunks, n, P}, H.options());
  auto partial_scale = at::zeros({chunks, P}, H.options());
  AT_DISPATCH_FLOATING_TYPES(H.scalar_type(), "hc_read_backward", [&] {
    const scalar_t *hp = H.data_ptr<scalar_t>(), *wp = W.data_ptr<scalar_t>(), *sp = S.data_ptr<scalar_t>(),
                   *scp = scale.data_ptr<scalar_t>();
    const scalar_t *gxp = gx.data_ptr<scalar_t>(), *gmp = gmixed.data_ptr<scalar_t>(),
                   *gcp = gcoeff.data_ptr<scalar_t>();
    scalar_t *ghp = gH.data_ptr<scalar_t>(), *pwp = partial_W.data_ptr<scalar_t>(),
             *psp = partial_S.data_ptr<scalar_t>(), *pcp = partial_scale.data_ptr<scalar_t>();
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t chunk = begin; chunk < end; ++chunk) {
        const int64_t t0 = chunk * CHUNK, t1 = std::min(N, t0 + CHUNK);
        dispatch_n(n, [&](auto nc) {
          read_backward_range<scalar_t, decltype(nc)::value>(hp, wp, sp, scp, scalar_t(eps), gxp, gmp, gcp, ghp,
                                                             pwp + chunk * P * d, psp + chunk * n * P, pcp + chunk * P,
                                                             n, d, t0, t1);
        });
      }
    });
  });
  // the chunks' sums added in chunk order: the same result for any number of threads
  auto gW = at::zeros({P, d}, H.options());
  auto gS = at::zeros({n, P}, H.options());
  auto gscale = at::zeros({P}, H.options());
  AT_DISPATCH_FLOATING_TYPES(H.scalar_type(), "hc_read_backward_sum", [&] {
    scalar_t *gwp = gW.data_ptr<scalar_t>(), *gsp = gS.data_ptr<scalar_t>(), *gcp = gscale.data_ptr<scalar_t>();
    const scalar_t *pwp = partial_W.data_ptr<scalar_t>(), *psp = partial_S.data_ptr<scalar_t>(),
                   *pcp = partial_scale.data_ptr<scalar_t>();
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      for (int64_t e = 0; e < P * d; ++e) gwp[e] += pwp[chunk * P * d + e];
      for (int64_t e = 0; e < n * P; ++e) gsp[e] += psp[chunk * n * P + e];
      for (int64_t e = 0; e < P; ++e) gcp[e] += pcp[chunk * P + e];
    }
  });
  return {gH, gW, gS, gscale};
}

// (dw (N, n), dout (N, d)) from dH (N, n, d), the write weights w (N, n) and the sublayer output
// out (N, d) of H = mixed + w^T out.
std::vector<at::Tensor> stream_write_backward(at::Tensor gH, at::Tensor w, at::Tensor out) {
  TORCH_CHECK(gH.device().is_cpu() && w.device().is_cpu() && out.device().is_cpu(),
              "stream write kernel: expected CPU tensors");
  TORCH_CHECK(gH.dim() == 3, "stream write kernel: expected a gradient of shape (tokens, n, d), got ", gH.sizes());
  const int64_t N = gH.size(0), n = gH.size(1), d = gH.size(2);
  TORCH_CHECK(w.sizes() == at::IntArrayRef({N, n}) && out.sizes() == at::IntArrayRef({N, d}),
              "stream write kernel: expected weights (", N, ", ", n, ") and output (", N, ", ", d, "), got ", w.sizes(),
              " and ", out.sizes());
  TORCH_CHECK(gH.scalar_type() == at::kFloat || gH.scalar_type() == at::kDouble,
              "stream write kernel: float32 or float64 only, got ", gH.scalar_type());
  TORCH_CHECK(w.scalar_type() == gH.scalar_type() && out.scalar_type() == gH.scalar_type(),
              "stream write kernel: all dtypes must be ", gH.scalar_type());
  gH = gH.contiguous();
  w = w.contiguous();
  out = out.contiguous();
  auto gw = at::empty({N, n}, gH.options());
  auto gout = at::empty({N, d}, gH.options());
  AT_DISPATCH_FLOATING_TYPES(gH.scalar_type(), "stream_write_backward", [&] {
    const scalar_t *gp = gH.data_ptr<scalar_t>(), *wp = w.data_ptr<scalar_t>(), *op = out.data_ptr<scalar_t>();
    scalar_t *gwp = gw.data_ptr<scalar_t>(), *gop = gout.data_ptr<scalar_t>();
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      dispatch_n(n, [&](auto nc) {
        write_backward_range<scalar_t, decltype(nc)::value>(gp, wp, op, gwp, gop, n, d, begin, end);
      });
    });
  });
  return {gw, gout};
}
