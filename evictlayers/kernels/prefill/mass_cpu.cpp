// Causal prefill attention with each slot's column mass, the logits computed once (mass_cpu.py documents the
// op and holds its PyTorch reference).
//
//   prefill_mass(query [R, G, Q, D], key [R, N, D], value [R, N, Dv], gain [R, Q] or empty, scaling, window,
//                need_mass, block_rows, out [R, G, Q, Dv], lse [R, G, Q], mass [R, G, N])   float32, R = B * H_kv
//
// Query row i sees slot j iff j <= i + N - Q (the queries are the last Q of N in-order slots) and, with a
// window W > 0, j > i + N - Q - W. Per query head and block of `block_rows` rows the slots are taken in tiles
// of kTile as flash attention does (logits by BLAS, running max and sum, P @ V by BLAS with the running
// rescale), and each tile's exp(logits - running max) is kept in a [block_rows, span] scratch with the max it
// was taken against. Once the block's rows are complete their log-sum-exp is final, and each slot's mass is
// one pass over the scratch: sum_i exp(m_i(t) - lse_i) * scratch[i, j]. With a gain (a factor >= 0 per query
// row) the mass is that of softmax(gain * logits): the scratch keeps exp(gain * (logits - m(t))), the model's
// probabilities for P @ V go to a tile of their own, and the scoring normaliser is summed beside the model's.
// The scratch (block_rows x N floats per thread) is the only extra memory. Inputs and outputs may be views
// (any strides, last dim contiguous).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#endif
#include <ATen/cpu/vec/vec.h>

// Fortran BLAS, as linked into libtorch_cpu (MKL on x86 wheels): column-major.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kTile = 512;  // slots per tile: a [128, kTile] logits tile (256 KiB) stays in L2

// Row-major c[m, n] = alpha * a[m, k] @ b[n, k]^T + beta * c
void gemm_abt(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda, const float* b,
              int64_t ldb, float beta, float* c, int64_t ldc) {
  const int M = m, N = n, K = k, LDA = lda, LDB = ldb, LDC = ldc;
  sgemm_("T", "N", &N, &M, &K, &alpha, b, &LDB, a, &LDA, &beta, c, &LDC);
}

// Row-major c[m, n] = a[m, k] @ b[k, n] + c
void gemm_ab_acc(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
                 int64_t ldc) {
  const int M = m, N = n, K = k, LDA = lda, LDB = ldb, LDC = ldc;
  const float one = 1.0f;
  sgemm_("N", "N", &N, &M, &K, &one, b, &LDB, a, &LDA, &one, c, &LDC);
}

// y[j] = exp(factor * (x[j] - shift)) (y may be x); returns the sum
float exp_shift_sum(const float* x, float* y, int64_t n, float shift, float factor = 1.0f) {
  const Vec s(shift), f(factor);
  Vec total(0.0f);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    const Vec e = ((Vec::loadu(x + j) - s) * f).exp_u20();
    e.store(y + j);
    total = total + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, total);
  for (; j < n; ++j) {
    y[j] = std::exp(factor * (x[j] - shift));
    sum += y[j];
  }
  return sum;
}

float max_of(const float* x, int64_t n) {
  Vec best(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) best = at::vec::maximum(best, Vec::loadu(x + j));
  float m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, best);
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// y[j] += c * x[j]
void axpy(float* y, const float* x, int64_t n, float c) {
  const Vec cv(c);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) at::vec::fmadd(cv, Vec::loadu(x + j), Vec::loadu(y + j)).store(y + j);
  for (; j < n; ++j) y[j] += c * x[j];
}

struct Scratch {
  std::vector<float> probs, model, tile_max, acc, row_max, row_sum, score_sum, score_lse;
};

// One block of query rows [i0, i1) of one query head: out, lse and (with need_mass) mass_row += the column sums
// of its scoring probabilities: the model's, or with gain (one factor >= 0 per query row) softmax(gain * logits).
void attend_block(const float* q, int64_t q_stride, const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                  const float* gain, int64_t i0, int64_t i1, int64_t N, int64_t Q, int64_t D, int64_t Dv,
                  float scaling, int64_t window, bool need_mass, float* out, int64_t out_stride, float* lse,
                  int64_t lse_stride, float* mass_row, int64_t block_rows, Scratch& s) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t rows = i1 - i0, offset = N - Q;
  const auto first_seen = [&](int64_t i) { return window > 0 ? std::max<int64_t>(0, i + offset - window + 1) : 0; };
  const int64_t lo = first_seen(i0), hi = i1 + offset, span = hi - lo;  // the block's slots [lo, hi)
  const int64_t n_tiles = (span + kTile - 1) / kTile;
  // [rows, span], row stride span: the scoring probabilities, kept for the mass. Without a gain they are the
  // model's, which P @ V reads from here too; with one, the model's go to a [rows, kTile] tile of their own.
  float* probs = s.probs.data();
  std::fill(s.acc.begin(), s.acc.begin() + rows * Dv, 0.0f);
  std::fill(s.row_max.begin(), s.row_max.begin() + rows, neg_inf);
  std::fill(s.row_sum.begin(), s.row_sum.begin() + rows, 0.0f);
  std::fill(s.score_sum.begin(), s.score_sum.begin() + rows, 0.0f);
  for (int64_t t = 0; t < n_tiles; ++t) {
    const int64_t j0 = lo + t * kTile, width = std::min(kTile, hi - j0);
    float* tile = probs + (j0 - lo);
    gemm_abt(rows, width, D, scaling, q + i0 * q_stride, q_stride, k + j0 * k_stride, k_stride, 0.0f, tile, span);
    for (int64_t r = 0; r < rows; ++r) {
      float* row = tile + r * span;
      float* model_row = gain ? s.model.data() + r * kTile : row;
      const int64_t i = i0 + r, first = first_seen(i), last = i + offset;  // visible slots first..last
      const int64_t hidden_before = std::clamp(first - j0, int64_t{0}, width);  // columns [0, hidden_before)
      const int64_t hidden_from = std::clamp(last + 1 - j0, int64_t{0}, width);  // and [hidden_from, width)
      std::fill(row, row + hidden_before, neg_inf);
      std::fill(row + hidden_from, row + width, neg_inf);
      const float seen = std::max(s.row_max[r], max_of(row, width));
      s.tile_max[t * block_rows + r] = seen;
      if (seen == neg_inf) {  // nothing visible yet: the tile contributes nothing
        std::fill(row, row + width, 0.0f);
        std::fill(model_row, model_row + width, 0.0f);
        continue;
      }
      const bool first_visible = s.row_max[r] == neg_inf;
      const float rescale = first_visible ? 0.0f : std::exp(s.row_max[r] - seen);
      if (gain) {
        // the scoring softmax's running max is gain * the model's (gain >= 0), so one max serves both
        const float g = gain[i];
        const float score_rescale = first_visible ? 0.0f : std::exp(g * (s.row_max[r] - seen));
        s.row_sum[r] = s.row_sum[r] * rescale + exp_shift_sum(row, model_row, width, seen);
        float score_new;
        if (g == 0.0f) {  // uniform over the visible slots (exp(0 * -inf) would be NaN on the hidden ones)
          std::fill(row, row + width, 0.0f);
          std::fill(row + hidden_before, row + std::max(hidden_before, hidden_from), 1.0f);
          score_new = static_cast<float>(std::max<int64_t>(0, hidden_from - hidden_before));
        } else {
          score_new = exp_shift_sum(row, row, width, seen, g);
        }
        s.score_sum[r] = s.score_sum[r] * score_rescale + score_new;
      } else {
        s.row_sum[r] = s.row_sum[r] * rescale + exp_shift_sum(row, row, width, seen);
      }
      s.row_max[r] = seen;
      if (rescale != 1.0f) {
        float* acc = s.acc.data() + r * Dv;
        for (int64_t d = 0; d < Dv; ++d) acc[d] *= rescale;
      }
    }
    if (gain)
      gemm_ab_acc(rows, Dv, width, s.model.data(), kTile, v + j0 * v_stride, v_stride, s.acc.data(), Dv);
    else
      gemm_ab_acc(rows, Dv, width, tile, span, v + j0 * v_stride, v_stride, s.acc.data(), Dv);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float total = s.row_sum[r];
    const float inv = total > 0 ? 1.0f / total : 0.0f;
    const float row_lse = total > 0 ? s.row_max[r] + std::log(total) : neg_inf;
    lse[(i0 + r) * lse_stride] = row_lse;
    const float* acc = s.acc.data() + r * Dv;
    float* o = out + (i0 + r) * out_stride;
    for (int64_t d = 0; d < Dv; ++d) o[d] = acc[d] * inv;
    // the scoring softmax's normaliser, against gain * (the max each tile was taken against)
    s.score_lse[r] = total <= 0 ? neg_inf : gain ? gain[i0 + r] * s.row_max[r] + std::log(s.score_sum[r]) : row_lse;
  }
  if (!need_mass) return;
  for (int64_t t = 0; t < n_tiles; ++t) {
    const int64_t j0 = lo + t * kTile, width = std::min(kTile, hi - j0);
    for (int64_t r = 0; r < rows; ++r) {
      const float taken = s.tile_max[t * block_rows + r], score_lse = s.score_lse[r];
      if (taken == neg_inf || score_lse == neg_inf) continue;
      const float factor = gain ? gain[i0 + r] : 1.0f;
      axpy(mass_row + j0, probs + r * span + (j0 - lo), width, std::exp(factor * taken - score_lse));
    }
  }
}

void check_rows(const torch::Tensor& t, const char* name, at::IntArrayRef shape) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.sizes() == shape && t.stride(-1) == 1, name,
              " must be a CPU float32 tensor of shape ", shape, " with a contiguous last dim, got ", t.scalar_type(),
              " ", t.sizes(), " with strides ", t.strides());
}

void prefill_mass(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                  const torch::Tensor& gain, double scaling, int64_t window, bool need_mass, int64_t block_rows,
                  torch::Tensor& out, torch::Tensor& lse, torch::Tensor& mass) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 3 && value.dim() == 3,
              "query must be [R, G, Q, D], key [R, N, D] and value [R, N, Dv]");
  const int64_t R = query.size(0), G = query.size(1), Q = query.size(2), D = query.size(3);
  const int64_t N = key.size(1), Dv = value.size(2);
  check_rows(query, "query", {R, G, Q, D});
  check_rows(key, "key", {R, N, D});
  check_rows(value, "value", {R, N, Dv});
  check_rows(out, "out", {R, G, Q, Dv});
  TORCH_CHECK(lse.device().is_cpu() && lse.scalar_type() == at::kFloat && lse.sizes() == at::IntArrayRef({R, G, Q}),
              "lse must be a CPU float32 tensor of shape [R, G, Q] = ", at::IntArrayRef({R, G, Q}));
  check_rows(mass, "mass (zeros: the kernel adds to it)", {R, G, N});
  const bool gained = gain.numel() > 0;
  if (gained) {
    check_rows(gain, "gain (or an empty tensor for the model's softmax)", {R, Q});
    TORCH_CHECK(gain.min().item<float>() >= 0, "gain must be >= 0 (the scoring max is gain * the model's)");
  }
  TORCH_CHECK(Q >= 1 && Q <= N, "the Q = ", Q, " queries must be the last of the N = ", N, " slots (1 <= Q <= N)");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(block_rows >= 1, "block_rows must be >= 1, got ", block_rows);
  const int64_t heads = R * G, blocks = (Q + block_rows - 1) / block_rows, tasks = heads * blocks;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks));
  // Each thread sums its mass into its own buffer (its blocks share columns with other threads' blocks of the
  // same head); the first writes into `mass` directly.
  std::vector<float> partial(threads > 1 && need_mass ? (threads - 1) * heads * N : 0, 0.0f);
  const float *qp = query.data_ptr<float>(), *kp = key.data_ptr<float>(), *vp = value.data_ptr<float>();
  float *op = out.data_ptr<float>(), *lp = lse.data_ptr<float>(), *mp = mass.data_ptr<float>();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t worker = begin; worker < end; ++worker) {
      Scratch s;
      s.probs.resize(block_rows * N);
      s.tile_max.resize((N + kTile - 1) / kTile * block_rows);
      s.model.resize(gained ? block_rows * kTile : 0);
      s.acc.resize(block_rows * Dv);
      s.row_max.resize(block_rows);
      s.row_sum.resize(block_rows);
      s.score_sum.resize(block_rows);
      s.score_lse.resize(block_rows);
      // block-major tasks dealt round-robin: every worker gets early (short) and late (long) causal blocks
      for (int64_t task = worker; task < tasks; task += threads) {
        const int64_t block = task / heads, head = task % heads, r = head / G, g = head % G;
        const int64_t i0 = block * block_rows, i1 = std::min(Q, i0 + block_rows);
        float* mass_row = worker == 0 ? mp + r * mass.stride(0) + g * mass.stride(1)
                                      : partial.data() + ((worker - 1) * heads + head) * N;
        attend_block(qp + r * query.stride(0) + g * query.stride(1), query.stride(2), kp + r * key.stride(0),
                     key.stride(1), vp + r * value.stride(0), value.stride(1),
                     gained ? gain.data_ptr<float>() + r * gain.stride(0) : nullptr, i0, i1, N, Q, D, Dv,
                     static_cast<float>(scaling), window, need_mass, op + r * out.stride(0) + g * out.stride(1),
                     out.stride(2), lp + r * lse.stride(0) + g * lse.stride(1), lse.stride(2), mass_row, block_rows, s);
      }
    }
  });
  for (int64_t w = 1; w < threads && need_mass; ++w)
    for (int64_t head = 0; head < heads; ++head) {
      float* mass_row = mp + (head / G) * mass.stride(0) + (head % G) * mass.stride(1);
      axpy(mass_row, partial.data() + ((w - 1) * heads + head) * N, N, 1.0f);
    }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prefill_mass", &prefill_mass, "causal prefill attention with column mass (mass_cpu.py)");
}
